"""Decoding lifecycle calls into hook views and writing hook results back, field by field."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.base.spec import Device, Mount
from crihook.hooks.allowlist import Allowlist
from crihook.hooks.base import Edit, HookContext, HookError, PodInfo, ResourcesPatch, Stage
from crihook.hooks.chain import HookChain
from crihook.hooks.registry import build_chain
from crihook.node.container import container_view, write_container
from crihook.node.lifecycle import Lifecycle
from crihook.node.pod import pod_view
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import wire
from crihook.proxy.intercept import HANDLERS, Interceptor
from crihook.proxy.link import start
from crihook.proxy.orphans import orphan_of
from crihook.proxy.stream import Rejected

CREATE = b"/runtime.v1.RuntimeService/CreateContainer"
RUN = b"/runtime.v1.RuntimeService/RunPodSandbox"


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field this schema does not know (as a newer kubelet might send)."""
    return wire.length_delimited(number, payload)


def sandbox() -> cri.PodSandboxConfig:
    cfg = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="train", namespace="ml", uid="u-1", attempt=1),
        labels={"app": "train"},
        annotations={"scheduling.koordinator.sh/device-allocated": '{"gpu":[{"minor":1}]}'},
    )
    cfg.linux.cgroup_parent = "/kubepods/podu-1"
    return cfg


def create_request() -> bytes:
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="main"),
        image=cri.ImageSpec(image="busybox"),
        envs=[cri.KeyValue(key=b"PATH", value=b"/bin"), cri.KeyValue(key=b"RAW", value=b"\xff\xfe not utf-8")],
        mounts=[cri.Mount(container_path="/data", host_path="/srv/data", readonly=True)],
        devices=[cri.Device(container_path="/dev/nvidia7", host_path="/dev/nvidia7", permissions="rwm")],
    )
    cfg.linux.resources.cpu_shares = 1024
    raw_cfg = bytearray(cfg.SerializeToString())
    # a field unknown to us inside the first Mount and inside ContainerConfig itself
    mount = cri.Mount(container_path="/data", host_path="/srv/data", readonly=True).SerializeToString()
    mount_with_unknown = mount + unknown_field(99, b"future-mount")
    raw_cfg = raw_cfg.replace(
        bytes([0x3A, len(mount)]) + mount, bytes([0x3A, len(mount_with_unknown)]) + mount_with_unknown
    )
    raw_cfg += unknown_field(99, b"future-config")
    req = cri.CreateContainerRequest(pod_sandbox_id="sb-1", sandbox_config=sandbox())
    req_raw = req.SerializeToString() + wire.length_delimited(2, bytes(raw_cfg))
    return req_raw


class EditHook:
    name = "edit"
    priority = 10

    def __init__(self, stages: set[Stage], edit: Edit | None = None, error: HookError | None = None) -> None:
        self.stages = frozenset(stages)
        self.edit = edit
        self.error = error
        self.seen: list[HookContext] = []

    async def handle(self, ctx: HookContext) -> Edit | None:
        self.seen.append(ctx)
        if self.error is not None:
            raise self.error
        return self.edit


def interceptor(tmp_path: Path, hook: EditHook, node: NodeConfig | None = None) -> Interceptor:
    cfg = HooksConfig(allowed_host_paths=("/dev/nvidia*",))
    chain = build_chain(cfg, node or NodeConfig(), factories={"edit": lambda options, node: hook})
    return Interceptor(Lifecycle(chain, Store(tmp_path)))


def test_every_intercepted_method_is_a_runtime_method() -> None:
    from crihook.proto.methods import METHODS as KNOWN

    assert set(HANDLERS) <= {p.encode() for p in KNOWN}


def test_views_decode_non_utf8_env_losslessly() -> None:
    req = cri.CreateContainerRequest.FromString(create_request())
    view = container_view(req.config)
    assert view.env("RAW") is not None
    assert view.env("RAW").encode("utf-8", "surrogateescape") == b"\xff\xfe not utf-8"
    pod = pod_view(req.sandbox_config, pod_id=req.pod_sandbox_id)
    assert pod.ref == "ml/train" and pod.id == "sb-1" and pod.cgroup_parent == "/kubepods/podu-1"


