"""The checks of what the gpu hook relies on: the NVIDIA driver through NVML and the device nodes,
CDI specs and containerd's CDI setting, kubelet's device-plugin checkpoint and pods dir."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crihook.base.config import NodeConfig
from crihook.cli.doctor.finding import Finding, Level
from crihook.cli.doctor.parse import containerd_cdi, parse_version
from crihook.devices import kubelet
from crihook.devices.kubelet import kubelet_argv
from crihook.devices.nvml import NodeGpus, Nvml
from crihook.hooks.cdi import DEFAULT_SPEC_DIRS, GENERATE_FIX, CdiIndex

CONTAINERD_CONFIG = "/etc/containerd/config.toml"


def check_nvml(node: NodeConfig, gpus: NodeGpus | None = None) -> Finding:
    """The driver answers through NVML (the same access layer the gpu hook uses) and every GPU has
    its device node."""
    name = "NVIDIA driver"
    driver_fix = (
        "nvidia-smi must list the GPUs; if it does not, (re)install the NVIDIA driver and check lsmod | grep nvidia. "
        "If libnvidia-ml.so.1 lives outside the loader path, set node.nvml_library"
    )
    if gpus is None:
        gpus = node_gpus(node)
    if gpus.reason:
        return Finding(name, Level.FAIL, gpus.reason, driver_fix)
    driver = gpus.driver_version
    minors = [g.minor for g in gpus.gpus]
    if not minors:
        return Finding(name, Level.WARN, f"driver {driver} is loaded but NVML sees no GPU", driver_fix)
    dev = node.dev_root.rstrip("/")
    missing = [p for p in [f"{dev}/nvidiactl", *(f"{dev}/nvidia{m}" for m in minors)] if not Path(p).exists()]
    found = f"driver {driver}, {len(minors)} GPU(s), minors {', '.join(map(str, sorted(minors)))}"
    if missing:
        return Finding(
            name,
            Level.FAIL,
            f"{found}; device nodes missing: {', '.join(missing)}",
            "crihook hands these nodes to containers: create them with nvidia-modprobe -c <minor> "
            "(or nvidia-smi once as root), or set node.dev_root",
        )
    mig = [str(g.minor) for g in gpus.gpus if g.mig_enabled]
    if mig:  # a mixed node is normal: said, not warned about
        found += f"; in MIG mode, for the device plugin's nvidia.com/mig-* only: minors {', '.join(mig)}"
    sick = [f"minor {g.minor} ({g.health_reason or 'unhealthy'})" for g in gpus.gpus if not g.healthy]
    if sick:
        return Finding(
            name,
            Level.WARN,
            f"{found}; unhealthy: {', '.join(sick)}",
            "the reporter marks these GPUs unhealthy so the scheduler skips them; check nvidia-smi -q and dmesg (Xid)",
        )
    return Finding(name, Level.OK, found + "; device nodes present")


def node_gpus(node: NodeConfig) -> NodeGpus:
    nvml = Nvml(node.nvml_library, node.sys_root)
    try:
        return nvml.snapshot(topology=False)
    finally:
        nvml.close()


def check_cdi(
    gpu_options: Mapping[str, Any] | None, runtime: Any, gpus: NodeGpus, containerd_config: str = CONTAINERD_CONFIG
) -> Finding:
    """Whether every GPU has its `nvidia.com/gpu=<uuid>` CDI device in the spec dirs crihook checks,
    and whether containerd (its config file, its release's defaults) injects CDI devices from them.
    Problems fail only with `inject = "cdi"`; otherwise they are said for whoever switches."""
    name = "CDI"
    options = gpu_options or {}
    inject = options.get("inject", "env+devices")
    dirs = tuple(options.get("cdi_spec_dirs", DEFAULT_SPEC_DIRS))
    problems, fixes = [], []
    found = []
    if gpus.gpus:
        scan = CdiIndex(dirs).scan()
        missing = [g.uuid for g in gpus.gpus if f"nvidia.com/gpu={g.uuid}" not in scan.devices]
        have = len(gpus.gpus) - len(missing)
        found.append(f"{have} of {len(gpus.gpus)} GPU(s) have a CDI device in {', '.join(dirs)}")
        if missing:
            problems.append(f"no nvidia.com/gpu device for {', '.join(missing)}")
            fixes.append(f"run `{GENERATE_FIX}`")
        if scan.problems:
            problems.append("unreadable specs: " + "; ".join(scan.problems))
    if runtime is None or runtime.runtime_name != "containerd":
        what = "no runtime answered" if runtime is None else f"the runtime is {runtime.runtime_name}"
        found.append(f"containerd's CDI setting not checked ({what})")
    else:
        version = parse_version(runtime.runtime_version)
        try:
            with open(containerd_config, "rb") as f:
                parsed: Mapping[str, Any] = tomllib.load(f)
            source = containerd_config
        except FileNotFoundError:
            parsed, source = {}, f"defaults, no {containerd_config}"
        except (OSError, tomllib.TOMLDecodeError) as e:
            return Finding(name, Level.FAIL, f"{containerd_config} can not be read: {e}", "fix containerd's config")
        cdi = containerd_cdi(parsed, version)
        label = f"containerd {runtime.runtime_version} ({source})"
        if version[:2] < (1, 7):
            found.append(f"{label} has no CDI")
            problems.append(f"containerd {runtime.runtime_version} can not inject CDI devices")
            fixes.append('upgrade containerd to 1.7 or newer, or use inject = "env+devices"')
        elif not cdi.enabled:
            found.append(f"{label}: CDI disabled")
            problems.append("containerd ignores CDI devices")
            fixes.append(f"set enable_cdi = true under [{cdi.where}] and restart containerd")
        else:
            found.append(f"{label}: CDI enabled, spec dirs {', '.join(cdi.spec_dirs)}")
            if not set(dirs) <= set(cdi.spec_dirs):
                problems.append(f"crihook checks {', '.join(dirs)}, containerd reads {', '.join(cdi.spec_dirs)}")
                fixes.append("make [hooks.gpu] cdi_spec_dirs name the dirs containerd reads")
    text = "; ".join(found + problems)
    if not problems:
        return Finding(name, Level.OK, f"inject = {inject}; {text}")
    if inject == "cdi":
        return Finding(name, Level.FAIL, f"inject = cdi; {text}", "; ".join(fixes))
    return Finding(name, Level.OK, f"inject = {inject} (CDI not used); {text}")


def check_checkpoint(node: NodeConfig, gpu_options: Mapping[str, Any] | None = None) -> Finding:
    """The device-plugin checkpoint is readable where kubelet keeps it, and the gpu hook looks for
    pod directories where kubelet keeps them. The two do not move together: the checkpoint stays in
    /var/lib/kubelet/device-plugins whatever kubelet's --root-dir, the pods dir follows it."""
    from crihook.devices.checkpoint import CheckpointError, parse_checkpoint

    name = "device checkpoint"
    path = node.kubelet_checkpoint
    try:
        checkpoint = parse_checkpoint(Path(path).read_bytes())
    except FileNotFoundError:
        if not Path(path).parent.is_dir():
            return Finding(
                name,
                Level.WARN,
                f"{Path(path).parent} does not exist, so crihook sees no device-plugin allocation",
                f"kubelet keeps its checkpoint in {kubelet.CHECKPOINT} whatever its --root-dir: set "
                "node.kubelet_checkpoint to that (the default)",
            )
        return Finding(
            name,
            Level.WARN,
            f"no kubelet device-plugin checkpoint at {path}: no device plugin has registered with kubelet",
            "nothing to do if no device plugin runs on this node; else check the plugin's pod and log (it registers "
            f"at {Path(kubelet.CHECKPOINT).parent}/kubelet.sock). The checkpoint does not move with kubelet's "
            "--root-dir",
        )
    except (OSError, CheckpointError) as e:
        return Finding(
            name,
            Level.FAIL,
            f"{path} can not be used: {e}",
            "crihook can not see which GPUs the device plugin handed out, so GPU containers fail closed. "
            "Restarting kubelet rewrites the file",
        )
    counts: dict[str, int] = {}
    for entry in checkpoint.entries:
        counts[entry.resource_name] = counts.get(entry.resource_name, 0) + len(entry.device_ids)
    held = ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) or "no devices"
    found = f"{path} readable: {held} held through device plugins"
    undecodable = [e for e in checkpoint.entries if e.alloc_error]
    if undecodable:
        first = undecodable[0]
        return Finding(
            name,
            Level.WARN,
            f"{found}; {len(undecodable)} entr{'y' if len(undecodable) == 1 else 'ies'} with an undecodable "
            f"AllocResp, first {first.pod_uid}/{first.container_name}",
            "crihook can not strip what the device plugin injected into those containers; check the plugin's "
            "version and journalctl -u kubelet",
        )
    return _with_pods_dir(Finding(name, Level.OK, found), node, gpu_options)


def _with_pods_dir(ok: Finding, node: NodeConfig, gpu_options: Mapping[str, Any] | None) -> Finding:
    """`ok`, or a warning when the gpu hook would look for kubelet's pod directories elsewhere than
    kubelet keeps them (then every device-plugin holder counts as live)."""
    argv = kubelet_argv(node.proc_root)
    if argv is None:
        return ok
    theirs = kubelet.pods_dir(argv)
    ours = (gpu_options or {}).get("kubelet_pods_dir")
    if isinstance(ours, str) and os.path.normpath(ours) != theirs:
        return Finding(
            ok.check,
            Level.WARN,
            f"{ok.found}; [hooks.gpu] kubelet_pods_dir is {ours}, but kubelet keeps pods in {theirs}",
            f"remove kubelet_pods_dir (crihook follows kubelet's --root-dir) or set it to {theirs}",
        )
    if not Path(theirs).is_dir():
        return Finding(
            ok.check,
            Level.WARN,
            f"{ok.found}; kubelet's pods dir {theirs} does not exist, so every device-plugin holder counts as live",
            "check kubelet's --root-dir; the checkpoint stays in /var/lib/kubelet/device-plugins whatever it says",
        )
    return ok
