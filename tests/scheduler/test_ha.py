"""Several scheduler replicas: the Lease election (scheduler/leader.py) against the fake API server
with a hand-driven clock, the bind's re-check against the API server when this replica's view is
stale, and two real `crihook scheduler` processes: the leader SIGKILLed in a burst of binds, and a
leader SIGSTOPped past its lease that wakes up to a bind."""

from __future__ import annotations

import http.client
import json
import logging
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crihook.base import metrics
from crihook.scheduler.cache import KubeApi
from crihook.scheduler.extender import ApiFailure
from crihook.scheduler.fence import CLAIM_LABEL
from crihook.scheduler.leader import Elector, KubeLeaseApi, LeaseTiming
from tests.support.bindrun import SHAPES, audit, cluster, start_scheduler
from tests.support.fakekube import MICRO_TIME, FakeKube
from tests.support.harun import (
    Replica,
    Service,
    Timing,
    burst,
    get,
    labelled,
    make_pods,
    replicas,
    schedule,
    time_to_ready,
    wait_leader,
)

LEASE, NS = "crihook-scheduler", "kube-system"
TIMING = LeaseTiming(duration=8, renew_deadline=5, retry_period=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(kube: FakeKube, name: str, clock: Clock) -> Elector:
    return Elector(KubeLeaseApi(kube.api_client(), LEASE, NS), name, TIMING, LEASE, NS, clock=clock)


# --- the election, one round at a time ---


def test_lease_is_acquired_renewed_and_taken_over_only_after_it_expires() -> None:
    with FakeKube() as kube:
        clock = Clock()
        a, b = elector(kube, "a", clock), elector(kube, "b", clock)
        assert a.step() and a.may_write()
        lease = kube.get("leases", LEASE, NS)["spec"]
        assert lease["holderIdentity"] == "a" and lease["leaseDurationSeconds"] == 8
        assert lease["leaseTransitions"] == 0
        assert MICRO_TIME.match(lease["renewTime"]) and MICRO_TIME.match(lease["acquireTime"])
        assert not b.step()  # held, and b has only just seen it
        clock.now += 7.9
        assert not b.step()  # unchanged for 7.9 s of b's clock: still a's
        clock.now += 0.2
        assert not a.may_write()  # a has not renewed for renew_deadline: it stops writing on its own
        assert b.step() and b.may_write()
        lease = kube.get("leases", LEASE, NS)["spec"]
        assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1
        assert not a.step() and not a.may_write()  # a wakes, reads the lease, and stays out


def test_renewals_keep_a_standby_out() -> None:
    with FakeKube() as kube:
        clock = Clock()
        a, b = elector(kube, "a", clock), elector(kube, "b", clock)
        assert a.step()
        for _ in range(20):  # 20 s of renewals every second: b's view of the lease keeps changing
            clock.now += 1
            assert a.step()
            assert not b.step()
        assert kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] == "a"


def test_two_standbys_racing_for_a_free_lease_get_one_leader() -> None:
    with FakeKube() as kube:
        clock = Clock()
        electors = [elector(kube, f"r{i}", clock) for i in range(4)]
        results: list[bool] = []
        threads = [threading.Thread(target=lambda e=e: results.append(e.step())) for e in electors]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, False, False, True]  # the others got 409 on create or replace
        holder = kube.get("leases", LEASE, NS)["spec"]["holderIdentity"]
        assert [e.identity for e in electors if e.may_write()] == [holder]


def test_release_lets_a_standby_take_over_at_its_next_look() -> None:
    with FakeKube() as kube:
        clock = Clock()
        a, b = elector(kube, "a", clock), elector(kube, "b", clock)
        assert a.step()
        assert not b.step()
        a.stop()  # not started: only releases
        spec = kube.get("leases", LEASE, NS)["spec"]
        assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1
        assert b.step()  # no waiting out the old lease
        # client-go keeps the count on release and adds one when the next holder acquires
        assert kube.get("leases", LEASE, NS)["spec"]["leaseTransitions"] == 1


