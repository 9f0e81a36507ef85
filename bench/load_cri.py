"""Concurrent pod lifecycles through crihook against a real containerd, with faults, and a full account.

    python bench/load_cri.py [--callers 64] [--seconds 60] [--fault none|containerd|crihook]

Each caller plays kubelet: RunPodSandbox, CreateContainer, StartContainer, StopContainer,
RemoveContainer, StopPodSandbox, RemovePodSandbox, over and over, leaving every `keep_every`-th pod
whose calls all succeeded running, the first one among them (so a fault that cuts short a slow run's
first lifecycles still leaves pods to account for).
It keeps a ledger of what it created and removed. A call that fails leaves its pod in doubt;
the caller then cleans that pod up by its uid label, the way kubelet's next sync would, retrying
until the runtime answers. At the end the runtime's own lists (asked directly, not through crihook)
must equal the union of the ledgers: nothing leaked, nothing lost, nothing duplicated. crihook's
resident memory is sampled from /proc throughout.

Faults (`--fault`): `containerd` kills containerd with SIGKILL a third of the way in and starts it
again after a pause (probing crihook while it is gone); `crihook` kills crihook with SIGKILL and
restarts it, and the store it rebuilt is compared with the runtime. tests/reliability/test_load.py
runs the same code for a few seconds; this script is the long run whose figures are in
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.node.storefile import read_file
from crihook.proto import runtime_v1_pb2 as api
from tests.support.containerd import Containerd, running_containerd
from tests.support.cri import POD_UID, Cri, CriError, container_config, pod_config
from tests.support.daemon import Crihook, CrihookError, install_hook_package, running_crihook

T = TypeVar("T")

LOAD_LABEL = "crihook.test/load"  # on every pod and container this driver makes
STAMP = "crihook.test/stamped"  # the annotation the load hook adds on CreateContainer
KEEP_PATIENCE = 60.0  # seconds a run may go on past its length until a pod was kept
CALL_TIMEOUT = 30.0  # each caller's deadline per call, as kubelet's runtime-request-timeout is 2 min
CLEANUP_PATIENCE = 60.0  # how long a caller keeps retrying the cleanup of a pod in doubt

# A hook under load: every CreateContainer is decoded, edited and re-encoded on the way through.
LOAD_HOOK = textwrap.dedent(
    f"""
    from crihook.hooks.base import Edit, Stage

    class Stamp:
        name = "loadstamp"
        stages = frozenset({{Stage.PRE_CREATE_CONTAINER}})
        priority = 50

        def handle(self, ctx):
            return Edit(env={{"CRIHOOK_LOAD": ctx.container.name}}, annotations={{{STAMP!r}: "yes"}})

    def factory(options, node):
        return Stamp()
    """
)


@dataclass(slots=True)
class CallRecord:
    op: str
    started: float  # seconds since the run began
    seconds: float
    code: str  # "OK" or the gRPC status name
    detail: str = ""  # the status message of a failed call


@dataclass
class Ledger:
    """What one caller knows exists: pods by id (with their uid) and containers by id."""

    pods: dict[str, str] = field(default_factory=dict)  # pod id -> uid
    containers: dict[str, str] = field(default_factory=dict)  # container id -> pod id
    cleaned: int = 0  # pods in doubt that were cleaned up by uid

    def drop_pod(self, pod_id: str) -> None:
        self.pods.pop(pod_id, None)
        for cid in [c for c, p in self.containers.items() if p == pod_id]:
            del self.containers[cid]


@dataclass
class Window:
    """A fault: when it began and ended, in seconds since the run began."""

    what: str
    start: float
    end: float = 0.0
    notes: dict[str, object] = field(default_factory=dict)


@dataclass
class Account:
    """The runtime's lists against the callers' ledgers."""

    pods_listed: int
    containers_listed: int
    leaked: list[str]  # listed by the runtime, in no ledger
    lost: list[str]  # in a ledger, not listed
    duplicated: list[str]  # one pod uid with two sandboxes, or one container name twice in a pod
    unstamped: list[str]  # containers the hook did not see
    store_mismatch: list[str]  # crihook's store file disagrees with the runtime


@dataclass
class Report:
    callers: int
    seconds: float
    calls: list[CallRecord]
    windows: list[Window]
    rss: list[tuple[float, int, int]]  # (t, pid, bytes)
    account: Account | None = None
    cleaned: int = 0

    def errors(self) -> list[CallRecord]:
        return [c for c in self.calls if c.code != "OK"]

    def in_windows(self, c: CallRecord, slack: float) -> bool:
        """Whether a call overlapped a fault window (plus `slack` seconds for clients to reconnect)."""
        return any(c.started <= w.end + slack and c.started + c.seconds >= w.start for w in self.windows)

    def recovered(self, w: Window) -> float | None:
        """Seconds from the end of a fault to the first call after it that succeeded."""
        done = [c.started + c.seconds for c in self.calls if c.code == "OK" and c.started >= w.end]
        return min(done) - w.end if done else None

    def rss_figures(self) -> tuple[int, int, int]:
        """(first, last, peak) bytes of the last crihook process, skipping its first 10 % (warm-up)."""
        last_pid = self.rss[-1][1]
        mine = [r for _, pid, r in self.rss if pid == last_pid]
        steady = mine[len(mine) // 10 :] or mine
        return steady[0], steady[-1], max(steady)

    def lines(self) -> list[str]:
        by_op: dict[str, list[CallRecord]] = {}
        for c in self.calls:
            by_op.setdefault(c.op, []).append(c)
        out = [f"callers {self.callers}, {self.seconds:.0f} s, {len(self.calls)} calls, {len(self.errors())} failed"]
        out.append(f"{'call':<18}{'n':>7}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
        for op, records in by_op.items():
            ms = sorted(c.seconds * 1000 for c in records)
            p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
            failed = sum(c.code != "OK" for c in records)
            out.append(f"{op:<18}{len(ms):>7}{failed:>8}{statistics.median(ms):9.1f}{p99:9.1f}{ms[-1]:9.1f}")
        codes = Counter(c.code for c in self.errors())
        if codes:
            out.append("failed calls by code: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
            slowest = max(c.seconds for c in self.errors())
            out.append(f"slowest failed call: {slowest * 1000:.0f} ms (deadline {CALL_TIMEOUT * 1000:.0f} ms)")
            for message in sorted({f"{c.op}: {c.code}: {c.detail[:160]}" for c in self.errors()})[:5]:
                out.append(f"  {message}")
        for w in self.windows:
            notes = ", ".join(f"{k} {v}" for k, v in w.notes.items())
            back = self.recovered(w)
            after = f"first call answered {back * 1000:.0f} ms after" if back is not None else "no call answered after"
            out.append(f"fault {w.what}: {w.start:.1f}..{w.end:.1f} s; {notes}; {after}")
        if self.account is not None:
            a = self.account
            out.append(
                f"accounted: {a.pods_listed} pods, {a.containers_listed} containers listed by containerd; "
                f"leaked {len(a.leaked)}, lost {len(a.lost)}, duplicated {len(a.duplicated)}, "
                f"unstamped {len(a.unstamped)}, store mismatches {len(a.store_mismatch)}; "
                f"pods cleaned up after a failed call {self.cleaned}"
            )
        if self.rss:
            first, last, peak = self.rss_figures()
            out.append(f"crihook RSS MiB: start {first / 2**20:.1f}, end {last / 2**20:.1f}, peak {peak / 2**20:.1f}")
        return out


class Load:
    """`callers` threads running pod lifecycles against `address` until `seconds` have passed."""

    def __init__(self, address: str, callers: int, seconds: float, keep_every: int = 8, min_calls: int = 0) -> None:
        self.address = address
        self.callers = callers
        self.seconds = seconds
        self.min_calls = min_calls
        self.keep_every = keep_every
        self.run_id = uuid.uuid4().hex[:8]
        self.t0 = 0.0
        self.calls: list[CallRecord] = []
        self.ledgers = [Ledger() for _ in range(callers)]
        self.kept = 0  # lifecycles that ended with their pod kept (the ones account() can compare)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def call(self, op: str, fn: Callable[[], T]) -> T:
        started = self.now()
        code, detail = "OK", ""
        try:
            return fn()
        except CriError as e:
            code, detail = e.code.name, e.details
            raise
        finally:
            record = CallRecord(op, started, self.now() - started, code, detail)
            with self._lock:
                self.calls.append(record)

    def caller(self, index: int) -> None:
        ledger = self.ledgers[index]
        with Cri(self.address, timeout=CALL_TIMEOUT) as cri:
            n = done = 0
            while not self._stop.is_set():
                uid = str(uuid.uuid4())
                try:
                    keep = done % self.keep_every == 0
                    self.lifecycle(cri, ledger, f"load-{self.run_id}-{index}-{n}", uid, keep=keep)
                    done += 1
                except CriError:
                    self.clean_up(cri, ledger, uid)
                    time.sleep(0.2)  # as kubelet waits for its next sync
                n += 1

    def lifecycle(self, cri: Cri, ledger: Ledger, name: str, uid: str, keep: bool) -> None:
        labels = {LOAD_LABEL: self.run_id}
        pod = pod_config(name, uid=uid, labels=labels)
        pod_id = self.call("RunPodSandbox", lambda: cri.run_pod(pod))
        ledger.pods[pod_id] = uid
        config = container_config("main", pod, labels=labels)
        cid = self.call("CreateContainer", lambda: cri.create_container(pod_id, config, pod))
        ledger.containers[cid] = pod_id
        self.call("StartContainer", lambda: cri.start_container(cid))
        if keep:
            with self._lock:
                self.kept += 1
            return
        self.call("StopContainer", lambda: cri.stop_container(cid, grace=2))
        self.call("RemoveContainer", lambda: cri.remove_container(cid))
        del ledger.containers[cid]
        self.call("StopPodSandbox", lambda: cri.stop_pod(pod_id))
        self.call("RemovePodSandbox", lambda: cri.remove_pod(pod_id))
        ledger.drop_pod(pod_id)

    def clean_up(self, cri: Cri, ledger: Ledger, uid: str) -> None:
        """Remove every sandbox of the pod `uid` (a failed call may or may not have made one)."""
        deadline = time.monotonic() + CLEANUP_PATIENCE
        request = api.ListPodSandboxRequest(filter=api.PodSandboxFilter(label_selector={POD_UID: uid}))
        while time.monotonic() < deadline:
            try:
                found = self.call("ListPodSandbox", lambda: cri._call(cri.runtime, "ListPodSandbox", request).items)
                for sandbox in found:
                    self.call("StopPodSandbox", lambda s=sandbox: cri.stop_pod(s.id))
                    self.call("RemovePodSandbox", lambda s=sandbox: cri.remove_pod(s.id))
                for pod_id in [p for p, u in ledger.pods.items() if u == uid]:
                    ledger.drop_pod(pod_id)
                ledger.cleaned += 1
                return
            except CriError:
                time.sleep(0.2)

    def _enough(self) -> bool:
        with self._lock:
            return self.kept > 0 and len(self.calls) >= self.min_calls

    def run(
        self,
        faults: Sequence[Callable[[Load], Window]] = (),
        sample: Callable[[], tuple[int, int] | None] | None = None,
    ) -> Report:
        """Run the callers; each fault runs in order at its own moment (it sleeps itself) and returns
        its window. `sample` returns (pid, rss bytes) of crihook, or None while it is down."""
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.caller, args=(i,), daemon=True) for i in range(self.callers)]
        for t in threads:
            t.start()
        windows: list[Window] = []
        rss: list[tuple[float, int, int]] = []

        def injector() -> None:
            for fault in faults:
                windows.append(fault(self))

        fault_thread = threading.Thread(target=injector, daemon=True)
        fault_thread.start()
        # past `seconds`, go on (up to KEEP_PATIENCE more) until some pod was kept and `min_calls` were
        # made: on a loaded machine a fault's recovery can take the whole run, and a load that kept no
        # pod or made few calls tests little
        while self.now() < self.seconds or (not self._enough() and self.now() < self.seconds + KEEP_PATIENCE):
            got = sample() if sample is not None else None
            if got is not None:
                rss.append((self.now(), *got))
            time.sleep(0.25)
        fault_thread.join()  # a fault always finishes with the system up again
        self._stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT * 8 + CLEANUP_PATIENCE)
        with self._lock:
            calls = sorted(self.calls, key=lambda c: c.started)
        return Report(self.callers, self.now(), calls, windows, rss, cleaned=sum(x.cleaned for x in self.ledgers))

    def account(self, direct: Cri, store_file: Path | None = None) -> Account:
        """Compare the runtime (asked directly) with the ledgers, and with crihook's store file."""
        request = api.ListPodSandboxRequest(filter=api.PodSandboxFilter(label_selector={LOAD_LABEL: self.run_id}))
        sandboxes = list(direct._call(direct.runtime, "ListPodSandbox", request).items)
        crequest = api.ListContainersRequest(filter=api.ContainerFilter(label_selector={LOAD_LABEL: self.run_id}))
        containers = list(direct._call(direct.runtime, "ListContainers", crequest).containers)
        want_pods = {p for ledger in self.ledgers for p in ledger.pods}
        want_containers = {c for ledger in self.ledgers for c in ledger.containers}
        have_pods = {s.id for s in sandboxes}
        have_containers = {c.id for c in containers}
        uids = Counter(s.metadata.uid for s in sandboxes)
        names = Counter((c.pod_sandbox_id, c.metadata.name, c.metadata.attempt) for c in containers)
        duplicated = [f"pod uid {u}" for u, k in uids.items() if k > 1]
        duplicated += [f"container {n[1]} in {n[0][:13]}" for n, k in names.items() if k > 1]
        mismatch: list[str] = []
        if store_file is not None:
            body = read_file(store_file)
            stored_pods = {p["id"] for p in body["pods"] if p["labels"].get(LOAD_LABEL) == self.run_id}
            stored_containers = {c["id"] for c in body["containers"] if c["labels"].get(LOAD_LABEL) == self.run_id}
            mismatch = sorted((stored_pods ^ have_pods) | (stored_containers ^ have_containers))
        return Account(
            pods_listed=len(sandboxes),
            containers_listed=len(containers),
            leaked=sorted((have_pods - want_pods) | (have_containers - want_containers)),
            lost=sorted((want_pods - have_pods) | (want_containers - have_containers)),
            duplicated=duplicated,
            unstamped=sorted(c.id for c in containers if c.annotations.get(STAMP) != "yes"),
            store_mismatch=mismatch,
        )


