"""crihook.base.metrics: exposition checked line by line against the text-format 0.0.4 rules, read
back by the reference parser (prometheus_client), and served over loopback HTTP."""

from __future__ import annotations

import asyncio
import math
import re
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from crihook.base import metrics, tls
from crihook.base.metrics import Counter, Gauge, Histogram, Registry

# -- a strict reader of the text format ----------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"(?:[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]Inf|NaN)"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL})(?:,{_LABEL})*)?\}})? ({_VALUE})\Z")
_HELP = re.compile(rf"# HELP ({_NAME}) ((?:[^\\\n]|\\[\\n])*)\Z")
_TYPE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)\Z")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), s)


def strict_parse(text: str) -> dict[str, dict]:
    """Families by name: {"type", "help", "samples": [(name, labels dict, value)]}, enforcing the
    rules a Prometheus server applies: one HELP and TYPE per family before its samples, samples of
    a family contiguous, valid names and escapes, no duplicate series, trailing newline."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current: str | None = None
    seen: set[tuple[str, tuple]] = set()
    for line in text[:-1].split("\n"):
        if m := _HELP.match(line):
            assert m.group(1) not in families, f"second HELP for {m.group(1)}"
            current = m.group(1)
            families[current] = {"help": _unescape(m.group(2)), "type": None, "samples": []}
            continue
        if m := _TYPE.match(line):
            assert m.group(1) == current and families[current]["type"] is None, line
            families[current]["type"] = m.group(2)
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        name, label_text, value = m.groups()
        assert current is not None and families[current]["type"], f"sample before HELP/TYPE: {line!r}"
        suffixes = ("_bucket", "_sum", "_count") if families[current]["type"] == "histogram" else ("",)
        assert name in {current + s for s in suffixes}, f"{name} outside its family {current}"
        labels = {k: _unescape(v) for k, v in _PAIR.findall(label_text or "")}
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen, f"duplicate series {key}"
        seen.add(key)
        families[current]["samples"].append((name, labels, float(value)))
    for name, fam in families.items():
        if fam["type"] == "histogram":
            check_histogram(name, fam["samples"])
    return families


def check_histogram(name: str, samples: list[tuple[str, dict, float]]) -> None:
    series: dict[tuple, dict] = {}
    for sample, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        s = series.setdefault(key, {"buckets": [], "sum": None, "count": None})
        if sample.endswith("_bucket"):
            s["buckets"].append((float(labels["le"]), value))
        else:
            s[sample.removeprefix(name + "_")] = value
    for key, s in series.items():
        les = [le for le, _ in s["buckets"]]
        counts = [c for _, c in s["buckets"]]
        assert les == sorted(les) and les[-1] == math.inf, f"{name}{key}: le not ascending to +Inf"
        assert counts == sorted(counts), f"{name}{key}: buckets not cumulative"
        assert s["count"] == counts[-1] and s["sum"] is not None


# -- format ---------------------------------------------------------------------------------------


def test_counter_gauge_histogram_render_and_parse() -> None:
    reg = Registry()
    calls = Counter("t_calls_total", "Calls.\nSecond line with a \\ backslash.", ("method", "code"), registry=reg)
    size = Gauge("t_size", "Size.", ("kind",), registry=reg)
    lat = Histogram("t_seconds", "Latency.", ("hook",), buckets=(0.001, 0.01, 0.1), registry=reg)
    Counter("t_starts_total", "Unlabelled.", registry=reg)
    calls.inc("/runtime.v1.RuntimeService/Version", "OK")
    calls.inc("/runtime.v1.RuntimeService/Version", "OK", amount=2)
    calls.inc('we"ird\\pod\nname', "UNAVAILABLE")
    size.set(7, "pods")
    size.set(2.5, "containers")
    size.dec("pods")
    for v in (0.0005, 0.001, 0.002, 0.5):
        lat.observe(v, "gpu")

    text = reg.render().decode()
    fams = strict_parse(text)
    assert fams["t_calls_total"]["help"] == "Calls.\nSecond line with a \\ backslash."
    assert {(s[1]["method"], s[1]["code"]): s[2] for s in fams["t_calls_total"]["samples"]} == {
        ("/runtime.v1.RuntimeService/Version", "OK"): 3,
        ('we"ird\\pod\nname', "UNAVAILABLE"): 1,
    }
    assert {s[1]["kind"]: s[2] for s in fams["t_size"]["samples"]} == {"pods": 6, "containers": 2.5}
    assert fams["t_starts_total"]["samples"] == [("t_starts_total", {}, 0)]
    buckets = [(s[1]["le"], s[2]) for s in fams["t_seconds"]["samples"] if s[0] == "t_seconds_bucket"]
    # 0.001 equals a bound and counts in it (le is "less than or equal").
    assert buckets == [("0.001", 2), ("0.01", 3), ("0.1", 3), ("+Inf", 4)]
    sums = {s[0]: s[2] for s in fams["t_seconds"]["samples"]}
    assert sums["t_seconds_count"] == 4 and sums["t_seconds_sum"] == pytest.approx(0.5035)

    ref = {f.name: f for f in text_string_to_metric_families(text)}
    assert ref["t_calls"].type == "counter"  # the reference parser drops the _total suffix
    assert {s.labels["method"] for s in ref["t_calls"].samples} == {
        "/runtime.v1.RuntimeService/Version",
        'we"ird\\pod\nname',
    }
    assert ref["t_seconds"].type == "histogram"
    assert ref["t_calls"].documentation == "Calls.\nSecond line with a \\ backslash."


def test_value_formatting() -> None:
    assert metrics.format_value(3) == "3"
    assert metrics.format_value(3.0) == "3"
    assert metrics.format_value(0.25) == "0.25"
    assert metrics.format_value(5e-05) == "5e-05"
    assert metrics.format_value(math.inf) == "+Inf"
    assert metrics.format_value(-math.inf) == "-Inf"
    assert metrics.format_value(math.nan) == "NaN"
    assert metrics.format_value(1e20) == "1e+20"


def test_default_buckets_cover_50us_to_10s() -> None:
    assert metrics.DEFAULT_BUCKETS[0] == 0.00005 and metrics.DEFAULT_BUCKETS[-1] == 10.0
    assert list(metrics.DEFAULT_BUCKETS) == sorted(set(metrics.DEFAULT_BUCKETS))


label_values = st.text(st.characters(codec="utf-8"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    incs=st.lists(st.tuples(label_values, label_values, st.integers(0, 1000)), max_size=20),
    obs=st.lists(st.tuples(label_values, st.floats(0, 20, allow_nan=False)), max_size=30),
)
def test_any_label_values_round_trip(incs: list[tuple[str, str, int]], obs: list[tuple[str, float]]) -> None:
    reg = Registry()
    c = Counter("p_total", "p", ("a", "b"), registry=reg)
    h = Histogram("p_seconds", "p", ("a",), registry=reg)
    want_c: dict[tuple[str, str], int] = {}
    for a, b, n in incs:
        c.inc(a, b, amount=n)
        want_c[(a, b)] = want_c.get((a, b), 0) + n
    want_h: dict[str, list[float]] = {}
    for a, v in obs:
        h.observe(v, a)
        want_h.setdefault(a, []).append(v)

    text = reg.render().decode()
    fams = strict_parse(text)
    assert {(s[1]["a"], s[1]["b"]): s[2] for s in fams["p_total"]["samples"]} == want_c
    got_h = {s[1]["a"]: s[2] for s in fams["p_seconds"]["samples"] if s[0] == "p_seconds_count"}
    assert got_h == {a: len(v) for a, v in want_h.items()}
    for a, values in want_h.items():
        for s in fams["p_seconds"]["samples"]:
            if s[0] == "p_seconds_bucket" and s[1]["a"] == a:
                assert s[2] == sum(1 for v in values if v <= float(s[1]["le"]))

    ref = {f.name: f for f in text_string_to_metric_families(text)}
    got_ref = {(s.labels["a"], s.labels["b"]): s.value for s in ref["p"].samples if s.name == "p_total"}
    assert got_ref == want_c


# -- misuse is caught where it happens ------------------------------------------------------------


def test_label_count_and_type_are_checked_on_first_use() -> None:
    c = Counter("e_total", "e", ("method", "code"), registry=None)
    with pytest.raises(ValueError, match=r"takes labels \('method', 'code'\)"):
        c.inc("only-one")
    with pytest.raises(TypeError, match="must be str"):
        c.inc("m", 0)  # type: ignore[arg-type]
    g = Gauge("e_gauge", "e", ("kind",), registry=None)
    with pytest.raises(ValueError):
        g.set(1)
    h = Histogram("e_seconds", "e", ("hook",), registry=None)
    with pytest.raises(ValueError):
        h.observe(0.1, "a", "b")
    assert c.value("only-one") == 0 and h.count("a", "b") == 0  # nothing half-recorded


def test_counter_cannot_go_down() -> None:
    c = Counter("d_total", "d", registry=None)
    with pytest.raises(ValueError, match="only go up"):
        c.inc(amount=-1)
    assert c.value() == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: Counter("1bad_total", "x", registry=r), "invalid metric name"),
        (lambda r: Counter("calls", "x", registry=r), "must end in _total"),
        (lambda r: Gauge("g", "x", ("bad-label",), registry=r), "invalid label name"),
        (lambda r: Gauge("g", "x", ("__reserved",), registry=r), "invalid label name"),
        (lambda r: Gauge("g", "x", ("a", "a"), registry=r), "duplicate label"),
        (lambda r: Histogram("h", "x", ("le",), registry=r), "reserved"),
        (lambda r: Histogram("h", "x", buckets=(0.1, 0.1), registry=r), "strictly increasing"),
        (lambda r: Histogram("h", "x", buckets=(), registry=r), "strictly increasing"),
    ],
)
def test_bad_definitions_are_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(Registry())


def test_a_name_registers_once() -> None:
    reg = Registry()
    Gauge("once", "x", registry=reg)
    with pytest.raises(ValueError, match="already registered"):
        Gauge("once", "x", registry=reg)


def test_crihook_metrics_exposition() -> None:
    fams = strict_parse(metrics.REGISTRY.render().decode())
    expected = {
        "crihook_build_info": "gauge",
        "crihook_cri_calls_total": "counter",
        "crihook_backend_duration_seconds": "histogram",
        "crihook_hook_duration_seconds": "histogram",
        "crihook_hook_failures_total": "counter",
        "crihook_store_objects": "gauge",
        "crihook_reporter_writes_total": "counter",
        "crihook_scheduler_leader": "gauge",
        "crihook_scheduler_binds_refused_total": "counter",
    }
    assert {n: f["type"] for n, f in fams.items() if n in expected} == expected
    assert metrics.CRI_CALLS.labels == ("method", "code")
    assert metrics.HOOK_SECONDS.labels == ("hook", "stage")
    assert metrics.BACKEND_SECONDS.labels == ("method",)


# -- the endpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "want"),
    [("127.0.0.1:9317", ("127.0.0.1", 9317)), ("[::1]:0", ("::1", 0)), ("localhost:80", ("localhost", 80))],
)
def test_parse_listen(listen: str, want: tuple[str, int]) -> None:
    assert metrics.parse_listen(listen) == want


@pytest.mark.parametrize("listen", ["9317", ":9317", "127.0.0.1:", "127.0.0.1:99999", "::1:9317", "host:port"])
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ValueError, match="metrics listen address"):
        metrics.parse_listen(listen)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "10.1.2.3:9317", "[::]:0", "example.org:9317"])
async def test_serve_refuses_non_loopback(listen: str) -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        await metrics.serve(listen)


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


@pytest.fixture
async def endpoint():
    reg = Registry()
    Counter("s_total", "s", ("k",), registry=reg).inc("v")
    server = await metrics.serve("127.0.0.1:0", registry=reg)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_get_metrics(endpoint: int) -> None:
    reply = await _request(endpoint, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert strict_parse(body.decode())["s_total"]["samples"] == [("s_total", {"k": "v"}, 1)]


async def test_head_query_and_errors(endpoint: int) -> None:
    head = await _request(endpoint, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
    query = await _request(endpoint, b"GET /metrics?name[]=x HTTP/1.0\r\n\r\n")
    assert query.startswith(b"HTTP/1.1 200 OK")
    for raw, status in [
        (b"GET / HTTP/1.1\r\n\r\n", b"404"),
        (b"GET /metricsx HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"garbage\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n", b"431"),
    ]:
        reply = await _request(endpoint, raw)
        assert reply.split(b" ", 2)[1] == status, (raw[:20], reply[:40])


async def test_silent_client_is_dropped(endpoint: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "REQUEST_TIMEOUT", 0.1)
    reply = await _request(endpoint, b"GET /metrics HTTP/1.1\r\n")  # never finishes its headers
    assert reply == b""


def test_replace_swaps_every_series_and_checks_new_labels() -> None:
    reg = Registry()
    g = Gauge("t_used_bytes", "used", ("pod", "gpu"), registry=reg)
    g.set(1, "a", "0")
    g.replace({("b", "0"): 2, ("c", "1"): 3})
    assert (g.value("a", "0"), g.value("b", "0"), g.value("c", "1")) == (0, 2, 3)
    assert 't_used_bytes{pod="a"' not in reg.render().decode()
    with pytest.raises(ValueError, match="takes labels"):
        g.replace({("only-one",): 1})
    g.replace({})
    assert list(g.samples()) == []


def test_the_docs_list_exactly_the_series_exposed_with_their_types() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = dict(re.findall(r"^\| `(crihook_\w+)` \| (\w+) \|", page, re.M))
    assert rows == {m.name: m.kind for m in metrics.REGISTRY}


def test_registry_labels_go_on_every_series() -> None:
    """A node daemon's registry carries node="<name>" on every series, histograms' buckets included,
    so two nodes' series never collide in Prometheus."""
    reg = Registry()
    Counter("c_total", "c", registry=reg).inc()
    Gauge("g_bytes", "g", ("pod",), registry=reg).set(1, "a")
    metrics.Histogram("h_seconds", "h", buckets=(1.0,), registry=reg).observe(0.5)
    reg.const_labels = {"node": "gpu-1"}
    parsed = strict_parse(reg.render().decode())
    samples = [s for family in parsed.values() for s in family["samples"]]
    assert samples and all(labels.get("node") == "gpu-1" for _, labels, _ in samples)
    assert ("g_bytes", {"node": "gpu-1", "pod": "a"}, 1) in samples


