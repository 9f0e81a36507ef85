"""How long GPU scheduling stops when the leading `crihook scheduler` replica goes away, with two
replicas against the fake API server and kube-scheduler's side played over HTTP (tests/support/harun.py):

- kill: the leader is SIGKILLed halfway through a burst of binds; the time until the other replica
  answers /readyz (it has waited out the Lease and rebuilt its state from the API server);
- term: the leader gets SIGTERM (a rollout, a drain): it releases the Lease on its way out;
- stop: the leader is SIGSTOPped (a frozen VM, a long GC pause) and woken after the takeover.

After every run the pods on the API server are audited GPU by GPU (no GPU over 100 %, no whole GPU
shared). Also, side by side in one process: binds per second with the bind's re-check against the
API server (one LIST of the node's pods) and without it.

    python bench/failover_bench.py [--runs 3] [--lease 8 --renew 5 --retry 1]
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.scheduler.cache import KubeApi
from tests.support.bindrun import SHAPES, audit, cluster, start_scheduler
from tests.support.harun import Service, Timing, burst, make_pods, replicas, time_to_ready, wait_leader

NODES = 8


def one_run(how: str, timing: Timing, seed: int) -> tuple[float, str]:
    """Seconds from the leader's loss to the other replica's /readyz, and the audit's verdict."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, cluster(NODES) as kube, replicas(kube, Path(tmp), 2, timing) as procs:
        leader = wait_leader(procs)
        service = Service(procs, kube)
        pods = [make_pods(kube, 1, dict(rng.choice(SHAPES)), prefix=f"b{i:03d}-")[0] for i in range(200)]
        nodes = [f"gpu-node-{i:02d}" for i in range(NODES)]
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(burst(kube, service, pods, nodes, 8, time.monotonic() + 120)))
        t.start()
        while sum(1 for p in kube.list("pods") if p["spec"].get("nodeName")) < 40:
            time.sleep(0.01)
        sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[how]
        leader.signal(sig)
        lost = time.monotonic()
        seconds = time_to_ready([p for p in procs if p is not leader], lost, 60)
        if how == "stop":
            leader.signal(signal.SIGCONT)
        t.join()
        service.close()
        r, a = done[0], audit(kube)
        verdict = "clean" if a.clean and not r.failed and len(a.held) == r.bound else f"PROBLEM {a} {r}"
        return seconds, f"bound {r.bound}, refused {r.refused}, retried {r.retries}; GPUs {a.gpus_checked}: {verdict}"


class NoRecheck(KubeApi):
    """The bind path without the re-check: no LISTs of the node's claims (the claim label is still
    written with the annotations, in the same PATCH)."""

    def claims(self, node: str) -> list[dict[str, Any]]:
        return []


def binds_per_second(pods: int) -> tuple[float, float]:
    """(with the re-check, without): medians of sequential binds of whole-GPU pods, in one process."""
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(7):  # round 0 warms up and is not counted; the order alternates
        for recheck in (True, False) if rnd % 2 else (False, True):
            with cluster(pods // 8 + 1) as kube:
                sched = start_scheduler(kube)
                sched.ext.api = (KubeApi if recheck else NoRecheck)(kube.api_client())  # same kind of client
                objs = make_pods(kube, pods, {"nvidia.com/gpu": "1"}, prefix=f"r{rnd}-")
                nodes = [f"gpu-node-{i:02d}" for i in range(pods // 8 + 1)]
                started = time.perf_counter()
                for i, p in enumerate(objs):
                    m = p["metadata"]
                    args = {"PodName": m["name"], "PodNamespace": "ha", "PodUID": m["uid"], "Node": nodes[i // 8]}
                    assert sched.ext.bind(args) == {"Error": ""}
                if rnd:
                    rates[recheck].append(pods / (time.perf_counter() - started))
                sched.stop()
    print(f"  binds/s per run: with re-check {[round(r) for r in rates[True]]}")
    print(f"                   without       {[round(r) for r in rates[False]]}")
    return statistics.median(rates[True]), statistics.median(rates[False])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    d = Timing()
    ap.add_argument("--lease", type=int, default=d.duration)
    ap.add_argument("--renew", type=float, default=d.renew_deadline)
    ap.add_argument("--retry", type=float, default=d.retry_period)
    ap.add_argument("--binds", type=int, default=200, help="pods for the re-check cost (0: skip)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    timing = Timing(args.lease, args.renew, args.retry)
    print(f"lease {timing.duration} s, renew deadline {timing.renew_deadline} s, retry {timing.retry_period} s")
    for how in ("kill", "term", "stop") if args.runs else ():
        times = []
        for i in range(args.runs):
            seconds, what = one_run(how, timing, seed=i)
            times.append(seconds)
            print(f"  {how} run {i + 1}: ready again after {seconds:.2f} s ({what})")
        print(f"{how}: min {min(times):.2f} s, median {statistics.median(times):.2f} s, max {max(times):.2f} s")
    if args.binds:
        on, off = binds_per_second(args.binds)
        print(f"sequential binds: {on:.0f}/s with the API re-check, {off:.0f}/s without ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
