"""The `remote` hook through HookChain, against real grpc hook servers on unix sockets: failure
policies on errors and timeouts, servers merged in file-name order, configuration hot reload, what
reaches the servers and what comes back into the call."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base.config import ConfigError, HooksConfig, NodeConfig
from crihook.base.metrics import HOOK_SERVER_FILES
from crihook.hooks.base import ContainerInfo, Edit, HookContext, LinuxResources, PodInfo, Stage
from crihook.hooks.chain import HookChain, Outcome
from crihook.hooks.registry import build_chain
from crihook.hooks.remote import RemoteHook, RemoteOptions, factory
from crihook.hooks.remote_protocol import SKIP_LABEL
from tests.support.hookserver import HookServer, short_dir, write_config, write_raw

CREATE = "PreCreateContainerHook"
RUN = "PreRunPodSandboxHook"
ALL_STAGES = [s.value for s in RemoteHook.stages]

POD = PodInfo(
    name="train",
    namespace="ml",
    uid="u-1",
    attempt=2,
    id="sb-1",
    labels={"app": "train"},
    annotations={"team": "vision"},
    cgroup_parent="/kubepods/burstable/podu-1",
    runtime_handler="runc",
    resources=LinuxResources(cpu_shares=2048, memory_limit_in_bytes=4 << 30),
    overhead=LinuxResources(cpu_shares=25, memory_limit_in_bytes=64 << 20),
)
CONTAINER = ContainerInfo(
    name="main",
    attempt=1,
    annotations={"io.kubernetes.container.hash": "abc"},
    envs=(("PATH", "/bin"), ("A", "1"), ("B", "2"), ("RAW", "\udcff\udcfe")),
    resources=LinuxResources(cpu_shares=512, cpu_quota=100000, memory_limit_in_bytes=1 << 30,
                             unified={"memory.high": "900000000"}),
)  # fmt: skip


def create_ctx(pod: PodInfo = POD) -> HookContext:
    return HookContext(Stage.PRE_CREATE_CONTAINER, pod, CONTAINER)


def run_ctx(pod: PodInfo = POD) -> HookContext:
    return HookContext(Stage.PRE_RUN_POD_SANDBOX, pod)


@pytest.fixture
def confdir() -> Iterator[Path]:
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def servers(confdir: Path) -> AsyncIterator[Callable[[str], Any]]:
    started: list[HookServer] = []

    async def start(name: str) -> HookServer:
        server = await HookServer(confdir / f"{name}.sock").start()
        started.append(server)
        return server

    yield start
    for s in started:
        await s.stop()


@pytest.fixture
async def chains(confdir: Path) -> AsyncIterator[Callable[..., HookChain]]:
    made: list[HookChain] = []

    def make(*others: Any, **options: Any) -> HookChain:
        # an hour between re-reads: the refresher stays out of the way, a test re-reads with `reread`
        opts = {"config_dir": str(confdir), "call_timeout_ms": 400, "budget_ms": 1000, "reload_interval_ms": 3_600_000}
        opts.update(options)
        opts = {k: v for k, v in opts.items() if v is not None}  # None: leave the option out
        default_timeout_ms = opts.pop("default_timeout_ms", 2000)
        factories: dict[str, Any] = {"remote": factory}
        factories.update({h.name: (lambda options, node, h=h: h) for h in others})
        hooks = HooksConfig(options={"remote": opts}, default_timeout_ms=default_timeout_ms)
        chain = build_chain(hooks, NodeConfig(), factories)
        made.append(chain)
        return chain

    yield make
    for chain in made:
        await remote_of(chain).close()


def remote_of(chain: HookChain) -> RemoteHook:
    (hook,) = (r.hook for r in chain.hooks if isinstance(r.hook, RemoteHook))
    return hook


async def reread(chain: HookChain) -> None:
    """What the refresher does once an interval has passed."""
    await remote_of(chain).reload()


def envs(outcome: Outcome) -> dict[str, str]:
    assert outcome.error is None, outcome.error.reason
    assert outcome.ctx.container is not None
    return dict(outcome.ctx.container.envs)


class DeviceHook:
    """Stands in for the gpu hook: priority 200, sets the variable it owns."""

    name = "gpu"
    priority = 200
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})

    def __init__(self) -> None:
        self.seen: list[HookContext] = []

    async def handle(self, ctx: HookContext) -> Edit:
        self.seen.append(ctx)
        return Edit(env={"NVIDIA_VISIBLE_DEVICES": "GPU-1111"})


# -- what the servers are sent -------------------------------------------------------------------


async def test_requests_carry_everything_the_protocol_has(confdir, servers, chains) -> None:
    s = await servers("a")
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreRunPodSandbox", "PreCreateContainer"])
    chain = chains()
    await chain.run(run_ctx())
    await chain.run(create_ctx())

    (pod_req,) = s.requests(RUN)
    assert (pod_req.pod_meta.name, pod_req.pod_meta.namespace, pod_req.pod_meta.uid) == ("train", "ml", "u-1")
    assert pod_req.pod_meta.attempt == 2
    assert pod_req.runtime_handler == "runc"
    assert dict(pod_req.labels) == {"app": "train"}
    assert dict(pod_req.annotations) == {"team": "vision"}
    assert pod_req.cgroup_parent == "/kubepods/burstable/podu-1"
    assert pod_req.resources.cpu_shares == 2048 and pod_req.resources.memory_limit_in_bytes == 4 << 30
    assert pod_req.overhead.cpu_shares == 25 and pod_req.overhead.memory_limit_in_bytes == 64 << 20

    (req,) = s.requests(CREATE)
    assert req.pod_meta.attempt == 2 and req.pod_meta.uid == "u-1"
    assert (req.container_meta.name, req.container_meta.attempt, req.container_meta.id) == ("main", 1, "")
    assert dict(req.container_annotations) == {"io.kubernetes.container.hash": "abc"}
    assert dict(req.pod_labels) == {"app": "train"} and dict(req.pod_annotations) == {"team": "vision"}
    assert req.pod_cgroup_parent == "/kubepods/burstable/podu-1"
    assert req.pod_resources.cpu_shares == 2048
    r = req.container_resources
    assert (r.cpu_shares, r.cpu_quota, r.memory_limit_in_bytes) == (512, 100000, 1 << 30)
    assert dict(r.unified) == {"memory.high": "900000000"}
    # a value that is not UTF-8 can not travel as a protobuf string: left out, and left alone
    assert dict(req.container_envs) == {"PATH": "/bin", "A": "1", "B": "2"}


# -- merging ---------------------------------------------------------------------------------------


async def test_env_merge_keeps_every_other_variable(confdir, servers, chains) -> None:
    echoing = await servers("echo")
    echoing.on(CREATE, change=lambda a: a.container_envs.update({"B": "20", "C": "3"}))
    partial = await servers("partial")  # answers only what it sets, not the whole map
    partial.on(CREATE, answer=_container_answer(container_envs={"D": "4"}))
    write_config(confdir, "1-echo.json", echoing.endpoint, "Fail", ["PreCreateContainer"])
    write_config(confdir, "2-partial.json", partial.endpoint, "Fail", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert envs(out) == {"PATH": "/bin", "A": "1", "B": "20", "C": "3", "D": "4", "RAW": "\udcff\udcfe"}


async def test_two_servers_run_in_file_name_order_and_merge(confdir, servers, chains) -> None:
    first, second = await servers("first"), await servers("second")
    first.on(CREATE, change=lambda a: a.container_envs.update({"X": "first", "Y": "first"}))
    second.on(CREATE, change=lambda a: a.container_envs.update({"Y": "second"}))
    # "10-" sorts before "20-": the order is the file names', byte by byte
    write_config(confdir, "20-second.json", second.endpoint, "Ignore", ["PreCreateContainer"])
    write_config(confdir, "10-first.json", first.endpoint, "Ignore", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert envs(out)["X"] == "first" and envs(out)["Y"] == "second"
    # the second server was told what the first one did
    (seen,) = second.requests(CREATE)
    assert seen.container_envs["X"] == "first"
    assert [r.hook for r in out.records] == ["remote"] and out.records[0].result == "ok"


async def test_resources_merge_field_by_field_where_set(confdir, servers, chains) -> None:
    a, b = await servers("a"), await servers("b")
    # an answer that sets only cpu_quota and one cgroup v2 file: everything else stays
    a.on(CREATE, answer=_container_answer(container_resources={"cpu_quota": 50000, "unified": {"io.weight": "50"}}))

    def second(answer: Any) -> None:
        answer.container_resources.memory_limit_in_bytes = 2 << 30
        answer.container_resources.cpu_shares = 0  # proto3 "not set": never clears a value

    b.on(CREATE, change=second)
    write_config(confdir, "a.json", a.endpoint, "Fail", ["PreCreateContainer"])
    write_config(confdir, "b.json", b.endpoint, "Fail", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert out.error is None and out.ctx.container is not None
    assert out.ctx.container.resources == LinuxResources(
        cpu_shares=512,
        cpu_quota=50000,
        memory_limit_in_bytes=2 << 30,
        unified={"memory.high": "900000000", "io.weight": "50"},
    )


async def test_pod_labels_annotations_and_cgroup_parent_only_when_set(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(RUN, answer=_pod_answer(labels={"qos": "LS"}, annotations={"team": "vision2"}, cgroup_parent=""))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreRunPodSandbox"])
    chain = chains()
    out = await chain.run(run_ctx())
    assert out.error is None
    assert out.ctx.pod.cgroup_parent == POD.cgroup_parent  # empty answer: unchanged
    assert out.ctx.pod.labels == {"app": "train", "qos": "LS"}
    assert out.ctx.pod.annotations == {"team": "vision2"}

    s.on(RUN, change=lambda a: setattr(a, "cgroup_parent", "/kubepods/ls/podu-1"))
    out = await chain.run(run_ctx())
    assert out.ctx.pod.cgroup_parent == "/kubepods/ls/podu-1"
    assert out.ctx.pod.labels == POD.labels  # the echo left them as they were


async def test_container_stage_cgroup_parent_is_reported_not_applied(confdir, servers, chains, caplog) -> None:
    s = await servers("a")
    s.on(CREATE, change=lambda a: setattr(a, "pod_cgroup_parent", "/elsewhere"))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    with caplog.at_level(logging.WARNING, "crihook.hooks.remote"):
        out = await chains().run(create_ctx())
    assert out.error is None and out.ctx == create_ctx()
    (rec,) = [r for r in caplog.records if "does not make" in r.getMessage()]
    assert rec.fields == "pod_cgroup_parent" and rec.server == "a.json"


async def test_update_resources_applies_resources_not_envs(confdir, servers, chains) -> None:
    s = await servers("a")

    def change(answer: Any) -> None:
        answer.container_resources.cpu_quota = 20000
        answer.container_envs["X"] = "1"

    s.on("PreUpdateContainerResourcesHook", change=change)
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreUpdateContainerResources"])
    ctx = HookContext(Stage.PRE_UPDATE_CONTAINER_RESOURCES, POD, CONTAINER)
    out = await chains().run(ctx)
    assert out.error is None and out.ctx.container is not None
    assert out.ctx.container.resources is not None and out.ctx.container.resources.cpu_quota == 20000
    assert out.ctx.container.envs == CONTAINER.envs


# -- ordering with in-process hooks and the skip label ---------------------------------------------


async def test_device_hooks_run_after_remote_and_have_the_last_word(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(CREATE, change=lambda a: a.container_envs.update({"NVIDIA_VISIBLE_DEVICES": "all", "Q": "1"}))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    gpu = DeviceHook()
    out = await chains(gpu).run(create_ctx())
    assert [r.hook for r in out.records] == ["remote", "gpu"]
    assert gpu.seen[0].container is not None and gpu.seen[0].container.env("Q") == "1"
    assert envs(out)["NVIDIA_VISIBLE_DEVICES"] == "GPU-1111"


async def test_skip_label_skips_servers_but_not_in_process_hooks(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(CREATE, error=(grpc.StatusCode.INTERNAL, "would refuse"))
    write_config(confdir, "a.json", s.endpoint, "Fail", ALL_STAGES)
    gpu = DeviceHook()
    pod = PodInfo(name="koordlet", namespace="koordinator-system", uid="u-2", labels={SKIP_LABEL: "true"})
    out = await chains(gpu).run(create_ctx(pod))
    assert s.calls == []
    assert envs(out)["NVIDIA_VISIBLE_DEVICES"] == "GPU-1111"
    # any other value of the label does not skip
    other = PodInfo(name="p", namespace="d", uid="u-3", labels={SKIP_LABEL: "false"})
    assert (await chains().run(create_ctx(other))).error is not None


# -- failure policies ------------------------------------------------------------------------------


async def test_fail_server_error_refuses_the_call(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(CREATE, error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "no cpuset left"))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert out.error is not None
    assert out.error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = out.error.reason
    assert "hook remote" in reason and "pod ml/train container main" in reason
    assert "a.json" in reason and s.endpoint in reason and "no cpuset left" in reason


async def test_ignore_server_error_is_skipped_and_later_servers_still_apply(confdir, servers, chains, caplog) -> None:
    bad, good = await servers("bad"), await servers("good")
    bad.on(CREATE, error=(grpc.StatusCode.INTERNAL, "boom"))
    good.on(CREATE, change=lambda a: a.container_envs.update({"OK": "1"}))
    write_config(confdir, "1-bad.json", bad.endpoint, "", ["PreCreateContainer"])  # empty means Ignore
    write_config(confdir, "2-good.json", good.endpoint, "Fail", ["PreCreateContainer"])
    with caplog.at_level(logging.WARNING, "crihook.hooks.remote"):
        out = await chains().run(create_ctx())
    assert envs(out)["OK"] == "1"
    (rec,) = [r for r in caplog.records if r.getMessage() == "hook server error ignored"]
    assert rec.server == "1-bad.json" and "boom" in rec.reason and rec.pod == "ml/train"


async def test_timeouts_follow_the_server_policy(confdir, servers, chains) -> None:
    slow, good = await servers("slow"), await servers("good")
    slow.on(CREATE, delay=1.0)
    good.on(CREATE, change=lambda a: a.container_envs.update({"OK": "1"}))
    write_config(confdir, "1-slow.json", slow.endpoint, "Ignore", ["PreCreateContainer"])
    write_config(confdir, "2-good.json", good.endpoint, "Fail", ["PreCreateContainer"])
    chain = chains(call_timeout_ms=100)
    assert envs(await chain.run(create_ctx()))["OK"] == "1"

    write_config(confdir, "1-slow.json", slow.endpoint, "Fail", ["PreCreateContainer"])
    await reread(chain)
    out = await chain.run(create_ctx())
    assert out.error is not None and out.error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no answer within 100 ms" in out.error.reason
    assert good.requests(CREATE)[1:] == []  # refused before the next server was asked


async def test_budget_caps_all_calls_below_the_chain_timeout(confdir, servers, chains) -> None:
    slow = [await servers(f"s{i}") for i in range(3)]
    for s in slow:
        s.on(CREATE, delay=1.0)
    for i, s in enumerate(slow):
        write_config(confdir, f"{i}.json", s.endpoint, "Ignore" if i < 2 else "Fail", ["PreCreateContainer"])
    chain = chains(call_timeout_ms=150, budget_ms=250)
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = await chain.run(create_ctx())
    assert loop.time() - start < 0.6
    assert out.error is not None and "not called" in out.error.reason and "2.json" in out.error.reason
    assert [len(s.calls) for s in slow] == [1, 1, 0]


async def test_servers_get_the_call_deadline_less_the_runtime_margin(confdir, servers, chains) -> None:
    """As koord-runtime-proxy: a slow server has what is left of the CRI call's own deadline, not a
    fixed second; crihook keeps `runtime_margin_ms` of it for the runtime."""
    slow = await servers("slow")
    slow.on(CREATE, delay=0.5, change=lambda a: a.container_envs.update({"SLOW": "done"}))
    write_config(confdir, "slow.json", slow.endpoint, "Fail", ["PreCreateContainer"])
    # no caps, and a chain whose fixed limit (200 ms) the server would overrun
    chain = chains(call_timeout_ms=None, budget_ms=None, runtime_margin_ms=300, default_timeout_ms=200)
    in_time = replace(create_ctx(), deadline=time.monotonic() + 1.5)
    assert envs(await chain.run(in_time))["SLOW"] == "done"
    # 0.7 s left: 0.4 s for the servers, 0.3 s kept for the runtime
    out = await chain.run(replace(create_ctx(), deadline=time.monotonic() + 0.7))
    assert out.error is not None and out.error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "slow.json" in out.error.reason and re.search(r"no answer within (3[5-9]\d|400) ms", out.error.reason)
    # a call without a deadline: the fallbacks (1 s a server) and the chain's own limit
    out = await chain.run(create_ctx())
    assert out.error is not None and "timed out after 200 ms" in out.error.reason
    # call_timeout_ms caps one server call however far the deadline is
    capped = chains(call_timeout_ms=100, budget_ms=None)
    out = await capped.run(replace(create_ctx(), deadline=time.monotonic() + 60))
    assert out.error is not None and "no answer within 100 ms" in out.error.reason
    # timeout_ms set for the hook: the chain's limit is fixed again
    fixed = chains(call_timeout_ms=None, budget_ms=None, timeout_ms=200)
    out = await fixed.run(replace(create_ctx(), deadline=time.monotonic() + 60))
    assert out.error is not None and "timed out after 200 ms" in out.error.reason


async def test_unreachable_server_then_back(confdir, servers, chains) -> None:
    path = confdir / "later.sock"
    write_config(confdir, "a.json", str(path), "Fail", ["PreCreateContainer"])
    chain = chains()
    out = await chain.run(create_ctx())
    assert out.error is not None and out.error.code is grpc.StatusCode.UNAVAILABLE
    s = await servers("later")
    s.on(CREATE, change=lambda a: a.container_envs.update({"BACK": "1"}))
    assert envs(await chain.run(create_ctx()))["BACK"] == "1"


async def test_invalid_env_in_answer_is_a_server_failure(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(CREATE, change=lambda a: a.container_envs.update({"A=B": "x"}))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert out.error is not None and out.error.code is grpc.StatusCode.INTERNAL
    assert "'A=B'" in out.error.reason
    write_config(confdir, "a.json", s.endpoint, "Ignore", ["PreCreateContainer"])
    out = await chains().run(create_ctx())
    assert envs(out) == dict(CONTAINER.envs)


async def test_pre_start_can_refuse_but_not_change(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on("PreStartContainerHook", change=lambda a: a.container_envs.update({"X": "1"}))
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreStartContainer"])
    ctx = HookContext(Stage.PRE_START_CONTAINER, POD, CONTAINER)
    chain = chains()
    out = await chain.run(ctx)
    assert out.error is None and out.ctx == ctx and out.records[0].result == "noop"
    s.on("PreStartContainerHook", error=(grpc.StatusCode.FAILED_PRECONDITION, "not ready"))
    out = await chain.run(ctx)
    assert out.error is not None and out.error.code is grpc.StatusCode.FAILED_PRECONDITION


async def test_post_stages_call_every_server_and_never_fail(confdir, servers, chains) -> None:
    bad, good = await servers("bad"), await servers("good")
    bad.on("PostStopContainerHook", error=(grpc.StatusCode.INTERNAL, "cleanup failed"))
    good.on("PostStopContainerHook", change=lambda a: a.container_envs.update({"X": "1"}))
    write_config(confdir, "1-bad.json", bad.endpoint, "Fail", ["PostStopContainer"])
    write_config(confdir, "2-good.json", good.endpoint, "Fail", ["PostStopContainer"])
    ctx = HookContext(Stage.POST_STOP_CONTAINER, POD, CONTAINER)
    out = await chains().run(ctx)
    assert out.error is None and out.records[0].result == "noop"
    assert len(bad.calls) == len(good.calls) == 1

    pod_ctx = HookContext(Stage.POST_STOP_POD_SANDBOX, POD)
    write_config(confdir, "2-good.json", good.endpoint, "Fail", ["PostStopPodSandbox"])
    await chains().run(pod_ctx)
    (req,) = good.requests("PostStopPodSandboxHook")
    assert req.pod_meta.uid == "u-1"


# -- configuration hot reload ----------------------------------------------------------------------


async def test_config_files_added_changed_and_removed_take_effect(confdir, servers, chains) -> None:
    s = await servers("a")
    s.on(CREATE, error=(grpc.StatusCode.INTERNAL, "refused"))
    chain = chains()
    assert (await chain.run(create_ctx())).error is None and s.calls == []

    write_config(confdir, "a.json", s.endpoint, "Ignore", ["PreCreateContainer"])  # added
    await reread(chain)
    assert (await chain.run(create_ctx())).error is None and len(s.calls) == 1

    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])  # changed
    await reread(chain)
    assert (await chain.run(create_ctx())).error is not None and len(s.calls) == 2

    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreStartContainer"])  # changed stages
    await reread(chain)
    assert (await chain.run(create_ctx())).error is None and len(s.calls) == 2

    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    (confdir / "a.json").unlink()  # removed
    await reread(chain)
    assert (await chain.run(create_ctx())).error is None and len(s.calls) == 2


async def test_calls_never_re_read_the_directory(confdir, servers, chains) -> None:
    s = await servers("a")
    chain = chains()
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    await chain.run(create_ctx())
    assert s.calls == []  # not re-read yet: that is the refresher's, once an interval has passed
    await reread(chain)
    await chain.run(create_ctx())
    assert len(s.calls) == 1


async def test_malformed_file_is_reported_and_skipped(confdir, servers, chains, caplog) -> None:
    s = await servers("good")
    s.on(CREATE, change=lambda a: a.container_envs.update({"OK": "1"}))
    write_config(confdir, "good.json", s.endpoint, "Fail", ["PreCreateContainer"])
    write_raw(confdir, "broken.json", b'{"remote-endpoint": "/run/x.sock",')
    write_config(confdir, "policy.json", "/run/y.sock", "Sometimes", ["PreCreateContainer"])
    write_raw(confdir, "notes.txt", b"not a config")  # only *.json files count
    with caplog.at_level(logging.INFO, "crihook.hooks.remote"):
        chain = chains()
        assert envs(await chain.run(create_ctx()))["OK"] == "1"
        await reread(chain)
        await chain.run(create_ctx())  # re-read: the same broken files are not reported again
    skipped = {r.server: r.error for r in caplog.records if r.getMessage() == "hook server file skipped"}
    assert set(skipped) == {"broken.json", "policy.json"}
    assert "not valid JSON" in skipped["broken.json"] and "'Sometimes'" in skipped["policy.json"]
    # and on the metrics endpoint, for an alert: a skipped file is a server never called
    assert (HOOK_SERVER_FILES.value("in_use"), HOOK_SERVER_FILES.value("skipped")) == (1, 2)

    # a good file that breaks stops being called; fixed, it is called again
    write_raw(confdir, "good.json", b"[]")
    await reread(chain)
    assert "OK" not in envs(await chain.run(create_ctx()))
    assert (HOOK_SERVER_FILES.value("in_use"), HOOK_SERVER_FILES.value("skipped")) == (0, 3)
    write_config(confdir, "good.json", s.endpoint, "Fail", ["PreCreateContainer"])
    await reread(chain)
    assert envs(await chain.run(create_ctx()))["OK"] == "1"


async def test_a_file_replaced_by_a_directory_stops_being_a_server(confdir, servers, chains) -> None:
    s = await servers("a")
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    chain = chains()
    await chain.run(create_ctx())
    (confdir / "a.json").unlink()
    (confdir / "a.json").mkdir()
    await reread(chain)
    await chain.run(create_ctx())
    assert len(s.calls) == 1


async def test_missing_directory_means_no_servers(chains, confdir) -> None:
    chain = chains(config_dir=str(confdir / "absent"), reload_interval_ms=3_600_000)
    # the hook wants no call, so the proxy forwards them undecoded and the chain does not call it
    assert not chain.wants(Stage.PRE_CREATE_CONTAINER)
    out = await chain.run(create_ctx())
    assert out.error is None and out.records == []


async def settled(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait, on the event loop, until `condition()` holds; a bound, not a timing."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not settled in time"
        await asyncio.sleep(0.005)


async def test_the_refresher_applies_changes_within_an_interval(confdir, servers, chains) -> None:
    s = await servers("a")
    chain = chains(reload_interval_ms=20)
    remote = remote_of(chain)
    assert not chain.wants(Stage.PRE_CREATE_CONTAINER)
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    await settled(lambda: chain.wants(Stage.PRE_CREATE_CONTAINER))
    assert (await chain.run(create_ctx())).error is None and len(s.calls) == 1
    assert set(remote._stubs) == {s.endpoint}  # connected
    (confdir / "a.json").unlink()
    await settled(lambda: not remote._stubs)  # the connection to a removed server is let go
    assert not chain.wants(Stage.PRE_CREATE_CONTAINER)


class StalledScan:
    """Stands in for ConfigDir.refresh on a file system that does not answer until `release`."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []
        self.inside = self.most_inside = 0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            self.threads.append(threading.current_thread())
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        self.release.wait(30)
        with self._lock:
            self.inside -= 1
        return False


