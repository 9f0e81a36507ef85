"""The plugin stub against the real runtimes: containerd 1.7 (NRI v0.6.1) and 2.x (NRI v0.8.0), each
started privately with NRI on (tests/support/containerd.py). Registration, Configure, Synchronize,
an adjustment reaching the container, refusals, every lifecycle event answered, and reconnection
after the plugin or containerd went away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from crihook.nri.stub import Code, RpcError, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.hookserver import wait_for
from tests.support.nriplugin import plugin_thread

pytestmark = pytest.mark.runtimes("1.7", "2")

# Events both runtimes know: NRI before v0.10 refuses a subscription to a later one.
ALL_EVENTS = event_mask(*range(api.RUN_POD_SANDBOX, api.REMOVE_CONTAINER + 1))
REFUSED = "refused"  # containers of this name are refused by the handler


class Marking:
    """Adds MARK=<pod name>/<container name> to each container it is asked about; refuses those
    named REFUSED; records every call."""

    def __init__(self, events: int = event_mask(api.CREATE_CONTAINER)) -> None:
        self.events = events
        self.configured: list[api.ConfigureRequest] = []
        self.synced: list[tuple[set[str], set[str]]] = []
        self.created: list[api.CreateContainerRequest] = []
        self.calls: list[str] = []
        self.stop_answer: RpcError | None = None

    async def configure(self, request: api.ConfigureRequest) -> int:
        self.configured.append(request)
        return self.events

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        self.synced.append(({p.id for p in pods}, {c.id for c in containers}))
        return []

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        self.created.append(request)
        self.calls.append("CreateContainer")
        if request.container.name == REFUSED:
            raise RpcError(Code.INVALID_ARGUMENT, f"pod {request.pod.namespace}/{request.pod.name}: not here")
        mark = api.KeyValue(key="MARK", value=f"{request.pod.name}/{request.container.name}")
        return api.CreateContainerResponse(adjust=api.ContainerAdjustment(env=[mark]))

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        self.calls.append("UpdateContainer")
        return api.UpdateContainerResponse()

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        self.calls.append("StopContainer")
        if self.stop_answer is not None:
            raise self.stop_answer
        return api.StopContainerResponse()

    async def validate_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        self.calls.append("ValidateContainerAdjustment")
        return api.ValidateContainerAdjustmentResponse()

    async def state_change(self, event: api.StateChangeEvent) -> None:
        self.calls.append(api.Event.Name(event.event))

    async def shutdown(self) -> None:
        self.calls.append("Shutdown")


def env_of(cri: Cri, container_id: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in cri.output(container_id, "env").splitlines() if "=" in line)


def reported_version(containerd: Containerd) -> str:
    """What the runtime calls its version: the Debian version's upstream part (1.7.24~ds1 -> 1.7.24)."""
    return containerd.runtime.package_version().split("~")[0].split("+")[0]


def test_registers_and_synchronizes_what_exists(containerd: Containerd, nri_socket: Path, containerd_cri: Cri) -> None:
    pod = pod_config("before")
    pod_id = containerd_cri.run_pod(pod)
    ctr_id = containerd_cri.create_container(pod_id, container_config("c", pod), pod)
    rec = Marking()
    with plugin_thread(rec, nri_socket) as plugin:
        plugin.wait_synchronized()
        (configured,) = rec.configured
        assert configured.runtime_name == "containerd"
        assert configured.runtime_version.startswith(reported_version(containerd)), configured.runtime_version
        ((pods, containers),) = rec.synced
        assert pod_id in pods and ctr_id in containers
        assert plugin.plugin.runtime.startswith("containerd ")
    assert ctr_id not in {c.id for c in rec.created}  # created before the plugin came: never shown to it