def test_a_leader_stopped_past_its_renew_deadline_still_releases_a_lease_it_holds() -> None:
    """The term's end can outlast the renew deadline on a busy node; the lease is still handed back,
    but only while the record names this replica."""
    with FakeKube() as kube:
        clock = Clock()
        a, b, c = elector(kube, "a", clock), elector(kube, "b", clock), elector(kube, "c", clock)
        assert a.step() and not b.step()
        clock.now += TIMING.renew_deadline + 1
        assert not a.may_write()
        a.stop()
        assert kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] == ""
        assert b.step() and not c.step()
        clock.now += TIMING.duration + 1
        assert c.step()  # b's lease ran out and c holds it: b's release must not touch it
        b.stop()
        assert kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] == "c"


def test_a_leader_that_can_not_renew_stops_writing_at_the_renew_deadline() -> None:
    with FakeKube() as kube:
        clock = Clock()
        a = elector(kube, "a", clock)
        assert a.step()
        kube.fail_next(100, 503, path="/leases/")
        clock.now += 4
        assert a.step()  # the write failed, but the last good renewal is 4 s old: still leading
        clock.now += 1.5
        assert not a.step() and not a.may_write()


def test_lease_timing_must_leave_room_between_its_parts() -> None:
    with pytest.raises(ValueError, match="duration > renew deadline > retry period"):
        LeaseTiming(duration=5, renew_deadline=5, retry_period=1)
    assert LeaseTiming().worst_takeover <= 15 - 3  # the 15 s target, with room for the state rebuild


def test_the_fake_refuses_a_lease_write_the_api_server_would_refuse() -> None:
    with FakeKube() as kube:
        api = KubeLeaseApi(kube.api_client(), LEASE, NS)
        base = {"metadata": {"name": LEASE, "namespace": NS}, "spec": {"holderIdentity": "x"}}
        with pytest.raises(ApiFailure) as e:
            api.create({**base, "spec": {"renewTime": "2026-01-01T00:00:00Z"}})  # a Time, not a MicroTime
        assert e.value.code == 400
        with pytest.raises(ApiFailure) as e:
            api.create({**base, "spec": {"leaseDurationSeconds": 0}})
        assert e.value.code == 422
        created = api.create(base)
        api.replace({**created, "spec": {"holderIdentity": "y"}})
        with pytest.raises(ApiFailure) as e:
            api.replace({**created, "spec": {"holderIdentity": "z"}})  # the resourceVersion read before y's write
        assert e.value.code == 409


# --- the bind's re-check against the API server ---


def _bind_elsewhere(kube: FakeKube, pod: dict[str, Any], node: str, minors: list[int]) -> None:
    """What another replica's bind leaves on the API server: the claim, then the Binding."""
    entries = [
        {"minor": m, "resources": {"koordinator.sh/gpu-core": 100, "koordinator.sh/gpu-memory": 1}} for m in minors
    ]
    ann = {"scheduling.koordinator.sh/device-allocated": json.dumps({"gpu": entries})}
    m = pod["metadata"]
    labels = {CLAIM_LABEL: node}
    kube.patch("pods", m["name"], {"metadata": {"annotations": ann, "labels": labels}}, m["namespace"])
    kube._bind(m["namespace"], m["name"], {"metadata": {"name": m["name"]}, "target": {"name": node}})


