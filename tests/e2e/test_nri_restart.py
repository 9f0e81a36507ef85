"""NRI mode across outages, on containerd 1.7.24 (NRI on) and 2.x: containers made while crihook was
away are found at its next Synchronize and evicted when they reach a GPU nobody granted (or only
reported); crihook killed mid-burst, or containerd killed mid-burst, and the store afterwards holds
exactly the runtime's pods and containers, none lost, none twice."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from crihook.base.config import Config, ProxyConfig
from crihook.cli.doctor.finding import Level
from crihook.cli.doctor.nri import check_evictions
from crihook.node.store import Store
from tests.e2e import test_gpu_containerd as proxy_mode
from tests.e2e import test_gpu_nri
from tests.e2e.test_gpu_containerd import GpuNode, allocated, env_of, leaky, privileged, privileged_pod, spec_of
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, DeviceSpec, container_config, pod_config
from tests.support.daemon import Crihook
from tests.support.hookserver import short_dir, write_config

pytestmark = [pytest.mark.containerd, pytest.mark.runtimes("1.7", "2")]
cri = proxy_mode.cri  # the proxy tests' client fixture, here on this module's gpu_node
BURST = 12  # pods created while one side is killed
WAIT = 30.0  # seconds a state change may take before the test gives up (not a speed target)
SYNC_ATTEMPTS = 5  # tries of one call that containerd failed after its restart
SYNC_BACKOFF = 0.5  # seconds before the second try, doubled for each further one
T = TypeVar("T")

gpu_node = test_gpu_nri.gpu_node  # the fixture: one simulated GPU node in NRI mode, as there


def until(what: str, check: Callable[[], bool], plugin: Crihook, detail: Callable[[], str] = str) -> None:
    """Wait for `check`; past WAIT, fail with `detail()` (what differs) and crihook's log tail."""
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {WAIT}s: {detail()}\n{plugin.log_tail()}")
        time.sleep(0.1)


def running(cri: Cri, cid: str) -> bool:
    return cri.container_status(cid).status.state == 1  # CONTAINER_RUNNING


def answers(cri: Cri) -> bool:
    try:
        cri.version()
    except CriError:
        return False
    return True


def with_config(plugin: Crihook, extra: str) -> None:
    base = plugin.config_text.split("\n[nri]")[0]
    plugin.write_config(base + extra)


