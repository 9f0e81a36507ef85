"""Property tests for what the gpu and rdma hooks parse from outside: the allocation annotations and
the kubelet checkpoint. Documents are valid ones with random damage at random places, so every check
in the parsers is reached. Properties: nothing but the parser's own error escapes, and every error
names a field that is really there in the document (or, for "missing", whose parent is there)."""

from __future__ import annotations

import ast
import base64
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crihook.base import allocation as al
from crihook.devices.checkpoint import CheckpointError, parse_checkpoint
from tests.support.gpu_fixtures import Entry, alloc_resp, checkpoint_doc

Path = tuple[str | int, ...]

KOORD_EXAMPLE = {
    "gpu": [
        {
            "minor": 3,
            "id": "GPU-0d3a5b8c-1111-2222-3333-444455556666",
            "resources": {al.GPU_CORE: "50", al.GPU_MEMORY: "23034Mi", al.GPU_MEMORY_RATIO: 50},
        },
        {"minor": 5, "resources": {al.GPU_CORE: 100}},
    ],
    "rdma": [
        {
            "minor": 0,
            "id": "0000:09:00.0",
            "resources": {al.RDMA: "100"},
            "extension": {"vfs": [{"minor": 2, "busID": "0000:09:00.2"}]},
        }
    ],
}
CONTAINER_MAP = {"trainer": {"gpu": [3, 5], "rdma": [0]}, "sidecar": {"gpu": []}}
CHECKPOINT = checkpoint_doc(
    [
        Entry("uid-1", "cuda", ["GPU-a", "GPU-b"], resp=alloc_resp(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"})),
        Entry("uid-2", "nic", ["mlx5_0"], resource="rdma/hca", resp=alloc_resp(devices=[("/dev/x", "/dev/x")])),
    ]
)
CHECKPOINT_OLD = checkpoint_doc([Entry("uid-3", "cuda", ["GPU-c"])], layout="list")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**33), max_value=2**33) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)
# values a parser meets in real damage: near-miss numbers, quantities, PCI addresses, base64
near_misses = st.sampled_from(
    [-1, 2**31, 3.0, "3", "50", "1.5Gi", "lots", "-1Gi", "0000:09:00.2", "09:00.2", "../..", "", "!!", "AAAA"]
)
replacements = json_values | near_misses | st.binary(max_size=24).map(lambda b: base64.b64encode(b).decode())