def test_write_back_keeps_unknown_fields_of_items_it_moves() -> None:
    """An edit that does not only append (here: a mount put before kubelet's) rebuilds the field;
    the item kept is kubelet's own message, unknown field and all."""
    cfg = cri.CreateContainerRequest.FromString(create_request()).config
    before = container_view(cfg)
    after = replace(before, mounts=(Mount("/first", "/dev/nvidia0"), *before.mounts), envs=before.envs[1:])
    write_container(cfg, before, after)
    out = cfg.SerializeToString()
    assert b"future-mount" in out and b"future-config" in out
    assert [(m.container_path, m.host_path) for m in cfg.mounts] == [("/first", "/dev/nvidia0"), ("/data", "/srv/data")]
    assert [kv.key for kv in cfg.envs] == [b"RAW"]
    assert [d.container_path for d in cfg.devices] == ["/dev/nvidia7"]


async def test_no_change_forwards_kubelet_bytes(tmp_path: Path) -> None:
    hook = EditHook({Stage.PRE_CREATE_CONTAINER})
    ic = interceptor(tmp_path, hook)
    raw = create_request()
    call = ic.classify(CREATE)
    assert call is not None and call.modifies
    assert await ic.rewrite(call, raw) is raw
    assert hook.seen[0].container.name == "main"
    assert hook.seen[0].pod.annotations["scheduling.koordinator.sh/device-allocated"]


async def test_edit_rewrites_only_what_changed_and_keeps_unknown_fields(tmp_path: Path) -> None:
    edit = Edit(
        env={"NVIDIA_VISIBLE_DEVICES": "GPU-1"},
        remove_devices={"/dev/nvidia7"},
        add_devices=[Device("/dev/nvidia1", "/dev/nvidia1")],
        annotations={"crihook": "yes"},
        resources=ResourcesPatch(cpu_quota=50000),
    )
    ic = interceptor(tmp_path, EditHook({Stage.PRE_CREATE_CONTAINER}, edit))
    raw = create_request()
    out = await ic.rewrite(ic.classify(CREATE), raw)
    assert b"future-mount" in out and b"future-config" in out
    cfg = cri.CreateContainerRequest.FromString(out).config
    assert [(kv.key, kv.value) for kv in cfg.envs] == [
        (b"PATH", b"/bin"),
        (b"RAW", b"\xff\xfe not utf-8"),
        (b"NVIDIA_VISIBLE_DEVICES", b"GPU-1"),
    ]
    assert [(d.container_path, d.host_path) for d in cfg.devices] == [("/dev/nvidia1", "/dev/nvidia1")]
    assert cfg.annotations["crihook"] == "yes"
    assert cfg.linux.resources.cpu_quota == 50000 and cfg.linux.resources.cpu_shares == 1024
    assert cfg.mounts[0].readonly


async def test_disallowed_host_path_refuses_the_call(tmp_path: Path) -> None:
    edit = Edit(add_mounts=[Mount("/host", "/etc")])
    ic = interceptor(tmp_path, EditHook({Stage.PRE_CREATE_CONTAINER}, edit))
    with pytest.raises(Rejected) as err:
        await ic.rewrite(ic.classify(CREATE), create_request())
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert "hook edit: pod ml/train container main" in err.value.message and "/etc" in err.value.message


async def test_hook_refusal_carries_its_code(tmp_path: Path) -> None:
    err = HookError(grpc.StatusCode.FAILED_PRECONDITION, "GPU 3 is held by pod other/x")
    ic = interceptor(tmp_path, EditHook({Stage.PRE_CREATE_CONTAINER}, error=err))
    with pytest.raises(Rejected) as rej:
        await ic.rewrite(ic.classify(CREATE), create_request())
    assert rej.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert rej.value.message == "hook edit: pod ml/train container main: GPU 3 is held by pod other/x"


async def test_malformed_request_is_invalid_argument(tmp_path: Path) -> None:
    ic = interceptor(tmp_path, EditHook({Stage.PRE_CREATE_CONTAINER}))
    with pytest.raises(Rejected) as err:
        await ic.rewrite(ic.classify(CREATE), b"\x12\xff\xff\xff")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "CreateContainer" in err.value.message