def test_an_adjustment_reaches_the_container(nri_socket: Path, containerd_cri: Cri) -> None:
    rec = Marking()
    with plugin_thread(rec, nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("adjusted", namespace="team-a")
        with containerd_cri.pod(pod) as pod_id:
            config = container_config("main", pod, envs={"FROM_CRI": "1"})
            with containerd_cri.container(pod_id, config, pod) as ctr_id:
                env = env_of(containerd_cri, ctr_id)
    assert env["MARK"] == "adjusted/main" and env["FROM_CRI"] == "1"
    (seen,) = rec.created
    assert (seen.pod.name, seen.pod.namespace, seen.pod.id, seen.container.name) == (
        "adjusted",
        "team-a",
        pod_id,
        "main",
    )
    assert "FROM_CRI=1" in seen.container.env


def test_a_refusal_fails_that_create_only(nri_socket: Path, containerd_cri: Cri) -> None:
    rec = Marking()
    with plugin_thread(rec, nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("half")
        with containerd_cri.pod(pod) as pod_id:
            with pytest.raises(CriError, match="pod default/half: not here"):
                containerd_cri.create_container(pod_id, container_config(REFUSED, pod), pod)
            with containerd_cri.container(pod_id, container_config("fine", pod), pod) as ctr_id:
                assert env_of(containerd_cri, ctr_id)["MARK"] == "half/fine"
        assert plugin.plugin.connections == 1  # the refusal did not cost the connection


class Long(Marking):
    """Marking, with MARK 5 KiB long and a 5 KiB refusal message: both over the 4 KiB the runtime
    reads of a logical connection at a time."""

    LONG = 5120

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        if request.container.name == REFUSED:
            raise RpcError(Code.INVALID_ARGUMENT, f"pod {request.pod.name}: " + "r" * self.LONG)
        answer = await super().create_container(request)
        answer.adjust.env[0].value += "m" * self.LONG
        return answer


def test_a_long_adjustment_and_a_long_refusal_keep_the_plugin(
    containerd: Containerd, nri_socket: Path, containerd_cri: Cri
) -> None:
    closing = containerd.log_path.read_text(errors="replace").count("closing plugin")
    with plugin_thread(Long(), nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("long")
        with containerd_cri.pod(pod) as pod_id:
            with pytest.raises(CriError, match=f"pod long: r{{{Long.LONG}}}"):
                containerd_cri.create_container(pod_id, container_config(REFUSED, pod), pod)
            with containerd_cri.container(pod_id, container_config("main", pod), pod) as ctr_id:
                assert env_of(containerd_cri, ctr_id)["MARK"] == "long/main" + "m" * Long.LONG
        assert plugin.plugin.connections == 1
    assert containerd.log_path.read_text(errors="replace").count("closing plugin") == closing


class Halving(Marking):
    """Answers UpdateContainer with an update of that container: half the CPU shares asked for."""

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        await super().update_container(request)
        update = api.ContainerUpdate(container_id=request.container.id)
        update.linux.resources.cpu.shares.value = request.linux_resources.cpu.shares.value // 2
        return api.UpdateContainerResponse(update=[update])


def test_an_update_answered_at_update_container_is_what_the_runtime_applies(
    nri_socket: Path, containerd_cri: Cri
) -> None:
    from crihook.proto import runtime_v1_pb2 as cri

    with plugin_thread(Halving(event_mask(api.CREATE_CONTAINER, api.UPDATE_CONTAINER)), nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("update")
        with containerd_cri.pod(pod) as pod_id, containerd_cri.container(pod_id, container_config("c", pod), pod) as c:
            asked = cri.UpdateContainerResourcesRequest(container_id=c)
            asked.linux.cpu_shares = 1024
            containerd_cri._call(containerd_cri.runtime, "UpdateContainerResources", asked)
            status = containerd_cri.container_status(c).status
            assert status.resources.linux.cpu_shares == 512
        assert plugin.plugin.connections == 1


def test_every_event_is_answered_and_an_error_answer_does_not_break_the_runtime(
    nri_socket: Path, containerd_cri: Cri
) -> None:
    rec = Marking(ALL_EVENTS)
    rec.stop_answer = RpcError(Code.UNIMPLEMENTED, "not served")
    with plugin_thread(rec, nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("lifecycle")
        with containerd_cri.pod(pod) as pod_id, containerd_cri.container(pod_id, container_config("c", pod), pod):
            pass  # created, started, stopped (StopContainer answered Unimplemented), removed
        wait_for(lambda: "REMOVE_POD_SANDBOX" in rec.calls, what="RemovePodSandbox reached the plugin")
        assert plugin.plugin.connections == 1
    for event in ("RUN_POD_SANDBOX", "CreateContainer", "POST_CREATE_CONTAINER", "START_CONTAINER"):
        assert event in rec.calls, rec.calls
    for event in ("POST_START_CONTAINER", "StopContainer", "REMOVE_CONTAINER", "STOP_POD_SANDBOX"):
        assert event in rec.calls, rec.calls
    assert rec.calls.index("CreateContainer") < rec.calls.index("START_CONTAINER") < rec.calls.index("StopContainer")


def test_a_killed_plugin_restarted_reconnects_and_learns_what_it_missed(nri_socket: Path, containerd_cri: Cri) -> None:
    pod = pod_config("gap")
    with containerd_cri.pod(pod) as pod_id:
        first = Marking()
        with plugin_thread(first, nri_socket) as plugin:
            plugin.wait_synchronized()
            plugin.kill()
        # no plugin: containerd creates the container unadjusted (the outage gap)
        with containerd_cri.container(pod_id, container_config("missed", pod), pod) as missed:
            assert "MARK" not in env_of(containerd_cri, missed)
            second = Marking()
            with plugin_thread(second, nri_socket) as plugin:
                plugin.wait_synchronized()
                ((pods, containers),) = second.synced
                assert pod_id in pods and missed in containers
                with containerd_cri.container(pod_id, container_config("after", pod), pod) as after:
                    assert env_of(containerd_cri, after)["MARK"] == "gap/after"


def test_a_containerd_restart_makes_the_plugin_reconnect(
    containerd: Containerd, nri_socket: Path, containerd_cri: Cri
) -> None:
    rec = Marking()
    with plugin_thread(rec, nri_socket) as plugin:
        plugin.wait_synchronized()
        containerd.restart()
        plugin.wait_synchronized(2)
        assert plugin.plugin.connections == 2 and len(rec.configured) == 2
        pod = pod_config("restarted")
        with containerd_cri.pod(pod) as pod_id, containerd_cri.container(pod_id, container_config("c", pod), pod) as c:
            assert env_of(containerd_cri, c)["MARK"] == "restarted/c"


def test_update_containers_reaches_the_runtime_and_its_evictions_are_ignored(
    nri_socket: Path, containerd_cri: Cri
) -> None:
    """NRI's runtime side (pkg/adaptation, v0.6.1 to v0.12) passes UpdateContainers' updates on and
    never reads its evictions: the container keeps running. crihook can not rely on evict."""
    with plugin_thread(Marking(), nri_socket) as plugin:
        plugin.wait_synchronized()
        pod = pod_config("evict")
        with containerd_cri.pod(pod) as pod_id, containerd_cri.container(pod_id, container_config("c", pod), pod) as c:
            failed = plugin.run(
                plugin.plugin.update_containers(evict=[api.ContainerEviction(container_id=c, reason="test")])
            )
            assert failed == []
            assert containerd_cri.container_status(c).status.state == 1  # CONTAINER_RUNNING
            assert plugin.plugin.connections == 1


# -- the command ------------------------------------------------------------------------------------


def crihook_nri(*args: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "crihook.cli", "nri", "--config", os.devnull, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def connected_lines(containerd: Containerd, plugin: str) -> int:
    """How often the runtime has logged this plugin as connected (1.7: "connected", 2.x: "connected
    and synchronized")."""
    log = containerd.log_path.read_text(errors="replace")
    return sum(f'plugin \\"{plugin}\\" connected' in line for line in log.splitlines())


def test_the_command_registers_and_comes_back_after_a_kill(
    containerd: Containerd, nri_socket: Path, tmp_path: Path
) -> None:
    log = tmp_path / "nri.log"
    before = connected_lines(containerd, "07-crihook")
    proc = crihook_nri("--nri-socket", str(nri_socket), "--plugin-index", "07", log=log)
    try:
        wait_for(lambda: connected_lines(containerd, "07-crihook") == before + 1, what="crihook nri connected")
        proc.send_signal(signal.SIGKILL)
        proc.wait(15)
        proc = crihook_nri("--nri-socket", str(nri_socket), "--plugin-index", "07", log=log)
        wait_for(lambda: connected_lines(containerd, "07-crihook") == before + 2, what="crihook nri connected again")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "registered with the runtime" in log.read_text()


def test_the_command_as_a_pre_registered_plugin(containerd: Containerd, tmp_path: Path) -> None:
    """containerd starts `NN-name` from its plugin dir at its own start, with the socket on fd 3, and
    configures it; 2.x then synchronizes it, 1.7 (NRI v0.6.1, which synchronizes only plugins that
    dial in) never does. The plugin exits when containerd stops. The runtime gives it 5 s to register,
    imports included, and on 1.7 a plugin that misses them takes containerd's CRI service down with
    it: CRI must answer once it is registered."""
    log = tmp_path / "nri.log"
    script = containerd.nri_plugin_dir / "05-crihook"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -m crihook.cli nri --config /dev/null 2>>{log}\n")
    script.chmod(0o755)
    try:
        containerd.restart()
        wait_for(lambda: "configured by the runtime" in (log.read_text() if log.exists() else ""), what="configured")
        runtime_log = containerd.log_path.read_text(errors="replace")
        assert 'registered as \\"05-crihook\\"' in runtime_log and "registration timed out" not in runtime_log
        assert 'socket="fd 3"' in log.read_text()
        with Cri(containerd.address) as cri:
            assert cri.version().runtime_name == "containerd"
        if containerd.runtime.name == "2":
            wait_for(lambda: "synchronized with the runtime" in log.read_text(), what="synchronized")
    finally:
        script.unlink()
        containerd.restart()  # the plugin sees its socket close and exits
    wait_for(lambda: "connection to the runtime lost" in log.read_text(), what="the pre-registered plugin's exit")
