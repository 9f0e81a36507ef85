"""crihook serve in front of a real containerd: kubelet's calls pass unharmed, lifecycle calls run hooks,
errors arrive unchanged, and the daemon's start, stop and reload behave as systemd and kubelet expect."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from crihook.base.metrics import ORPHAN_TASKS
from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import runtime_v1_pb2_grpc as api_grpc
from crihook.proxy.orphans import TaskJanitor
from tests.support.containerd import BUSYBOX_IMAGE, Containerd, cut_by_deadline
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.daemon import Crihook, CrihookError, install_hook_package, running_crihook

pytestmark = pytest.mark.containerd

# A hook as a plugin package would ship it: it stamps containers, refuses one pod, and records
# every stage it saw (so a test can tell post hooks ran) in a file named by its option.
TEST_HOOK = textwrap.dedent(
    """
    import json
    from dataclasses import dataclass

    import grpc
    from crihook.base.config import NodeConfig
    from crihook.hooks.base import Edit, HookError, Stage

    @dataclass(frozen=True)
    class StampOptions:
        value: str = "from-hook"
        seen_file: str = ""

    class Stamp:
        name = "stamp"
        stages = frozenset(Stage)
        priority = 50

        def __init__(self, options: StampOptions) -> None:
            self.value = options.value
            self.seen = options.seen_file

        def handle(self, ctx):
            if self.seen:
                with open(self.seen, "a") as f:
                    f.write(json.dumps([str(ctx.stage), ctx.pod.name]) + "\\n")
            if ctx.pod.name == "refused":
                raise HookError(grpc.StatusCode.FAILED_PRECONDITION, "this pod may not start here")
            if ctx.stage is Stage.PRE_CREATE_CONTAINER:
                return Edit(env={"CRIHOOK_STAMP": self.value}, annotations={"crihook.test/stamped": "yes"})
            return None

    def factory(options: StampOptions, node: NodeConfig) -> Stamp:
        return Stamp(options)
    """
)


@pytest.fixture
def hooked(containerd: Containerd, tmp_path: Path) -> Crihook:
    env = install_hook_package(tmp_path / "site", "stamp", TEST_HOOK)
    seen = tmp_path / "seen.jsonl"
    config = f'[hooks.stamp]\nvalue = "v1"\nseen_file = "{seen}"\n'
    with running_crihook(containerd.address, tmp_path / "crihook", config, env) as proxy:
        yield proxy


@pytest.fixture
def hooked_cri(hooked: Crihook) -> Cri:
    with Cri(hooked.address) as client:
        yield client
        client.remove_all()


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_pass_through_calls_answer_as_containerd_does(proxy_cri: Cri, containerd_cri: Cri) -> None:
    assert proxy_cri.version() == containerd_cri.version()
    status = proxy_cri._call(proxy_cri.runtime, "Status", api.StatusRequest(verbose=True))
    assert {c.type for c in status.status.conditions} >= {"RuntimeReady"}
    images = proxy_cri._call(proxy_cri.images, "ListImages", api.ListImagesRequest()).images
    direct = containerd_cri._call(containerd_cri.images, "ListImages", api.ListImagesRequest()).images
    assert sorted(i.id for i in images) == sorted(i.id for i in direct)
    assert proxy_cri.image_present(BUSYBOX_IMAGE)
    assert not proxy_cri.image_present("localhost/crihook/absent:none")


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_full_pod_lifecycle_through_crihook(proxy_cri: Cri, containerd_cri: Cri) -> None:
    pod = pod_config("web", annotations={"a": "1"})
    with proxy_cri.pod(pod) as pod_id:
        cfg = container_config("main", pod, envs={"GREETING": "hello"})
        with proxy_cri.container(pod_id, cfg, pod) as cid:
            assert "GREETING=hello" in proxy_cri.output(cid, "env")
            status = proxy_cri.container_status(cid, verbose=True)
            assert status.status.state == api.CONTAINER_RUNNING
            assert "pid" in status.info.get("info", "")
            assert [c.id for c in proxy_cri.list_containers(pod_id)] == [cid]
            # the runtime itself sees the same container
            assert [c.id for c in containerd_cri.list_containers(pod_id)] == [cid]
            assert proxy_cri.pod_status(pod_id).status.state == api.SANDBOX_READY
    assert proxy_cri.list_pods() == []


def test_errors_arrive_unchanged(proxy_cri: Cri, containerd_cri: Cri) -> None:
    with pytest.raises(CriError) as through:
        proxy_cri.container_status("no-such-container")
    with pytest.raises(CriError) as direct:
        containerd_cri.container_status("no-such-container")
    assert through.value.code == direct.value.code == grpc.StatusCode.NOT_FOUND
    assert through.value.details == direct.value.details


# What each release answers for an id it does not know (measured on 1.6.20, 1.7.24, 2.1.9). The CRI
# API asks Stop*/Remove* to be idempotent; 1.6 still answers NOT_FOUND to both Stop calls, 1.7 and 2.x
# succeed. Status calls are NOT_FOUND everywhere. kubelet copes with both (it treats NotFound from a
# Stop as done); crihook must pass each answer through as it came.
UNKNOWN_ID_CALLS = (
    ("StopContainer", api.StopContainerRequest(container_id="no-such-id")),
    ("RemoveContainer", api.RemoveContainerRequest(container_id="no-such-id")),
    ("ContainerStatus", api.ContainerStatusRequest(container_id="no-such-id")),
    ("StopPodSandbox", api.StopPodSandboxRequest(pod_sandbox_id="no-such-id")),
    ("RemovePodSandbox", api.RemovePodSandboxRequest(pod_sandbox_id="no-such-id")),
    ("PodSandboxStatus", api.PodSandboxStatusRequest(pod_sandbox_id="no-such-id")),
)
UNKNOWN_ID_ANSWERS = {
    "1.6": {"StopContainer": "NOT_FOUND", "StopPodSandbox": "NOT_FOUND"},
    "1.7": {},
    "2": {},
}


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_unknown_ids_answer_as_each_release_does(proxy_cri: Cri, containerd_cri: Cri, containerd: Containerd) -> None:
    def answer(client: Cri, method: str, request: object) -> str:
        try:
            client._call(client.runtime, method, request)
        except CriError as e:
            return e.code.name
        return "OK"

    status_calls = {"ContainerStatus", "PodSandboxStatus"}
    want = {
        method: "NOT_FOUND" if method in status_calls else UNKNOWN_ID_ANSWERS[containerd.runtime.name].get(method, "OK")
        for method, _ in UNKNOWN_ID_CALLS
    }
    assert {m: answer(containerd_cri, m, r) for m, r in UNKNOWN_ID_CALLS} == want
    assert {m: answer(proxy_cri, m, r) for m, r in UNKNOWN_ID_CALLS} == want


def _retry_like_kubelet(call: Callable[[], None], patience: float = 10.0) -> None:
    """Repeat a removal until it succeeds, as kubelet's pod worker does."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except CriError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _orphan(cri: Cri, containerd: Containerd, name: str, failed_start: bool) -> tuple[str, str]:
    """(pod id, container id) of a container whose task runs while CRI holds it as not running.
    The task is started behind CRI's back; with `failed_start` a CRI StartContainer then fails on
    it, which leaves CRI's record as containerd 1.6 leaves a StartContainer cancelled mid-way:
    exited, reason StartError. Without, CRI still holds the container as created."""
    pod = pod_config(name)
    pod_id = cri.run_pod(pod)
    container_id = cri.create_container(pod_id, container_config("main", pod), pod)
    containerd.ctr("tasks", "start", "--detach", container_id)
    if failed_start:
        with pytest.raises(CriError, match="already exists"):
            cri.start_container(container_id)
    status = cri.container_status(container_id).status
    assert (status.state, status.reason) == (
        (api.CONTAINER_EXITED, "StartError") if failed_start else (api.CONTAINER_CREATED, "")
    )
    assert container_id in containerd.ctr("tasks", "list")
    return pod_id, container_id


