"""containerd 2.2 and later (NRI v0.10+), played by the fake runtime from NRI's sources (Debian has
no 2.2): the runtime appends an adjustment's device-cgroup rules, deny rules included, to the spec's,
so crihook takes an ungranted GPU away where it must refuse the container before; and it asks
validators for the adjustment of every plugin merged, so a plugin called after crihook can not give
the container a GPU crihook did not leave it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.hooks.base import ContainerInfo, Edit, HookContext, PodInfo, Stage
from crihook.hooks.reach import VISIBLE, Gpu, Grants, Reach, Verdict, judge
from crihook.hooks.registry import build_chain
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.nri.handler import HookHandler
from crihook.nri.stub import Plugin
from crihook.proto import nri_v1alpha1_pb2 as api
from tests.nri.fakeruntime import Conflict, FakeRuntime, Peer, opens, spec_rules
from tests.nri.test_stub import running

GPUS = tuple(Gpu(minor=m, index=m, uuid=f"GPU-{m}") for m in range(4))
POD = api.PodSandbox(id="sb-1", name="train", namespace="ml", uid="u-1")
V022 = ("containerd", "v2.2.1")  # NRI v0.11.0
V021 = ("containerd", "2.1.9+unknown")  # NRI v0.8.0: rules in an adjustment are ignored


class GrantsOne:
    """The gpu hook's part, as hooks.reach decides it: the scheduler granted GPU 1; the hook names it
    in NVIDIA_VISIBLE_DEVICES and takes away the node of every other GPU the container was given."""

    name = "gpu"
    priority = 20
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})

    async def handle(self, ctx: HookContext) -> Edit | None:
        assert ctx.container is not None
        others = {d.container_path for d in ctx.container.devices if d.number and d.number[2] != 1}
        return Edit(env={VISIBLE: "GPU-1"}, remove_devices=others)

    def verdict(self, pod: PodInfo, container: ContainerInfo, reach: Reach) -> Verdict:
        return judge(reach, Grants(scheduler=frozenset({1})), GPUS)


def given_gpu0() -> api.Container:
    """What a device plugin (or a CDI device) made of a container before NRI is asked: the node of
    GPU 0 and its allow rule, after containerd's deny-all."""
    c = api.Container(id="c-1", pod_sandbox_id=POD.id, name="main", env=[f"{VISIBLE}=all"])
    c.linux.resources.devices.add(allow=False, access="rwm")
    c.linux.devices.add(path="/dev/nvidia0", type="c", major=195, minor=0)
    rule = c.linux.resources.devices.add(allow=True, type="c", access="rw")
    rule.major.value, rule.minor.value = 195, 0
    return c


@contextlib.asynccontextmanager
async def crihook(tmp_path: Path, runtime: tuple[str, str]) -> AsyncIterator[tuple[Peer, int]]:
    """crihook's NRI handler behind the plugin stub, connected to the fake runtime: the peer, and
    the events crihook subscribed to."""
    chain = build_chain(HooksConfig(), NodeConfig(), factories={"gpu": lambda options, node: GrantsOne()})
    handler = HookHandler(Lifecycle(chain, Store(tmp_path / "state")))
    sock = tmp_path / "nri.sock"
    plugin = Plugin(handler, "crihook", "10", str(sock), backoff=0.01, max_backoff=0.05)
    async with FakeRuntime(sock) as rt, running(plugin):
        peer = await rt.accept()
        configured = await peer.handshake(runtime=runtime)
        yield peer, configured.events


def create(c: api.Container) -> api.CreateContainerRequest:
    return api.CreateContainerRequest(pod=POD, container=c)


def later_node(minor: int) -> api.ContainerAdjustment:
    """What a plugin with a higher index adds: the node of a GPU."""
    adj = api.ContainerAdjustment()
    adj.linux.devices.add(path=f"/dev/nvidia-later{minor}", type="c", major=195, minor=minor)
    return adj


async def test_before_2_2_a_gpu_the_runtime_gave_is_refused(tmp_path: Path) -> None:
    async with crihook(tmp_path, V021) as (peer, events):
        assert not events & (1 << (api.VALIDATE_CONTAINER_ADJUSTMENT - 1))  # NRI v0.8 knows no such event
        response = await peer.call_raw("CreateContainer", create(given_gpu0()).SerializeToString())
    assert response.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "removing device /dev/nvidia0" in response.status.message


async def test_from_2_2_a_gpu_the_runtime_gave_is_taken_away_by_a_deny_rule(tmp_path: Path) -> None:
    container = given_gpu0()
    async with crihook(tmp_path, V022) as (peer, events):
        merged, validated = await peer.create_container(create(container), events)
    assert validated is not None and validated.status.code == 0
    assert api.ValidateContainerAdjustmentResponse.FromString(validated.payload).reject is False
    rules = spec_rules(container, merged)
    assert not opens(rules, "c", 195, 0)  # the node stays in the spec, unusable
    assert [(kv.key, kv.value) for kv in merged.env] == [(VISIBLE, "GPU-1")]


@pytest.mark.parametrize(
    ("later", "found"),
    [
        (later_node(3), "GPU minor 3 through a device node or device-cgroup rule"),
        (later_node(0), ""),  # GPU 0's node added again: crihook's deny rule comes after its allow
        (
            api.ContainerAdjustment(CDI_devices=[api.CDIDevice(name="nvidia.com/gpu=GPU-2")]),
            "CDI device nvidia.com/gpu=GPU-2",
        ),
        (api.ContainerAdjustment(CDI_devices=[api.CDIDevice(name="vendor.com/nic=a")]), ""),
    ],
)
async def test_a_later_plugin_can_not_give_a_gpu_crihook_did_not_leave(
    tmp_path: Path, later: api.ContainerAdjustment, found: str
) -> None:
    async with crihook(tmp_path, V022) as (peer, events):
        _, validated = await peer.create_container(create(given_gpu0()), events, later)
    assert validated is not None
    verdict = api.ValidateContainerAdjustmentResponse.FromString(validated.payload)
    assert verdict.reject == bool(found)
    if found:
        assert found in verdict.reason and "container main of pod ml/train" in verdict.reason
        assert "10-crihook, 90-later" in verdict.reason


async def test_a_later_rule_opening_a_denied_gpu_is_refused(tmp_path: Path) -> None:
    later = api.ContainerAdjustment()
    rule = later.linux.resources.devices.add(allow=True, type="c", access="rw")
    rule.major.value = 195  # every GPU minor
    async with crihook(tmp_path, V022) as (peer, events):
        _, validated = await peer.create_container(create(given_gpu0()), events, later)
    assert validated is not None
    verdict = api.ValidateContainerAdjustmentResponse.FromString(validated.payload)
    assert verdict.reject and "GPU minor 0 to 253 (254 of them)" in verdict.reason


async def test_a_later_plugin_setting_the_visible_gpus_fails_in_the_merge(tmp_path: Path) -> None:
    """NRI itself refuses a second owner of an env variable (owners.go), before any validation."""
    later = api.ContainerAdjustment(env=[api.KeyValue(key=VISIBLE, value="all")])
    async with crihook(tmp_path, V022) as (peer, events):
        with pytest.raises(Conflict, match=f"set env {VISIBLE}"):
            await peer.create_container(create(given_gpu0()), events, later)
