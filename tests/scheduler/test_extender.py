"""Extender verbs with request bodies shaped exactly as kube-scheduler sends them (fixtures), over the
real allocator, and the HTTP(S) server around them."""

from __future__ import annotations

import copy
import http.client
import json
import shutil
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.scheduler import server as srv
from crihook.scheduler import webhook
from crihook.scheduler.claims import ClaimAsk
from crihook.scheduler.extender import (
    MAX_EXTENDER_PRIORITY,
    BadRequest,
    Extender,
    HostPriorityList,
    host_priorities,
    to_extender_scores,
)
from crihook.scheduler.plugin import PluginConfig
from crihook.scheduler.score import DefaultPolicy
from tests.support.extender import cluster_plugin, fixture
from tests.support.tlsburst import make_ca, make_cert, review

FILTER_RESULT_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


@pytest.fixture
def ext() -> Extender:
    return Extender(cluster_plugin())


def test_filter_node_names(ext: Extender) -> None:
    args = fixture("filter_node_names.json")
    out = ext.filter(args)
    assert set(out) == FILTER_RESULT_KEYS
    assert out["Nodes"] is None and out["Error"] == "" and out["FailedNodes"] == {}
    assert out["NodeNames"] == ["gpu-node-1", "gpu-node-2"]
    assert list(out["FailedAndUnresolvableNodes"]) == ["cpu-node-1"]
    assert "no Device" in out["FailedAndUnresolvableNodes"]["cpu-node-1"]


def test_filter_full_nodes_keeps_node_objects(ext: Extender) -> None:
    args = fixture("filter_nodes.json")  # 4 whole GPUs, nvidia.com/use-gputype: A100
    out = ext.filter(args)
    assert out["NodeNames"] is None and out["Error"] == ""
    assert out["Nodes"] == {"metadata": {}, "items": [args["Nodes"]["items"][0]]}
    failed = out["FailedAndUnresolvableNodes"]
    assert set(failed) == {"gpu-node-2", "cpu-node-1"}
    assert "nvidia.com/use-gputype" in failed["gpu-node-2"]


def test_pods_without_devices_pass_straight_through(ext: Extender) -> None:
    for name in ("filter_node_names.json", "filter_nodes.json"):
        args = fixture(name)
        for c in args["Pod"]["spec"]["containers"]:
            c["resources"] = {"requests": {"cpu": "1"}}
        out = ext.filter(args)
        assert out["FailedAndUnresolvableNodes"] == {} and out["Error"] == ""
        assert out["NodeNames"] == args["NodeNames"] and out["Nodes"] == args["Nodes"]
        assert all(p["Score"] == 0 for p in ext.prioritize(args))