def test_a_task_cri_lost_track_of_is_cleared_so_the_pod_can_go(
    crihook_proxy: Crihook, proxy_cri: Cri, containerd: Containerd
) -> None:
    """containerd refuses every removal of a container whose task CRI lost track of. Through
    crihook the first removal is refused as containerd refuses it, crihook kills the live task and
    deletes it, and the retry succeeds: for RemoveContainer, and for RemovePodSandbox on the state
    the load test left (exited after a failed start)."""
    pod_id, container_id = _orphan(proxy_cri, containerd, "orphan-created", failed_start=False)
    with pytest.raises(CriError, match="cannot delete running task"):
        proxy_cri.remove_container(container_id)
    _retry_like_kubelet(lambda: proxy_cri.remove_container(container_id))
    assert container_id not in containerd.ctr("tasks", "list")
    _logged(crihook_proxy, f'msg="orphan task cleared" container={container_id}')
    proxy_cri.stop_pod(pod_id)
    proxy_cri.remove_pod(pod_id)
    pod_id, container_id = _orphan(proxy_cri, containerd, "orphan-exited", failed_start=True)
    proxy_cri.stop_pod(pod_id)
    with pytest.raises(CriError, match="cannot delete running task"):
        proxy_cri.remove_pod(pod_id)
    _retry_like_kubelet(lambda: proxy_cri.remove_pod(pod_id))
    assert proxy_cri.list_pods() == []
    _logged(crihook_proxy, f'msg="orphan task cleared" container={container_id}')


