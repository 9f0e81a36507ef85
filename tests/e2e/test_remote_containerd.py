"""Koordinator-protocol hook servers behind the real `crihook serve`, in front of a real containerd:
what a server changes reaches the running container, its failure policy decides on errors and
timeouts, its config file is picked up, changed and dropped while crihook runs, several servers
merge in file-name order, and in-process hooks come after them."""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.hooks.remote_protocol import SKIP_LABEL
from crihook.proto import runtime_v1_pb2 as api
from tests.support.containerd import Containerd
from tests.support.cri import POD_UID, Cri, CriError, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook
from tests.support.hookserver import (
    HookServer,
    ServerThread,
    server_thread,
    short_dir,
    wait_for,
    write_config,
    write_raw,
)

pytestmark = pytest.mark.containerd

CREATE = "PreCreateContainerHook"
RUN = "PreRunPodSandboxHook"
CALL_TIMEOUT_MS = 500
RELOAD_INTERVAL_MS = 100

# Stands in for the gpu hook (priority 200) for pods that ask for it: sets the variable the device
# hooks own, and records what the hook servers before it had set.
DEVICE_HOOK = textwrap.dedent(
    """
    from crihook.hooks.base import Edit, Stage

    class Device:
        name = "testdevice"
        stages = frozenset({Stage.PRE_CREATE_CONTAINER})
        priority = 200

        def handle(self, ctx):
            if "crihook.test/device" not in ctx.pod.annotations:
                return None
            saw = ctx.container.env("FROM_SERVER") or "nothing"
            return Edit(env={"NVIDIA_VISIBLE_DEVICES": "GPU-test", "DEVICE_HOOK_SAW": saw})

    def factory(options, node):
        return Device()
    """
)


