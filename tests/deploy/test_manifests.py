"""deploy/ checked as the API server would check it, and deploy/ and the chart against what
`crihook scheduler` serves.

Every document under deploy/ is validated with `kubernetes-validate` against Kubernetes' own
OpenAPI schemas for the newest release it knows, strictly (an unknown field fails, where the API
server would drop it or, with kubectl's default field validation, refuse it). Objects of a kind
defined by a CRD in deploy/crd (the example Devices) are validated against that CRD's schema, and
pruning would drop none of their fields. kube-scheduler's configuration file, inside a ConfigMap, is
no API object: test_extender_deploy.py checks its extender keys. test_chart.py validates the chart's
renderings the same way.

The last test reads deploy/, and the chart rendered with its defaults and with the extender stanza,
generically (whatever Deployments, Services, webhooks and extender stanzas they hold) and starts
`crihook scheduler` with the Deployment's own arguments: every probe, webhook path and extender verb
must be served on the port the Service and the stanza lead to, and the image must be the one
deploy/image/build-offline.py tags.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from crihook.cli import demo
from crihook.scheduler import ha
from crihook.simnode.fakenvml import CONFIG_ENV, TOPOLOGIES, build, compiler
from crihook.simnode.node import make_sim_node
from tests.devices.test_reporter import check_against_crd
from tests.support import helm
from tests.support.extender import FIXTURES
from tests.support.fakekube import FakeKube
from tests.support.image_build import offline

DEVICE_EXAMPLES = helm.DEPLOY / "examples" / "devices"
VERSION = kubernetes_validate.latest_version()
Docs = list[tuple[str, dict[str, Any]]]


def crds(found: Docs) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD version among the documents."""
    out = {}
    for crd in helm.of_kind(found, "CustomResourceDefinition"):
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


DOCS = helm.deploy_documents()


@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[w for w, _ in DOCS])
def test_manifest_valid_for_the_api_server(where: str, doc: dict[str, Any]) -> None:
    if (doc.get("apiVersion"), doc.get("kind")) in crds(DOCS):
        check_against_crd(doc)
        return
    if problem := helm.api_problem(doc, VERSION):
        pytest.fail(f"{where}: {problem}")


def test_strict_validation_catches_what_the_api_server_refuses() -> None:
    """The validator does fail: a misspelt field, a string where an integer belongs."""
    (dep, *_) = helm.of_kind(DOCS, "Deployment")
    kubernetes_validate.validate(dep, VERSION, strict=True)
    misspelt = copy.deepcopy(dep)
    misspelt["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "one"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSION, strict=True)


def reported_device(topology: str, work: Path) -> dict[str, Any]:
    """The Device the reporter publishes for a simulated node, as `crihook demo` builds it."""
    node = make_sim_node(work / topology, topology, char_devices=False)
    os.environ[CONFIG_ENV] = str(node.config)
    return demo.device_object(node, build())


def example_text(topology: str, device: dict[str, Any]) -> str:
    return (
        f"# What `crihook report` publishes for the simulated {topology} node of `crihook demo`\n"
        f"# (regenerate: .venv/bin/python tests/deploy/test_manifests.py)\n"
        + yaml.safe_dump(device, sort_keys=False, width=1 << 16)
    )


@pytest.mark.skipif(compiler() is None, reason="needs gcc for the fake NVML library")
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_example_devices_are_what_the_reporter_publishes(
    topology: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONFIG_ENV, "")
    assert (DEVICE_EXAMPLES / f"{topology}.yaml").read_text() == example_text(
        topology, reported_device(topology, tmp_path)
    ), "deploy/examples/devices is stale: .venv/bin/python -m tests.deploy.test_manifests"


# -- deploy/ against the running scheduler ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key, crt = tmp / "tls.key", tmp / "tls.crt"
    subject = ["-days", "1", "-subj", "/CN=crihook-scheduler", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt, *subject],
        check=True,
        capture_output=True,
    )
    return key, crt