async def stalled_scan(chains: Callable[..., HookChain]) -> tuple[HookChain, RemoteHook, StalledScan]:
    """A chain whose remote hook re-reads every 10 ms, its first scan now stuck in the file system."""
    chain = chains(reload_interval_ms=10)
    remote = remote_of(chain)
    scan = StalledScan()
    remote.config.refresh = scan  # type: ignore[method-assign]
    await settled(scan.entered.is_set)
    return chain, remote, scan


async def test_a_stalled_scan_holds_no_call_and_no_second_scan(confdir, servers, chains) -> None:
    s = await servers("a")
    write_config(confdir, "a.json", s.endpoint, "Fail", ["PreCreateContainer"])
    chain, remote, scan = await stalled_scan(chains)
    try:
        for _ in range(3):  # calls go on with the servers last read
            assert (await asyncio.wait_for(chain.run(create_ctx()), 5)).error is None
        assert len(s.calls) == 3 and not scan.release.is_set()
        asked = asyncio.create_task(remote.reload())  # a re-read asked for meanwhile waits its turn
        await asyncio.sleep(0.1)  # ten intervals: no second scan starts beside the stalled one
        assert len(scan.threads) == 1 and not asked.done()
    finally:
        scan.release.set()
    await asyncio.wait_for(asked, 5)
    assert len(scan.threads) >= 2 and scan.most_inside == 1