@pytest.fixture(scope="module")
def confdir() -> Iterator[Path]:
    d = short_dir("crihook-hsd-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(containerd: Containerd, confdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crihook]:
    work = tmp_path_factory.mktemp("remote")
    env = install_hook_package(work / "site", "testdevice", DEVICE_HOOK)
    config = (
        '[hooks]\ndisabled = ["gpu", "rdma"]  # the node hooks need GPUs and NICs; a stand-in takes their place\n'
        "[hooks.remote]\n"
        f'config_dir = "{confdir}"\n'
        f"call_timeout_ms = {CALL_TIMEOUT_MS}\n"
        "budget_ms = 1500\n"
        f"reload_interval_ms = {RELOAD_INTERVAL_MS}\n"
    )
    with running_crihook(containerd.address, work / "crihook", config, env) as proxy:
        yield proxy


@pytest.fixture
def servers(confdir: Path) -> Iterator[ServerThread]:
    """Hook servers for one test; the config directory starts empty, and crihook knows it."""
    with server_thread() as thread:
        yield thread
        for f in confdir.glob("*.json"):
            f.unlink()
        settle()


@pytest.fixture
def cri(daemon: Crihook) -> Iterator[Cri]:
    with Cri(daemon.address) as client:
        yield client
        client.remove_all()


def configure(confdir: Path, name: str, server: HookServer | str, policy: str, hooks: list[str]) -> None:
    """Write one server's file and wait until crihook's refresher has re-read the directory."""
    endpoint = server.endpoint if isinstance(server, HookServer) else server
    write_config(confdir, name, endpoint, policy, hooks)
    settle()


def settle() -> None:
    time.sleep(RELOAD_INTERVAL_MS / 1000 * 2)


def env_of(cri: Cri, cid: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in cri.output(cid, "env").splitlines() if "=" in line)


def runtime_spec(cri: Cri, cid: str) -> dict[str, Any]:
    info = json.loads(cri.container_status(cid, verbose=True).info["info"])
    return info["runtimeSpec"]


def test_server_edits_reach_the_pod_and_the_running_container(servers: ServerThread, confdir: Path, cri: Cri) -> None:
    s = servers.start(confdir / "k.sock")

    def pod_change(answer: Any) -> None:
        answer.labels["koordinator.test/qos"] = "LS"
        answer.annotations["koordinator.test/seen"] = "yes"

    def container_change(answer: Any) -> None:
        answer.container_envs.update({"FROM_SERVER": "1", "B": "20"})
        answer.container_annotations["koordinator.test/container"] = "yes"
        answer.container_resources.memory_limit_in_bytes = 256 << 20
        answer.container_resources.cpu_quota = 50000

    s.on(RUN, change=pod_change)
    s.on(CREATE, change=container_change)
    configure(confdir, "koordlet.json", s, "Fail", [
        "PreRunPodSandbox", "PreCreateContainer", "PreStartContainer", "PostStartContainer", "PostStopContainer",
        "PostStopPodSandbox", "PreUpdateContainerResources",
    ])  # fmt: skip

    pod = pod_config("remote", namespace="ml", labels={"app": "train"}, annotations={"team": "vision"}, attempt=1)
    pod_id = cri.run_pod(pod)
    status = cri.pod_status(pod_id).status
    assert status.labels["koordinator.test/qos"] == "LS" and status.labels["app"] == "train"
    assert status.annotations["koordinator.test/seen"] == "yes" and status.annotations["team"] == "vision"

    cfg = container_config("main", pod, envs={"A": "1", "B": "2"}, annotations={"c": "3"}, attempt=2)
    cid = cri.create_container(pod_id, cfg, pod)
    cri.start_container(cid)
    env = env_of(cri, cid)
    assert (env["A"], env["B"], env["FROM_SERVER"]) == ("1", "20", "1")
    assert env["PATH"]  # the image's variables are still there
    assert cri.container_status(cid).status.annotations["koordinator.test/container"] == "yes"
    resources = runtime_spec(cri, cid)["linux"]["resources"]
    assert resources["memory"]["limit"] == 256 << 20 and resources["cpu"]["quota"] == 50000

    # what the servers were told
    (run,) = s.requests(RUN)
    meta = run.pod_meta
    assert (meta.name, meta.namespace, meta.uid, meta.attempt) == ("remote", "ml", pod.metadata.uid, 1)
    assert run.labels["app"] == "train" and run.labels[POD_UID] == pod.metadata.uid
    assert dict(run.annotations) == {"team": "vision"}
    assert run.cgroup_parent == pod.linux.cgroup_parent
    (create,) = s.requests(CREATE)
    assert (create.container_meta.name, create.container_meta.attempt) == ("main", 2)
    assert create.pod_meta.uid == pod.metadata.uid and create.pod_meta.attempt == 1
    # the pod as the hooks left it at RunPodSandbox (kubelet's copy of the sandbox config lacks the server's edits)
    assert create.pod_labels["app"] == "train" and create.pod_annotations["team"] == "vision"
    assert create.pod_labels["koordinator.test/qos"] == "LS"
    assert create.pod_annotations["koordinator.test/seen"] == "yes"
    assert create.pod_cgroup_parent == pod.linux.cgroup_parent
    assert dict(create.container_envs) == {"A": "1", "B": "2"}
    assert create.container_annotations["c"] == "3"
    (start,) = s.requests("PreStartContainerHook")
    assert start.container_meta.id == cid and start.container_meta.name == "main"
    # later stages are told what the container was created with, the servers' edits included
    assert dict(start.container_envs) == {"A": "1", "B": "20", "FROM_SERVER": "1"}
    assert start.container_resources.memory_limit_in_bytes == 256 << 20
    assert start.container_resources.cpu_quota == 50000
    wait_for(lambda: s.requests("PostStartContainerHook"), what="PostStartContainerHook")

    # UpdateContainerResources: the server's value joins kubelet's
    s.on("PreUpdateContainerResourcesHook", change=lambda a: setattr(a.container_resources, "cpu_quota", 30000))
    update = api.UpdateContainerResourcesRequest(
        container_id=cid, linux=api.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=256 << 20)
    )
    cri._call(cri.runtime, "UpdateContainerResources", update)
    (upd,) = s.requests("PreUpdateContainerResourcesHook")
    assert upd.container_meta.id == cid and upd.container_resources.cpu_shares == 512
    resources = runtime_spec(cri, cid)["linux"]["resources"]
    assert resources["cpu"]["quota"] == 30000 and resources["cpu"]["shares"] == 512

    cri.stop_container(cid)
    (stopped,) = wait_for(lambda: s.requests("PostStopContainerHook"), what="PostStopContainerHook")
    assert stopped.container_meta.id == cid
    # the resources the update set, the server's quota included
    assert (stopped.container_resources.cpu_shares, stopped.container_resources.cpu_quota) == (512, 30000)
    cri.stop_pod(pod_id)
    (pod_stopped,) = wait_for(lambda: s.requests("PostStopPodSandboxHook"), what="PostStopPodSandboxHook")
    assert pod_stopped.pod_meta.uid == pod.metadata.uid
    cri.remove_pod(pod_id)