def _logged(daemon: Crihook, line: str) -> None:
    """crihook logs a clearing once containerd's Delete answered, which may be after kubelet's retry
    already went through: wait for the line a little."""
    deadline = time.monotonic() + 5
    while line not in daemon.log_text():
        assert time.monotonic() < deadline, f"never logged: {line}"
        time.sleep(0.05)


def _clear(containerd: Containerd, container_id: str) -> bool:
    janitor = TaskJanitor(str(containerd.socket), "k8s.io")

    async def clear() -> bool:
        try:
            return await janitor.clear(container_id)
        finally:
            await janitor.close()

    return asyncio.run(clear())


@pytest.mark.parametrize("failed_start", [False, True], ids=["created", "exited"])
def test_the_janitor_clears_a_live_orphan_task_and_counts_it(
    containerd: Containerd, containerd_cri: Cri, failed_start: bool
) -> None:
    _, container_id = _orphan(containerd_cri, containerd, "orphan-direct", failed_start)
    cleared = ORPHAN_TASKS.value("cleared")
    assert _clear(containerd, container_id) is True
    assert ORPHAN_TASKS.value("cleared") == cleared + 1
    assert container_id not in containerd.ctr("tasks", "list")
    containerd_cri.remove_container(container_id)  # CRI alone can remove it now


def test_the_task_of_a_started_container_is_never_cleared(containerd: Containerd, proxy_cri: Cri) -> None:
    pod = pod_config("started")
    with proxy_cri.pod(pod) as pod_id, proxy_cri.container(pod_id, container_config("main", pod), pod) as cid:
        counted = ORPHAN_TASKS.value("cleared") + ORPHAN_TASKS.value("failed")
        assert _clear(containerd, cid) is False
        assert ORPHAN_TASKS.value("cleared") + ORPHAN_TASKS.value("failed") == counted
        assert proxy_cri.container_status(cid).status.state == api.CONTAINER_RUNNING
        assert proxy_cri.output(cid, "echo", "alive") == "alive\n"