async def test_pod_stage_edits_labels_annotations_cgroup(tmp_path: Path) -> None:
    edit = Edit(labels={"l": "1"}, annotations={"a": "2"}, cgroup_parent="/kubepods/besteffort/podu-1")
    ic = interceptor(tmp_path, EditHook({Stage.PRE_RUN_POD_SANDBOX}, edit))
    raw = cri.RunPodSandboxRequest(config=sandbox(), runtime_handler="runc").SerializeToString()
    out = cri.RunPodSandboxRequest.FromString(await ic.rewrite(ic.classify(RUN), raw))
    assert out.config.labels["l"] == "1" and out.config.labels["app"] == "train"
    assert out.config.annotations["a"] == "2"
    assert out.config.linux.cgroup_parent == "/kubepods/besteffort/podu-1"
    assert out.runtime_handler == "runc"


async def test_lifecycle_bookkeeping_and_post_hooks(tmp_path: Path) -> None:
    hook = EditHook({Stage.POST_STOP_CONTAINER, Stage.POST_REMOVE_POD_SANDBOX})
    ic = interceptor(tmp_path, hook)
    run = ic.classify(RUN)
    assert run is not None and not run.modifies  # observed for the store only
    ic.post(
        run,
        cri.RunPodSandboxRequest(config=sandbox()).SerializeToString(),
        cri.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString(),
        grpc.StatusCode.OK,
        None,
    )
    create = ic.classify(CREATE)
    ic.post(
        create,
        create_request(),
        cri.CreateContainerResponse(container_id="c-1").SerializeToString(),
        grpc.StatusCode.OK,
        None,
    )
    assert ic.store.pods["sb-1"].namespace == "ml"
    assert ic.store.containers["c-1"].pod_id == "sb-1"
    stop = ic.classify(b"/runtime.v1.RuntimeService/StopContainer")
    ic.post(stop, cri.StopContainerRequest(container_id="c-1").SerializeToString(), b"", grpc.StatusCode.OK, None)
    # a failed call changes nothing
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/RemoveContainer"),
        cri.RemoveContainerRequest(container_id="c-1").SerializeToString(),
        None,
        grpc.StatusCode.NOT_FOUND,
        None,
    )
    assert "c-1" in ic.store.containers
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/RemovePodSandbox"),
        cri.RemovePodSandboxRequest(pod_sandbox_id="sb-1").SerializeToString(),
        b"",
        grpc.StatusCode.OK,
        None,
    )
    await ic.close()
    assert ic.store.containers == {} and ic.store.pods == {}
    assert [c.stage for c in hook.seen] == [Stage.POST_STOP_CONTAINER, Stage.POST_REMOVE_POD_SANDBOX]
    assert hook.seen[0].pod.ref == "ml/train" and hook.seen[0].container.name == "main"
    await ic.store.close()


def test_only_a_refused_removal_reaches_the_task_janitor(tmp_path: Path) -> None:
    noticed: list[bytes | None] = []
    ic = interceptor(tmp_path, EditHook(set()))
    ic.janitor = SimpleNamespace(notice=noticed.append)  # type: ignore[assignment]
    refused = b"failed to delete containerd container%3A cannot delete running task c-1: failed precondition"
    remove = cri.RemoveContainerRequest(container_id="c-1").SerializeToString()
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/RemoveContainer"),
        remove,
        None,
        grpc.StatusCode.FAILED_PRECONDITION,
        refused,
    )
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/RemoveContainer"),
        remove,
        None,
        grpc.StatusCode.NOT_FOUND,
        b"not found",
    )
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/StopContainer"),
        remove,
        None,
        grpc.StatusCode.FAILED_PRECONDITION,
        refused,
    )
    sandbox = cri.RemovePodSandboxRequest(pod_sandbox_id="sb-1").SerializeToString()
    ic.post(
        ic.classify(b"/runtime.v1.RuntimeService/RemovePodSandbox"),
        sandbox,
        None,
        grpc.StatusCode.FAILED_PRECONDITION,
        refused,
    )
    assert noticed == [refused, refused]


