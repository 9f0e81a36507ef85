"""The express lane of CreateContainer: for hooks that answer partial views with edits that only add,
the request is written without views; what reaches the runtime must be exactly what the full lane
(views, apply_edit, write_container) sends, and the lane must be taken whenever it can be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crihook.base.config import HooksConfig, NodeConfig
from crihook.base.spec import Device, Mount
from crihook.hooks.base import Edit, HookContext, Stage
from crihook.hooks.chain import build_chain
from crihook.node.container import Additions
from crihook.node.store import Store
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proxy.intercept import Interceptor

from .test_intercept import CREATE, RUN, create_request, sandbox

KEYS = ("A", "B", "NVIDIA_VISIBLE_DEVICES")
PATHS = ("/dev/nvidia0", "/dev/nvidia1", "/dev/infiniband/uverbs0")
CDI = ("nvidia.com/gpu=0", "vendor.com/nic=1")
NOTES = ("x", "y", "cdi.k8s.io/nic")


class Adds:
    """A cached hook answering every CreateContainer with the same edit; `express` decides whether
    it may take the express lane."""

    stages = frozenset({Stage.PRE_CREATE_CONTAINER})

    def __init__(self, name: str, edit: Edit | None, express: bool) -> None:
        self.name, self.priority, self.edit, self.express = name, 1, edit, express

    def handle(self, ctx: HookContext) -> Edit | None:
        return self.edit

    def handle_cached(self, ctx: HookContext) -> Edit | None:
        return self.edit


def started(tmp_path: Path, edits: list[Edit | None], express: bool) -> Interceptor:
    """An interceptor whose store saw sandbox sb-1 start."""
    hooks = [Adds(f"h{i}", e, express) for i, e in enumerate(edits)]
    chain = build_chain(
        HooksConfig(allowed_host_paths=("/dev/*",), order=tuple(h.name for h in hooks)),
        NodeConfig(),
        factories={h.name: (lambda options, node, h=h: h) for h in hooks},
    )
    ic = Interceptor(chain, Store(tmp_path))
    run = ic.classify(RUN)
    assert run is not None
    body = cri.RunPodSandboxRequest(config=sandbox()).SerializeToString()
    ic.post(run, body, cri.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString(), grpc.StatusCode.OK, None)
    return ic


def request(envs: list[str], devices: list[str], cdi: list[str], notes: list[str]) -> bytes:
    """A CreateContainer for sb-1 with what the container brings (kubelet's own fields kept)."""
    req = cri.CreateContainerRequest.FromString(create_request())
    del req.config.devices[:]
    req.config.envs.extend(cri.KeyValue(key=k.encode(), value=b"own") for k in envs)
    req.config.devices.extend(cri.Device(container_path=p, host_path=p) for p in devices)
    req.config.CDI_devices.extend(cri.CDIDevice(name=n) for n in cdi)
    req.config.annotations.update({n: "own" for n in notes})
    return req.SerializeToString()


def edits() -> st.SearchStrategy[Edit | None]:
    some = st.lists
    return st.none() | st.builds(
        lambda env, mounts, devices, cdi, notes: Edit(
            env={k: "added" for k in env},
            add_mounts=[Mount(p, p) for p in mounts],
            add_devices=[Device(p, p) for p in devices],
            add_cdi_devices=cdi,
            annotations={n: "added" for n in notes},
        ),
        some(st.sampled_from(KEYS), max_size=2, unique=True),
        some(st.sampled_from(PATHS), max_size=2),
        some(st.sampled_from(PATHS), max_size=3),
        some(st.sampled_from(CDI), max_size=2),
        some(st.sampled_from(NOTES), max_size=1, unique=True),
    )


def full_lane(added: list[Edit], envs: list[str], devices: list[str], cdi: list[str], notes: list[str]) -> bool:
    """Whether the call must take the full lane, counted here the plain way: the container brings
    devices of its own by some path, or an addition has a key the container or another addition
    has (the full lane would replace that entry)."""
    if devices or cdi or any(n.startswith("cdi.k8s.io/") for n in notes):
        return True
    kinds: list[tuple[list[Any], list[Any]]] = [
        ([k for e in added for k in e.env], envs),
        ([m.container_path for e in added for m in e.add_mounts], ["/data"]),  # create_request's mount
        ([d.container_path for e in added for d in e.add_devices], devices),
        ([n for e in added for n in e.add_cdi_devices], cdi),
        ([n for e in added for n in e.annotations], notes),
    ]
    return any(len(set(new)) < len(new) or set(new) & set(own) for new, own in kinds)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(edits(), min_size=1, max_size=2),
    st.lists(st.sampled_from(KEYS), max_size=2),
    st.lists(st.sampled_from(PATHS), max_size=1),
    st.lists(st.sampled_from(CDI), max_size=1),
    st.lists(st.sampled_from(NOTES), max_size=1),
)
async def test_the_express_lane_sends_what_the_full_lane_sends(
    tmp_path_factory: Any,
    hooks: list[Edit | None],
    envs: list[str],
    devices: list[str],
    cdi: list[str],
    notes: list[str],
) -> None:
    raw = request(envs, devices, cdi, notes)
    full = started(tmp_path_factory.mktemp("full"), hooks, express=False)
    fast = started(tmp_path_factory.mktemp("fast"), hooks, express=True)
    full_call, fast_call = full.classify(CREATE), fast.classify(CREATE)
    assert full_call is not None and fast_call is not None
    sent = await full.rewrite(full_call, raw)
    assert full_call.sent is None and full_call.ctx is not None  # the full lane's views
    expressed = await fast.rewrite(fast_call, raw)
    assert cri.CreateContainerRequest.FromString(expressed) == cri.CreateContainerRequest.FromString(sent)
    assert b"future-config" in expressed and b"future-mount" in expressed  # kubelet's unknown fields kept
    added = [e for e in hooks if e is not None and not e.is_empty()]
    assert (fast_call.sent is not None) == (not full_lane(added, envs, devices, cdi, notes))  # whenever it can be
    assert [(r.hook, r.result) for r in fast_call.records] == [(r.hook, r.result) for r in full_call.records]
    if not added:
        assert expressed is raw  # nothing added: kubelet's own bytes