def test_a_bind_on_a_stale_view_is_refused_by_the_api_servers_pods(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="crihook")
    with cluster(1) as kube:
        sched = start_scheduler(kube)  # leads (may_write is always true here): only the re-check is left
        try:
            kube.pause_watches()  # what another leader does from now on never reaches this view
            others = make_pods(kube, 8, {"nvidia.com/gpu": "1"}, prefix="other")
            for i, pod in enumerate(others):
                _bind_elsewhere(kube, pod, "gpu-node-00", [i])
            late = make_pods(kube, 1, {"nvidia.com/gpu": "1"}, prefix="late")[0]
            m = late["metadata"]
            refused = metrics.SCHEDULER_BINDS_REFUSED.value("stale_view")
            answer = sched.ext.bind(
                {"PodName": m["name"], "PodNamespace": "ha", "PodUID": m["uid"], "Node": "gpu-node-00"}
            )
            assert "already held by ha/other" in answer["Error"] and "stale view" in answer["Error"]
            assert metrics.SCHEDULER_BINDS_REFUSED.value("stale_view") == refused + 1
            assert not kube.get("pods", m["name"], "ha")["spec"].get("nodeName")
            assert m["uid"] not in sched.plugin.held  # the reservation is undone
            assert audit(kube).clean
        finally:
            kube.pause_watches(False)
            sched.stop()


def _claim(name: str, shares: list[tuple[int, int]], bound: bool) -> dict[str, Any]:
    entries = [
        {"minor": m, "resources": {"koordinator.sh/gpu-core": c, "koordinator.sh/gpu-memory": c}} for m, c in shares
    ]
    annotations = {"scheduling.koordinator.sh/device-allocated": json.dumps({"gpu": entries})}
    meta = {"name": name, "namespace": "ns", "uid": name, "resourceVersion": "1", "annotations": annotations}
    return {"metadata": meta, "spec": {"nodeName": "n"} if bound else {}}


def test_judging_the_claims_on_a_node() -> None:
    from crihook.base.allocation import DeviceAllocation
    from crihook.scheduler.fence import claim_value, judge

    def ours(minor: int, core: int) -> list[DeviceAllocation]:
        return [
            DeviceAllocation(
                minor=minor, id="", resources={"koordinator.sh/gpu-core": core, "koordinator.sh/gpu-memory": core}
            )
        ]

    memory = lambda minor: 100  # noqa: E731
    # a bound half and our half fit; a bound whole GPU refuses
    assert judge("me", ours(0, 50), [_claim("a", [(0, 50)], True)], memory) == (None, [])
    why, clear = judge("me", ours(0, 50), [_claim("a", [(0, 100)], True)], memory)
    assert why and "ns/a" in why and clear == []
    # unbound claims that only together with ours overflow GPU 0 are all in the way; one on GPU 1 is not
    claims = [_claim("u1", [(0, 40)], False), _claim("u2", [(0, 40)], False), _claim("u3", [(1, 100)], False)]
    why, clear = judge("me", ours(0, 40), claims, memory)
    assert why is None and [p["metadata"]["name"] for p in clear] == ["u1", "u2"]
    # our own claim is among those listed, and is not in our way
    assert judge("me", ours(0, 100), [_claim("me", [(0, 100)], False)], memory) == (None, [])
    # a GPU a ResourceClaim holds on the API server refuses, whoever else shares it
    from crihook.scheduler.fence import held_by_claims

    assert held_by_claims(ours(0, 50) + ours(1, 50), {1: ["ns/c", "ns/d"]}) == (
        "GPU 1 is held by ResourceClaim ns/c, ns/d on the API server"
    )
    assert held_by_claims(ours(0, 50), {1: ["ns/c"], 0: []}) is None
    # node names are label values, hashed past 63 characters
    assert claim_value("gpu-node-1") == "gpu-node-1"
    long = "n" * 70 + ".example.com"
    assert len(claim_value(long)) <= 63 and claim_value(long) != claim_value(long + "x")


class Stalling(KubeApi):
    """A replica that stops dead at one step of a bind (a SIGSTOP, a long pause) until `go` is set."""

    def __init__(self, api_client: Any, at: str) -> None:
        super().__init__(api_client)
        self.at = at
        self.reached = threading.Event()
        self.go = threading.Event()

    def _stall(self, step: str) -> None:
        if step == self.at:
            self.reached.set()
            assert self.go.wait(30)

    def annotate_pod(self, *args: Any, **kw: Any) -> str:
        self._stall("claim")
        return super().annotate_pod(*args, **kw)

    def bind_pod(self, *args: Any, **kw: Any) -> None:
        self._stall("binding")
        super().bind_pod(*args, **kw)


