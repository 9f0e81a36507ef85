"""The chart's webhook configurations on a real kube-apiserver (the suite's build of Kubernetes, with
etcd; no node, no controllers): the API server accepts their matchConditions, and for each pod of
tests/support/webhook_cases.py it calls a webhook exactly when the table says. No scheduler answers
(the webhooks' Service does not exist), so a pod sent to a webhook is refused with "failed calling
webhook" (failurePolicy Fail) and every other pod is created: what happens while both replicas are
down. Skipped where the Kubernetes programs or etcd are not built (tests/cluster.sh builds them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import helm
from tests.support.cluster import Pki, etcd_binary, free_port, kube_binary, kubeconfig
from tests.support.webhook_cases import Case, cases

NAMESPACE = "team"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A kubernetes ApiClient of a kube-apiserver on loopback, admin, with the chart's webhooks."""
    from kubernetes import client, config

    kube = kube_binary()
    if kube is None or not etcd_binary().is_file() or shutil.which("openssl") is None:
        pytest.skip("needs the suite's Kubernetes programs, etcd and openssl (bash tests/cluster.sh builds them)")
    base = tmp_path_factory.mktemp("apiserver")
    pki = Pki(base / "pki")
    pki.make_ca()
    pki.make_service_account_key()
    pki.issue("apiserver", "/CN=kube-apiserver", "serverAuth", ("IP:127.0.0.1",))
    pki.issue("admin", "/O=system:masters/CN=admin", "clientAuth")
    etcd, port = free_port(), free_port()
    log = (base / "log").open("w")
    procs = [
        subprocess.Popen(
            [
                str(etcd_binary()),
                "--name=x",
                f"--data-dir={base / 'etcd'}",
                "--log-level=warn",
                f"--listen-client-urls=http://127.0.0.1:{etcd}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd}",
                f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
            ],
            stdout=log,
            stderr=log,
        ),
        subprocess.Popen(
            [
                str(kube),
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{etcd}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
                f"--secure-port={port}",
                f"--cert-dir={base / 'certs'}",
                "--service-cluster-ip-range=10.250.0.0/24",
                f"--client-ca-file={pki.ca}",
                f"--tls-cert-file={pki.cert('apiserver')}",
                f"--tls-private-key-file={pki.key('apiserver')}",
                f"--service-account-key-file={pki.dir / 'sa.pub'}",
                f"--service-account-signing-key-file={pki.key('sa')}",
                "--service-account-issuer=https://x",
                "--authorization-mode=RBAC",
                "--disable-admission-plugins=ServiceAccount",
                "--profiling=false",
            ],
            stdout=log,
            stderr=log,
        ),
    ]
    try:
        cfg = client.Configuration()
        path = kubeconfig(base / "kubeconfig", f"https://127.0.0.1:{port}", pki.ca, pki.cert("admin"), pki.key("admin"))
        config.load_kube_config(config_file=str(path), client_configuration=cfg)
        cfg.retries = False
        api_client = client.ApiClient(cfg)
        deadline = time.monotonic() + 120  # a cold start on a loaded machine; it is ready in seconds
        while True:
            assert all(p.poll() is None for p in procs), (base / "log").read_text()[-3000:]
            try:
                client.VersionApi(api_client).get_code()
                break
            except Exception:
                assert time.monotonic() < deadline, "kube-apiserver never answered"
                time.sleep(0.5)
        client.CoreV1Api(api_client).create_namespace({"metadata": {"name": NAMESPACE}})
        yield api_client
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def call(fn: Any, *args: Any) -> str:
    """ "" when the API server did it, else its message."""
    from kubernetes.client.exceptions import ApiException

    try:
        fn(*args)
    except ApiException as e:
        return str(json.loads(e.body).get("message", "")) if e.body else str(e)
    return ""


def test_the_api_server_sends_exactly_the_pods_the_cel_selects(api: Any) -> None:
    from kubernetes import client

    adm, core = client.AdmissionregistrationV1Api(api), client.CoreV1Api(api)
    for config in (d for _, d in helm.rendered("defaults") if d["kind"].endswith("WebhookConfiguration")):
        create = (
            adm.create_mutating_webhook_configuration
            if config["kind"].startswith("Mutating")
            else adm.create_validating_webhook_configuration
        )
        assert call(create, config) == "", config["kind"]  # its matchConditions compile here
    time.sleep(1)  # the admission plugins pick the configurations up from their informers
    checked: list[str] = []
    for i, case in enumerate(cases()):
        pod = json.loads(json.dumps(case.object))
        pod["metadata"].update(name=f"case-{i}", namespace=NAMESPACE)
        if case.operation == "UPDATE":
            assert case.old is not None
            old = json.loads(json.dumps(case.old))
            old["metadata"].update(name=pod["metadata"]["name"], namespace=NAMESPACE)
            if "failed calling webhook" in call(core.create_namespaced_pod, NAMESPACE, old):
                continue  # its pod before can not be made without a scheduler either
            message = call(core.patch_namespaced_pod, pod["metadata"]["name"], NAMESPACE, annotation_patch(case))
        else:
            message = call(core.create_namespaced_pod, NAMESPACE, pod)
        assert ("failed calling webhook" in message) == any(case.expected), (case.name, message)
        if any(case.expected):  # what a user sees: the webhook and the Service nobody answers for
            assert "crihook-scheduler.crihook.svc" in message, message
        checked.append(case.name)
    assert len(checked) >= len(cases()) - 2, checked


def annotation_patch(case: Case) -> dict[str, Any]:
    """The merge patch from the case's pod before to its pod after (annotations only change)."""
    assert case.old is not None
    before = case.old["metadata"].get("annotations") or {}
    after = case.object["metadata"].get("annotations") or {}
    return {"metadata": {"annotations": {k: after.get(k) for k in {*before, *after} if before.get(k) != after.get(k)}}}
