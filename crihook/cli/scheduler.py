"""`crihook scheduler`: the extender and admission webhook server's command line: flags, the API
client, leader election, signals. The HTTP server is crihook.scheduler.server."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import ssl
import threading
import time
from typing import Any

from crihook.base import log as crihook_log
from crihook.base import quantity
from crihook.base.tls import TlsFiles
from crihook.scheduler import ha, webhook
from crihook.scheduler.draconvert import ConvertConfig
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.request import STRATEGIES
from crihook.scheduler.server import (
    DEFAULT_LISTEN,
    DEFAULT_SCHEDULER_USER,
    App,
    check_listen,
    make_server,
)
from crihook.scheduler.webhook import DEFAULT_SCHEDULER

log = logging.getLogger("crihook.scheduler")

API_CONNECTIONS = 32  # kept-alive connections to the API server, for binds in flight
M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
MALLOC_ARENAS = 2  # glibc malloc arenas (limit_malloc_arenas)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to serve on (default %(default)s)")
    parser.add_argument("--tls-cert", default="", help="PEM certificate (chain) file; enables HTTPS")
    parser.add_argument("--tls-key", default="", help="PEM private key file for --tls-cert")
    parser.add_argument(
        "--client-ca", default="", help="extender verbs only from callers with a client certificate signed by this CA"
    )
    parser.add_argument(
        "--extender-client",
        action="append",
        default=[],
        help="common name of a client certificate allowed the extender verbs (repeatable; default: any that "
        "--client-ca signed)",
    )
    parser.add_argument(
        "--insecure-allow-plain-http", action="store_true", help="allow plain HTTP on a non-loopback address"
    )
    parser.add_argument(
        "--insecure-allow-anonymous-extender",
        action="store_true",
        help="allow extender verbs without a client certificate on a non-loopback address",
    )
    parser.add_argument("--kubeconfig", default="", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    parser.add_argument("--strategy", default="fragmentation", choices=STRATEGIES, help="node scoring strategy")
    parser.add_argument(
        "--scheduler-user",
        action="append",
        default=[],
        help=f"user allowed to write allocation annotations (repeatable; default {DEFAULT_SCHEDULER_USER})",
    )
    parser.add_argument("--scheduler-name", default="", help="webhook: move GPU pods of the default scheduler here")
    parser.add_argument(
        "--serve-scheduler-name",
        action="append",
        default=[],
        help="schedulerName of the pods the extender filters and binds (repeatable; default --scheduler-name if "
        f"given, else {DEFAULT_SCHEDULER})",
    )
    parser.add_argument(
        "--dra-convert",
        action="store_true",
        help="webhook: turn GPU requests into ResourceClaims of gpu.crihook.io for pods of namespaces the "
        "webhook's /mutate-dra receives, and for pods whose nodeSelector names --dra-pool",
    )
    parser.add_argument(
        "--dra-pool", default="", help="LABEL=VALUE (or LABEL) of the nodes crihook's DRA driver serves"
    )
    parser.add_argument(
        "--dra-gpu-memory",
        default="0",
        help="memory of one GPU of the DRA pool (a quantity, e.g. 80Gi), to convert memory ratios; "
        "without it, pods asking a memory ratio stay on the annotation path",
    )
    parser.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds after SIGTERM to go on answering (the lead is handed over at once), while the "
        "pod's endpoint leaves the API servers' view: a webhook call on a closed socket fails a pod's write",
    )
    parser.add_argument("--log-level", default="info", choices=crihook_log.LEVELS)
    ha.add_arguments(parser)


def _api_client(kubeconfig: str) -> Any:
    """A client whose connection pool holds as many connections as binds run at once: kube-scheduler
    binds in parallel, and the client's default (5 per CPU) makes, and throws away, a new TLS
    connection to the API server for every bind beyond it."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize, API_CONNECTIONS)
    return client.ApiClient(cfg)


def limit_malloc_arenas() -> None:
    """Cap glibc's malloc at MALLOC_ARENAS arenas unless MALLOC_ARENA_MAX says otherwise. Each thread
    that allocates gets an arena of its own by default (up to 8 per core), and memory freed there
    stays with the process: 5,000-node bench, 1,500 binds, RSS 156 -> 400 MiB with the default and
    165 -> 250 MiB with two arenas, pods/s no lower. Called before any thread starts."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has no arenas and no mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_ARENA_MAX, MALLOC_ARENAS)


def run(args: argparse.Namespace) -> int:
    from crihook.scheduler.cache import KubeApi

    limit_malloc_arenas()
    crihook_log.setup(args.log_level)
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("give both --tls-cert and --tls-key")
        return 2
    tls = TlsFiles(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
    if args.client_ca and tls is None:
        log.error("--client-ca needs --tls-cert and --tls-key")
        return 2
    try:
        host, port = check_listen(
            args.listen, tls, args.insecure_allow_plain_http, args.insecure_allow_anonymous_extender
        )
    except ValueError as e:
        log.error(str(e))
        return 2
    api_client = _api_client(args.kubeconfig)

    def new_plugin() -> DeviceShare:
        return DeviceShare(PluginConfig(strategy=args.strategy, background_outlook=True))

    extender = Extender(new_plugin(), KubeApi(api_client))
    extender.scheduler_names = frozenset(args.serve_scheduler_name or [args.scheduler_name or DEFAULT_SCHEDULER])
    try:
        replica = ha.build(args, api_client, extender, new_plugin, freeze_heap=True)
    except ValueError as e:
        log.error(str(e))
        return 2
    users = tuple(args.scheduler_user) or (DEFAULT_SCHEDULER_USER,)
    try:
        gpu_memory = quantity.to_int(args.dra_gpu_memory)
    except quantity.QuantityError as e:
        log.error(f"--dra-gpu-memory: {e}")
        return 2
    dra = ConvertConfig(gpu_memory=gpu_memory) if args.dra_convert else None
    hooks = webhook.WebhookConfig(users, args.scheduler_name, dra, args.dra_pool, KubeApi(api_client).create_template)
    app = App(extender, hooks, replica.ready)
    try:
        server = make_server(app, host, port, tls, extender_clients=frozenset(args.extender_client))
    except (OSError, ssl.SSLError) as e:
        log.error("can not serve", extra={"listen": args.listen, "error": str(e)})
        return 2
    replica.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("scheduler listening", extra={"listen": args.listen, "tls": tls is not None})
    stop.wait()
    signalled = time.monotonic()
    replica.stop()  # the label off and the Lease handed back first: a standby leads at once
    time.sleep(max(0.0, args.shutdown_delay - (time.monotonic() - signalled)))
    server.shutdown()
    return 0
