"""The intercepted calls' fast path: file-system answers remembered until inotify reports a change
(hooks.fscache), hooks answering from them on the event loop, and the guarantees that must survive
it: a remembered answer is never used after the change kubelet made before its call, and a stalled
file system (a hook's read, the store's fsync) never freezes the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base import allocation as al
from crihook.base.config import HooksConfig, NodeConfig
from crihook.hooks.base import MISS, ContainerInfo, HookContext, HookError, PodInfo, Stage
from crihook.hooks.fscache import FsMemo, NotCached
from crihook.hooks.gpu import GpuHook
from crihook.hooks.rdma import RdmaHook
from crihook.hooks.registry import build_chain
from crihook.hooks.remote import RemoteHook
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.node.storefile import read_file
from tests.hooks import test_gpu as test_gpu_hook
from tests.support.gpu_fixtures import Entry, nvidia_plugin_resp, write_checkpoint
from tests.support.loop import assert_loop_keeps_ticking

BOX = test_gpu_hook.BOX  # minors 2..5
POD = "0b1c2d3e-0000-4000-8000-000000000001"
OTHER = "0b1c2d3e-0000-4000-8000-000000000002"

# -- the memo ----------------------------------------------------------------------------------------


@pytest.fixture
def memo() -> Any:
    m = FsMemo()
    if not m.enabled:
        pytest.skip("no inotify here")
    yield m
    m.close()


def test_an_answer_is_kept_until_its_name_changes(memo: FsMemo, tmp_path: Path) -> None:
    path = str(tmp_path / "nvidia0")
    with pytest.raises(NotCached):
        memo.recall(path)
    assert memo.answer(path, lambda: os.path.exists(path)) is False
    memo.sync()
    assert memo.recall(path) is False
    (tmp_path / "other").touch()  # another name in the same directory: the answer stands
    memo.sync()
    assert memo.recall(path) is False
    (tmp_path / "nvidia0").touch()
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)
    assert memo.answer(path, lambda: os.path.exists(path)) is True
    (tmp_path / "nvidia0").unlink()
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_contents_answers_follow_writes_and_renames(memo: FsMemo, tmp_path: Path) -> None:
    f = tmp_path / "checkpoint"
    f.write_text("one")
    assert memo.answer(str(f), f.read_text, contents=True) == "one"
    memo.sync()
    assert memo.recall(str(f)) == "one"
    with open(f, "a") as out:  # written in place
        out.write("+")
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(str(f))
    assert memo.answer(str(f), f.read_text, contents=True) == "one+"
    tmp = tmp_path / "checkpoint.tmp"  # replaced by rename, the way kubelet writes its checkpoint
    tmp.write_text("two")
    memo.sync()
    assert memo.recall(str(f)) == "one+"  # another name: not yet
    tmp.rename(f)
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(str(f))


def test_inode_answers_follow_a_chmod_and_a_new_node_not_writes(memo: FsMemo, tmp_path: Path) -> None:
    f = tmp_path / "nvidia0"
    f.write_text("")
    f.chmod(0o666)

    def mode() -> int:
        return os.stat(f).st_mode & 0o777

    assert memo.answer(str(f), mode, inode=True) == 0o666
    with open(f, "a") as out:  # written to, as a device node is all the time: the answer stands
        out.write("x")
    memo.sync()
    assert memo.recall(str(f)) == 0o666
    f.chmod(0o600)
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(str(f))
    assert memo.answer(str(f), mode, inode=True) == 0o600
    f.unlink()
    f.write_text("")  # made again (a driver reloaded): other numbers, maybe
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(str(f))


def test_a_change_during_the_read_is_not_remembered(memo: FsMemo, tmp_path: Path) -> None:
    path = str(tmp_path / "dev0")

    def racing() -> bool:
        seen = os.path.exists(path)
        Path(path).touch()  # changed after it was read
        return seen

    assert memo.answer(path, racing) is False
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_errors_are_remembered(memo: FsMemo, tmp_path: Path) -> None:
    f = str(tmp_path / "bad")

    def fail() -> None:
        raise ValueError("damaged")

    with pytest.raises(ValueError):
        memo.answer(f, fail, contents=True)
    with pytest.raises(ValueError, match="damaged"):
        memo.recall(f)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_missing_directory_is_answered_for_until_it_appears(memo: FsMemo, tmp_path: Path, depth: int) -> None:
    """kubelet's checkpoint directory on a node where kubelet has not started (or never runs): the
    answer is remembered, so calls stay on the event loop, until the way to it changes."""
    top = tmp_path / "kubelet"
    d = top.joinpath(*["sub"] * (depth - 1))
    path = str(d / "checkpoint")
    assert memo.answer(path, lambda: os.path.exists(path), contents=True) is False
    (tmp_path / "other").mkdir()  # another name beside the way down: the answer stands
    memo.sync()
    assert memo.recall(path) is False
    d.mkdir(parents=True)
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)
    assert memo.answer(path, lambda: os.path.exists(path), contents=True) is False  # watched for real now
    (d / "checkpoint").write_text("{}")
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_a_missing_directory_made_while_it_is_read_is_not_remembered(memo: FsMemo, tmp_path: Path) -> None:
    d = tmp_path / "device-plugins"
    path = str(d / "checkpoint")

    def racing() -> bool:
        seen = os.path.exists(path)
        d.mkdir()
        (d / "checkpoint").touch()
        return seen

    assert memo.answer(path, racing) is False
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_a_path_under_a_file_is_answered_for_until_the_file_goes(memo: FsMemo, tmp_path: Path) -> None:
    blocker = tmp_path / "kubelet"
    blocker.write_text("not a directory")
    path = str(blocker / "device-plugins" / "checkpoint")
    assert memo.answer(path, lambda: os.path.exists(path)) is False
    memo.sync()
    assert memo.recall(path) is False
    blocker.unlink()
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_a_removed_directory_drops_its_answers(memo: FsMemo, tmp_path: Path) -> None:
    d = tmp_path / "pods"
    d.mkdir()
    path = str(d / POD)
    memo.answer(path, lambda: os.path.exists(path))
    d.rmdir()
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)
    d.mkdir()  # watched afresh on the next real read
    memo.answer(path, lambda: os.path.exists(path))
    (d / POD).mkdir()
    memo.sync()
    with pytest.raises(NotCached):
        memo.recall(path)


def test_memos_give_their_descriptors_back() -> None:
    """A chain built and dropped without close() (a reload's old chain, a test's) must not use up
    the user's inotify instances (128 by default)."""
    import gc

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        FsMemo()
    gc.collect()
    closed = FsMemo()
    closed.close()
    closed.close()
    assert len(os.listdir("/proc/self/fd")) <= before


