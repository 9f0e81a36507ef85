"""Fuzzing the CRI request decoder: `Interceptor.rewrite` on what a hostile or broken client can send as a
RunPodSandbox or CreateContainer body, with the real gpu hook and an editing hook in the chain.

Inputs: arbitrary bytes; kubelet-shaped requests (hostile annotations, non-UTF-8 envs, int64
extremes, device paths) serialized and then truncated, bit-flipped, spliced with junk, or given
unknown fields. Outcome for every input: either rewritten bytes that decode as the same request type,
or `Rejected` with a clear error: INVALID_ARGUMENT naming the method for bytes that are not the
request, or a hook's refusal naming hook and pod. INTERNAL (an exception escaping a hook) is a crash.
And whatever the input, a container whose pod has no GPU allocation ends up with
NVIDIA_VISIBLE_DEVICES=void and no /dev/nvidiaN node.

The normal suite runs hypothesis' default count; bench/fuzz.py runs 10,000 examples a target.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

import grpc
from hypothesis import event, given
from hypothesis import strategies as st

from crihook.base import allocation as al
from crihook.base.spec import Device
from crihook.devices.checkpoint import CheckpointReader
from crihook.hooks.allowlist import Allowlist
from crihook.hooks.base import Edit, HookContext, ResourcesPatch, Stage
from crihook.hooks.chain import HookChain, Registered
from crihook.hooks.gpu import GpuHook
from crihook.hooks.gpu_edit import GpuOptions
from crihook.hooks.grant import VISIBLE
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import wire as wire_format
from crihook.proxy.intercept import HANDLERS, Interceptor
from crihook.proxy.stream import Rejected
from tests.support.gpu_fixtures import Entry, Inventory, gpus, nvidia_plugin_resp, write_checkpoint

INVENTORY = gpus(4, minor_offset=2)
PLUGIN_POD = "plugin-pod-uid"  # the checkpoint says the device plugin gave this pod's "main" a GPU
HOOK_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
GPU_NODE = re.compile(r"/dev/nvidia[0-9]+")


class Editor:
    """Edits every field kind the write-back has to handle, so re-encoding runs on every input."""

    name = "editor"
    stages = frozenset({Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER})
    priority = 50

    def handle(self, ctx: HookContext) -> Edit:
        if ctx.container is None:
            return Edit(labels={"fuzz": "1"}, annotations={"fuzz": "1"}, resources=ResourcesPatch(cpu_shares=512))
        return Edit(
            env={"CRIHOOK_FUZZ": "1"},
            add_devices=[Device("/dev/nvidiactl", "/dev/nvidiactl", "rw")],
            annotations={"fuzz": "1"},
            resources=ResourcesPatch(memory_limit_in_bytes=1 << 30),
        )


WORK = tempfile.TemporaryDirectory(prefix="crihook-fuzz-")  # removed when the test process exits


def _interceptor() -> tuple[Interceptor, asyncio.AbstractEventLoop]:
    tmp = Path(WORK.name)
    checkpoint = tmp / "kubelet_internal_checkpoint"
    write_checkpoint(
        checkpoint, [Entry(PLUGIN_POD, "main", [INVENTORY[0].uuid], resp=nvidia_plugin_resp(INVENTORY[:1]))]
    )
    gpu = GpuHook(
        GpuOptions(), Inventory(INVENTORY), CheckpointReader(str(checkpoint)), lambda uid: True, lambda p: True
    )
    chain = HookChain(
        [Registered(Editor(), "fail", 5.0, False), Registered(gpu, "fail", 5.0, False)],
        Allowlist(["/dev/nvidia*"]),
    )
    return Interceptor(Lifecycle(chain, Store(tmp / "state"))), asyncio.new_event_loop()


INTERCEPTOR, LOOP = _interceptor()
RUN_POD_PATH = b"/runtime.v1.RuntimeService/RunPodSandbox"
CREATE_PATH = b"/runtime.v1.RuntimeService/CreateContainer"


# -- inputs --------------------------------------------------------------------------------------

names = st.text(max_size=20)
int64 = st.integers(-(2**63), 2**63 - 1)
raw = st.binary(max_size=40)
allocation_json = st.one_of(
    st.builds(
        al.format_device_allocated,
        st.fixed_dictionaries(
            {
                "gpu": st.lists(
                    st.builds(al.DeviceAllocation, st.integers(0, 8)), max_size=3, unique_by=lambda a: a.minor
                )
            }
        ),
    ),
    st.text(max_size=60),
    st.sampled_from(['{"gpu":[{"minor":2,"id":"GPU-wrong"}]}', '{"gpu":null}', '{"gpu":[{"minor":1e400}]}', "[]"]),
)
annotations = st.dictionaries(
    st.sampled_from([al.DEVICE_ALLOCATED, al.CONTAINER_DEVICES, "other"]) | names,
    allocation_json | names,
    max_size=3,
)
resources = st.builds(
    cri.LinuxContainerResources,
    cpu_shares=int64,
    memory_limit_in_bytes=int64,
    oom_score_adj=int64,
    cpuset_cpus=names,
    unified=st.dictionaries(names, names, max_size=2),
)


@st.composite
def pod_configs(draw: st.DrawFn) -> cri.PodSandboxConfig:
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(
            name=draw(names), namespace=draw(names), uid=draw(st.sampled_from([PLUGIN_POD, "u1"]) | names)
        ),
        labels=draw(st.dictionaries(names, names, max_size=3)),
        annotations=draw(annotations),
    )
    config.linux.cgroup_parent = draw(names)
    if draw(st.booleans()):
        config.linux.resources.CopyFrom(draw(resources))
    return config


@st.composite
def create_requests(draw: st.DrawFn) -> cri.CreateContainerRequest:
    envs = st.lists(
        st.tuples(st.sampled_from([VISIBLE.encode(), b"PATH"]) | raw, st.sampled_from([b"all", b"0", b"void"]) | raw),
        max_size=4,
    )
    paths = st.sampled_from(["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl", "/dev/sda"]) | names
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(
            name=draw(st.sampled_from(["main", ""]) | names), attempt=draw(st.integers(0, 2**32 - 1))
        ),
        image=cri.ImageSpec(image=draw(names)),
        envs=[cri.KeyValue(key=k, value=v) for k, v in draw(envs)],
        devices=[
            cri.Device(container_path=p, host_path=p, permissions="rw") for p in draw(st.lists(paths, max_size=3))
        ],
        mounts=[cri.Mount(container_path=p, host_path=p) for p in draw(st.lists(paths, max_size=2))],
        annotations=draw(st.dictionaries(names, names, max_size=2)),
    )
    if draw(st.booleans()):
        config.linux.resources.CopyFrom(draw(resources))
    return cri.CreateContainerRequest(pod_sandbox_id=draw(names), config=config, sandbox_config=draw(pod_configs()))


def _unknown_field(number: int, wire: int, payload: bytes) -> bytes:
    tag = wire_format.tag(number, wire)
    if wire == 0:
        return tag + wire_format.varint(int.from_bytes(payload[:9] or b"\0", "little"))
    if wire == 1:
        return tag + payload[:8].ljust(8, b"\0")
    if wire == 5:
        return tag + payload[:4].ljust(4, b"\0")
    return tag + wire_format.varint(len(payload)) + payload  # wire type 2


@st.composite
def mutated(draw: st.DrawFn, message: st.SearchStrategy[object]) -> bytes:
    """A valid request's bytes with one damage applied (or none)."""
    data = draw(message).SerializeToString()  # type: ignore[attr-defined]
    kind = draw(st.sampled_from(["none", "truncate", "flip", "splice", "unknown"]))
    if kind == "none" or not data:
        return data
    at = draw(st.integers(0, len(data)))
    if kind == "truncate":
        return data[:at]
    if kind == "flip":
        i = min(at, len(data) - 1)
        return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
    if kind == "splice":
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    field = _unknown_field(draw(st.integers(16, 2**29 - 1)), draw(st.sampled_from([0, 1, 2, 5])), draw(raw))
    return data + field  # an unknown top-level field, as a newer kubelet sends


