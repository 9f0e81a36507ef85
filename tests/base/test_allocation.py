"""The device-allocation annotations: Koordinator's JSON both ways, our per-container map, and what
a container ends up with."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base import allocation as al
from crihook.base.allocation import (
    CONTAINER_DEVICES,
    DEVICE_ALLOCATED,
    AnnotationError,
    DeviceAllocation,
)

GiB = 2**30
MiB = 2**20

# The example of the design document, as Koordinator writes it.
KOORD_EXAMPLE = (
    '{"gpu":[{"minor":3,"id":"GPU-5b4c3a2e-0000-1111-2222-333344445555","resources":'
    '{"koordinator.sh/gpu-core":"50","koordinator.sh/gpu-memory":"23034Mi","koordinator.sh/gpu-memory-ratio":"50"}}],'
    '"rdma":[{"minor":0,"id":"0000:09:00.0","resources":{"koordinator.sh/rdma":"100"},'
    '"extension":{"vfs":[{"busID":"0000:09:00.2"}]}}]}'
)


def test_koordinator_example() -> None:
    got = al.parse_device_allocated(KOORD_EXAMPLE)
    assert got == {
        "gpu": (
            DeviceAllocation(
                minor=3,
                id="GPU-5b4c3a2e-0000-1111-2222-333344445555",
                resources={al.GPU_CORE: 50, al.GPU_MEMORY: 23034 * MiB, al.GPU_MEMORY_RATIO: 50},
            ),
        ),
        "rdma": (
            DeviceAllocation(
                minor=0,
                id="0000:09:00.0",
                resources={al.RDMA: 100},
                vfs=("0000:09:00.2",),
                extension={"vfs": [{"busID": "0000:09:00.2"}]},
            ),
        ),
    }


def test_quantities_as_numbers_and_strings_agree() -> None:
    as_numbers = json.dumps({"gpu": [{"minor": 0, "resources": {al.GPU_CORE: 100, al.GPU_MEMORY: 16 * GiB}}]})
    as_strings = json.dumps({"gpu": [{"minor": 0, "resources": {al.GPU_CORE: "100", al.GPU_MEMORY: "16Gi"}}]})
    assert al.parse_device_allocated(as_numbers) == al.parse_device_allocated(as_strings)
    assert al.parse_device_allocated(as_strings)["gpu"][0].resources == {al.GPU_CORE: 100, al.GPU_MEMORY: 16 * GiB}


def test_bytes_input_and_go_nulls() -> None:
    # Go marshals a nil ResourceList as null and a nil slice of a type as null.
    got = al.parse_device_allocated(b'{"gpu":[{"minor":1,"resources":null}],"rdma":null}')
    assert got == {"gpu": (DeviceAllocation(minor=1),)}


def test_unknown_types_and_fields_are_kept_or_ignored() -> None:
    got = al.parse_device_allocated('{"fpga":[{"minor":2,"extra":true,"extension":{"x":1}}]}')
    assert got == {"fpga": (DeviceAllocation(minor=2, extension={"x": 1}),)}


def test_types_filter_skips_other_types_unchecked() -> None:
    text = '{"gpu":[{"minor":1}],"rdma":"garbage"}'
    assert al.parse_device_allocated(text, ("gpu",)) == {"gpu": (DeviceAllocation(minor=1),)}
    with pytest.raises(AnnotationError, match=r"rdma: expected a list"):
        al.parse_device_allocated(text)
    with pytest.raises(AnnotationError, match=r"rdma: expected a list"):
        al.parse_device_allocated(text, ("rdma",))


@pytest.mark.parametrize(
    ("text", "where", "reason"),
    [
        ("", "", "not valid JSON"),
        ("{", "", "not valid JSON"),
        ("[]", "", "expected a JSON object of device types, got list"),
        ('"gpu"', "", "expected a JSON object"),
        ('{"gpu":{}}', "gpu", "expected a list of allocations"),
        ('{"gpu":[1]}', "gpu[0]", "expected an object"),
        ('{"gpu":[{}]}', "gpu[0].minor", "missing"),
        ('{"gpu":[{"minor":"3"}]}', "gpu[0].minor", "expected an integer"),
        ('{"gpu":[{"minor":3.0}]}', "gpu[0].minor", "expected an integer"),
        ('{"gpu":[{"minor":true}]}', "gpu[0].minor", "expected an integer"),
        ('{"gpu":[{"minor":-1}]}', "gpu[0].minor", "out of range"),
        ('{"gpu":[{"minor":2147483648}]}', "gpu[0].minor", "out of range"),
        ('{"gpu":[{"minor":0},{"minor":1,"id":7}]}', "gpu[1].id", "expected a string"),
        ('{"gpu":[{"minor":0,"resources":[]}]}', "gpu[0].resources", "expected an object"),
        ('{"gpu":[{"minor":0,"resources":0}]}', "gpu[0].resources", "expected an object"),
        (
            '{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-core":"lots"}}]}',
            "gpu[0].resources['koordinator.sh/gpu-core']",
            "not a Kubernetes quantity",
        ),
        (
            '{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-memory":"-1Gi"}}]}',
            "gpu[0].resources['koordinator.sh/gpu-memory']",
            "negative quantity",
        ),
        (
            '{"gpu":[{"minor":0,"resources":{"koordinator.sh/gpu-core":true}}]}',
            "gpu[0].resources['koordinator.sh/gpu-core']",
            "boolean",
        ),
        ('{"gpu":[{"minor":1},{"minor":1}]}', "gpu", "the same minor is allocated twice"),
        ('{"rdma":[{"minor":0,"id":"../../etc"}]}', "rdma[0].id", "is not a PCI address"),
        ('{"rdma":[{"minor":0,"extension":[]}]}', "rdma[0].extension", "expected an object"),
        ('{"rdma":[{"minor":0,"extension":{"vfs":{}}}]}', "rdma[0].extension.vfs", "expected a list"),
        ('{"rdma":[{"minor":0,"extension":{"vfs":[{}]}}]}', "rdma[0].extension.vfs[0].busID", "missing"),
        ('{"rdma":[{"minor":0,"extension":{"vfs":[3]}}]}', "rdma[0].extension.vfs[0]", "expected an object"),
        ('{"rdma":[{"minor":0,"extension":{"vfs":[{"busID":"x"}]}}]}', "rdma[0].extension.vfs[0].busID", "PCI address"),
        (
            '{"rdma":[{"minor":0,"extension":{"vfs":[{"busID":"0000:09:00.2/../.."}]}}]}',
            "rdma[0].extension.vfs[0].busID",
            "PCI address",
        ),
        ('{"gpu":[' + ",".join(f'{{"minor":{i}}}' for i in range(1025)) + "]}", "gpu", "more than 1024"),
        # a device type that is no plain key is named as one (found by the property test)
        ('{"":[{}]}', "[''][0].minor", "missing"),
        ('{"a.b":3}', "['a.b']", "expected a list"),
    ],
)
def test_rejections_name_the_field(text: str, where: str, reason: str) -> None:
    with pytest.raises(AnnotationError) as info:
        al.parse_device_allocated(text)
    err = info.value
    assert err.annotation == DEVICE_ALLOCATED
    assert err.where == where
    assert reason in err.reason
    assert str(err).startswith(f"annotation {DEVICE_ALLOCATED}: ")
    if where:
        assert f": {where}: " in str(err)


def test_oversized_annotation() -> None:
    with pytest.raises(AnnotationError, match="larger than any annotation"):
        al.parse_device_allocated(" " * (al.MAX_ANNOTATION_BYTES + 1))


def test_deep_nesting_is_a_clean_error() -> None:
    with pytest.raises(AnnotationError, match="not valid JSON"):
        al.parse_device_allocated("[" * 100_000)


def test_rdma_ids_of_either_case() -> None:
    got = al.parse_device_allocated('{"rdma":[{"minor":1,"id":"0000:AF:00.1"}]}')
    assert got["rdma"][0].id == "0000:AF:00.1"


# -- formatting ------------------------------------------------------------------------------------


def test_format_is_koordinator_json() -> None:
    allocs = {
        "gpu": (DeviceAllocation(3, "GPU-x", {al.GPU_MEMORY: 23034 * MiB, al.GPU_CORE: 50, al.GPU_MEMORY_RATIO: 50}),),
        "rdma": (DeviceAllocation(0, "0000:09:00.0", {al.RDMA: 100}, vfs=("0000:09:00.2",)),),
    }
    assert json.loads(al.format_device_allocated(allocs)) == {
        "gpu": [
            {
                "minor": 3,
                "resources": {
                    "koordinator.sh/gpu-core": "50",
                    "koordinator.sh/gpu-memory": "23034Mi",
                    "koordinator.sh/gpu-memory-ratio": "50",
                },
                "id": "GPU-x",
            }
        ],
        "rdma": [
            {
                "minor": 0,
                "resources": {"koordinator.sh/rdma": "100"},
                "id": "0000:09:00.0",
                "extension": {"vfs": [{"busID": "0000:09:00.2"}]},
            }
        ],
    }


def test_format_keeps_vf_details_when_they_agree() -> None:
    ext = {"vfs": [{"busID": "0000:09:00.2", "minor": 4}], "other": "x"}
    kept = DeviceAllocation(0, vfs=("0000:09:00.2",), extension=ext)
    assert json.loads(al.format_device_allocated({"rdma": (kept,)}))["rdma"][0]["extension"] == ext
    changed = DeviceAllocation(0, vfs=("0000:09:00.3",), extension=ext)
    assert json.loads(al.format_device_allocated({"rdma": (changed,)}))["rdma"][0]["extension"] == {
        "other": "x",
        "vfs": [{"busID": "0000:09:00.3"}],
    }
    dropped = DeviceAllocation(0, extension=ext)
    assert json.loads(al.format_device_allocated({"rdma": (dropped,)}))["rdma"][0]["extension"] == {"other": "x"}


def test_parse_format_parse_is_stable_on_the_example() -> None:
    once = al.parse_device_allocated(KOORD_EXAMPLE)
    assert al.parse_device_allocated(al.format_device_allocated(once)) == once


# -- the per-container map -------------------------------------------------------------------------


def test_container_devices_round_trip() -> None:
    assignment = {"worker": {"gpu": (3, 1)}, "sidecar": {"gpu": (), "rdma": (0,)}}
    text = al.format_container_devices(assignment)
    assert text == '{"sidecar":{"gpu":[],"rdma":[0]},"worker":{"gpu":[3,1]}}'
    assert al.parse_container_devices(text) == assignment


@pytest.mark.parametrize(
    ("text", "where", "reason"),
    [
        ("nope", "", "not valid JSON"),
        ("[]", "", "expected a JSON object of container names"),
        ('{"c":[3]}', "c", "expected an object of device types"),
        ('{"c":{"gpu":3}}', "c.gpu", "expected a list of minors"),
        ('{"c":{"gpu":["3"]}}', "c.gpu[0]", "expected an integer"),
        ('{"c":{"gpu":[1,-2]}}', "c.gpu[1]", "out of range"),
        ('{"c":{"gpu":[1,1]}}', "c.gpu", "listed twice"),
    ],
)
def test_container_devices_rejections(text: str, where: str, reason: str) -> None:
    with pytest.raises(AnnotationError) as info:
        al.parse_container_devices(text)
    assert info.value.annotation == CONTAINER_DEVICES
    assert info.value.where == where
    assert reason in info.value.reason


# -- allocated_to ----------------------------------------------------------------------------------

TWO_GPUS = '{"gpu":[{"minor":3},{"minor":5}],"rdma":[{"minor":0,"id":"0000:09:00.0"}]}'


def _minors(allocs: tuple[DeviceAllocation, ...] | None) -> list[int] | None:
    return None if allocs is None else [a.minor for a in allocs]


def test_allocated_to_without_annotations() -> None:
    assert al.allocated_to({}, "c", "gpu") is None
    assert al.allocated_to({DEVICE_ALLOCATED: '{"rdma":[{"minor":0}]}'}, "c", "gpu") is None
    assert al.allocated_to({DEVICE_ALLOCATED: '{"gpu":[]}'}, "c", "gpu") is None


def test_allocated_to_per_pod() -> None:
    ann = {DEVICE_ALLOCATED: TWO_GPUS}
    assert _minors(al.allocated_to(ann, "any", "gpu")) == [3, 5]
    assert _minors(al.allocated_to(ann, "any", "rdma")) == [0]


def test_allocated_to_per_container() -> None:
    ann = {DEVICE_ALLOCATED: TWO_GPUS, CONTAINER_DEVICES: '{"a":{"gpu":[5]},"b":{"gpu":[3,5]},"c":{"rdma":[0]}}'}
    assert _minors(al.allocated_to(ann, "a", "gpu")) == [5]
    assert _minors(al.allocated_to(ann, "b", "gpu")) == [3, 5]
    assert _minors(al.allocated_to(ann, "c", "gpu")) == []
    assert _minors(al.allocated_to(ann, "c", "rdma")) == [0]
    assert _minors(al.allocated_to(ann, "a", "rdma")) == []
    assert _minors(al.allocated_to(ann, "unlisted", "gpu")) == []


def test_a_containers_split_is_the_same_tuple_every_time() -> None:
    """Callers key what they work out from an allocation on it (the gpu hook's placements)."""
    ann = {DEVICE_ALLOCATED: TWO_GPUS, CONTAINER_DEVICES: '{"a":{"gpu":[5]},"b":{"gpu":[3,5]}}'}
    devices = al.pod_devices(ann, "gpu")
    assert devices.for_container("a") is devices.for_container("a")
    assert _minors(devices.for_container("b")) == [3, 5] and devices == al.pod_devices(ann, "gpu")
    whole = al.pod_devices({DEVICE_ALLOCATED: TWO_GPUS}, "gpu")
    assert whole.for_container("a") is whole.for_container("b") is whole.allocs


def test_allocated_to_refuses_minors_outside_the_pod() -> None:
    ann = {DEVICE_ALLOCATED: TWO_GPUS, CONTAINER_DEVICES: '{"a":{"gpu":[5,4]}}'}
    with pytest.raises(AnnotationError) as info:
        al.allocated_to(ann, "a", "gpu")
    assert info.value.annotation == CONTAINER_DEVICES
    assert info.value.where == "a.gpu[1]"
    assert "minor 4 is not among the pod's allocated gpu minors [3, 5]" in str(info.value)


def test_allocated_to_ignores_other_types_errors() -> None:
    ann = {DEVICE_ALLOCATED: '{"gpu":[{"minor":1}],"rdma":[{"minor":"x"}]}'}
    assert _minors(al.allocated_to(ann, "c", "gpu")) == [1]
    with pytest.raises(AnnotationError, match=r"rdma\[0\]\.minor"):
        al.allocated_to(ann, "c", "rdma")


def test_allocated_to_ignores_container_map_when_pod_has_none_of_the_type() -> None:
    ann = {DEVICE_ALLOCATED: '{"rdma":[{"minor":0}]}', CONTAINER_DEVICES: "not json"}
    assert al.allocated_to(ann, "c", "gpu") is None
    with pytest.raises(AnnotationError, match=CONTAINER_DEVICES):
        al.allocated_to(ann, "c", "rdma")


# -- properties ------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
# Values shaped like the annotation, so the search reaches the inner checks rather than stopping at the top.
entry_like = st.fixed_dictionaries(
    {},
    optional={
        "minor": json_values | st.integers(min_value=-2, max_value=2**32),
        "id": json_values | st.sampled_from(["GPU-1", "0000:09:00.0", "x"]),
        "resources": json_values
        | st.dictionaries(st.sampled_from([al.GPU_CORE, al.GPU_MEMORY]), json_values | st.text(max_size=8)),
        "extension": json_values | st.fixed_dictionaries({"vfs": json_values | st.lists(json_values)}),
    },
)
annotation_like = st.dictionaries(
    st.sampled_from(["gpu", "rdma", "fpga"]), json_values | st.lists(entry_like, max_size=3), max_size=3
)


def _parse_or_error(parse: Any, text: str | bytes) -> None:
    try:
        parse(text)
    except AnnotationError as e:
        assert e.annotation in (DEVICE_ALLOCATED, CONTAINER_DEVICES)
        assert str(e).startswith(f"annotation {e.annotation}: ")
        assert e.reason


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    _parse_or_error(al.parse_device_allocated, data)
    _parse_or_error(al.parse_container_devices, data)


@given(json_values | annotation_like)
def test_arbitrary_json_never_crashes(doc: Any) -> None:
    text = json.dumps(doc)
    _parse_or_error(al.parse_device_allocated, text)
    _parse_or_error(al.parse_container_devices, text)


@given(annotation_like)
def test_accepted_annotations_are_stable(doc: Any) -> None:
    try:
        once = al.parse_device_allocated(json.dumps(doc))
    except AnnotationError:
        return
    again = al.parse_device_allocated(al.format_device_allocated(once))
    assert again == once


pci = st.from_regex(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", fullmatch=True)


@st.composite
def allocation(draw: st.DrawFn, dtype: str) -> DeviceAllocation:
    minor = draw(st.integers(min_value=0, max_value=2**31 - 1))
    dev_id = draw(pci if dtype == "rdma" else st.text(max_size=20))
    resources = draw(
        st.dictionaries(
            st.sampled_from([al.GPU_CORE, al.GPU_MEMORY, al.GPU_MEMORY_RATIO, al.RDMA, "example.com/other"]),
            st.integers(min_value=0, max_value=2**63 - 1),
            max_size=4,
        )
    )
    vfs = tuple(draw(st.lists(pci, max_size=3))) if dtype == "rdma" else ()
    extension = {"vfs": [{"busID": b} for b in vfs]} if vfs else {}
    return DeviceAllocation(minor, dev_id, resources, vfs, extension)


allocations = st.fixed_dictionaries(
    {},
    optional={
        "gpu": st.lists(allocation("gpu"), max_size=4, unique_by=lambda a: a.minor).map(tuple),
        "rdma": st.lists(allocation("rdma"), max_size=3).map(tuple),
    },
)


@given(allocations)
def test_format_then_parse_round_trips(allocs: dict[str, tuple[DeviceAllocation, ...]]) -> None:
    assert al.parse_device_allocated(al.format_device_allocated(allocs)) == allocs


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=10),
        st.dictionaries(
            st.sampled_from(["gpu", "rdma"]),
            st.lists(st.integers(min_value=0, max_value=2**31 - 1), unique=True, max_size=4).map(tuple),
        ),
        max_size=4,
    )
)
def test_container_devices_format_then_parse_round_trips(assignment: dict[str, dict[str, tuple[int, ...]]]) -> None:
    assert al.parse_container_devices(al.format_container_devices(assignment)) == assignment