# -- the gpu hook from the memo -------------------------------------------------------------------------


class Node(test_gpu_hook.Node):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.checkpoint.parent.mkdir()  # kubelet makes it at start; the file comes with a device plugin

    def hook(self, memo: FsMemo | None = None, **options: Any) -> GpuHook:  # type: ignore[override]
        hook = super().hook(**options)
        hook.memo = memo
        return hook


def ctx(uid: str, *minors: int) -> HookContext:
    annotations = {al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m} for m in minors]})}
    pod = PodInfo("p", "ml", uid, annotations=annotations if minors else {})
    return HookContext(Stage.PRE_CREATE_CONTAINER, pod, ContainerInfo("cuda"))


def outcome(fn: Any, c: HookContext) -> Any:
    try:
        return fn(c)
    except HookError as e:
        return e.code, e.reason


def test_the_cached_answer_is_the_read_answer_after_every_change(memo: FsMemo, tmp_path: Path) -> None:
    """After each change kubelet (or an admin) makes on the node, the hook answering from the memo
    either says MISS or says exactly what reading the files says."""
    node = Node(tmp_path)
    hook = node.hook(memo)
    cases = [ctx(POD, 2), ctx(OTHER), ctx(POD, 3, 4)]
    plugin_on_2 = [Entry(OTHER, "cuda", [BOX[0].uuid], resp=nvidia_plugin_resp(BOX[:1]))]
    steps = [
        lambda: None,
        lambda: write_checkpoint(node.checkpoint, plugin_on_2),  # kubelet's Allocate for OTHER: a conflict
        lambda: (node.kubelet / "pods" / OTHER).mkdir(),  # ...held by a live pod
        lambda: (node.dev / "nvidia4").unlink(),  # a device node goes
        lambda: (node.kubelet / "pods" / OTHER).rmdir(),  # the holder is cleaned up
        lambda: write_checkpoint(node.checkpoint, []),
        lambda: node.checkpoint.write_text("{damaged"),
        lambda: node.checkpoint.unlink(),
    ]
    answered = 0
    for step in steps:
        step()
        for c in cases:
            for _ in range(2):  # the first may miss; the second has what the first read
                cached = outcome(hook.handle_cached, c)
                if cached is MISS:
                    outcome(hook.handle, c)
                    continue
                answered += 1
                assert cached == outcome(hook.handle, c), (step, c)
    assert answered >= len(steps) * len(cases) // 2