def probe_version(address: str, timeout: float = 5.0) -> tuple[str, float]:
    """One Version call on a fresh connection: its status name and how long it took (s)."""
    started = time.monotonic()
    with Cri(address, timeout=timeout) as cri:
        try:
            cri.version()
            code = "OK"
        except CriError as e:
            code = e.code.name
    return code, time.monotonic() - started


def kill_containerd(containerd: Containerd, proxy: Crihook, at: float, down: float) -> Callable[[Load], Window]:
    """At `at` s: SIGKILL containerd, probe crihook while it is gone, start it again after `down` s."""

    def fault(load: Load) -> Window:
        time.sleep(max(0.0, at - load.now()))
        window = Window("containerd SIGKILL", load.now())
        containerd.stop(kill=True)
        code, took = probe_version(proxy.address)
        window.notes["Version while down"] = f"{code} in {took * 1000:.0f} ms"
        time.sleep(max(0.0, down - took))
        containerd.start()
        window.end = load.now()
        return window

    return fault


def kill_crihook(proxy: Crihook, at: float) -> Callable[[Load], Window]:
    """At `at` s: SIGKILL crihook and start it again (it serves only once its store is rebuilt)."""

    def fault(load: Load) -> Window:
        time.sleep(max(0.0, at - load.now()))
        window = Window("crihook SIGKILL", load.now())
        proxy.stop(kill=True)
        code, took = probe_version(proxy.address)
        window.notes["Version while down"] = f"{code} in {took * 1000:.0f} ms"
        started = time.monotonic()
        proxy.start()
        window.notes["restart to READY"] = f"{(time.monotonic() - started) * 1000:.0f} ms"
        window.end = load.now()
        return window

    return fault


