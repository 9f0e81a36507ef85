"""The installed hooks (entry points of group `crihook.hooks`) made into a chain from the
configuration: each hook's options checked against what its factory declares, order, timeouts,
failure policies, the allowlist."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points

from crihook.base.config import ConfigError, HooksConfig, NodeConfig
from crihook.hooks.allowlist import Allowlist
from crihook.hooks.base import Factory, NamesHostPaths, Recalls, options_type
from crihook.hooks.chain import HookChain, Registered

ENTRY_POINT_GROUP = "crihook.hooks"


def discover_factories() -> dict[str, Factory]:
    """Hook factories from installed entry points, by entry-point name."""
    return {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}


def build_chain(
    hooks_cfg: HooksConfig,
    node: NodeConfig,
    factories: Mapping[str, Factory] | None = None,
) -> HookChain:
    """Instantiate every enabled hook with its `[hooks.<name>]` table, checked against the options its
    factory declares. Raises ConfigError naming the file, the table and the key."""
    factories = discover_factories() if factories is None else factories
    unknown = [n for n in (*hooks_cfg.order, *hooks_cfg.options) if n not in factories]
    if unknown:
        installed = ", ".join(sorted(factories))
        names = ", ".join(sorted(set(unknown)))
        raise ConfigError(hooks_cfg.source, f"no hook named {names} (installed: {installed})", "hooks")
    regs: list[Registered] = []
    for name, factory in factories.items():
        if name in hooks_cfg.disabled:
            continue
        common, options = hooks_cfg.table(name, options_type(factory))
        hook = factory(options, node)
        timeout_ms = hooks_cfg.default_timeout_ms if common.timeout_ms is None else common.timeout_ms
        is_async = inspect.iscoroutinefunction(hook.handle)
        follows = is_async and common.timeout_ms is None and getattr(hook, "follows_call_deadline", False) is True
        cached = not is_async and isinstance(hook, Recalls)
        narrows = callable(getattr(hook, "wants", None))
        regs.append(Registered(hook, common.failure_policy, timeout_ms / 1000, is_async, follows, cached, narrows))
    explicit = {n: i for i, n in enumerate(hooks_cfg.order)}
    regs.sort(key=lambda r: (explicit.get(r.hook.name, len(explicit)), r.hook.priority, r.hook.name))
    patterns = [p.replace("{dev_root}", node.dev_root.rstrip("/") or "/") for p in hooks_cfg.allowed_host_paths]
    patterns += [p for r in regs if isinstance(r.hook, NamesHostPaths) for p in r.hook.host_paths()]
    return HookChain(regs, Allowlist(patterns))