def paths(node: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every place in a JSON document, the root included."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


def damage(doc: Any, data: st.DataObject) -> Any:
    """`doc` with one to three random changes: a value replaced, a key removed, an unknown key added."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(list(paths(doc))))
        op = data.draw(st.sampled_from(["replace", "remove", "add"]))
        if not where:
            if op == "replace":
                doc = data.draw(replacements)
            continue
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        last = where[-1]
        if op == "replace":
            parent[last] = data.draw(replacements)
        elif op == "remove" and isinstance(parent, dict):
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(min_size=1, max_size=6))] = data.draw(replacements)
    return doc


def names_a_field(doc: Any, where: str, missing: bool = False) -> bool:
    """True when `where` (the parsers' spelling: `a.b[0]['k.with.dots']`) leads to a place in `doc`;
    with `missing`, the last step may be absent but its parent must exist."""
    return where == "" or _walk(doc, where, missing, first=True)


def _walk(node: Any, rest: str, missing: bool, first: bool = False) -> bool:
    if rest == "":
        return True
    if rest.startswith("["):
        for close in (i for i, ch in enumerate(rest) if ch == "]"):
            token, after = rest[1:close], rest[close + 1 :]
            if isinstance(node, list) and token.isdigit():
                i = int(token)
                if i < len(node) and _walk(node[i], after, missing):
                    return True
            elif isinstance(node, dict):
                try:
                    key = ast.literal_eval(token)
                except (ValueError, SyntaxError):
                    continue
                if key in node and _walk(node[key], after, missing):
                    return True
                if missing and after == "" and key not in node:
                    return True
        return False
    if not first:
        if not rest.startswith("."):
            return False
        rest = rest[1:]
    if not isinstance(node, dict):
        return False
    for key in node:
        fits = isinstance(key, str) and (rest == key or rest.startswith((key + ".", key + "[")))
        if fits and _walk(node[key], rest[len(key) :], missing):
            return True
    return missing and isinstance(node, dict) and rest not in node and not any(c in rest for c in ".[")


def test_the_path_reader_itself() -> None:
    doc = {"gpu": [{"minor": 1, "resources": {"koordinator.sh/gpu-core": "x"}}], "a.b": {"c": []}}
    assert names_a_field(doc, "gpu[0].resources['koordinator.sh/gpu-core']")
    assert names_a_field(doc, "gpu[0].minor")
    assert names_a_field(doc, "a.b.c")
    assert not names_a_field(doc, "gpu[1]")
    assert not names_a_field(doc, "gpu[0].id")
    assert names_a_field(doc, "gpu[0].id", missing=True)
    assert not names_a_field(doc, "rdma[0].id", missing=True)
    assert not names_a_field(doc, "gpu[0]resources")


def _check_annotation_error(e: al.AnnotationError, doc: Any) -> None:
    assert str(e).startswith(f"annotation {e.annotation}: ")
    assert e.reason
    assert names_a_field(doc, e.where, missing=e.reason == "missing"), (e.where, doc)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_damaged_device_allocated_is_accepted_or_named(data: st.DataObject) -> None:
    doc = damage(KOORD_EXAMPLE, data)
    try:
        allocs = al.parse_device_allocated(json.dumps(doc))
    except al.AnnotationError as e:
        assert e.annotation == al.DEVICE_ALLOCATED
        _check_annotation_error(e, doc)
        return
    for dtype, entries in allocs.items():  # what is accepted is what the hooks rely on
        assert min((a.minor for a in entries), default=0) >= 0
        if dtype == al.GPU:
            assert len({a.minor for a in entries}) == len(entries)
        if dtype == al.RDMA_TYPE:
            assert all(al.PCI_ADDRESS.fullmatch(x) for a in entries for x in (*a.vfs, *([a.id] if a.id else [])))
        assert all(v >= 0 for a in entries for v in a.resources.values())


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data(), st.sampled_from(["trainer", "sidecar", "other"]), st.sampled_from([al.GPU, al.RDMA_TYPE]))
def test_damaged_container_map_is_accepted_or_named(data: st.DataObject, container: str, dtype: str) -> None:
    doc = damage(CONTAINER_MAP, data)
    annotations = {al.DEVICE_ALLOCATED: json.dumps(KOORD_EXAMPLE), al.CONTAINER_DEVICES: json.dumps(doc)}
    try:
        got = al.allocated_to(annotations, container, dtype)
    except al.AnnotationError as e:
        assert e.annotation == al.CONTAINER_DEVICES
        _check_annotation_error(e, doc)
        return
    pod_minors = {a["minor"] for a in KOORD_EXAMPLE[dtype]}
    assert got is not None and {a.minor for a in got} <= pod_minors


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data(), st.sampled_from([CHECKPOINT, CHECKPOINT_OLD]))
def test_damaged_checkpoint_is_read_or_named(data: st.DataObject, original: dict[str, Any]) -> None:
    doc = damage(original, data)
    try:
        cp = parse_checkpoint(json.dumps(doc).encode())
    except CheckpointError as e:
        assert str(e).startswith("kubelet checkpoint: ") and e.reason
        assert names_a_field(doc, e.where), (e.where, doc)
        return
    for e in cp.entries:
        if e.alloc_error:  # kept, not raised: one bad entry must not hide the others
            assert e.alloc_resp is None
            where = e.alloc_error.split(": ", 1)[0]
            assert where.endswith(".AllocResp") and names_a_field(doc, where), (e.alloc_error, doc)


@pytest.mark.parametrize("key", ["[", "a.b", "x]y", "with space"])
def test_a_key_with_dots_or_brackets_still_names_one_place(key: str) -> None:
    doc = {"trainer": {"gpu": [1]}, key: -1}
    with pytest.raises(al.AnnotationError) as e:
        al.parse_container_devices(json.dumps(doc))
    assert e.value.where == f"[{key!r}]"
    assert names_a_field(doc, e.value.where)