@pytest.mark.parametrize(
    ("message", "found"),
    [
        (b"failed to remove container: cannot delete running task 4f2a_b.c-9: failed precondition", "4f2a_b.c-9"),
        (b"cannot%20delete%20running%20task%20abc", "abc"),  # grpc-message is percent-encoded
        (b"container is still running, to stop first", None),
        (None, None),
    ],
)
def test_orphan_of_reads_the_container_id(message: bytes | None, found: str | None) -> None:
    assert orphan_of(message) == found


async def test_chain_close_releases_hooks_once_and_survives_a_failing_close() -> None:
    closed: list[str] = []

    class Holder:
        stages = frozenset({Stage.PRE_CREATE_CONTAINER})
        priority = 0

        def __init__(self, name: str, fail: bool = False, is_async: bool = True) -> None:
            self.name, self.fail, self.is_async = name, fail, is_async

        def handle(self, ctx: HookContext) -> None:
            return None

        def close(self) -> object:
            if self.fail:
                raise RuntimeError("boom")
            closed.append(self.name)
            if self.is_async:

                async def done() -> None:
                    closed.append(f"{self.name}:awaited")

                return done()
            return None

    hooks = {"a": Holder("a"), "b": Holder("b", fail=True), "c": Holder("c", is_async=False)}
    factories = {n: (lambda options, node, h=h: h) for n, h in hooks.items()}
    chain = build_chain(HooksConfig(), NodeConfig(), factories=factories)
    await chain.close()
    assert closed == ["a", "a:awaited", "c"]


UPDATE = b"/runtime.v1.RuntimeService/UpdateContainerResources"
CREATED = {  # what the store holds for a container created with shares 256, 128 MiB, oom_score_adj 500
    "cpu_period": 100000, "cpu_quota": 0, "cpu_shares": 256, "memory_limit_in_bytes": 128 << 20,
    "oom_score_adj": 500, "cpuset_cpus": "", "cpuset_mems": "", "memory_swap_limit_in_bytes": 0,
    "unified": {"memory.high": "100000000"},
}  # fmt: skip


def stored_container(ic: Interceptor) -> None:
    ic.store.pods["sb-1"] = PodRecord("sb-1", "train", "ml", "u-1", cgroup_parent="/kubepods/podu-1")
    ic.store.containers["c-1"] = ContainerRecord(
        "c-1", "sb-1", "main", annotations={"a": "1"}, envs={"A": "1", "B": "2"}, resources=dict(CREATED)
    )


