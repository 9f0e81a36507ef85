"""The gpu hook: on CreateContainer, the container gets exactly the GPUs the scheduler chose for it.

This is the I/O edge around `gpu_edit`: it reads the kubelet checkpoint (parsed again only when the
file changed), asks the node's GPU index (NVML, cached) about minors and UUIDs, looks for device
nodes under the node's dev_root and tells live pods from gone ones by kubelet's pod directories.
Every refusal is a HookError; the chain adds the pod and container to the message, and nothing a
refused call did stays behind, so one bad pod can not affect another.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from crihook.config import NodeConfig
from crihook.hooks.base import ConfigError, Edit, HookContext, HookError, Stage
from crihook.hooks.checkpoint import CheckpointError, CheckpointReader
from crihook.hooks.gpu_edit import INJECT_MODES, GpuLookup, GpuOptions, HamiCore, NodeView, gpu_edit

PRIORITY = 200  # before rdma (210): the GPU decision is the one most likely to refuse a call
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_OPTIONS = ("node", "inject", "deny_unallocated", "plugin_resources", "hami_core", "kubelet_pods_dir")


class PodDirs:
    """Whether a pod is still on this node: kubelet keeps /var/lib/kubelet/pods/<uid> from admission
    until it has cleaned the pod up, which covers every moment the pod can hold a device. Anything
    uncertain (an odd UID, an unreadable directory) counts as live, so a conflict is never missed."""

    def __init__(self, pods_dir: str) -> None:
        self.pods_dir = pods_dir

    def __call__(self, pod_uid: str) -> bool:
        if not _POD_UID.fullmatch(pod_uid):
            return True
        try:
            os.stat(f"{self.pods_dir}/{pod_uid}")
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return True


class GpuHook:
    name = "gpu"
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})
    priority = PRIORITY

    def __init__(
        self,
        opts: GpuOptions,
        gpus: GpuLookup,
        checkpoint: CheckpointReader,
        pod_live: Callable[[str], bool],
        exists: Callable[[str], bool] = os.path.exists,
    ) -> None:
        self.opts = opts
        self.gpus = gpus
        self.checkpoint = checkpoint
        self.pod_live = pod_live
        self.exists = exists

    def handle(self, ctx: HookContext) -> Edit | None:
        assert ctx.container is not None
        try:
            cp = self.checkpoint.read()
        except CheckpointError as e:
            # Without it neither the device plugin's injections nor a conflicting holder can be seen.
            raise HookError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e} ({self.checkpoint.path}); can not tell which GPUs the device plugin handed out",
            ) from None
        return gpu_edit(ctx.pod, ctx.container, self.gpus, NodeView(cp, self.exists, self.pod_live), self.opts)


@dataclass(frozen=True, slots=True)
class Settings:
    """The `[hooks.gpu]` table, checked."""

    opts: GpuOptions
    pods_dir: str


def parse_options(options: Mapping[str, Any], node: NodeConfig) -> Settings:
    """Raises ConfigError naming the option."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)} (known: {', '.join(_OPTIONS[1:])})")
    defaults = GpuOptions()
    inject = options.get("inject", defaults.inject)
    if inject not in INJECT_MODES:
        raise ConfigError(f"inject must be one of {', '.join(map(repr, INJECT_MODES))}, not {inject!r}")
    deny = options.get("deny_unallocated", defaults.deny_unallocated)
    if not isinstance(deny, bool):
        raise ConfigError(f"deny_unallocated must be true or false, not {deny!r}")
    resources = options.get("plugin_resources", list(defaults.plugin_resources))
    if not isinstance(resources, list) or not all(isinstance(r, str) and r for r in resources):
        raise ConfigError(f"plugin_resources must be a list of resource names, not {resources!r}")
    hami_in = options.get("hami_core", {})
    if not isinstance(hami_in, Mapping):
        raise ConfigError("hami_core must be a table ([hooks.gpu.hami_core])")
    hami_known = HamiCore.__dataclass_fields__
    hami_unknown = sorted(set(hami_in) - set(hami_known))
    if hami_unknown:
        raise ConfigError(f"hami_core: unknown option(s) {', '.join(hami_unknown)} (known: {', '.join(hami_known)})")
    for key, value in hami_in.items():
        _host_path(value, f"hami_core.{key}", optional=key == "lock_dir")
    checkpoint_dir = os.path.dirname(os.path.dirname(node.kubelet_checkpoint.rstrip("/")))
    pods_dir = options.get("kubelet_pods_dir", f"{checkpoint_dir}/pods")
    _host_path(pods_dir, "kubelet_pods_dir")
    opts = GpuOptions(
        inject=inject,
        deny_unallocated=deny,
        plugin_resources=tuple(resources),
        dev_root=node.dev_root.rstrip("/"),
        hami_core=HamiCore(**hami_in),
    )
    return Settings(opts, pods_dir.rstrip("/") or "/")


def _host_path(value: Any, key: str, optional: bool = False) -> None:
    if optional and value == "":
        return
    if not isinstance(value, str) or not os.path.isabs(value) or os.path.normpath(value) != value.rstrip("/"):
        raise ConfigError(f"{key} must be an absolute, normalised path, not {value!r}")


def factory(options: Mapping[str, Any]) -> GpuHook:
    """Entry point `gpu`: the `[hooks.gpu]` options and the node's paths."""
    node = options.get("node")
    node = node if isinstance(node, NodeConfig) else NodeConfig()
    settings = parse_options(options, node)
    from crihook.devices.nvml import GpuIndex, Nvml  # NVML is loaded on the first lookup, not here

    gpus = GpuIndex(Nvml(node.nvml_library, node.sys_root.rstrip("/") or "/"))
    return GpuHook(settings.opts, gpus, CheckpointReader(node.kubelet_checkpoint), PodDirs(settings.pods_dir))