def test_invalid_request_fails_every_node_with_the_reason(ext: Extender) -> None:
    args = fixture("filter_node_names.json")
    args["Pod"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    out = ext.filter(args)
    assert out["NodeNames"] == [] and out["Error"] == ""
    reasons = set(out["FailedAndUnresolvableNodes"].values())
    assert len(reasons) == 1 and "nvidia.com/gpu can not be combined" in reasons.pop()
    assert out["FailedAndUnresolvableNodes"].keys() == set(args["NodeNames"])


def test_not_ready_answers_an_error() -> None:
    e = Extender(cluster_plugin(), ready=lambda: False)
    out = e.filter(fixture("filter_node_names.json"))
    assert "not ready" in out["Error"] and out["NodeNames"] == []
    assert all(p["Score"] == 0 for p in e.prioritize(fixture("prioritize_node_names.json")))


def test_prioritize(ext: Extender) -> None:
    args = fixture("prioritize_node_names.json")
    out = ext.prioritize(args)
    assert [p["Host"] for p in out] == args["NodeNames"]
    assert all(set(p) == {"Host", "Score"} and 0 <= p["Score"] <= MAX_EXTENDER_PRIORITY for p in out)
    expected = ext.plugin.score_nodes(ext.plugin.pre_filter(_pod(args)), args["NodeNames"])
    best = max(args["NodeNames"], key=expected.__getitem__)
    scaled = to_extender_scores(np.array([expected[n] for n in args["NodeNames"]])).tolist()
    want = [MAX_EXTENDER_PRIORITY if n == best else min(9, s) for n, s in zip(args["NodeNames"], scaled, strict=True)]
    assert [p["Score"] for p in out] == want
    # a node that can not take the pod scores 0
    args["NodeNames"].append("cpu-node-1")
    assert ext.prioritize(args)[-1] == {"Host": "cpu-node-1", "Score": 0}


def as_claim_pod(args: dict[str, Any], claim: str = "gpus") -> dict[str, Any]:
    """The fixture's pod with its GPU requests turned into one ResourceClaim named `claim`."""
    out = copy.deepcopy(args)
    spec = out["Pod"]["spec"]
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    for c in spec["containers"]:
        c["resources"] = {"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]}
    return out


class Untouchable:
    """A lock that fails the test when taken: the allocator is not to be consulted."""

    def __enter__(self) -> None:
        raise AssertionError("the allocator's lock was taken")

    def __exit__(self, *_: object) -> None:
        return None


def test_prioritize_claims_answers_a_plain_pod_zeros_without_the_allocator() -> None:
    """The scoring-only entry is sent every pod: one with neither our resources nor claims gets a
    zero for every node, in the order sent, before the pod is read or the allocator's lock taken."""
    ext = Extender(cluster_plugin())
    ext.lock = Untouchable()  # type: ignore[assignment]
    args = fixture("prioritize_node_names.json")
    for c in args["Pod"]["spec"]["containers"]:
        c["resources"] = {"requests": {"cpu": "1"}}
    args["NodeNames"] = [*args["NodeNames"], "cpu-node-1"]
    out = ext.prioritize_claims(args)
    assert list(out) == [{"Host": n, "Score": 0} for n in args["NodeNames"]]
    assert out.json() == json.dumps(list(out), separators=(",", ":")).encode()
    assert list(ext.prioritize_claims({"Pod": None, "NodeNames": ["a"]})) == [{"Host": "a", "Score": 0}]
    with pytest.raises(BadRequest):
        ext.prioritize_claims([])


def test_prioritize_claims_scores_a_claim_pod_as_prioritize_does() -> None:
    """A pod whose claims ask for GPUs: the same scores as the binding entry's prioritize gives it,
    and nothing held (kube-scheduler's DRA allocator picks the GPUs)."""
    args = as_claim_pod(fixture("prioritize_node_names.json"))
    args["NodeNames"] = [*args["NodeNames"], "cpu-node-1"]

    def scored(verb: str) -> tuple[list[int], Extender]:
        ext = Extender(cluster_plugin())
        ext.claim_asks = {"team-a/gpus": ClaimAsk(1, 50)}
        return [p["Score"] for p in getattr(ext, verb)(args)], ext

    (got, ext), (want, _) = scored("prioritize_claims"), scored("prioritize")
    assert got == want and MAX_EXTENDER_PRIORITY in got and got[-1] == 0
    assert not ext.plugin.held


def test_prioritize_claims_leaves_our_resources_to_the_binding_entry() -> None:
    """kube-scheduler adds the scores of every entry interested in a pod: a pod asking for our
    resources is scored by the binding entry's prioritize, so the scoring-only entry gives it zeros,
    claims or not. A standby (not ready) gives every pod zeros."""
    ext = Extender(cluster_plugin())
    ext.claim_asks = {"team-a/gpus": ClaimAsk(1)}
    args = fixture("prioritize_node_names.json")
    both = copy.deepcopy(args)
    both["Pod"]["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "gpus"}]
    assert any(p["Score"] for p in Extender(cluster_plugin()).prioritize(args))
    for pod in (args, both):
        assert all(p["Score"] == 0 for p in ext.prioritize_claims(pod))
    standby = Extender(cluster_plugin(), ready=lambda: False)
    standby.claim_asks = ext.claim_asks
    assert all(p["Score"] == 0 for p in standby.prioritize_claims(as_claim_pod(args)))


def test_an_outlook_due_is_derived_on_a_thread_and_installed() -> None:
    """The pod that makes the allocator's outlook due starts its re-derivation on a thread of its
    own (Extender._refresh): the verbs do not wait for it, and the next ones score with it once in."""
    ext = Extender(cluster_plugin(PluginConfig(background_outlook=True)))
    policy = ext.plugin.policy
    assert isinstance(policy, DefaultPolicy)
    args = fixture("prioritize_node_names.json")
    first = None
    for i in range(192):  # the 192nd pod seen makes the outlook due
        with ext.lock:
            first = first or policy.outlook
        args["Pod"]["metadata"]["uid"] = f"pod-{i}"
        ext.filter(args)
        ext.prioritize(args)
        with ext.lock:
            ext._let_go(f"pod-{i}")  # the pod goes: the nodes never fill, every evaluation scores
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # let each job in before the next pod, as a quiet cluster would
            with ext.lock:
                if not ext._refreshing:
                    break
            time.sleep(0.001)
    with ext.lock:
        assert not policy.due and not ext._refreshing
        assert policy.outlook is not first and policy.outlook.seen == 192


def _pod(args: dict[str, Any]) -> Any:
    from crihook.scheduler.pod import pod_from_json

    return pod_from_json(args["Pod"])


def test_prioritize_prefers_the_partly_used_node_for_a_share(ext: Extender) -> None:
    """After a share lands on gpu-node-2, the next share scores that node higher (fragmentation)."""
    args = fixture("prioritize_node_names.json")
    req = ext.plugin.pre_filter(_pod(args))
    first = {p["Host"]: p["Score"] for p in ext.prioritize(args)}
    ext.plugin.reserve(req, "gpu-node-2")
    nxt = copy.deepcopy(args)
    nxt["Pod"]["metadata"]["uid"] = "another"
    after = {p["Host"]: p["Score"] for p in ext.prioritize(nxt)}
    assert after["gpu-node-2"] >= first["gpu-node-2"]


@given(st.lists(st.sampled_from([0.0, 12.5, 55.0, 96.0, 100.0]), min_size=1, max_size=8))
def test_one_node_alone_scores_highest(values: list[float]) -> None:
    """kube-scheduler picks among equal top scores at random: the allocator's best (the first
    among equals) must be the only node at MaxExtenderPriority."""
    names = [f"n{i}" for i in range(len(values))]
    out = host_priorities(names, dict(zip(names, values, strict=True)))
    top = [p["Host"] for p in out if p["Score"] == MAX_EXTENDER_PRIORITY]
    assert top == [names[values.index(max(values))]]
    assert list(host_priorities(names, {})) == [{"Host": n, "Score": 0} for n in names]


@given(
    st.lists(st.tuples(st.one_of(st.from_regex(r"[a-z0-9.-]{1,20}", fullmatch=True), st.text()), st.integers(0, 10)))
)
def test_host_priority_list_json(pairs: list[tuple[str, int]]) -> None:
    """The bytes written without dicts are the JSON of the dicts, names needing escapes included."""
    out = HostPriorityList([h for h, _ in pairs], [s for _, s in pairs])
    assert json.loads(out.json()) == [{"Host": h, "Score": s} for h, s in pairs] == list(out)


@given(st.floats(-50, 150, allow_nan=False))
def test_score_scale(score: float) -> None:
    s = int(to_extender_scores(np.array([score]))[0])
    assert 0 <= s <= MAX_EXTENDER_PRIORITY
    if 0 <= score <= 100:
        assert abs(s - score / 10) <= 0.5


@pytest.mark.parametrize(
    "body",
    [[], {"NodeNames": "n1"}, {"Nodes": {"items": [{"metadata": {}}]}}, {"Nodes": []}],
)
def test_bad_filter_bodies(ext: Extender, body: Any) -> None:
    with pytest.raises(BadRequest):
        ext.filter(body)


@pytest.mark.parametrize("missing", ["PodName", "PodNamespace", "PodUID", "Node"])
def test_bad_bind_bodies(ext: Extender, missing: str) -> None:
    body = fixture("bind.json")
    del body[missing]
    with pytest.raises(BadRequest, match=missing):
        ext.bind(body)


def test_bind_without_api_is_an_error(ext: Extender) -> None:
    assert "no API server" in ext.bind(fixture("bind.json"))["Error"]


# --- HTTP ---------------------------------------------------------------------------------------


@pytest.fixture
def http_server(ext: Extender) -> Iterator[tuple[str, int]]:
    ready = threading.Event()
    app = srv.App(ext, webhook.WebhookConfig(), ready.is_set)
    server = srv.make_server(app, "127.0.0.1", 0, None)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    server.ready_flag = ready  # type: ignore[attr-defined]
    yield server  # type: ignore[misc]
    server.shutdown()
    server.server_close()


def post(conn: http.client.HTTPConnection, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    return r.status, json.loads(raw) if r.getheader("Content-Type") == "application/json" else raw


def test_http_endpoints(http_server: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", http_server.server_address[1], timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"
    conn.request("GET", "/readyz")
    r = conn.getresponse()
    r.read()
    assert r.status == 503
    http_server.ready_flag.set()
    conn.request("GET", "/readyz")
    r = conn.getresponse()
    r.read()
    assert r.status == 200
    # one kept-alive connection carries every call, as kube-scheduler's client does
    code, out = post(conn, "/filter", fixture("filter_node_names.json"))
    assert code == 200 and out["NodeNames"] == ["gpu-node-1", "gpu-node-2"]
    code, out = post(conn, "/prioritize", fixture("prioritize_node_names.json"))
    assert code == 200 and [p["Host"] for p in out] == ["gpu-node-1", "gpu-node-2"]
    code, out = post(conn, "/mutate", fixture("admission_create.json"))
    assert code == 200 and out["response"]["patchType"] == "JSONPatch"
    code, out = post(conn, "/validate", fixture("admission_create.json"))
    assert code == 200 and out["response"]["uid"] == fixture("admission_create.json")["request"]["uid"]
    code, _ = post(conn, "/filter", b"{not json")
    assert code == 400
    code, _ = post(conn, "/bind", {"PodName": "x"})
    assert code == 400
    code, out = post(conn, "/preempt", {})
    assert code == 200 and out == {"NodeNameToMetaVictims": {}}
    code, _ = post(conn, "/unknown", {})
    assert code == 404


def test_metrics_count_requests_by_path_and_status(http_server: Any) -> None:
    from crihook.base import metrics

    ok, bad = metrics.SCHEDULER_REQUESTS.value("/filter", "200"), metrics.SCHEDULER_REQUESTS.value("/filter", "400")
    timed, cpu = metrics.SCHEDULER_SECONDS.count("/filter"), metrics.SCHEDULER_CPU_SECONDS.count("/filter")
    conn = http.client.HTTPConnection("127.0.0.1", http_server.server_address[1], timeout=10)
    assert post(conn, "/filter", fixture("filter_node_names.json"))[0] == 200
    assert post(conn, "/filter", b"{not json")[0] == 400
    assert metrics.SCHEDULER_REQUESTS.value("/filter", "200") == ok + 1
    assert metrics.SCHEDULER_REQUESTS.value("/filter", "400") == bad + 1
    assert metrics.SCHEDULER_SECONDS.count("/filter") == timed + 2
    assert metrics.SCHEDULER_CPU_SECONDS.count("/filter") == cpu + 2
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("Content-Type") == metrics.CONTENT_TYPE
    assert f'crihook_scheduler_requests_total{{path="/filter",code="200"}} {int(ok) + 1}' in text
    assert 'crihook_scheduler_request_duration_seconds_count{path="/filter"}' in text


def test_plain_http_only_on_loopback() -> None:
    assert srv.check_listen("127.0.0.1:9443", None, False) == ("127.0.0.1", 9443)
    assert srv.check_listen("[::1]:9443", None, False) == ("::1", 9443)
    with pytest.raises(ValueError, match="refusing plain HTTP"):
        srv.check_listen("0.0.0.0:9443", None, False)
    assert srv.check_listen("0.0.0.0:9443", None, True) == ("0.0.0.0", 9443)
    assert srv.check_listen("0.0.0.0:9443", srv.TlsFiles("c", "k", "ca"), False) == ("0.0.0.0", 9443)
    assert srv.check_listen("[::]:9443", srv.TlsFiles("c", "k", "ca"), False) == ("::", 9443)


def test_anonymous_extender_calls_only_on_loopback() -> None:
    """HTTPS without a client CA lets anyone who reaches the port bind pods: loopback only, or asked for."""
    assert srv.check_listen("127.0.0.1:9443", srv.TlsFiles("c", "k"), False) == ("127.0.0.1", 9443)
    with pytest.raises(ValueError, match="--client-ca"):
        srv.check_listen("[::]:9443", srv.TlsFiles("c", "k"), False)
    assert srv.check_listen("0.0.0.0:9443", srv.TlsFiles("c", "k"), False, True) == ("0.0.0.0", 9443)


def test_cli_refuses_plain_public_listener(capsys: pytest.CaptureFixture[str]) -> None:
    from crihook.cli import main

    assert main(["scheduler", "--listen", "0.0.0.0:9443"]) == 2
    assert "refusing plain HTTP" in capsys.readouterr().err
    assert main(["scheduler", "--tls-cert", "/x.pem"]) == 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_extender_verbs_need_kube_schedulers_client_certificate(ext: Extender, tmp_path: Path) -> None:
    """With a client CA, real TLS on loopback: kube-scheduler's certificate may call every verb; a
    caller without one may call the webhooks and the GETs (the API server presents none) but gets 403
    for filter and bind; another name signed by the same CA gets 403 where names are given; a
    certificate of another CA fails the handshake."""
    ca, other_ca = make_ca(tmp_path, "ca"), make_ca(tmp_path, "other-ca")
    server_cert = make_cert(tmp_path, "server", ca, "subjectAltName=IP:127.0.0.1")
    clients = {
        name: make_cert(tmp_path, name, signer, "extendedKeyUsage=clientAuth")
        for name, signer in (("crihook-kube-scheduler", ca), ("someone", ca), ("stranger", other_ca))
    }
    tls = srv.TlsFiles(str(server_cert[0]), str(server_cert[1]), str(ca[0]))
    app = srv.App(ext, webhook.WebhookConfig(), lambda: True)
    server = srv.make_server(app, "127.0.0.1", 0, tls, extender_clients=frozenset({"crihook-kube-scheduler"}))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    port = server.server_address[1]

    def conn(client: str = "") -> http.client.HTTPSConnection:
        ctx = ssl.create_default_context(cafile=str(ca[0]))
        if client:
            ctx.load_cert_chain(str(clients[client][0]), str(clients[client][1]))
        return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)

    bind = fixture("bind.json")
    try:
        code, out = post(conn("crihook-kube-scheduler"), "/filter", fixture("filter_node_names.json"))
        assert code == 200 and out["NodeNames"] == ["gpu-node-1", "gpu-node-2"]
        assert post(conn("crihook-kube-scheduler"), "/bind", bind)[0] == 200
        for caller in ("", "someone"):
            for path, body in (("/filter", fixture("filter_node_names.json")), ("/bind", bind)):
                code, out = post(conn(caller), path, body)
                assert code == 403 and b"client certificate" in out, (caller, path)
            code, out = post(conn(caller), "/validate", json.loads(review("uid-1")))
            assert code == 200 and out["response"]["allowed"] is True
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            post(conn("stranger"), "/validate", json.loads(review("uid-1")))
    finally:
        server.shutdown()
        server.server_close()


def test_extender_refuses_pods_of_schedulers_it_does_not_serve(ext: Extender) -> None:
    ext.scheduler_names = frozenset({"crihook"})
    args = fixture("filter_node_names.json")
    out = ext.filter(args)
    assert out["NodeNames"] == [] and all("schedulerName default-scheduler" in w for w in out["FailedNodes"].values())
    args["Pod"].setdefault("spec", {})["schedulerName"] = "crihook"
    assert ext.filter(args)["NodeNames"] == ["gpu-node-1", "gpu-node-2"]


def test_bind_refuses_a_pod_of_another_scheduler() -> None:
    """A bind names only the pod: the pod read back must name a scheduler this extender serves, or
    whoever reaches /bind could have any pending pod placed through crihook."""
    from crihook.scheduler.cache import KubeApi
    from tests.support.fakekube import FakeKube

    with FakeKube() as kube:
        for name, scheduler in (("theirs", "other-scheduler"), ("ours", "crihook")):
            kube.create(
                "pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": "ns"},
                    "spec": {"schedulerName": scheduler, "containers": [{"name": "c", "image": "busybox"}]},
                },
            )
        ext = Extender(cluster_plugin(), KubeApi(kube.api_client()))
        ext.scheduler_names = frozenset({"crihook"})
        for name in ("theirs", "ours"):
            uid = kube.get("pods", name, "ns")["metadata"]["uid"]
            out = ext.bind({"PodName": name, "PodNamespace": "ns", "PodUID": uid, "Node": "gpu-node-1"})
            if name == "theirs":
                assert "schedulerName other-scheduler is not served" in out["Error"]
                assert "nodeName" not in kube.get("pods", name, "ns")["spec"]
            else:
                assert out == {"Error": ""} and kube.get("pods", name, "ns")["spec"]["nodeName"] == "gpu-node-1"
