"""Mutation fuzzing of the three file/annotation parsers on the node's path: real documents damaged
the way transport, truncation and hostile users damage them.

tests/base/test_allocation.py and tests/devices/test_checkpoint.py already throw arbitrary bytes and
arbitrary JSON at the allocation and checkpoint parsers; here the inputs start as valid documents
(Koordinator's annotation, both checkpoint layouts with real AllocResp bytes, crihook's own store
file) and get byte-level damage, so the fuzzer spends its time near the accepting paths, where a
missed type check would crash. Every rejection must be the parser's own error type with a message
that names the document and, below the top level, the field; the store file must never be trusted
once damaged.

The normal suite runs hypothesis' default count; bench/fuzz.py runs 10,000 examples a target.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import tempfile
from collections.abc import Callable

from hypothesis import event, given
from hypothesis import strategies as st

from crihook.base import allocation as al
from crihook.devices.checkpoint import CheckpointError, parse_checkpoint
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from tests.support.gpu_fixtures import Entry, alloc_resp, checkpoint_doc, gpus, nvidia_plugin_resp

KOORD_EXAMPLE = (
    '{"gpu":[{"minor":3,"id":"GPU-00000003-aaaa-bbbb-cccc-000000000003","resources":{"koordinator.sh/gpu-core":"50",'
    '"koordinator.sh/gpu-memory":"23034Mi","koordinator.sh/gpu-memory-ratio":"50"}}],"rdma":[{"minor":0,'
    '"id":"0000:09:00.0","resources":{"koordinator.sh/rdma":"100"},"extension":{"vfs":[{"busID":"0000:09:00.2"}]}}]}'
)
CONTAINER_DEVICES = '{"main":{"gpu":[3],"rdma":[0]},"sidecar":{"gpu":[]}}'
GPUS = gpus(2)
CHECKPOINT_ENTRIES = [
    Entry("pod-a", "main", [GPUS[0].uuid], resp=nvidia_plugin_resp(GPUS[:1])),
    Entry(
        "pod-b",
        "train",
        [GPUS[1].uuid],
        resp=alloc_resp(envs={"A": "1"}, devices=[("/dev/nvidia1", "/dev/nvidia1")], mounts=[("/x", "/y")], cdi=["c"]),
    ),
    Entry("pod-c", "rdma", ["mlx5_0"], resource="rdma/hca"),
]
CHECKPOINTS = [json.dumps(checkpoint_doc(CHECKPOINT_ENTRIES, layout=layout)).encode() for layout in ("numa", "list")]

# JSON-aware damage: the tokens a parser branches on, swapped for each other.
TOKENS = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"null", b"true", b"1e999", b"-1", b"0", b'""', b"{}", b"[]"]


@st.composite
def damaged(draw: st.DrawFn, documents: list[bytes]) -> bytes:
    """One of `documents` with 1 to 4 damages: truncation, bit flip, byte or token insert/delete/replace."""
    data = bytearray(draw(st.sampled_from(documents)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "token"]))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data[at : at + draw(st.integers(0, 6))] = draw(st.sampled_from(TOKENS))
    return bytes(data)


# -- allocation annotations ------------------------------------------------------------------------


def _annotation_rejection(e: al.AnnotationError, annotation: str) -> None:
    assert str(e).startswith(f"annotation {annotation}: ")
    assert e.reason
    if e.where:  # a field below the top level is named by its path in the document
        assert e.where.split(".")[0].split("[")[0] in e.where and e.where in str(e)


@given(damaged([KOORD_EXAMPLE.encode()]))
def test_damaged_device_allocated(data: bytes) -> None:
    try:
        allocs = al.parse_device_allocated(data)
    except al.AnnotationError as e:
        event("rejected")
        _annotation_rejection(e, al.DEVICE_ALLOCATED)
        return
    event("accepted")
    # what was accepted is well-formed and writes back to something that reads the same
    assert al.parse_device_allocated(al.format_device_allocated(allocs)) == allocs


@given(damaged([CONTAINER_DEVICES.encode()]), damaged([KOORD_EXAMPLE.encode()]), st.sampled_from(["main", "sidecar"]))
def test_damaged_allocation_for_a_container(per_container: bytes, pod: bytes, container: str) -> None:
    """The call the hooks make: both annotations, either damaged."""
    annotations = {
        al.DEVICE_ALLOCATED: pod.decode("utf-8", "replace"),
        al.CONTAINER_DEVICES: per_container.decode("utf-8", "replace"),
    }
    for dtype in (al.GPU, al.RDMA_TYPE):
        try:
            got = al.allocated_to(annotations, container, dtype)
        except al.AnnotationError as e:
            event("rejected")
            _annotation_rejection(e, e.annotation)
            assert e.annotation in (al.DEVICE_ALLOCATED, al.CONTAINER_DEVICES)
        else:
            event("accepted")
            assert got is None or all(isinstance(a.minor, int) and a.minor >= 0 for a in got)


# -- kubelet checkpoint ----------------------------------------------------------------------------


@given(damaged(CHECKPOINTS))
def test_damaged_checkpoint(data: bytes) -> None:
    try:
        cp = parse_checkpoint(data)
    except CheckpointError as e:
        event("rejected")
        assert str(e).startswith("kubelet checkpoint: ") and e.reason
        return
    event("accepted" if all(not e.alloc_error for e in cp.entries) else "accepted, an AllocResp set aside")
    for entry in cp.entries:
        assert isinstance(entry.pod_uid, str) and isinstance(entry.container_name, str)
        assert all(isinstance(d, str) for d in entry.device_ids)
        assert (entry.alloc_resp is None) or not entry.alloc_error
        if entry.alloc_error:
            assert entry.alloc_error.startswith("Data.PodDeviceEntries[")  # names the entry


@given(st.integers(0, len(CHECKPOINT_ENTRIES) - 1), st.binary(max_size=200), st.booleans())
def test_damaged_alloc_resp(index: int, junk: bytes, append: bool) -> None:
    """The protobuf inside an entry, replaced or extended with junk: that entry is set aside with a
    reason, every other entry still reads."""
    doc = checkpoint_doc(CHECKPOINT_ENTRIES)
    entry = doc["Data"]["PodDeviceEntries"][index]
    old = base64.b64decode(entry["AllocResp"])
    entry["AllocResp"] = base64.b64encode(old + junk if append else junk).decode()
    cp = parse_checkpoint(json.dumps(doc).encode())
    assert [e.pod_uid for e in cp.entries] == [e.pod_uid for e in CHECKPOINT_ENTRIES]
    bad = cp.entries[index]
    if bad.alloc_error:
        event("AllocResp set aside")
        assert bad.alloc_error.startswith(f"Data.PodDeviceEntries[{index}].AllocResp: ")
    others = [e for i, e in enumerate(cp.entries) if i != index]
    assert all(not e.alloc_error for e in others)


# -- crihook's own store file ----------------------------------------------------------------------


# the stores of every example live here, removed when the test process exits
STORES = tempfile.TemporaryDirectory(prefix="crihook-fuzz-store-")


def _store_file() -> bytes:
    store = Store(tempfile.mkdtemp(dir=STORES.name))
    store.pods["p1"] = PodRecord("p1", "web", "default", "uid-1", labels={"a": "b"}, hooks=[{"hook": "gpu"}])
    store.containers["c1"] = ContainerRecord("c1", "p1", "main", state="running", hooks=[{"hook": "gpu"}])
    store.save()
    return store.path.read_bytes()


STORE_FILE = _store_file()


def _load(data: bytes) -> tuple[str, Store]:
    store = Store(tempfile.mkdtemp(dir=STORES.name))
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_bytes(data)
    return store.load(), store


@given(damaged([STORE_FILE]))
def test_damaged_store_file_is_never_trusted(data: bytes) -> None:
    result, store = _load(data)
    if result == "ok":
        # only a file whose body still matches its checksum is used (a damage inside JSON white
        # space or key order can leave the content the same)
        event("unchanged content")
        assert json.loads(data)["body"] == json.loads(STORE_FILE)["body"]
        assert set(store.pods) == {"p1"} and set(store.containers) == {"c1"}
    else:
        event("ignored")
        assert result == "corrupt" and store.pods == {} and store.containers == {}
        assert not store.path.exists()  # set aside, so the next save starts clean


def _journaled() -> tuple[bytes, bytes, list[tuple[set[str], set[str]]]]:
    """A snapshot, the journal of three writes after it, and the (pods, containers) after each."""
    store = Store(tempfile.mkdtemp(dir=STORES.name))
    store.pods["p1"] = PodRecord("p1", "web", "default", "uid-1", labels={"a": "b"})
    store.save()
    states = [({"p1"}, set())]

    async def write(change: Callable[[], object]) -> None:
        change()
        await store.flushed()

    for change in (
        lambda: store.put_container(ContainerRecord("c1", "p1", "main", hooks=[{"hook": "gpu"}])),
        lambda: store.put_pod(PodRecord("p2", "db", "default", "uid-2")),
        lambda: store.remove_pod("p1"),
    ):
        asyncio.run(write(change))
        states.append((set(store.pods), set(store.containers)))
    return store.path.read_bytes(), store.journal.read_bytes(), states


SNAPSHOT, JOURNAL, JOURNAL_STATES = _journaled()


@given(damaged([JOURNAL]))
def test_damaged_store_journal_applies_only_whole_verified_lines(data: bytes) -> None:
    """Whatever is done to the journal, the store loads the state after some of its writes, in order:
    never a line whose checksum fails, never one after it."""
    store = Store(tempfile.mkdtemp(dir=STORES.name))
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_bytes(SNAPSHOT)
    store.journal.write_bytes(data)
    result = store.load()
    event(result)
    assert result in ("ok", "partial")
    assert (set(store.pods), set(store.containers)) in JOURNAL_STATES


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
record_like = st.fixed_dictionaries({"id": json_values}, optional={"name": json_values, "labels": json_values})
body_like = json_values | st.fixed_dictionaries(
    {}, optional={"pods": json_values | st.lists(record_like, max_size=2), "containers": json_values}
)


@given(body_like)
def test_store_file_with_a_valid_checksum_over_any_body(body: object) -> None:
    """A file that passes its checksum but whose body is not what crihook writes (a hand edit that
    recomputed the checksum, an older or newer format): loaded or ignored, never a crash at start."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    doc = {"version": 1, "checksum": "sha256:" + hashlib.sha256(canonical).hexdigest(), "body": body}
    result, store = _load(json.dumps(doc).encode())
    event(result)
    assert result in ("ok", "corrupt")
    assert all(isinstance(p, PodRecord) for p in store.pods.values())
    assert all(isinstance(c, ContainerRecord) for c in store.containers.values())


def test_store_file_fuzz_starts_from_a_file_store_accepts() -> None:
    result, store = _load(STORE_FILE)
    assert result == "ok" and set(store.pods) == {"p1"}