def test_an_allocation_is_placed_once_until_the_node_changes(memo: FsMemo, tmp_path: Path) -> None:
    """The allocation's GPUs are resolved and turned into device nodes once; later calls look that
    up (no GPU lookups), until the device directory or the GPU index changes."""
    node = Node(tmp_path)
    hook = node.hook(memo)
    c = ctx(POD, 2, 3)
    hook.handle(c)  # a worker thread's reads fill the memo
    first = hook.handle_cached(c)
    lookups = node.inventory.lookups
    assert hook.handle_cached(c) == first and node.inventory.lookups == lookups
    node.inventory.generation += 1  # the reporter's round found the GPUs changed
    assert hook.handle_cached(c) == first and node.inventory.lookups == lookups + 2
    (node.dev / "nvidia3").unlink()
    assert hook.handle_cached(c) is MISS
    missing = outcome(hook.handle, c)
    assert missing[0] == grpc.StatusCode.FAILED_PRECONDITION and "nvidia3" in missing[1]
    assert outcome(hook.handle_cached, c) == missing


def test_a_pods_containers_are_placed_before_they_come(memo: FsMemo, tmp_path: Path) -> None:
    """prepare_pod (after RunPodSandbox is answered) places each container's GPUs from what the memo
    and the GPU index hold, so its CreateContainers only look them up; a malformed split is left
    for the container it concerns to be refused, naming the annotation and the field."""
    node = Node(tmp_path)
    hook = node.hook(memo)
    hook.handle(ctx(POD, 2, 3, 4, 5))  # the memo learns every device node
    split = {"a": {"gpu": [2]}, "b": {"gpu": [4, 5]}, "c": {"gpu": [3]}}
    annotations = {
        al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m} for m in (2, 4, 5)]}),
        al.CONTAINER_DEVICES: json.dumps(split),
    }
    pod = PodInfo("p", "ml", OTHER, annotations=annotations)
    hook.prepare_pod(pod)
    lookups = node.inventory.lookups
    calls = [HookContext(Stage.PRE_CREATE_CONTAINER, pod, ContainerInfo(name)) for name in ("a", "b")]
    cached = [hook.handle_cached(c) for c in calls]
    assert node.inventory.lookups == lookups
    assert cached == [hook.handle(c) for c in calls]
    with pytest.raises(HookError) as refused:
        hook.handle_cached(HookContext(Stage.PRE_CREATE_CONTAINER, pod, ContainerInfo("c")))
    assert al.CONTAINER_DEVICES in refused.value.reason and "c.gpu[0]" in refused.value.reason