@pytest.mark.parametrize("action", ["evict", "report"])
def test_containers_made_while_crihook_was_away(gpu_node: GpuNode, cri: Cri, action: str) -> None:
    plugin, node = gpu_node.proxy, gpu_node.node
    with_config(plugin, f'\n[nri]\nsynchronize = "{action}"\n')
    plugin.stop()
    web = pod_config("web")  # no allocation: the image's NVIDIA_VISIBLE_DEVICES=all reaches every GPU
    granted = pod_config("granted", annotations=allocated({"minor": 2}))
    try:
        with cri.pod(web) as web_id, cri.pod(granted) as granted_id:
            greedy = container_config("cuda", web, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
            plain = container_config("plain", web)
            own = container_config(
                "cuda",
                granted,
                envs={"NVIDIA_VISIBLE_DEVICES": node.uuid(2)},
                devices=[DeviceSpec("/dev/nvidia2", str(node.dev_root / "nvidia2"), "rw")],
            )
            # minor 2 is NVML index 0 (GPUs are listed in NVML order): the same GPU, named by index
            by_index = container_config("indexed", granted, envs={"NVIDIA_VISIBLE_DEVICES": "0"})
            with (
                cri.container(web_id, greedy, web) as bad,
                cri.container(web_id, plain, web) as ok1,
                cri.container(granted_id, own, granted) as ok2,
                cri.container(granted_id, by_index, granted) as ok3,
            ):
                assert env_of(cri, bad)["NVIDIA_VISIBLE_DEVICES"] == "all"  # the outage gap
                seen = len(plugin.log_text())

                def log() -> str:
                    return plugin.log_text()[seen:]

                plugin.start()
                until("the finding", lambda: "container reaches an ungranted GPU" in log(), plugin)
                assert "NVIDIA_VISIBLE_DEVICES=all" in log()
                if action == "evict":
                    until("the eviction", lambda: not running(cri, bad), plugin)
                    until("the eviction's log line", lambda: "container evicted" in log(), plugin)
                else:
                    assert running(cri, bad) and "container evicted" not in log()
                until("the check", lambda: "containers checked" in log(), plugin)
                assert running(cri, ok1) and running(cri, ok2) and running(cri, ok3)
                assert log().count("container reaches an ungranted GPU") == 1
    finally:
        if plugin.pid is None:
            plugin.start()
        with_config(plugin, "")


@pytest.mark.parametrize("action", ["evict", "report"])
def test_a_container_created_while_away_and_not_started_is_not_started(
    gpu_node: GpuNode, cri: Cri, action: str
) -> None:
    """kubelet's CreateContainer went through while crihook was away and its StartContainer comes
    after the reconnection: stopping a created container does nothing, so with evict on its start is
    refused with the finding's reason; report only lets it start."""
    plugin = gpu_node.proxy
    with_config(plugin, f'\n[nri]\nsynchronize = "{action}"\n')
    plugin.stop()
    web = pod_config("web")
    try:
        with cri.pod(web) as web_id:
            greedy = container_config("cuda", web, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
            cid = cri.create_container(web_id, greedy, web)
            seen = len(plugin.log_text())
            plugin.start()
            until("the finding", lambda: "container reaches an ungranted GPU" in plugin.log_text()[seen:], plugin)
            if action == "evict":
                with pytest.raises(CriError) as err:
                    cri.start_container(cid)
                assert "NRI container start failed" in err.value.details
                assert "container cuda of pod default/web reaches GPU minor 0 (by NVIDIA_VISIBLE_DEVICES=all)" in (
                    err.value.details
                )
                assert not running(cri, cid)
            else:
                cri.start_container(cid)
                assert running(cri, cid)
    finally:
        if plugin.pid is None:
            plugin.start()
        with_config(plugin, "")


def test_privileged_containers_survive_synchronize(gpu_node: GpuNode, cri: Cri) -> None:
    """Privileged containers, one created through crihook and one while it was away, both bringing a
    GPU node nobody granted: a reconnection with evict on passes them over (their privilege gives them
    every device in either mode) and evicts the unprivileged container that brings the same node."""
    plugin, dev = gpu_node.proxy, gpu_node.node.dev_root
    with_config(plugin, '\n[nri]\nsynchronize = "evict"\n')
    agents, plain = privileged_pod("agents"), pod_config("plain")
    try:
        with (
            cri.pod(agents) as agents_id,
            cri.pod(plain) as plain_id,
            cri.container(agents_id, privileged("through", agents, dev), agents) as through,
        ):
            plugin.stop()
            with (
                cri.container(agents_id, privileged("away", agents, dev), agents) as away,
                cri.container(plain_id, leaky("cuda", plain, dev), plain) as bad,
            ):
                seen = len(plugin.log_text())

                def log() -> str:
                    return plugin.log_text()[seen:]

                plugin.start()
                until("the eviction", lambda: not running(cri, bad), plugin)
                until("the eviction's log line", lambda: "container evicted" in log(), plugin)
                assert running(cri, through) and running(cri, away)
                findings = [line for line in log().splitlines() if "reaches an ungranted GPU" in line]
                assert len(findings) == 1 and "pod=default/plain" in findings[0]
                noted = [line for line in log().splitlines() if "privileged container" in line]
                assert len(noted) == 2 and all("pod=default/agents" in line for line in noted)
                assert env_of(cri, through)["NVIDIA_VISIBLE_DEVICES"] == "void"
                assert env_of(cri, away)["NVIDIA_VISIBLE_DEVICES"] == "all"  # made while crihook was away
    finally:
        if plugin.pid is None:
            plugin.start()
        with_config(plugin, "")


def test_a_hook_server_down_at_reconnection_stops_no_gpu_pod(gpu_node: GpuNode, cri: Cri) -> None:
    """crihook comes back while the hook server it must ask (failure policy Fail) is down: that
    decides nothing about GPUs, so the containers running with the GPUs they were granted, and the
    ones reaching none, keep running; only one reaching a GPU nobody granted is evicted."""
    plugin = gpu_node.proxy
    granted = pod_config("granted", annotations=allocated({"minor": 2}))
    web, greedy_pod = pod_config("web"), pod_config("greedy")
    confdir = short_dir()
    try:
        with (
            cri.pod(granted) as granted_id,
            cri.pod(web) as web_id,
            cri.pod(greedy_pod) as greedy_id,
            cri.container(granted_id, container_config("cuda", granted), granted) as trainer,
            cri.container(web_id, container_config("app", web), web) as app,
        ):
            plugin.stop()
            greedy = container_config("cuda", greedy_pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
            with cri.container(greedy_id, greedy, greedy_pod) as bad:
                write_config(confdir, "koordlet.json", str(confdir / "down.sock"), "Fail", ["PreCreateContainerHook"])
                with_config(plugin, f'\n[hooks.remote]\nconfig_dir = "{confdir}"\n[nri]\nsynchronize = "evict"\n')
                seen = len(plugin.log_text())

                def log() -> str:
                    return plugin.log_text()[seen:]

                plugin.start()
                until("the check", lambda: "containers checked" in log(), plugin)
                until("the eviction", lambda: not running(cri, bad), plugin)
                until("the eviction's log line", lambda: "container evicted" in log(), plugin)
                assert running(cri, trainer) and running(cri, app)
                assert log().count("container evicted") == 1 and "pod=default/greedy" in log()
    finally:
        if plugin.pid is None:
            plugin.start()
        with_config(plugin, "")
        shutil.rmtree(confdir, ignore_errors=True)


def test_an_eviction_that_fails_is_retried_and_shown_until_it_is_done(gpu_node: GpuNode, cri: Cri) -> None:
    """The runtime's CRI socket is not there when crihook comes back: the eviction fails, is shown
    by `crihook doctor`, and is tried again with back-off, not at the next reconnection; once the
    socket is there the container is stopped and the doctor's finding goes."""
    plugin = gpu_node.proxy
    real = plugin.backend
    link = short_dir() / "cri.sock"
    doctor = Config(proxy=ProxyConfig(state_dir=str(plugin.state_dir)))
    with_config(plugin, '\n[nri]\nsynchronize = "evict"\n')
    plugin.stop()
    web = pod_config("web")
    greedy = container_config("cuda", web, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    try:
        with cri.pod(web) as web_id, cri.container(web_id, greedy, web) as bad:
            plugin.backend = f"unix://{link}"
            seen = len(plugin.log_text())

            def log() -> str:
                return plugin.log_text()[seen:]

            plugin.start()
            until("a failed eviction", lambda: "eviction failed; trying again" in log(), plugin)
            finding = check_evictions(doctor)
            assert finding.level is Level.FAIL and "container cuda of pod default/web" in finding.found
            assert running(cri, bad)
            link.symlink_to(real.removeprefix("unix://"))
            until("the eviction", lambda: not running(cri, bad), plugin)
            until("the eviction's log line", lambda: "container evicted" in log(), plugin)
            assert check_evictions(doctor).level is Level.OK
            assert log().count("registered with the runtime") == 1  # no reconnection needed
    finally:
        plugin.stop()
        plugin.backend = real
        with_config(plugin, "")
        plugin.start()
        shutil.rmtree(link.parent, ignore_errors=True)


def store_ids(plugin: Crihook) -> tuple[set[str], set[str]]:
    store = Store(plugin.state_dir)
    store.load()
    return set(store.pods), set(store.containers)


def runtime_ids(cri: Cri) -> tuple[set[str], set[str]]:
    return {p.id for p in cri.list_pods()}, {c.id for c in cri.list_containers()}


def store_matches(plugin: Crihook, cri: Cri) -> None:
    """Wait until the store holds exactly the runtime's pods and containers; the failure names each side's extras."""

    def differences() -> str:
        (pods, containers), (rpods, rcontainers) = store_ids(plugin), runtime_ids(cri)
        return (
            f"pods only in the store {sorted(pods - rpods)}, only in the runtime {sorted(rpods - pods)}; "
            f"containers only in the store {sorted(containers - rcontainers)}, "
            f"only in the runtime {sorted(rcontainers - containers)}"
        )

    until("the store to match the runtime", lambda: store_ids(plugin) == runtime_ids(cri), plugin, differences)


def burst(cri: Cri, errors: list[str], made: list[str]) -> None:
    """BURST pods of one GPU-less container each, as kubelet would make them, errors kept."""
    for i in range(BURST):
        pod = pod_config(f"burst-{i}")
        try:
            pod_id = cri.run_pod(pod)
            made.append(pod_id)
            cid = cri.create_container(
                pod_id, container_config("app", pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"}), pod
            )
            cri.start_container(cid)
        except CriError as e:
            errors.append(e.details)


def synced(cri: Cri, call: Callable[[], T], made: list[str]) -> T:
    """`call`'s result, retried as kubelet retries a failed pod sync: its pod worker requeues the pod
    after a jittered backoff (pkg/kubelet/pod_workers.go, completeWork), and the node goes on meanwhile.
    A containerd SIGKILLed between its overlayfs snapshotter's rename of a new snapshot directory and
    the commit of that snapshot's record leaves the directory behind; the record's ID is handed out
    again, so every later snapshot fails ("failed to rename ... file exists") until containerd's
    snapshot garbage collection removes directories it has no record of, which it does only after a
    snapshot removal. So between tries one burst pod is deleted, as its deletion would reach a node
    that kept running. Refusals by crihook (an NRI failure) are never retried: they fail the test."""
    for attempt in range(SYNC_ATTEMPTS - 1):
        try:
            return call()
        except CriError as e:
            if "NRI" in e.details or not made:
                raise
        doomed = made.pop(0)
        cri.stop_pod(doomed)
        cri.remove_pod(doomed)
        time.sleep(SYNC_BACKOFF * 2**attempt)
    return call()


@pytest.mark.parametrize("side", ["crihook", "containerd"])
def test_killed_mid_burst_the_store_matches_the_runtime(
    gpu_node: GpuNode, containerd: Containerd, cri: Cri, side: str
) -> None:
    plugin = gpu_node.proxy
    errors: list[str] = []
    made: list[str] = []
    worker = threading.Thread(target=burst, args=(cri, errors, made))
    worker.start()
    until("a few pods", lambda: len(made) >= 3, plugin)
    registered = plugin.log_text().count("registered with the runtime")
    if side == "crihook":
        plugin.stop(kill=True)
        plugin.start()
    else:
        containerd.restart(kill=True)
        until(
            "crihook's new registration",
            lambda: plugin.log_text().count("registered with the runtime") > registered,
            plugin,
        )
    worker.join(WAIT)
    assert not worker.is_alive()
    until("CRI to answer again", lambda: answers(cri), plugin)  # the client's channel backs off too
    # every container that runs now either went through crihook (void) or was evicted at its return
    for c in cri.list_containers():
        if c.state == 1:
            until(
                f"container {c.id[:13]} voided or evicted",
                # the spec, not an exec: crihook may stop the container between the listing and a look
                lambda c=c: (
                    "NVIDIA_VISIBLE_DEVICES=void" in spec_of(cri, c.id)["process"]["env"] or not running(cri, c.id)
                ),
                plugin,
            )
    store_matches(plugin, cri)
    # one more pod through the restarted side, as kubelet makes it after a runtime restart: a failed
    # sync retried with backoff, pods deleted meanwhile; then the store is the runtime's, exactly
    pod = pod_config("after")
    pod_id = synced(cri, lambda: cri.run_pod(pod), made)
    cid = synced(cri, lambda: cri.create_container(pod_id, container_config("app", pod), pod), made)
    synced(cri, lambda: cri.start_container(cid), made)
    store_matches(plugin, cri)
    assert pod_id in store_ids(plugin)[0] and cid in store_ids(plugin)[1]
    cri.stop_pod(pod_id)
    cri.remove_pod(pod_id)
    store_matches(plugin, cri)
    # calls failed only for the outage itself, never because crihook refused
    assert not [e for e in errors if "NRI adjustment" in e], errors