@pytest.mark.parametrize("failure", ["error", "timeout"])
def test_fail_refuses_and_ignore_goes_on(servers: ServerThread, confdir: Path, cri: Cri, failure: str) -> None:
    s = servers.start(confdir / "f.sock")
    if failure == "error":
        s.on(CREATE, error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "no cpuset left"))
    else:
        s.on(CREATE, delay=CALL_TIMEOUT_MS / 1000 * 3)
    pod = pod_config(f"policy-{failure}")
    pod_id = cri.run_pod(pod)

    configure(confdir, "f.json", s, "Ignore", ["PreCreateContainer"])
    cid = cri.create_container(pod_id, container_config("ignored", pod, envs={"A": "1"}), pod)
    cri.start_container(cid)
    assert env_of(cri, cid)["A"] == "1"
    assert len(s.requests(CREATE)) == 1

    configure(confdir, "f.json", s, "Fail", ["PreCreateContainer"])
    with pytest.raises(CriError) as err:
        cri.create_container(pod_id, container_config("refused", pod), pod)
    if failure == "error":
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no cpuset left" in err.value.details
    else:
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"no answer within {CALL_TIMEOUT_MS} ms" in err.value.details
    assert "f.json" in err.value.details and f"default/policy-{failure}" in err.value.details
    assert [c.metadata.name for c in cri.list_containers(pod_id)] == ["ignored"]  # nothing reached containerd


def test_config_added_changed_and_removed_while_serving(servers: ServerThread, confdir: Path, cri: Cri) -> None:
    first, second = servers.start(confdir / "one.sock"), servers.start(confdir / "two.sock")
    first.on(CREATE, change=lambda a: a.container_envs.update({"FROM_SERVER": "one"}))
    second.on(CREATE, change=lambda a: a.container_envs.update({"FROM_SERVER": "two"}))
    pod = pod_config("reload")
    pod_id = cri.run_pod(pod)

    def started(name: str) -> dict[str, str]:
        cid = cri.create_container(pod_id, container_config(name, pod), pod)
        cri.start_container(cid)
        return env_of(cri, cid)

    assert "FROM_SERVER" not in started("none")  # no file yet
    configure(confdir, "hooks.json", first, "Fail", ["PreCreateContainer"])  # added
    assert started("added")["FROM_SERVER"] == "one"
    configure(confdir, "hooks.json", second, "Fail", ["PreCreateContainer"])  # changed: another endpoint
    assert started("changed")["FROM_SERVER"] == "two"
    configure(confdir, "hooks.json", second, "Fail", ["PreStartContainer"])  # changed: other stages
    assert "FROM_SERVER" not in started("other-stage")
    write_raw(confdir, "hooks.json", b'{"remote-endpoint": ')  # broken: reported and skipped
    settle()
    assert "FROM_SERVER" not in started("broken")
    configure(confdir, "hooks.json", first, "Fail", ["PreCreateContainer"])  # fixed
    assert started("fixed")["FROM_SERVER"] == "one"
    (confdir / "hooks.json").unlink()  # removed
    settle()
    assert "FROM_SERVER" not in started("removed")
    assert (len(first.requests(CREATE)), len(second.requests(CREATE))) == (2, 1)


def test_two_servers_merge_in_file_name_order_then_in_process_hooks(
    servers: ServerThread, confdir: Path, cri: Cri
) -> None:
    first, second = servers.start(confdir / "a.sock"), servers.start(confdir / "b.sock")
    first.on(CREATE, change=lambda a: a.container_envs.update({"X": "first", "Y": "first", "FROM_SERVER": "1"}))
    second.on(CREATE, change=lambda a: a.container_envs.update({"Y": "second", "NVIDIA_VISIBLE_DEVICES": "all"}))
    write_config(confdir, "20-second.json", second.endpoint, "Fail", ["PreCreateContainer"])
    configure(confdir, "10-first.json", first, "Fail", ["PreCreateContainer"])
    pod = pod_config("merged", annotations={"crihook.test/device": "1"})
    pod_id = cri.run_pod(pod)
    cid = cri.create_container(pod_id, container_config("main", pod, envs={"KEEP": "me"}), pod)
    cri.start_container(cid)
    env = env_of(cri, cid)
    assert (env["X"], env["Y"], env["KEEP"]) == ("first", "second", "me")
    (seen,) = second.requests(CREATE)
    assert seen.container_envs["X"] == "first"  # the second server was told what the first did
    # the in-process device hook ran after both servers, saw their work and has the last word
    assert env["DEVICE_HOOK_SAW"] == "1" and env["NVIDIA_VISIBLE_DEVICES"] == "GPU-test"