def test_without_a_memo_every_call_reads(tmp_path: Path) -> None:
    hook = Node(tmp_path).hook(None)
    assert hook.handle_cached(ctx(POD, 2)) is MISS


def test_rdma_answers_on_the_loop_only_without_rdma_devices() -> None:
    hook = RdmaHook(NodeConfig())
    assert hook.handle_cached(ctx(POD, 2)) is None
    rdma = {al.DEVICE_ALLOCATED: '{"rdma": [{"minor": 0, "id": "0000:4b:00.0"}]}'}
    c = HookContext(Stage.PRE_CREATE_CONTAINER, PodInfo("p", "ml", POD, annotations=rdma), ContainerInfo("c"))
    assert hook.handle_cached(c) is MISS


# -- in the chain --------------------------------------------------------------------------------------


def gpu_chain(hook: GpuHook, timeout_ms: int = 300) -> Any:
    cfg = HooksConfig(options={"gpu": {"timeout_ms": timeout_ms}}, allowed_host_paths=("/**",))
    return build_chain(cfg, NodeConfig(), factories={"gpu": lambda options, node: hook})


@pytest.mark.parametrize("kubelet_started", [True, False])
async def test_a_warm_gpu_hook_runs_on_the_event_loop(memo: FsMemo, tmp_path: Path, kubelet_started: bool) -> None:
    """Also before kubelet has made its device-plugins directory (or on a node without kubelet):
    the missing directory is an answer too."""
    node = Node(tmp_path)
    if not kubelet_started:
        node.checkpoint.parent.rmdir()
    hook = node.hook(memo)
    threads: list[int] = []
    real = hook.handle
    hook.handle = lambda c: (threads.append(threading.get_ident()), real(c))[1]  # type: ignore[method-assign]
    chain = gpu_chain(hook)
    first = await chain.run(ctx(POD, 2))
    assert threads and threads[0] != threading.get_ident()  # cold: read on a worker thread
    second = await chain.run(ctx(POD, 2))
    assert len(threads) == 1  # warm: answered on the loop, no hand-off
    assert first.ctx == second.ctx and first.error is second.error is None
    assert [r.result for r in second.records] == ["ok"]


async def test_a_stalled_file_system_never_freezes_the_event_loop(memo: FsMemo, tmp_path: Path) -> None:
    """A read that hangs (an NFS server gone, a disk stuck) holds a worker thread and the hook's
    decision lock. The event loop keeps serving: other calls of the hook do not wait on that lock
    there (they go to a thread and time out on their own budget), and the hung call fails at its
    timeout."""
    node = Node(tmp_path)
    hook = node.hook(memo)
    hook.attach_store(Store(tmp_path / "state"))
    release = threading.Event()
    stalled = threading.Event()

    def exists(path: str) -> bool:
        stalled.set()
        release.wait(10)
        return os.path.exists(path)

    hook.exists = exists
    chain = gpu_chain(hook, timeout_ms=300)
    try:
        hung = asyncio.create_task(chain.run(ctx(POD, 2)))
        assert await asyncio.to_thread(stalled.wait, 10), "the hook never read"
        other = asyncio.create_task(chain.run(ctx(OTHER, 3)))
        # on the loop, the hook does not wait for the lock either: it sends the call to a thread
        assert hook.handle_cached(ctx(OTHER, 3)) is MISS
        await assert_loop_keeps_ticking()
        for task in (hung, other):
            out = await task
            assert out.error is not None and out.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()


# -- calls no hook wants go through undecoded -------------------------------------------------------------


