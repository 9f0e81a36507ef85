"""Koordinator's remote hook servers behind crihook: the in-process hook `remote` calls every server
configured for the stage (runtime.v1alpha1.RuntimeHookService over a unix socket), one after the
other in file-name order, and merges their answers into one edit.

Each server has its own failure policy, from its file: an error, a timeout or an unusable answer
from a `Fail` server refuses the CRI call; from an `Ignore` server it is logged and the next server
is called. So the chain's own failure policy for this hook only matters for crihook's bugs.

Order among hooks: priority 100 puts remote servers before the gpu (200) and rdma (210) hooks, so our
device hooks see what the servers did and have the last word on what a container gets. The protocol
carries no devices or mounts; the chain checks every host path any hook adds against the allowlist.

Timing, as koord-runtime-proxy gives it: the servers of one CRI call may use what is left of that
call's own deadline (kubelet's grpc-timeout) less `runtime_margin_ms`, kept for the runtime to do
the call itself. `call_timeout_ms` (one server call) and `budget_ms` (all of them) are optional caps
below that. A call that carries no deadline gets fallbacks (1 s a server, 1.5 s in all). Setting
`timeout_ms` for this hook fixes the chain's limit instead of following the deadline: `budget_ms`
must then stay below it, so a slow `Ignore` server is skipped by its own policy, not the chain's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from crihook.base.config import NodeConfig, not_empty, not_negative, positive
from crihook.hooks.base import Edit, HookContext, HookError, Stage
from crihook.hooks.edit import apply_edit
from crihook.hooks.executor import DaemonThreads
from crihook.hooks.remote_config import DEFAULT_DIR, ConfigDir, Policy, ServerConfig
from crihook.hooks.remote_protocol import (
    RPCS,
    InvalidAnswer,
    answer_applies,
    merge,
    read_answer,
    request_for,
    skips_hook_servers,
)
from crihook.proto.hookservice_v1alpha1_pb2_grpc import RuntimeHookServiceStub

log = logging.getLogger("crihook.hooks.remote")

# without a deadline from the CRI call: one server call, and all of them
FALLBACK_CALL_TIMEOUT_MS = 1000
FALLBACK_BUDGET_MS = 1500
# kept from the CRI call's deadline for the runtime (containerd creating the container)
DEFAULT_RUNTIME_MARGIN_MS = 2000
DEFAULT_RELOAD_INTERVAL_MS = 1000
# grpc shares subchannels between channels to one target process-wide, reconnect back-off
# included: a channel of its own per server is what lets a dropped connection start afresh.
_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


class RemoteHook:
    name = "remote"
    priority = 100
    stages = frozenset(RPCS)
    follows_call_deadline = True  # the chain gives it the CRI call's deadline unless timeout_ms is set

    def __init__(
        self,
        config_dir: str = DEFAULT_DIR,
        call_timeout: float | None = None,
        budget: float | None = None,
        reload_interval: float = DEFAULT_RELOAD_INTERVAL_MS / 1000,
        runtime_margin: float = DEFAULT_RUNTIME_MARGIN_MS / 1000,
    ) -> None:
        self.config = ConfigDir(config_dir)
        self.config.refresh()
        self.call_timeout = call_timeout  # None: no cap of its own
        self.budget = budget
        self.runtime_margin = runtime_margin
        self.reload_interval = reload_interval
        self._stubs: dict[str, tuple[grpc.aio.Channel, RuntimeHookServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._reloading = asyncio.Lock()  # one directory scan at a time, whoever asks
        # the scans' thread is a daemon: a file system that never answers must not keep crihook from stopping
        self._scanner = DaemonThreads(1, "crihook-remote-scan")
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False
        self._start_refresher()

    @property
    def servers(self) -> tuple[ServerConfig, ...]:
        """The servers in effect, in calling order."""
        return self.config.servers

    async def reload(self) -> None:
        """Re-read the configuration directory now, off the event loop, and let go of connections
        to servers no longer configured. What the refresher does every `reload_interval`."""
        async with self._reloading:
            changed = await asyncio.get_running_loop().run_in_executor(self._scanner, self.config.refresh)
        if not changed:
            return
        wanted = {s.endpoint for s in self.config.servers}
        for endpoint in set(self._stubs) - wanted:
            self._drop(endpoint)

    def wants(self, stage: Stage) -> bool:
        """Whether a call at `stage` must come here: a server takes the stage. Otherwise the proxy
        forwards the call undecoded."""
        if self._refresher is None:
            self._start_refresher()
        return any(stage in s.stages for s in self.config.servers)

    async def handle(self, ctx: HookContext) -> Edit | None:
        if skips_hook_servers(ctx.pod):
            return None
        servers = [s for s in self.config.servers if ctx.stage in s.stages]
        if not servers:
            return None
        deadline, call_timeout = self._limits(ctx)
        applies = answer_applies(ctx.stage)
        total = Edit()
        view = ctx  # what the next server is told: the call as the servers before it left it
        for server in servers:
            try:
                answer = await self._call(server, view, deadline, call_timeout)
                if not applies:
                    continue
                reading = read_answer(view, answer)
            except (HookError, InvalidAnswer) as e:
                err = _server_error(server, ctx, e)
                if server.policy is Policy.FAIL and not ctx.stage.is_post:
                    raise err from None
                log.warning(
                    "hook server error ignored",
                    extra={**server.describe(), "stage": ctx.stage.value, **ctx.log_fields(), "reason": err.reason},
                )
                continue
            if reading.not_applied:
                log.warning(
                    "hook server asked for changes crihook does not make at this stage",
                    extra={**server.describe(), "stage": ctx.stage.value, **ctx.log_fields(),
                           "fields": ",".join(reading.not_applied)},
                )  # fmt: skip
            if not reading.edit.is_empty():
                view = apply_edit(view, reading.edit)
                merge(total, reading.edit)
        return None if total.is_empty() else total

    async def close(self) -> None:
        """Stop the refresher and close every connection (tests, shutdown, a replaced chain). A scan
        still running is not waited for: its daemon thread leaves when the file system answers."""
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        self._scanner.shutdown(wait=False)
        for endpoint in list(self._stubs):
            self._drop(endpoint)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _start_refresher(self) -> None:
        """Start re-reading the directory in the background, on the running event loop; none yet
        (a hook made outside one), the first call that asks `wants` starts it."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refresher = loop.create_task(self._refresh_every_interval(), name="crihook-remote-refresher")

    async def _refresh_every_interval(self) -> None:
        """A scan `reload_interval` after the last one ended: a file changed is in effect within the
        interval plus a scan's time, and CRI calls never wait for a scan. A scan stuck on the file
        system holds only this task; calls go on with the servers last read."""
        while True:
            await asyncio.sleep(self.reload_interval)
            try:
                await self.reload()
            except Exception:
                log.exception("hook server directory not re-read", extra={"dir": self.config.path})

    def _limits(self, ctx: HookContext) -> tuple[float, float | None]:
        """(when the servers of this call must be done, time.monotonic(); the cap on one server call)."""
        now = time.monotonic()
        if ctx.deadline is None:
            budget = self.budget if self.budget is not None else FALLBACK_BUDGET_MS / 1000
            call = self.call_timeout if self.call_timeout is not None else FALLBACK_CALL_TIMEOUT_MS / 1000
            return now + budget, call
        left = ctx.deadline - now
        # the runtime keeps its margin; a call with less than two margins left splits it in half
        budget = left - self.runtime_margin if left > 2 * self.runtime_margin else left / 2
        if self.budget is not None:
            budget = min(budget, self.budget)
        return now + budget, self.call_timeout

    async def _call(self, server: ServerConfig, ctx: HookContext, deadline: float, cap: float | None) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HookError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "not called: earlier hook servers used up the time this call leaves them",
            )
        timeout = left if cap is None else min(cap, left)
        stub = self._stub(server.endpoint)
        try:
            return await getattr(stub, RPCS[ctx.stage])(request_for(ctx), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code is grpc.StatusCode.UNAVAILABLE:
                # A fresh connection on the next call, not the channel's reconnect back-off, so a
                # restarted server is called again at once.
                self._drop(server.endpoint)
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise HookError(code, f"no answer within {timeout * 1000:.0f} ms") from None
            raise HookError(code, f"{code.name}: {e.details()}") from None

    def _stub(self, endpoint: str) -> RuntimeHookServiceStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = grpc.aio.insecure_channel(f"unix:{endpoint}", options=_CHANNEL_OPTIONS)
            entry = self._stubs[endpoint] = (channel, RuntimeHookServiceStub(channel))
        return entry[1]

    def _drop(self, endpoint: str) -> None:
        entry = self._stubs.pop(endpoint, None)
        if entry is None:
            return
        task = asyncio.get_running_loop().create_task(entry[0].close(grace=self.budget or FALLBACK_BUDGET_MS / 1000))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _server_error(server: ServerConfig, ctx: HookContext, exc: HookError | InvalidAnswer) -> HookError:
    where = f"hook server {server.file} ({server.endpoint}) {RPCS[ctx.stage]}"
    if isinstance(exc, InvalidAnswer):
        return HookError(grpc.StatusCode.INTERNAL, f"{where}: unusable answer: {exc}")
    return HookError(exc.code, f"{where}: {exc.reason}")


@dataclass(frozen=True)
class RemoteOptions:
    """The `[hooks.remote]` table (docs/remote-hooks.md)."""

    config_dir: str = field(default=DEFAULT_DIR, metadata={"check": not_empty})
    """the directory of the hook-server files"""
    call_timeout_ms: float | None = field(default=None, metadata={"check": positive})
    """cap on one server call; None: the CRI call's deadline alone limits it"""
    budget_ms: float | None = field(default=None, metadata={"check": positive})
    """cap on all server calls of one CRI call together; None: the CRI call's deadline alone"""
    runtime_margin_ms: float = field(default=DEFAULT_RUNTIME_MARGIN_MS, metadata={"check": not_negative})
    """kept from the CRI call's deadline for the runtime to do the call itself"""
    reload_interval_ms: float = field(default=DEFAULT_RELOAD_INTERVAL_MS, metadata={"check": positive})
    """how often the directory is checked for changes"""


def factory(options: RemoteOptions, node: NodeConfig) -> RemoteHook:
    """Entry point `remote`: the `[hooks.remote]` options; the servers need none of the node's paths."""
    return RemoteHook(
        options.config_dir,
        call_timeout=None if options.call_timeout_ms is None else options.call_timeout_ms / 1000,
        budget=None if options.budget_ms is None else options.budget_ms / 1000,
        reload_interval=options.reload_interval_ms / 1000,
        runtime_margin=options.runtime_margin_ms / 1000,
    )