async def test_update_shows_the_stored_container_with_the_update_applied(tmp_path: Path) -> None:
    """kubelet's CPU manager sends only the cpuset; the hooks see everything else from the store,
    and only kubelet's field plus the hook's changes go to the runtime."""
    edit = Edit(annotations={"hook": "yes"}, resources=ResourcesPatch(cpu_quota=30000, unified={"cpu.idle": "0"}))
    hook = EditHook({Stage.PRE_UPDATE_CONTAINER_RESOURCES}, edit)
    ic = interceptor(tmp_path, hook)
    stored_container(ic)
    call = ic.classify(UPDATE)
    assert call is not None and call.modifies
    request = cri.UpdateContainerResourcesRequest(
        container_id="c-1", linux=cri.LinuxContainerResources(cpuset_cpus="0")
    )
    out = cri.UpdateContainerResourcesRequest.FromString(await ic.rewrite(call, request.SerializeToString(), 123.0))
    (seen,) = hook.seen
    assert seen.deadline == 123.0 and seen.pod.cgroup_parent == "/kubepods/podu-1"
    assert seen.container.envs == (("A", "1"), ("B", "2")) and seen.container.annotations == {"a": "1"}
    res = seen.container.resources
    assert (res.cpu_shares, res.memory_limit_in_bytes, res.oom_score_adj, res.cpuset_cpus) == (256, 128 << 20, 500, "0")
    assert res.unified == {"memory.high": "100000000"}
    assert out.linux == cri.LinuxContainerResources(cpuset_cpus="0", cpu_quota=30000, unified={"cpu.idle": "0"})
    assert dict(out.annotations) == {"hook": "yes"}

    ic.post(call, out.SerializeToString(), b"", grpc.StatusCode.OK, None)  # the runtime merged it in; so does the store
    assert ic.store.containers["c-1"].resources == {
        **CREATED, "cpuset_cpus": "0", "cpu_quota": 30000, "unified": {"memory.high": "100000000", "cpu.idle": "0"},
    }  # fmt: skip
    # a full update later: every field it sets wins, oom_score_adj stays what the container was created with
    full = cri.LinuxContainerResources(
        cpu_period=50000, cpu_quota=25000, cpu_shares=512, memory_limit_in_bytes=256 << 20, oom_score_adj=-999,
        cpuset_cpus="1", cpuset_mems="0",
    )  # fmt: skip
    ic.post(
        ic.classify(UPDATE),  # another call, not rewritten (no hook wanted it, say)
        cri.UpdateContainerResourcesRequest(container_id="c-1", linux=full).SerializeToString(),
        b"",
        grpc.StatusCode.OK,
        None,
    )
    assert ic.store.containers["c-1"].resources == {
        **CREATED, "cpu_period": 50000, "cpu_quota": 25000, "cpu_shares": 512, "memory_limit_in_bytes": 256 << 20,
        "cpuset_cpus": "1", "cpuset_mems": "0", "unified": {"memory.high": "100000000", "cpu.idle": "0"},
    }  # fmt: skip
    # a refused update changes nothing
    ic.post(call, cri.UpdateContainerResourcesRequest(container_id="c-1", linux=cri.LinuxContainerResources(
        cpu_shares=2)).SerializeToString(), None, grpc.StatusCode.UNKNOWN, None)  # fmt: skip
    assert ic.store.containers["c-1"].resources["cpu_shares"] == 512
    await ic.close()
    await ic.store.close()


async def test_update_no_hook_changed_forwards_kubelet_bytes(tmp_path: Path) -> None:
    ic = interceptor(tmp_path, EditHook({Stage.PRE_UPDATE_CONTAINER_RESOURCES}))
    stored_container(ic)
    raw = cri.UpdateContainerResourcesRequest(
        container_id="c-1", linux=cri.LinuxContainerResources(cpuset_cpus="0-1"), annotations={"k": "v"}
    ).SerializeToString()
    assert await ic.rewrite(ic.classify(UPDATE), raw) is raw


async def test_update_of_a_container_crihook_never_saw(tmp_path: Path) -> None:
    """Created before crihook and not reconciled: the hooks see kubelet's fields alone, and the
    store gains nothing it could not know."""
    hook = EditHook({Stage.PRE_UPDATE_CONTAINER_RESOURCES})
    ic = interceptor(tmp_path, hook)
    raw = cri.UpdateContainerResourcesRequest(
        container_id="x", linux=cri.LinuxContainerResources(cpu_shares=300)
    ).SerializeToString()
    assert await ic.rewrite(ic.classify(UPDATE), raw) is raw
    assert hook.seen[0].container.id == "x" and hook.seen[0].container.resources.cpu_shares == 300
    ic.post(ic.classify(UPDATE), raw, b"", grpc.StatusCode.OK, None)
    assert ic.store.containers == {}


# -- the handler table --------------------------------------------------------------------------------


def test_every_pre_stage_has_exactly_one_handler() -> None:
    stages = [h.pre for h in HANDLERS.values() if h.pre is not None]
    assert sorted(stages) == sorted(s for s in Stage if not s.is_post)


@pytest.mark.parametrize("path", sorted(HANDLERS))
def test_each_handler_names_its_method_messages_and_steps(path: bytes) -> None:
    h = HANDLERS[path]
    assert path.decode().rsplit("/", 1)[1] == h.name
    assert h.request is getattr(cri, h.name + "Request") and h.response is getattr(cri, h.name + "Response")
    assert (h.pre is not None) == (h.decide is not None)  # a pre stage needs the hooks' view of the request