def rss_sampler(proxy: Crihook) -> Callable[[], tuple[int, int] | None]:
    def sample() -> tuple[int, int] | None:
        pid = proxy.pid
        if pid is None:
            return None
        try:
            return pid, proxy.rss_bytes()
        except (FileNotFoundError, ProcessLookupError, AssertionError, CrihookError):
            return None  # exited between the two reads, or killed and not yet reaped (a zombie has no VmRSS)

    return sample


@contextmanager
def loaded_crihook(containerd: Containerd, work: Path) -> Iterator[Crihook]:
    """crihook in front of `containerd` with the load hook installed."""
    env = install_hook_package(work / "site", "loadstamp", LOAD_HOOK)
    with running_crihook(containerd.address, work / "crihook", "", env) as proxy:
        yield proxy


def store_settled(proxy: Crihook, quiet: float = 0.3, limit: float = 15.0) -> Path:
    """The store file once crihook's writes have happened: the snapshot and its journal unchanged
    for `quiet` seconds (the store writes on a thread that fsyncs: a loaded machine takes longer
    than any fixed wait), or `limit` seconds at most."""
    snapshot = proxy.state_dir / "store.json"
    files = (snapshot, snapshot.with_suffix(".journal"))

    def state() -> tuple[tuple[int, int] | None, ...]:
        seen: list[tuple[int, int] | None] = []
        for f in files:
            try:
                st = f.stat()
            except FileNotFoundError:  # no journal yet, or a snapshot being replaced
                seen.append(None)
            else:
                seen.append((st.st_size, st.st_mtime_ns))
        return tuple(seen)

    end = time.monotonic() + limit
    last, since = state(), time.monotonic()
    while time.monotonic() < end and time.monotonic() - since < quiet:
        time.sleep(0.05)
        now = state()
        if now != last:
            last, since = now, time.monotonic()
    return snapshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--fault", choices=("none", "containerd", "crihook"), default="none")
    parser.add_argument("--down", type=float, default=3.0, help="seconds containerd stays down (default 3)")
    args = parser.parse_args()
    with (
        running_containerd() as containerd,
        tempfile.TemporaryDirectory(prefix="crihook-load-") as tmp,
        loaded_crihook(containerd, Path(tmp)) as proxy,
        Cri(containerd.address) as direct,
    ):
        load = Load(proxy.address, args.callers, args.seconds)
        faults = {
            "none": [],
            "containerd": [kill_containerd(containerd, proxy, args.seconds / 3, args.down)],
            "crihook": [kill_crihook(proxy, args.seconds / 3)],
        }[args.fault]
        report = load.run(faults, rss_sampler(proxy))
        report.account = load.account(direct, store_settled(proxy))
        version = direct.version()
        print(f"# {version.runtime_name} {version.runtime_version}, fault: {args.fault}")
        for line in report.lines():
            print(line)
        outside = [c for c in report.errors() if not report.in_windows(c, slack=10.0)]
        late = [c for c in report.errors() if c.seconds > CALL_TIMEOUT + 1]
        print(f"failed calls outside fault windows (+10 s): {len(outside)}; failed past the deadline: {len(late)}")
        direct.remove_all()
        a = report.account
        clean = not (outside or late or a.leaked or a.lost or a.duplicated or a.unstamped or a.store_mismatch)
        return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