async def test_the_store_records_what_the_express_lane_forwarded(tmp_path: Path) -> None:
    grant = Edit(env={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, add_devices=[Device("/dev/nvidia1", "/dev/nvidia1")])
    ic = started(tmp_path, [grant], express=True)
    call = ic.classify(CREATE)
    assert call is not None
    out = await ic.rewrite(call, request([], [], [], []))
    assert call.sent is not None
    ic.post(call, out, cri.CreateContainerResponse(container_id="c-1").SerializeToString(), grpc.StatusCode.OK, None)
    rec = ic.store.containers["c-1"]
    assert rec.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1" and rec.pod_id == "sb-1"
    assert rec.hooks == [
        {
            "hook": "h0",
            "stage": "PreCreateContainer",
            "result": "ok",
            "ms": rec.hooks[0]["ms"],
            "detail": grant.summary(),
        }
    ]


async def test_a_pod_crihook_did_not_see_start_takes_the_full_lane(tmp_path: Path) -> None:
    ic = started(tmp_path, [Edit(env={"A": "1"})], express=True)
    req = cri.CreateContainerRequest.FromString(request([], [], [], []))
    req.pod_sandbox_id = "sb-unknown"
    call = ic.classify(CREATE)
    assert call is not None
    await ic.rewrite(call, req.SerializeToString())
    assert call.sent is None


def test_an_edit_is_encoded_once_and_its_own_duplicates_are_refused() -> None:
    additions = Additions()
    grant = Edit(add_devices=[Device("/dev/nvidia0", "/dev/nvidia0")])
    first, second = cri.ContainerConfig(), cri.ContainerConfig()
    assert additions.write(first, [grant]) and additions.write(second, [grant])
    assert additions._added(grant) is additions._added(grant)
    assert [d.container_path for d in second.devices] == ["/dev/nvidia0"]
    twice = Edit(add_devices=[Device("/dev/nvidia0", "/dev/nvidia0")] * 2)
    untouched = cri.ContainerConfig()
    assert not additions.write(untouched, [twice]) and untouched == cri.ContainerConfig()