async def test_remote_hook_wants_only_stages_its_servers_take(tmp_path: Path) -> None:
    hook = RemoteHook(str(tmp_path), reload_interval=3600)
    assert not hook.wants(Stage.PRE_RUN_POD_SANDBOX)
    (tmp_path / "a.json").write_text(
        '{"remote-endpoint": "/run/x.sock", "failure-policy": "Ignore", "runtime-hooks": ["PreRunPodSandbox"]}'
    )
    await hook.reload()
    assert hook.wants(Stage.PRE_RUN_POD_SANDBOX) and not hook.wants(Stage.PRE_START_CONTAINER)
    # re-reading is the refresher's, off the call path: a re-read due does not make a call come here
    due = RemoteHook(str(tmp_path / "absent"), reload_interval=1e-6)
    assert not due.wants(Stage.PRE_START_CONTAINER)
    await hook.close()
    await due.close()


# -- the store's writes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("write", ["snapshot", "journal"])
async def test_a_stalled_disk_never_freezes_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    store = Store(tmp_path / "state")
    if write == "journal":
        store.save()  # the next write appends to the journal
    release = threading.Event()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(10), real_fsync(fd)))
    store.put_pod(PodRecord("s1", "p", "ns", POD, annotations={"a": "1"}))
    try:
        t = time.perf_counter()
        await asyncio.sleep(0.3)  # the write is due after 50 ms and hangs in fsync
        assert time.perf_counter() - t < 0.6
        assert store._written < store._encoded  # the write hangs ...
        assert write == "journal" or not store.path.exists()  # ... before the snapshot's rename
        store.put_pod(PodRecord("s2", "q", "ns", OTHER))  # changes meanwhile go in the next write
    finally:
        release.set()
    await asyncio.wait_for(store.flushed(), 5)
    body = read_file(tmp_path / "state" / "store.json")
    assert sorted(p["id"] for p in body["pods"]) == ["s1", "s2"]
    assert body["pods"][0]["annotations"] in ({"a": "1"}, {})
    await store.close()


def test_the_store_file_is_what_it_was(tmp_path: Path) -> None:
    """One encoding serves the checksum and the file."""
    store = Store(tmp_path)
    store.pods["s1"] = PodRecord("s1", "p", "ns", POD, labels={"é": "ü"}, hooks=[{"hook": "gpu", "ms": 0.1}])
    store.save()
    again = Store(tmp_path)
    assert again.load() == "ok" and again.pods == store.pods


async def test_rows_kept_between_writes_encode_what_a_full_encoding_does(tmp_path: Path) -> None:
    """The store encodes only the records changed since its last write; the result is the same
    bytes as encoding everything (and so passes the checksum a reader computes)."""
    store = Store(tmp_path)
    for i in range(5):
        store.put_pod(PodRecord(f"s{i}", f"p{i}", "ns", f"uid-{i}"))
        store.put_container(ContainerRecord(f"c{i}", f"s{i}", "app"))
    store._encode(reuse=True)
    store.set_pod_state("s1", "notready")
    store.add_hook_records("c2", [{"hook": "gpu", "result": "ok"}])
    store.set_container_state("c3", "running")
    store.set_container_resources("c0", {"cpu_shares": 2})
    store.remove_pod("s4")
    store.remove_container("c1")
    store.put_pod(PodRecord("s5", "p5", "ns", "uid-5", labels={"ü": "é"}))
    kept = b"".join(store._encode(reuse=True).pieces)
    assert kept.replace(b'"generation":2,', b'"generation":3,') == b"".join(store._encode().pieces)
    body = json.loads(kept)
    del body["generation"]
    assert [c["id"] for c in body["containers"]] == ["c0", "c2", "c3"]
    assert body["containers"][1]["hooks"] == [{"hook": "gpu", "result": "ok"}]
    assert [(p["id"], p["state"]) for p in body["pods"]] == [
        ("s0", "ready"),
        ("s1", "notready"),
        ("s2", "ready"),
        ("s3", "ready"),
        ("s5", "ready"),
    ]
    await store.close()
    assert read_file(tmp_path / "store.json") == body