@pytest.mark.parametrize("at", ["claim", "binding"])
def test_a_replica_stalled_inside_a_bind_can_not_give_out_a_gpu_another_replica_gave_out(
    at: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Both replicas believe they may write and both see GPU 7 as the node's last free one (every
    timing check passed before the stall): the claims on the API server decide."""
    caplog.set_level(logging.ERROR, logger="crihook")
    with cluster(1) as kube:
        for i, p in enumerate(make_pods(kube, 7, {"nvidia.com/gpu": "1"}, prefix="full")):
            _bind_elsewhere(kube, p, "gpu-node-00", [i])
        a, b = start_scheduler(kube), start_scheduler(kube)
        try:
            stall = Stalling(kube.api_client(), at)
            a.ext.api = stall
            pa, pb = make_pods(kube, 2, {"nvidia.com/gpu": "1"}, prefix="late")

            def args(p: dict[str, Any]) -> dict[str, str]:
                m = p["metadata"]
                return {"PodName": m["name"], "PodNamespace": "ha", "PodUID": m["uid"], "Node": "gpu-node-00"}

            answer: list[Any] = []
            t = threading.Thread(target=lambda: answer.append(a.ext.bind(args(pa))))
            t.start()
            assert stall.reached.wait(10)  # a has reserved GPU 7 (and, stalled at its binding, claimed it)
            assert b.ext.bind(args(pb)) == {"Error": ""}  # b gives GPU 7 to its pod
            stall.go.set()
            t.join(30)
            assert answer[0]["Error"]  # a's write is refused: b's pod holds the GPU, or b cleared a's claim
            late_a = kube.get("pods", pa["metadata"]["name"], "ha")
            assert not late_a["spec"].get("nodeName")
            assert CLAIM_LABEL not in (late_a["metadata"].get("labels") or {})  # no claim left behind
            assert kube.get("pods", pb["metadata"]["name"], "ha")["spec"]["nodeName"] == "gpu-node-00"
            assert pa["metadata"]["uid"] not in a.plugin.held
            au = audit(kube)
            assert au.clean and len(au.held) == 8
        finally:
            a.stop()
            b.stop()


# --- two real processes ---


def scrape(rep: Replica) -> dict[str, float]:
    """The replica's /metrics as {series: value}."""
    text = get(rep.port, "/metrics", 5)[1].decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


FAST = Timing(duration=3, renew_deadline=2.0, retry_period=0.5)


def test_sigkill_of_the_leader_in_a_burst_of_binds_hands_no_gpu_out_twice(tmp_path: Path) -> None:
    rng = random.Random(25)
    with cluster(6) as kube, replicas(kube, tmp_path, 2, FAST) as procs:
        leader = wait_leader(procs)
        service = Service(procs, kube)
        pods = []
        for i in range(160):
            pods += make_pods(kube, 1, dict(rng.choice(SHAPES)), prefix=f"b{i:03d}-")
        nodes = [f"gpu-node-{i:02d}" for i in range(6)]
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(burst(kube, service, pods, nodes, 8, time.monotonic() + 90)))
        t.start()
        while sum(1 for p in kube.list("pods") if p["spec"].get("nodeName")) < 30:
            time.sleep(0.01)
        leader.signal(signal.SIGKILL)
        killed = time.monotonic()
        survivors = [p for p in procs if p is not leader]
        failover = time_to_ready(survivors, killed, 30)
        # the new leader labels its pod and takes the dead one's label off: the Service follows
        deadline = time.monotonic() + 10
        while labelled(kube) != {survivors[0].name} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert labelled(kube) == {survivors[0].name}
        t.join()
        service.close()
        r = result[0]
        print(f"\nfailover after SIGKILL: {failover:.2f} s (lease {FAST.duration} s, retry {FAST.retry_period} s)")
        print(f"bound {r.bound}, refused {r.refused}, retried cycles {r.retries}: {r.errors_seen}")
        assert r.failed == [] and r.bound + r.refused == len(pods)
        assert r.bound > 40 and r.refused > 0  # the cluster filled up: binds competed for the last GPUs
        assert failover < FAST.duration + 2 * FAST.retry_period + 3
        a = audit(kube)
        assert a.gpus_checked == 6 * 8
        assert a.over_committed == [] and a.shared_whole == [] and a.unannotated_bound == []
        assert len(a.held) == r.bound