def test_unknown_method_is_forwarded(crihook_proxy: Crihook, containerd: Containerd) -> None:
    """A method this build has never heard of reaches the runtime, which answers for itself."""
    results = []
    for address in (crihook_proxy.address, containerd.address):
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary("/runtime.v1.RuntimeService/FutureMethod")(b"\x0a\x01x", timeout=5)
            results.append((err.value.code(), err.value.details()))
    assert results[0] == results[1]
    assert results[0][0] == grpc.StatusCode.UNIMPLEMENTED


def test_deadline_passes_through(crihook_proxy: Crihook) -> None:
    """ExecSync running past the caller's deadline fails DEADLINE_EXCEEDED at the caller's deadline."""
    with Cri(crihook_proxy.address) as client:
        pod = pod_config("slow")
        with client.pod(pod) as pod_id, client.container(pod_id, container_config("main", pod), pod) as cid:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                request = api.ExecSyncRequest(container_id=cid, cmd=["sleep", "5"], timeout=10)
                client.runtime.ExecSync(request, timeout=1)
            # containerd 1.6 may answer first, when its own copy of the deadline ends the exec:
            # UNKNOWN "... context deadline exceeded", the deadline all the same
            e = err.value
            assert cut_by_deadline(e) or (
                e.code() == grpc.StatusCode.UNKNOWN and "context deadline exceeded" in (e.details() or "")
            )
            assert time.monotonic() - started < 3
        client.remove_all()


def _events(address: str, seconds: float) -> tuple[grpc.StatusCode, list[api.ContainerEventResponse]]:
    """Read GetContainerEvents for `seconds` while a pod comes and goes; the stream's end status."""
    events: list[api.ContainerEventResponse] = []
    code = grpc.StatusCode.OK
    with Cri(address) as client:
        stream = client.runtime.GetContainerEvents(api.GetEventsRequest(), timeout=seconds)
        pod = pod_config("events")
        with client.pod(pod) as pod_id, client.container(pod_id, container_config("main", pod), pod):
            pass
        try:
            # Only this pod's container: a previous test's containers can still be going away, and
            # 1.7+ also reports the sandbox's own container, whose first event can come before the
            # stream is subscribed (a race that the proxy's extra hop makes visible).
            events.extend(e for e in stream if e.pod_sandbox_status.id == pod_id and e.container_id != pod_id)
        except grpc.RpcError as e:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if cut_by_deadline(e) else e.code()
        client.remove_all()
    return code, events


@pytest.mark.runtimes("1.6", "1.7", "2")
def test_container_events_stream_like_direct(crihook_proxy: Crihook, containerd: Containerd) -> None:
    """The server-streaming call ends the same way through crihook as direct: containerd 1.6 answers
    UNIMPLEMENTED, 1.7+ streams events until the deadline (streaming data itself: test_relay.py)."""
    direct_code, direct_events = _events(containerd.address, 3)
    code, events = _events(crihook_proxy.address, 3)
    assert code == direct_code
    assert [e.container_event_type for e in events] == [e.container_event_type for e in direct_events]
    if direct_code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert {api.CONTAINER_CREATED_EVENT, api.CONTAINER_STARTED_EVENT} <= {e.container_event_type for e in events}


def test_hook_edit_reaches_the_running_container(hooked: Crihook, hooked_cri: Cri, tmp_path: Path) -> None:
    pod = pod_config("stamped")
    with hooked_cri.pod(pod) as pod_id:
        cfg = container_config("main", pod, envs={"KEEP": "me"})
        with hooked_cri.container(pod_id, cfg, pod) as cid:
            env = hooked_cri.output(cid, "env").split()
            assert "CRIHOOK_STAMP=v1" in env and "KEEP=me" in env
            assert hooked_cri.container_status(cid).status.annotations["crihook.test/stamped"] == "yes"
    seen = (tmp_path / "seen.jsonl").read_text()
    for stage in (
        "PreRunPodSandbox",
        "PreCreateContainer",
        "PreStartContainer",
        "PostStartContainer",
        "PostStopContainer",
        "PostStopPodSandbox",
    ):
        assert f'["{stage}", "stamped"]' in seen, stage