async def test_close_stops_the_refresher_even_mid_scan(confdir, chains) -> None:
    _, remote, scan = await stalled_scan(chains)
    try:
        await asyncio.wait_for(remote.close(), 5)  # not held by the scan
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "crihook-remote-refresher"]
    finally:
        scan.release.set()
    # the scan's thread leaves once the file system answers; no scan starts after close
    await settled(lambda: not scan.threads[0].is_alive())
    assert len(scan.threads) == 1


def test_options_are_checked() -> None:
    def remote(values: dict[str, Any]) -> RemoteHook:
        return factory(HooksConfig(options={"remote": values}).table("remote", RemoteOptions)[1], NodeConfig())

    for values, message in [
        ({"call_timeout_ms": 0}, r"\[hooks.remote\].call_timeout_ms: must be positive, not 0"),
        ({"call_timeout_ms": True}, r"\[hooks.remote\].call_timeout_ms: expected float, got bool True"),
        ({"config-dir": "/x"}, r"\[hooks.remote\].config-dir: unknown key \(known: budget_ms, call_timeout_ms"),
        ({"config_dir": ""}, r"\[hooks.remote\].config_dir: must not be empty"),
        ({"runtime_margin_ms": -1}, r"\[hooks.remote\].runtime_margin_ms: must be 0 or more, not -1"),
        ({"reload_interval_ms": 0}, r"\[hooks.remote\].reload_interval_ms: must be positive"),
    ]:
        with pytest.raises(ConfigError, match=r"^config " + message):
            remote(values)
    hook = remote({"config_dir": "/nonexistent", "budget_ms": 900, "runtime_margin_ms": 0})
    assert hook.runtime_margin == 0.0
    hook = remote({"config_dir": "/nonexistent", "budget_ms": 900})
    # caps only where given; the margin kept for the runtime defaults to 2 s
    assert (hook.name, hook.priority, hook.budget, hook.call_timeout) == ("remote", 100, 0.9, None)
    assert hook.runtime_margin == 2.0
    assert hook.stages == frozenset(Stage) - {Stage.POST_REMOVE_CONTAINER, Stage.POST_REMOVE_POD_SANDBOX}


def _container_answer(**fields: Any) -> Any:
    from crihook.proto import hookservice_v1alpha1_pb2 as pb

    return pb.ContainerResourceHookResponse(**fields)


def _pod_answer(**fields: Any) -> Any:
    from crihook.proto import hookservice_v1alpha1_pb2 as pb

    return pb.PodSandboxHookResponse(**fields)