def serves(rep: Replica, timeout: float = 20.0) -> bool:
    """Whether the replica's readinessProbe (/healthz) passes within `timeout`: the process may
    still be starting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if get(rep.port, "/healthz", 1)[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def test_the_leader_label_follows_the_lease_and_every_serving_replica_is_ready(tmp_path: Path) -> None:
    """Why the label: the PodDisruptionBudget counts Ready pods, so both replicas must be Ready (their
    readinessProbe is /healthz) for the leader's node to drain, and the Service must still reach the
    leader alone. A leader evicted by a drain gets SIGTERM: it takes its label off and hands the Lease
    back, and the standby labels itself once it has rebuilt the state."""
    with cluster(1) as kube, replicas(kube, tmp_path, 2, FAST) as procs:
        leader = wait_leader(procs)
        standby = next(p for p in procs if p is not leader)
        deadline = time.monotonic() + 10
        while labelled(kube) != {leader.name} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert labelled(kube) == {leader.name}
        assert all(serves(p) for p in procs)  # both Ready
        assert not standby.ready()  # /readyz still says who leads
        leader.stop()  # SIGTERM, as an eviction sends
        assert leader.name not in labelled(kube)  # off before the process exits
        assert wait_leader(procs, 30, among=[standby]) is standby
        deadline = time.monotonic() + 10
        while labelled(kube) != {standby.name} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert labelled(kube) == {standby.name}


def test_a_replica_told_to_stop_hands_the_lead_over_and_answers_until_its_delay_is_out(tmp_path: Path) -> None:
    """SIGTERM comes as the pod's endpoint starts to leave the Services: with `--shutdown-delay` the
    replica hands the lead over at once and goes on answering (the webhooks' calls) until the delay is
    out, so no call meets a closed socket while the API servers still send it some."""
    with cluster(1) as kube, replicas(kube, tmp_path, 2, FAST, flags=("--shutdown-delay=6",)) as procs:
        leader = wait_leader(procs)
        standby = next(p for p in procs if p is not leader)
        assert serves(leader)
        assert leader.process is not None
        signalled = time.monotonic()
        leader.process.terminate()
        deadline = signalled + 5
        while kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] == leader.name and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] != leader.name  # handed back
        assert time.monotonic() - signalled < 5 and get(leader.port, "/healthz", 1)[0] == 200  # still answers
        assert wait_leader(procs, 30, among=[standby]) is standby
        assert leader.process.wait(20) == 0
        assert time.monotonic() - signalled >= 6


def test_a_leader_paused_past_its_lease_is_refused_when_it_wakes_to_a_bind(tmp_path: Path) -> None:
    with cluster(1) as kube, replicas(kube, tmp_path, 2, FAST) as procs:
        leader = wait_leader(procs)
        standby = next(p for p in procs if p is not leader)
        pods = make_pods(kube, 8, {"nvidia.com/gpu": "1"})
        late = make_pods(kube, 1, {"nvidia.com/gpu": "1"}, prefix="late")[0]
        for pod in pods[:4]:
            assert schedule(leader, pod, ["gpu-node-00"]) == "bound"
        leader.signal(signal.SIGSTOP)
        paused = time.monotonic()
        assert wait_leader(procs, 30, among=[standby]) is standby
        print(f"\ntakeover from a paused leader: {time.monotonic() - paused:.2f} s")
        for pod in pods[4:]:  # the node's other four GPUs, which the paused leader still thinks free
            assert schedule(standby, pod, ["gpu-node-00"]) == "bound"
        answer: list[Any] = []
        m = late["metadata"]
        args = {"PodName": m["name"], "PodNamespace": "ha", "PodUID": m["uid"], "Node": "gpu-node-00"}
        t = threading.Thread(target=lambda: answer.append(leader.post("/bind", args, timeout=30)))
        t.start()  # the request waits in the paused process's socket backlog
        time.sleep(0.3)
        leader.signal(signal.SIGCONT)
        t.join(30)
        assert "Lease" in answer[0]["Error"]
        assert not kube.get("pods", m["name"], "ha")["spec"].get("nodeName")
        assert not leader.ready()
        deadline = time.monotonic() + 10  # its election thread, woken too, steps down within a round
        while scrape(leader)["crihook_scheduler_leader"] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scrape(leader)["crihook_scheduler_leader"] == 0
        assert scrape(leader)['crihook_scheduler_binds_refused_total{reason="not_leader"}'] >= 1
        assert scrape(standby)["crihook_scheduler_leader"] == 1
        a = audit(kube)
        assert a.clean and len(a.held) == 8


def test_a_replica_that_is_not_ready_sends_kept_alive_clients_back_to_the_service() -> None:
    from crihook.scheduler import server, webhook
    from crihook.scheduler.extender import Extender
    from tests.support.extender import cluster_plugin, fixture

    leading = threading.Event()
    app = server.App(Extender(cluster_plugin()), webhook.WebhookConfig(), leading.is_set)
    srv = server.make_server(app, "127.0.0.1", 0, None)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=5)
        body = json.dumps(fixture("filter_node_names.json"))
        leading.set()
        conn.request("POST", "/filter", body)
        r = conn.getresponse()
        r.read()
        assert r.getheader("Connection") is None  # the leader keeps the connection
        leading.clear()  # the Lease is lost
        conn.request("POST", "/filter", body)
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("Connection") == "close"
        assert conn.sock is None  # http.client closed its side: the next call dials the Service again
    finally:
        srv.shutdown()
        srv.server_close()


def test_without_leader_election_one_replica_serves_from_the_start() -> None:
    import argparse

    from crihook.cli import scheduler as command
    from crihook.scheduler import ha
    from crihook.scheduler.extender import Extender
    from crihook.scheduler.plugin import DeviceShare

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with cluster(1) as kube:
        kube.create("pods", {"metadata": {"name": "sched-0", "namespace": NS}, "spec": {"containers": [{"name": "s"}]}})
        for argv, elects in ((["--no-leader-elect"], False), ([], True)):
            args = parser.parse_args([*argv, "--pod-name=sched-0"])
            ext = Extender(DeviceShare())
            replica = ha.build(args, kube.api_client(), ext, DeviceShare)
            assert (replica.elector is not None) == elects
            replica.start()
            try:
                deadline = time.monotonic() + 20
                while not replica.ready() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert replica.ready() and "gpu-node-00" in ext.plugin.st.rows
                while not labelled(kube) and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert labelled(kube) == {"sched-0"}  # the Service selects this replica alone
            finally:
                replica.stop()
            assert not replica.ready() and labelled(kube) == set()
        assert kube.get("leases", LEASE, NS)["spec"]["holderIdentity"] == ""  # released on stop
    with pytest.raises(ValueError, match="duration > renew deadline"):
        ha.build(parser.parse_args(["--renew-deadline", "9"]), None, Extender(DeviceShare()), DeviceShare)


def test_a_leader_whose_label_was_refused_tries_again() -> None:
    """Until the label is on, the Service reaches no replica: a failed write is tried again."""
    import argparse

    from crihook.cli import scheduler as command
    from crihook.scheduler import ha
    from crihook.scheduler.extender import Extender
    from crihook.scheduler.plugin import DeviceShare

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with cluster(1) as kube:
        kube.create("pods", {"metadata": {"name": "sched-0", "namespace": NS}, "spec": {"containers": [{"name": "s"}]}})
        kube.fail_next(2, 503, method="PATCH", path="/pods/sched-0")
        replica = ha.build(
            parser.parse_args(["--no-leader-elect", "--pod-name=sched-0"]),
            kube.api_client(),
            Extender(DeviceShare()),
            DeviceShare,
        )
        replica.start()
        try:
            deadline = time.monotonic() + 20
            while not labelled(kube) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert labelled(kube) == {"sched-0"}
            patches = [r for r in kube.requests if r.method == "PATCH" and r.path.endswith("/pods/sched-0")]
            assert len(patches) == 3  # two refused, then written
        finally:
            replica.stop()
        assert labelled(kube) == set()


def test_a_term_freezes_what_it_listed_and_its_end_thaws_it() -> None:
    """`crihook scheduler` keeps the listed cluster out of full collections (ha.Replica docstring):
    frozen once the lists are in, back with the collector when the term ends."""
    import argparse
    import gc

    from crihook.cli import scheduler as command
    from crihook.scheduler import ha
    from crihook.scheduler.extender import Extender
    from crihook.scheduler.plugin import DeviceShare

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with cluster(1) as kube:
        ext = Extender(DeviceShare())
        replica = ha.build(parser.parse_args(["--no-leader-elect"]), kube.api_client(), ext, DeviceShare, True)
        assert gc.get_freeze_count() == 0
        replica.start()
        try:
            deadline = time.monotonic() + 20
            while not gc.get_freeze_count() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert replica.ready() and replica.cache is not None
            device = replica.cache.devices["gpu-node-00"]  # the parsed Device object, as listed
            assert not any(o is device for o in gc.get_objects())  # frozen: no collection walks it
        finally:
            replica.stop()
        assert gc.get_freeze_count() == 0 and any(o is device for o in gc.get_objects())


class LateRenewal:
    """An elector whose renewal is running late: the term is on, may_write() says no until `renewed`."""

    def __init__(self) -> None:
        self.renewed = threading.Event()
        self.on_start: Any = None
        self.on_stop: Any = None

    def may_write(self) -> bool:
        return self.renewed.is_set()

    def start(self) -> None:
        self.on_start()

    def stop(self) -> None:
        self.on_stop()


def test_a_leader_whose_renewal_ran_late_when_its_lists_came_in_still_labels_its_pod() -> None:
    """A term's lists may come in while the last renewal is past the renew deadline (a loaded node):
    the label waits for the renewal; it is not left off for the rest of the term."""
    from crihook.scheduler import ha
    from crihook.scheduler.extender import Extender
    from crihook.scheduler.plugin import DeviceShare

    with cluster(1) as kube:
        kube.create("pods", {"metadata": {"name": "sched-0", "namespace": NS}, "spec": {"containers": [{"name": "s"}]}})
        late = LateRenewal()
        label = ha.LeaderLabel(kube.api_client(), NS, "sched-0")
        replica = ha.Replica(kube.api_client(), Extender(DeviceShare()), DeviceShare, late, label=label)  # type: ignore[arg-type]
        replica.start()
        try:
            deadline = time.monotonic() + 20
            while not (replica.cache is not None and replica.cache.ready()) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert replica.cache is not None and replica.cache.ready() and labelled(kube) == set()
            late.renewed.set()  # the renewal lands; the elector keeps the term
            while not labelled(kube) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert labelled(kube) == {"sched-0"}
        finally:
            replica.stop()
        assert labelled(kube) == set()