@pytest.mark.parametrize("path", sorted(p for p, h in HANDLERS.items() if h.pre is not None))
async def test_a_view_no_hook_changed_writes_nothing_back(tmp_path: Path, path: bytes) -> None:
    h = HANDLERS[path]
    assert h.pre is not None and h.decide is not None
    msg = h.request.FromString(create_request()) if h.name == "CreateContainer" else h.request()
    before = msg.SerializeToString()
    decided = await h.decide(Lifecycle(HookChain((), Allowlist(())), Store(tmp_path)), msg, None)
    assert not decided.edited
    h.write_back(msg, decided)
    assert msg.SerializeToString() == before


def test_resource_fields_are_the_views_and_both_protocols_fields() -> None:
    from dataclasses import fields

    from crihook.hooks.base import RESOURCE_FIELDS, LinuxResources, ResourcesPatch
    from crihook.proto import hookservice_v1alpha1_pb2 as pb

    scalars = set(RESOURCE_FIELDS)
    assert {f.name for f in fields(LinuxResources)} - {"unified"} == scalars
    assert {f.name for f in fields(ResourcesPatch)} - {"unified"} == scalars
    for message in (cri.LinuxContainerResources, pb.LinuxContainerResources):
        assert scalars <= set(message.DESCRIPTOR.fields_by_name)


async def test_a_started_sandbox_lets_hooks_prepare_for_its_containers(tmp_path: Path) -> None:
    """After RunPodSandbox's answer (never before it, never for a failed one), hooks that prepare
    per-pod work get the pod as recorded."""

    class Preparing(EditHook):
        def __init__(self) -> None:
            super().__init__({Stage.PRE_CREATE_CONTAINER})
            self.prepared: list[PodInfo] = []

        def prepare_pod(self, pod: PodInfo) -> None:
            self.prepared.append(pod)

    hook = Preparing()
    ic = interceptor(tmp_path, hook)
    run, body = ic.classify(RUN), cri.RunPodSandboxRequest(config=sandbox()).SerializeToString()
    assert run is not None
    ic.post(run, body, None, grpc.StatusCode.DEADLINE_EXCEEDED, None)
    assert hook.prepared == []
    ic.post(run, body, cri.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString(), grpc.StatusCode.OK, None)
    assert [(p.id, p.uid, dict(p.annotations)) for p in hook.prepared] == [
        ("sb-1", sandbox().metadata.uid, dict(sandbox().annotations))
    ]


async def test_a_rewrite_started_from_a_protocol_callback_may_wait_on_an_async_hook(tmp_path: Path) -> None:
    """The relay starts a rewrite in its data_received callback, outside any task (link.start): an
    async hook on the way must still run, under its timeout, and the rewrite finish as a task."""
    hook = EditHook({Stage.PRE_CREATE_CONTAINER}, Edit(env={"X": "1"}))
    ic = interceptor(tmp_path, hook)
    loop = asyncio.get_running_loop()
    started: asyncio.Future[asyncio.Future[bytes]] = loop.create_future()
    loop.call_soon(lambda: started.set_result(start(ic.rewrite(ic.classify(CREATE), create_request()))))
    out = cri.CreateContainerRequest.FromString(await (await started))
    assert container_view(out.config).env("X") == "1" and hook.seen


async def test_a_failed_create_is_forgotten_by_the_hooks_that_kept_it(tmp_path: Path) -> None:
    """containerd fails the CreateContainer crihook let through: no record, and a hook that kept
    something of the container (the gpu hook's claim on its GPUs) is told to forget it."""

    class Keeper(EditHook):
        def __init__(self) -> None:
            super().__init__({Stage.PRE_CREATE_CONTAINER})
            self.forgotten: list[tuple[str, str]] = []

        def forget(self, pod_uid: str, container: str) -> None:
            self.forgotten.append((pod_uid, container))

    hook = Keeper()
    ic = interceptor(tmp_path, hook)
    call = ic.classify(CREATE)
    assert call is not None
    sent = await ic.rewrite(call, create_request())
    ic.post(call, sent, None, grpc.StatusCode.UNKNOWN, b"failed to create containerd container")
    assert hook.forgotten == [("u-1", "main")] and not ic.lifecycle.store.containers