def test_skip_label_bypasses_hook_servers(servers: ServerThread, confdir: Path, cri: Cri) -> None:
    s = servers.start(confdir / "s.sock")
    for rpc in (RUN, CREATE, "PreStartContainerHook"):
        s.on(rpc, error=(grpc.StatusCode.UNAVAILABLE, "hook server is being upgraded"))
    configure(confdir, "s.json", s, "Fail", ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer"])
    pod = pod_config("koordlet", namespace="koordinator-system", labels={SKIP_LABEL: "true"})
    pod_id = cri.run_pod(pod)
    cid = cri.create_container(pod_id, container_config("main", pod), pod)
    cri.start_container(cid)
    assert s.calls == []
    with pytest.raises(CriError) as err:
        cri.run_pod(pod_config("other"))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "being upgraded" in err.value.details


UPDATE = "PreUpdateContainerResourcesHook"
ENVS = {"A": "1", "B": "2", "C": "3", "D": "4", "E": "5"}


def resources_of(message: Any) -> tuple[Any, ...]:
    r = message.container_resources
    return (r.cpu_period, r.cpu_quota, r.cpu_shares, r.memory_limit_in_bytes, r.oom_score_adj, r.cpuset_cpus,
            r.cpuset_mems)  # fmt: skip


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_update_stage_is_told_the_stored_container_and_the_merged_resources(
    servers: ServerThread, confdir: Path, cri: Cri
) -> None:
    """kubelet's CPU manager updates only the cpuset; the server is told what the container was
    created with and its resources with the update merged in, as containerd merges it, and so is
    PostStopContainer after a full update."""
    s = servers.start(confdir / "u.sock")
    configure(confdir, "u.json", s, "Fail", ["PreCreateContainer", "PreUpdateContainerResources", "PostStopContainer"])
    pod = pod_config("update", annotations={"team": "vision"})
    pod_id = cri.run_pod(pod)
    cfg = container_config("main", pod, envs=ENVS, annotations={"c": "3"})
    cfg.linux.resources.cpu_shares = 256
    cfg.linux.resources.memory_limit_in_bytes = 128 << 20
    cfg.linux.resources.oom_score_adj = 500
    cid = cri.create_container(pod_id, cfg, pod)
    cri.start_container(cid)

    cpuset = api.UpdateContainerResourcesRequest(container_id=cid, linux=api.LinuxContainerResources(cpuset_cpus="0"))
    cri._call(cri.runtime, "UpdateContainerResources", cpuset)
    (told,) = s.requests(UPDATE)
    assert dict(told.container_envs) == ENVS and told.container_annotations["c"] == "3"
    assert told.pod_annotations["team"] == "vision" and told.pod_cgroup_parent == pod.linux.cgroup_parent
    assert resources_of(told) == (0, 0, 256, 128 << 20, 500, "0", "")
    spec = runtime_spec(cri, cid)["linux"]["resources"]  # what containerd made of it: the same merge
    assert (spec["cpu"]["shares"], spec["cpu"]["cpus"], spec["memory"]["limit"]) == (256, "0", 128 << 20)

    full = api.LinuxContainerResources(cpu_period=100000, cpu_quota=50000, cpu_shares=512,
                                       memory_limit_in_bytes=256 << 20, cpuset_cpus="0", cpuset_mems="0")  # fmt: skip
    request = api.UpdateContainerResourcesRequest(container_id=cid, linux=full)
    cri._call(cri.runtime, "UpdateContainerResources", request)
    told = s.requests(UPDATE)[1]
    assert resources_of(told) == (100000, 50000, 512, 256 << 20, 500, "0", "0")
    assert dict(told.container_envs) == ENVS

    cri.stop_container(cid)
    (stopped,) = wait_for(lambda: s.requests("PostStopContainerHook"), what="PostStopContainerHook")
    assert resources_of(stopped) == (100000, 50000, 512, 256 << 20, 500, "0", "0")
    assert dict(stopped.container_envs) == ENVS and stopped.container_annotations["c"] == "3"
    assert stopped.pod_cgroup_parent == pod.linux.cgroup_parent


@pytest.fixture
def uncapped(containerd: Containerd, confdir: Path, tmp_path: Path) -> Iterator[Crihook]:
    """crihook with the remote hook's defaults: no caps, the CRI call's own deadline."""
    config = f'[hooks]\ndisabled = ["gpu", "rdma"]\n[hooks.remote]\nconfig_dir = "{confdir}"\n'
    config += f"reload_interval_ms = {RELOAD_INTERVAL_MS}\n"
    with running_crihook(containerd.address, tmp_path / "crihook", config) as proxy:
        yield proxy


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_a_slow_server_under_fail_has_the_call_deadline(
    servers: ServerThread, confdir: Path, uncapped: Crihook
) -> None:
    """A koordlet answering in 3 s under Fail: kubelet's call waits (its deadline is 20 s for
    RunPodSandbox and 10 s for CreateContainer here), and the pod starts with the server's changes."""
    s = servers.start(confdir / "slow.sock")
    s.on(RUN, delay=3, change=lambda a: a.labels.update({"koordinator.test/qos": "LS"}))
    s.on(CREATE, delay=3, change=lambda a: a.container_envs.update({"FROM_SERVER": "slow"}))
    configure(confdir, "slow.json", s, "Fail", ["PreRunPodSandbox", "PreCreateContainer"])
    with Cri(uncapped.address, timeout=10) as client:
        try:
            pod = pod_config("slow")
            pod_id = client._call(client.runtime, "RunPodSandbox", api.RunPodSandboxRequest(config=pod), timeout=20)
            pod_id = pod_id.pod_sandbox_id
            assert client.pod_status(pod_id).status.labels["koordinator.test/qos"] == "LS"
            cid = client.create_container(pod_id, container_config("main", pod), pod)
            client.start_container(cid)
            assert env_of(client, cid)["FROM_SERVER"] == "slow"
        finally:
            client.remove_all()


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_pod_cgroup_parent_survives_a_crihook_restart(servers: ServerThread, confdir: Path, uncapped: Crihook) -> None:
    """PreStartContainer after a restart is told the pod's cgroup parent: from the store kept
    across the restart, and from the runtime's sandbox status when the store is gone."""
    s = servers.start(confdir / "r.sock")
    configure(confdir, "r.json", s, "Fail", ["PreStartContainer"])
    with Cri(uncapped.address) as client:
        try:
            pod = pod_config("restart")
            pod_id = client.run_pod(pod)
            first = client.create_container(pod_id, container_config("first", pod), pod)
            second = client.create_container(pod_id, container_config("second", pod), pod)
            uncapped.restart(kill=True)
            client.start_container(first)
            uncapped.stop()
            (uncapped.state_dir / "store.json").unlink()
            uncapped.start()
            client.start_container(second)
            told = s.requests("PreStartContainerHook")
            assert [t.container_meta.name for t in told] == ["first", "second"]
            assert [t.pod_cgroup_parent for t in told] == [pod.linux.cgroup_parent] * 2
            assert told[1].pod_meta.uid == pod.metadata.uid
        finally:
            client.remove_all()


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_a_container_crihook_did_not_see_created_keeps_its_envs_and_resources(
    servers: ServerThread, confdir: Path, uncapped: Crihook
) -> None:
    """A container the store does not know (its file lost, or created while crihook was away) is
    adopted with the envs it was created with and its resources as they are now (after an update),
    from the runtime's verbose status: a hook server is told them as for any other container."""
    s = servers.start(confdir / "a.sock")
    configure(confdir, "a.json", s, "Fail", ["PreStartContainer"])
    with Cri(uncapped.address) as client:
        try:
            pod = pod_config("adopted")
            pod_id = client.run_pod(pod)
            config = container_config("main", pod, envs={"GREETING": "hello", "EMPTY": ""})
            config.linux.resources.cpu_shares = 512
            config.linux.resources.memory_limit_in_bytes = 64 << 20
            cid = client.create_container(pod_id, config, pod)
            update = api.LinuxContainerResources(cpu_shares=1024, memory_limit_in_bytes=128 << 20)
            client.runtime.UpdateContainerResources(api.UpdateContainerResourcesRequest(container_id=cid, linux=update))
            uncapped.stop()
            (uncapped.state_dir / "store.json").unlink()
            uncapped.start()
            client.start_container(cid)
            (told,) = s.requests("PreStartContainerHook")
            assert told.container_meta.name == "main"
            assert told.container_envs["GREETING"] == "hello" and told.container_envs["EMPTY"] == ""
            assert told.container_resources.cpu_shares == 1024
            assert told.container_resources.memory_limit_in_bytes == 128 << 20
        finally:
            client.remove_all()