def scheduler_container(found: Docs) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Deployment, container) that runs `crihook scheduler`."""
    found = [
        (d, c)
        for d in helm.of_kind(found, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        if (c.get("args") or [""])[0] == "scheduler"
    ]
    assert len(found) == 1, "one Deployment container runs `crihook scheduler`"
    return found[0]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's target port (name or number) as the container's port number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


@pytest.fixture(params=["deploy", "defaults", "extender-stanza"])
def manifests(request: pytest.FixtureRequest) -> Docs:
    """deploy/, or the chart rendered with its defaults or with the extender stanza."""
    return DOCS if request.param == "deploy" else helm.rendered(request.param)


@pytest.fixture
def running(tmp_path: Path, manifests: Docs) -> Iterator[tuple[int, ssl.SSLContext, subprocess.Popen[bytes]]]:
    """`crihook scheduler` with the Deployment's arguments, on a loopback port, its certificate and
    kubeconfig swapped for test ones."""
    _, c = scheduler_container(manifests)
    key, crt = self_signed(tmp_path)
    port = free_port()
    # the self-signed certificate is its own CA, so it is the client certificate kube-scheduler shows
    swap = {"--listen": f"127.0.0.1:{port}", "--tls-cert": str(crt), "--tls-key": str(key), "--client-ca": str(crt)}
    args = [f"{a.split('=', 1)[0]}={swap[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in swap else a for a in c["args"]]
    # the certificate's name stands for the one the chart gives kube-scheduler
    args = [a for a in args if not a.startswith("--extender-client=")] + ["--extender-client=crihook-scheduler"]
    with FakeKube() as kube:
        args.append(f"--kubeconfig={kube.write_kubeconfig(tmp_path / 'kubeconfig')}")
        log = (tmp_path / "scheduler.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "crihook.cli", *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            tls = ssl.create_default_context(cafile=str(crt))
            tls.load_cert_chain(str(crt), str(key))
            yield port, tls, proc
        finally:
            proc.terminate()
            try:  # its shutdown is not what this test checks; on a loaded machine it can be slow
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def tls_ca(proc: subprocess.Popen[bytes]) -> str:
    """The CA file the running scheduler was given (its --tls-cert, self-signed)."""
    assert isinstance(proc.args, list)
    return str(flag([str(a) for a in proc.args], "--tls-cert"))


def request(port: int, tls: ssl.SSLContext, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def until_ok(port: int, tls: ssl.SSLContext, path: str, proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, "crihook scheduler exited"
        try:
            if request(port, tls, "GET", path)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"GET {path} never answered 200"
        time.sleep(0.2)


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


# A body each extender verb accepts (kube-scheduler's ExtenderArgs, ExtenderBindingArgs,
# ExtenderPreemptionArgs in k8s.io/kube-scheduler/extender/v1).
VERB_BODIES = {
    "filterVerb": lambda: fixture("filter_node_names.json"),
    "prioritizeVerb": lambda: fixture("prioritize_node_names.json"),
    "bindVerb": lambda: fixture("bind.json"),
    "preemptVerb": lambda: {"Pod": fixture("filter_node_names.json")["Pod"], "NodeNameToMetaVictims": {}},
}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_deploy_agrees_with_what_the_scheduler_serves(
    running: tuple[int, ssl.SSLContext, Any], manifests: Docs
) -> None:
    port, tls, proc = running
    dep, c = scheduler_container(manifests)
    assert c["image"] == offline.ref(), "the Deployment runs the image deploy/image/build-offline.py tags"
    listen = int(flag(c["args"], "--listen").rsplit(":", 1)[1])
    # the leader's pod: the template's labels and the one the leader adds (scheduler/ha.py)
    labels = {**dep["spec"]["template"]["metadata"]["labels"], ha.LEADER_LABEL: "true"}

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in c:
            probe = c[kind]["httpGet"]
            assert container_port(c, probe["port"]) == listen, kind
            assert probe.get("scheme") == "HTTPS", kind
            until_ok(port, tls, probe["path"], proc)

    services = {
        (s["metadata"]["name"], s["metadata"]["namespace"]): s
        for s in helm.of_kind(manifests, "Service")
        if s["spec"].get("selector") and s["spec"]["selector"].items() <= labels.items()
    }
    assert services, "a Service selects the scheduler's pods"
    service_ports = {}
    for key, s in services.items():
        for p in s["spec"]["ports"]:
            assert container_port(c, p.get("targetPort", p["port"])) == listen, (key, p)
            service_ports.setdefault(key, set()).add(p["port"])

    webhooks = [
        w
        for kind in ("Mutating", "Validating")
        for o in helm.of_kind(manifests, f"{kind}WebhookConfiguration")
        for w in o["webhooks"]
    ]
    assert webhooks
    review = fixture("admission_create.json")
    for wh in webhooks:
        svc = wh["clientConfig"]["service"]
        key = (svc["name"], svc["namespace"])
        assert key in services and svc.get("port", 443) in service_ports[key], wh["name"]
        status, body = request(port, tls, "POST", svc["path"], review)
        assert status == 200, (wh["name"], svc["path"], status, body[:200])
        assert json.loads(body)["response"]["uid"] == review["request"]["uid"]

    extenders = [e for o in helm.scheduler_configs(manifests) for e in o.get("extenders", [])]
    assert extenders
    for ext in extenders:
        url = urlsplit(ext["urlPrefix"])
        name, namespace, *_ = url.hostname.split(".")
        assert url.scheme == "https" and ext.get("enableHTTPS") is True
        assert url.port in service_ports[(name, namespace)], ext["urlPrefix"]
        for verb, body in VERB_BODIES.items():
            if verb in ext:
                status, answer = request(port, tls, "POST", f"{url.path.rstrip('/')}/{ext[verb]}", body())
                assert status == 200, (verb, status, answer[:200])
                json.loads(answer)
                # a caller without kube-scheduler's client certificate is refused
                anonymous = ssl.create_default_context(cafile=tls_ca(proc))
                status, _ = request(port, anonymous, "POST", f"{url.path.rstrip('/')}/{ext[verb]}", body())
                assert status == 403, verb
        tls_file = ext["tlsConfig"]
        assert {"caFile", "certFile", "keyFile", "serverName"} <= tls_file.keys()


if __name__ == "__main__":  # rewrite deploy/examples/devices from the reporter's output
    import tempfile

    DEVICE_EXAMPLES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name in TOPOLOGIES:
            (DEVICE_EXAMPLES / f"{name}.yaml").write_text(example_text(name, reported_device(name, Path(work))))


def test_the_image_is_built_again_when_any_package_changes() -> None:
    """The image's cache key covers every module the wheel installs: a change to any of them must
    build a new image, or the cluster tests run yesterday's code."""
    hashed = {p.relative_to(offline.ROOT) for p in offline.inputs()}
    shipped = [p for p in offline.sources() if p.suffix == ".py" and p.parts[0] in offline.package_dirs()]
    folders = {p.parts[0] for p in shipped}
    assert {"dra", "scheduler", "nri", "crihook"} <= folders
    assert [p for p in shipped if p not in hashed] == []