def test_failing_hook_refuses_only_that_pod(hooked: Crihook, hooked_cri: Cri, containerd_cri: Cri) -> None:
    with pytest.raises(CriError) as err:
        hooked_cri.run_pod(pod_config("refused"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "stamp" in err.value.details and "this pod may not start here" in err.value.details
    assert "default/refused" in err.value.details
    assert containerd_cri.list_pods() == []  # nothing reached containerd
    pod = pod_config("fine")
    with hooked_cri.pod(pod) as pod_id, hooked_cri.container(pod_id, container_config("main", pod), pod) as cid:
        assert "CRIHOOK_STAMP=v1" in hooked_cri.output(cid, "env")


def test_sighup_reloads_hook_options(hooked: Crihook, hooked_cri: Cri) -> None:
    text = hooked.config_path.read_text().replace('value = "v1"', 'value = "v2"')
    hooked.config_path.write_text(text)
    hooked.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "configuration reloaded" not in hooked.log_text():
        assert time.monotonic() < deadline, hooked.log_tail()
        time.sleep(0.05)
    pod = pod_config("reloaded")
    with hooked_cri.pod(pod) as pod_id, hooked_cri.container(pod_id, container_config("main", pod), pod) as cid:
        assert "CRIHOOK_STAMP=v2" in hooked_cri.output(cid, "env")


def test_socket_is_private_and_store_survives_restart(crihook_proxy: Crihook, proxy_cri: Cri) -> None:
    st = crihook_proxy.socket_path.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    pod = pod_config("kept")
    pod_id = proxy_cri.run_pod(pod)
    cid = proxy_cri.create_container(pod_id, container_config("main", pod), pod)
    crihook_proxy.restart(kill=True)  # a crash: the store is rebuilt from containerd before serving
    out = subprocess.run(
        [sys.executable, "-m", "crihook.cli", "inspect", "--state-dir", str(crihook_proxy.state_dir), "default/kept"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert cid[:13] in out.stdout


def test_sigterm_drains_and_exits_zero(crihook_proxy: Crihook) -> None:
    with grpc.insecure_channel(crihook_proxy.address) as ch:
        stub = api_grpc.RuntimeServiceStub(ch)
        stub.Version(api.VersionRequest(), timeout=5)
    assert crihook_proxy.stop() == 0
    assert not crihook_proxy.socket_path.exists()
    assert "stopped" in crihook_proxy.log_text()


def test_refuses_a_socket_directory_others_can_write(containerd: Containerd, tmp_path: Path) -> None:
    proxy = Crihook(tmp_path, containerd.address)
    proxy.write_config()
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o777)
    with pytest.raises(CrihookError) as err:
        proxy.start(timeout=15)
    assert "writable by others" in str(err.value)
    proxy.stop()


def test_waits_for_a_runtime_that_comes_late(containerd: Containerd, tmp_path: Path) -> None:
    containerd.stop()
    proxy = Crihook(tmp_path, containerd.address)
    proxy.write_config()
    # patient enough for a containerd that takes long to come back on a loaded machine
    text = proxy.config_path.read_text().replace("connect_timeout_seconds = 20.0", "connect_timeout_seconds = 120.0")
    proxy.config_path.write_text(text)
    starter = threading.Thread(target=proxy.start, kwargs={"timeout": 120})
    try:
        starter.start()
        # containerd comes back only once crihook has found it missing: on a loaded machine crihook's
        # own start can take longer than any fixed pause, and then there is nothing to wait for
        deadline = time.monotonic() + 60
        while "waiting for runtime" not in proxy.log_text():
            assert time.monotonic() < deadline, proxy.log_text()
            time.sleep(0.05)
        assert not proxy.socket_path.exists()  # never serves before the runtime answers
        containerd.start()
        starter.join(120)
        assert proxy.socket_path.exists()
        with Cri(proxy.address) as client:
            assert client.version().runtime_name == "containerd"
    finally:
        if containerd.pid is None:
            containerd.start()
        proxy.stop()