async def _request_tls(port: int, raw: bytes) -> bytes:
    """A request over TLS, checking nothing of the certificate (a self-signed one: Prometheus'
    insecureSkipVerify) and sending no server name (Prometheus dials a pod's IP address)."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=None)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_healthz_needs_no_token_and_metrics_need_an_allowed_one() -> None:
    """Off loopback the endpoint serves only with an authorizer, over TLS; a scrape without a bearer
    token, with an unknown one, or with one not allowed is refused; kubelet's probe of /healthz needs
    none."""
    from crihook.base.kubeauth import Verdict

    reg = Registry()
    Counter("s_total", "s", registry=reg).inc()
    seen: list[str] = []

    def authorize(token: str) -> Verdict:
        seen.append(token)
        return {"good": Verdict(200, "prometheus"), "other": Verdict(403, "no")}.get(token, Verdict(401, "who"))

    context = tls.self_signed_context(["localhost"])
    server = await metrics.serve("0.0.0.0:0", registry=reg, authorize=authorize, tls=context)
    port = server.sockets[0].getsockname()[1]
    try:
        get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        assert (await _request_tls(port, get + b"\r\n")).startswith(b"HTTP/1.1 401")
        assert (await _request_tls(port, get + b"Authorization: Bearer bad\r\n\r\n")).startswith(b"HTTP/1.1 401")
        assert (await _request_tls(port, get + b"Authorization: Bearer other\r\n\r\n")).startswith(b"HTTP/1.1 403")
        reply = await _request_tls(port, get + b"authorization: bearer good\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200") and b"s_total 1" in reply
        assert (await _request_tls(port, b"GET /healthz HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert seen == ["", "bad", "other", "good"]
        # plain HTTP on the TLS port: the handshake fails, no answer, and the token was never read
        assert await _request(port, get + b"Authorization: Bearer good\r\n\r\n") == b""
        assert seen == ["", "bad", "other", "good"]
    finally:
        server.close()
        await server.wait_closed()


async def test_bearer_tokens_are_taken_over_tls_only() -> None:
    from crihook.base.kubeauth import Verdict

    with pytest.raises(ValueError, match="served over TLS only"):
        await metrics.serve("127.0.0.1:0", authorize=lambda _token: Verdict(200))


async def test_tls_without_authorization_on_loopback() -> None:
    """A certificate alone encrypts a loopback endpoint; it does not open it to other addresses."""
    reg = Registry()
    Counter("s_total", "s", registry=reg).inc()
    context = tls.self_signed_context(["localhost"])
    with pytest.raises(ValueError, match="not a loopback address"):
        await metrics.serve("0.0.0.0:0", registry=reg, tls=context)
    server = await metrics.serve("127.0.0.1:0", registry=reg, tls=context)
    try:
        reply = await _request_tls(server.sockets[0].getsockname()[1], b"GET /metrics HTTP/1.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200") and b"s_total 1" in reply
    finally:
        server.close()
        await server.wait_closed()


def test_kube_authorizer_asks_token_and_access_reviews_and_caches() -> None:
    from crihook.base.kubeauth import KubeAuthorizer
    from tests.support.fakekube import FakeKube

    with FakeKube() as kube:
        kube.tokens = {
            "prom": {"username": "system:serviceaccount:monitoring:prometheus", "groups": ["system:serviceaccounts"]},
            "pod": {"username": "system:serviceaccount:team:app", "groups": []},
        }
        kube.allowed = {("system:serviceaccount:monitoring:prometheus", "/metrics", "get")}
        clock = [0.0]
        auth = KubeAuthorizer(kube.api_client(), clock=lambda: clock[0])
        assert auth.check("prom").code == 200
        assert auth.check("pod").code == 403
        assert auth.check("forged").code == 401
        assert auth.check("").code == 401
        calls = len(kube.requests)
        for _ in range(5):
            assert auth.check("prom").code == 200  # cached: no call
        assert len(kube.requests) == calls
        kube.allowed.clear()
        clock[0] += 61
        assert auth.check("prom").code == 403  # asked again after a minute
        kube.fail_next(5, 500)
        clock[0] += 61
        assert auth.check("prom").code == 503  # the API server failing: this scrape fails