# -- the property --------------------------------------------------------------------------------


def check(method_path: bytes, data: bytes) -> bytes | None:
    """Run pre; assert the outcome is a decodable request or a clear rejection. Returns the output."""
    method = HANDLERS[method_path]
    call = INTERCEPTOR.classify(method_path)
    assert call is not None and call.modifies
    try:
        out = LOOP.run_until_complete(INTERCEPTOR.rewrite(call, data))
    except Rejected as r:
        assert r.message
        if r.message.startswith("crihook: malformed"):
            event("rejected: malformed")
            assert r.code is grpc.StatusCode.INVALID_ARGUMENT and method.name in r.message
        else:
            event("refused by a hook")
            assert r.code in HOOK_REFUSALS, f"a hook crashed: {r.code} {r.message}"
            assert r.message.startswith("hook gpu: pod "), r.message
            assert "annotation " in r.message  # the gpu hook names the annotation at fault
        return None
    event("forwarded")
    method.request.FromString(out)
    return out


@given(st.binary(max_size=600))
def test_arbitrary_bytes(data: bytes) -> None:
    check(RUN_POD_PATH, data)
    check(CREATE_PATH, data)


@given(mutated(st.builds(cri.RunPodSandboxRequest, config=pod_configs(), runtime_handler=names)))
def test_mutated_run_pod_sandbox(data: bytes) -> None:
    out = check(RUN_POD_PATH, data)
    if out is not None:
        assert cri.RunPodSandboxRequest.FromString(out).config.labels["fuzz"] == "1"


@given(mutated(create_requests()))
def test_mutated_create_container(data: bytes) -> None:
    out = check(CREATE_PATH, data)
    if out is None:
        return
    request = cri.CreateContainerRequest.FromString(out)
    config, pod = request.config, request.sandbox_config
    assert config.annotations["fuzz"] == "1"
    allocated = al.DEVICE_ALLOCATED in pod.annotations
    by_plugin = pod.metadata.uid == PLUGIN_POD and config.metadata.name == "main"
    if not allocated and not by_plugin:
        # no GPU for this container, whatever its env and devices asked for
        visible = [kv.value for kv in config.envs if kv.key == VISIBLE.encode()]
        assert visible and visible[-1] == b"void"
        assert not [d for d in config.devices if GPU_NODE.fullmatch(d.host_path)]
