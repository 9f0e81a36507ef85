"""Koordinator's remote hook servers behind crihook: the in-process hook `remote` calls every server
configured for the stage (runtime.v1alpha1.RuntimeHookService over a unix socket), one after the
other in file-name order, and merges their answers into one edit.

Each server has its own failure policy, from its file: an error, a timeout or an unusable answer
from a `Fail` server refuses the CRI call; from an `Ignore` server it is logged and the next server
is called. So the chain's own failure policy for this hook only matters for crihook's bugs.

Order among hooks: priority 100 puts remote servers before the gpu (200) and rdma (210) hooks, so our
device hooks see what the servers did and have the last word on what a container gets. The protocol
carries no devices or mounts; the chain checks every host path any hook adds against the allowlist.

Timing: one server call may take `call_timeout_ms`; all the calls of one CRI call share
`budget_ms`. Keep the budget below the chain's `timeout_ms` for this hook (default 2000 ms), so a
slow `Ignore` server is skipped by its own policy rather than by the chain's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import grpc

from crihook.hooks.base import ConfigError, Edit, HookContext, HookError, apply_edit
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

DEFAULT_CALL_TIMEOUT_MS = 1000
DEFAULT_BUDGET_MS = 1500
DEFAULT_RELOAD_INTERVAL_MS = 1000
# grpc shares subchannels between channels to one target process-wide, reconnect back-off
# included: a channel of its own per server is what lets a dropped connection start afresh.
_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


class RemoteHook:
    name = "remote"
    priority = 100
    stages = frozenset(RPCS)

    def __init__(
        self,
        config_dir: str = DEFAULT_DIR,
        call_timeout: float = DEFAULT_CALL_TIMEOUT_MS / 1000,
        budget: float = DEFAULT_BUDGET_MS / 1000,
        reload_interval: float = DEFAULT_RELOAD_INTERVAL_MS / 1000,
    ) -> None:
        self.config = ConfigDir(config_dir)
        self.config.refresh()
        self.call_timeout = call_timeout
        self.budget = budget
        self.reload_interval = reload_interval
        self._next_reload = time.monotonic() + reload_interval
        self._stubs: dict[str, tuple[grpc.aio.Channel, RuntimeHookServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._reloading = asyncio.Lock()  # one directory scan at a time, whoever asks

    @property
    def servers(self) -> tuple[ServerConfig, ...]:
        """The servers in effect, in calling order."""
        return self.config.servers

    async def reload(self) -> None:
        """Re-read the configuration directory now, off the event loop, and let go of connections
        to servers no longer configured."""
        async with self._reloading:
            if not await asyncio.to_thread(self.config.refresh):
                return
        wanted = {s.endpoint for s in self.config.servers}
        for endpoint in set(self._stubs) - wanted:
            self._drop(endpoint)

    async def handle(self, ctx: HookContext) -> Edit | None:
        now = time.monotonic()
        if now >= self._next_reload:
            self._next_reload = now + self.reload_interval
            await self.reload()
        if skips_hook_servers(ctx.pod):
            return None
        servers = [s for s in self.config.servers if ctx.stage in s.stages]
        if not servers:
            return None
        deadline = time.monotonic() + self.budget
        applies = answer_applies(ctx.stage)
        total = Edit()
        view = ctx  # what the next server is told: the call as the servers before it left it
        for server in servers:
            try:
                answer = await self._call(server, view, deadline)
                if not applies:
                    continue
                reading = read_answer(view, answer)
            except (HookError, InvalidAnswer) as e:
                err = _server_error(server, ctx, e)
                if server.policy is Policy.FAIL and not ctx.stage.is_post:
                    raise err from None
                log.warning(
                    "hook server error ignored",
                    extra={**server.describe(), "stage": ctx.stage.value, **_subject(ctx), "reason": err.reason},
                )
                continue
            if reading.not_applied:
                log.warning(
                    "hook server asked for changes crihook does not make at this stage",
                    extra={**server.describe(), "stage": ctx.stage.value, **_subject(ctx),
                           "fields": ",".join(reading.not_applied)},
                )  # fmt: skip
            if not reading.edit.is_empty():
                view = apply_edit(view, reading.edit)
                merge(total, reading.edit)
        return None if total.is_empty() else total

    async def close(self) -> None:
        """Close every connection (tests, shutdown)."""
        for endpoint in list(self._stubs):
            self._drop(endpoint)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _call(self, server: ServerConfig, ctx: HookContext, deadline: float) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HookError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"not called: earlier hook servers used up the {self.budget * 1000:.0f} ms budget",
            )
        timeout = min(self.call_timeout, left)
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
        task = asyncio.get_running_loop().create_task(entry[0].close(grace=self.budget))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _server_error(server: ServerConfig, ctx: HookContext, exc: HookError | InvalidAnswer) -> HookError:
    where = f"hook server {server.file} ({server.endpoint}) {RPCS[ctx.stage]}"
    if isinstance(exc, InvalidAnswer):
        return HookError(grpc.StatusCode.INTERNAL, f"{where}: unusable answer: {exc}")
    return HookError(exc.code, f"{where}: {exc.reason}")


def _subject(ctx: HookContext) -> dict[str, str]:
    fields = {"pod": ctx.pod.ref}
    if ctx.container is not None:
        fields["container"] = ctx.container.name
    return fields


def create(options: Mapping[str, Any]) -> RemoteHook:
    """Entry point `remote`: options from `[hooks.remote]`."""
    opts = {k: v for k, v in options.items() if k != "node"}
    config_dir = opts.pop("config_dir", DEFAULT_DIR)
    if not isinstance(config_dir, str) or not config_dir:
        raise ConfigError(f"config_dir must be a directory path, not {config_dir!r}")
    seconds = {
        name: _positive_ms(opts.pop(name, default), name)
        for name, default in (
            ("call_timeout_ms", DEFAULT_CALL_TIMEOUT_MS),
            ("budget_ms", DEFAULT_BUDGET_MS),
            ("reload_interval_ms", DEFAULT_RELOAD_INTERVAL_MS),
        )
    }
    if opts:
        known = "config_dir, call_timeout_ms, budget_ms, reload_interval_ms"
        raise ConfigError(f"unknown option(s) {', '.join(sorted(opts))} (known: {known})")
    return RemoteHook(
        config_dir,
        call_timeout=seconds["call_timeout_ms"],
        budget=seconds["budget_ms"],
        reload_interval=seconds["reload_interval_ms"],
    )


def _positive_ms(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of milliseconds, not {value!r}")
    return value / 1000
