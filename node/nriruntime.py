"""What the runtime at hand applies of an NRI adjustment, and so what crihook must refuse instead.

containerd builds a container's whole spec (CRI devices and their cgroup rules, CDI) before it asks NRI
plugins, and its NRI merge drops env and device removals; each NRI version applies a different subset
of the rest. The facts, with the source files they come from, are in docs/nri.md. Everything here is
pure: the NRI plugin feeds it the runtime's name and version from Configure, and the container before
and after the hook chain.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from crihook.hooks.base import RESOURCE_FIELDS, ContainerInfo
from crihook.hooks.reach import (
    BY_ENV,
    GPU_MAJOR,
    GPU_MINORS,
    DeviceRule,
    Gpu,
    Reach,
    Verdict,
    every_device,
    gpu_cdi_name,
    reached,
)
from crihook.node.update import changed_fields

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")
# the LinuxResources fields an NRI adjustment can set on every NRI version; oom_score_adj needs v0.8
_RESOURCES_ANY = frozenset(RESOURCE_FIELDS) - {"memory_swap_limit_in_bytes", "oom_score_adj"}
# what NRI's spec generator skips when 0 or empty, on every version (generate.go, AdjustResources)
_SKIPPED_WHEN_EMPTY = frozenset({"memory_limit_in_bytes", "cpuset_cpus", "cpuset_mems"})
# the NRI release each containerd release vendors, from the first release that vendors it on: NRI's
# own table (pkg/api/version.go, InferVersionFromRuntime, as of v0.12.5). Later containerd releases
# send their NRI release in Configure.
_CONTAINERD_NRI = (
    ((1, 7, 0), (0, 3, 0)),
    ((1, 7, 7), (0, 4, 0)),
    ((1, 7, 14), (0, 6, 0)),
    ((1, 7, 16), (0, 6, 1)),
    ((1, 7, 26), (0, 8, 0)),
    ((2, 0, 0), (0, 8, 0)),
    ((2, 2, 0), (0, 10, 0)),
    ((2, 2, 1), (0, 11, 0)),
)

Version = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class NriRuntime:
    """The runtime's name and version as Configure reports them, the NRI release it runs, and what
    that applies."""

    name: str
    version: str
    nri: Version | None = None  # Configure's NRI_version (NRI v0.12+), else inferred from `version`
    removes_mounts: bool = False  # a "-DEST" mount entry reaches the spec (NRI v0.8.0: containerd 1.7.26, 2.0)
    cdi_devices: bool = False  # CDI_devices are injected (containerd 1.7.30+, 2.1+)
    oom_score_adj: bool = False  # linux.oom_score_adj is applied (NRI v0.8.0)
    # linux.resources.devices of an adjustment, deny rules included, are appended to the spec's
    # rules (NRI v0.10: containerd 2.2), and the runtime asks validators for the merged adjustment
    device_rules: bool = False

    @property
    def ref(self) -> str:
        return f"{self.name} {self.version}".strip()


def parse_version(text: str) -> Version | None:
    """(major, minor, patch) of "v1.7.24", "2.1.9+unknown", "1.7.24~ds1"; None when it is not one."""
    m = _VERSION.match(text.strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def nri_runtime(name: str, version: str, nri_version: str = "") -> NriRuntime:
    """The runtime from Configure's runtime_name, runtime_version ("v1.7.24", "2.1.9+unknown") and,
    from NRI v0.12 on, NRI_version ("v0.12.5"): the NRI release is the runtime's own word when it
    gives one, else read off containerd's version. A runtime crihook has not read the sources of, or
    a version it can not place, gets the least: nothing beyond what every NRI version applies."""
    v = parse_version(version)
    if name != "containerd" or v is None:
        return NriRuntime(name, version)
    nri = parse_version(nri_version) or next((n for since, n in reversed(_CONTAINERD_NRI) if v >= since), None)
    if nri is None:
        return NriRuntime(name, version)
    return NriRuntime(
        name,
        version,
        nri=nri,
        removes_mounts=nri >= (0, 8, 0),
        # containerd wires NRI's CDI injector from 1.7.30 and 2.1 on (nri_api_linux.go)
        cdi_devices=v >= (2, 1) or (1, 7, 30) <= v < (2,),
        oom_score_adj=nri >= (0, 8, 0),
        device_rules=nri >= (0, 10, 0),
    )


def unapplied(
    before: ContainerInfo,
    after: ContainerInfo,
    runtime: NriRuntime,
    *,
    every_device: bool = False,
    selinux: bool = True,
) -> list[str]:
    """What the hook chain changed (before → after) that an adjustment can not carry to this runtime,
    one phrase each; empty when the adjustment does everything. Additions and replacements always
    carry (env, devices and mounts are replaced by key); removals mostly do not. With `every_device`
    (a privileged container: hooks.reach.every_device) a device node left in the spec reaches
    nothing the container could not reach anyway, so leaving it is no failure. `selinux`: whether
    the node enforces SELinux labels, so that a mount asking to be relabeled must be."""
    out: list[str] = []
    kept_env = {k for k, _ in after.envs}
    counts = Counter(k for k, _ in before.envs)
    for key in sorted({k for k, _ in before.envs} - kept_env):
        out.append(f"removing env {key} (no NRI version applies env removals)")
    for key in sorted(k for k in kept_env if counts[k] > 1 and before.env(k) != after.env(k)):
        out.append(f"changing env {key}, set {counts[key]} times (NRI replaces the first only)")
    paths = {d.container_path for d in after.devices}
    for path in sorted({d.container_path for d in before.devices} - paths):
        # a privileged container reaches the device whether its node stays or not; from NRI v0.10 a
        # removed node is denied by its numbers (container.nri_adjustment)
        if not every_device and not runtime.device_rules:
            out.append(f"removing device {path} (no NRI version applies device removals)")
    if not runtime.device_rules:
        old_devices = set(before.devices)
        for d in after.devices:
            if not ("r" in d.permissions and "w" in d.permissions) and d not in old_devices:
                out.append(
                    f"giving device {d.container_path} access {d.permissions!r} (NRI before v0.10 gives every"
                    " device node it adds rw; needs containerd 2.2)"
                )
    if after.mounts is not before.mounts:  # else no hook touched them (hooks.edit keeps the tuple)
        old_mounts = set(before.mounts)
        for m in after.mounts:
            if m.selinux_relabel and selinux and m not in old_mounts:
                out.append(f"relabeling mount {m.container_path} for SELinux (an NRI adjustment can not ask for it)")
        if not runtime.removes_mounts:
            gone = {m.container_path for m in before.mounts} - {m.container_path for m in after.mounts}
            out.extend(f"removing mount {p} (needs containerd 1.7.26 or 2.0)" for p in sorted(gone))
    if not runtime.cdi_devices:
        added = sorted(set(after.cdi_devices) - set(before.cdi_devices))
        out.extend(f"adding CDI device {n} (needs containerd 2.1 or 1.7.30)" for n in added)
    out.extend(_resources(before, after, runtime))
    return out


def _resources(before: ContainerInfo, after: ContainerInfo, runtime: NriRuntime) -> Iterable[str]:
    if after.resources == before.resources or after.resources is None:
        return
    settable = _RESOURCES_ANY | ({"oom_score_adj"} if runtime.oom_score_adj else set())
    for f in fields(after.resources):
        old = getattr(before.resources, f.name) if before.resources is not None else None
        new = getattr(after.resources, f.name)
        if f.name == "unified" or new == old:
            continue
        if f.name not in settable:
            need = "containerd 1.7.26 or 2.0" if f.name == "oom_score_adj" else "proxy mode"
            yield f"setting {f.name} (needs {need})"
        elif f.name in _SKIPPED_WHEN_EMPTY and not new:
            yield f"clearing {f.name} (no NRI version applies a memory limit of 0 or an empty cpuset: the value stays)"


def update_unapplied(before: ContainerInfo, after: ContainerInfo) -> list[str]:
    """What the PreUpdateContainerResources hooks changed (before → after) that NRI's UpdateContainer
    can not carry, one phrase each. The runtime merges the plugin's update into the request and hands
    it to CRI's update, where a field of 0 or empty means "leave as it is"."""
    out: list[str] = []
    if after.annotations != before.annotations:
        out.append("changing annotations (NRI's UpdateContainer carries resources only)")
    for name, value in changed_fields(before.resources, after.resources).items():
        if name == "oom_score_adj":
            out.append("setting oom_score_adj (a container's is fixed at its creation)")
        elif not value:
            out.append(f"clearing {name} (an update of 0 or empty leaves the container's value as it is)")
    return out


def deniable(verdict: Verdict) -> bool:
    """Whether deny rules appended to the spec's take every ungranted GPU of `verdict` away: each is
    reached only through the device cgroup (a node, a rule, a CDI device's nodes), not by
    NVIDIA_VISIBLE_DEVICES, which the NVIDIA runtime hook honours at start whatever the rules say."""
    return all(not w.startswith(BY_ENV) for m in verdict.ungranted for w in verdict.reached.get(m, ()))


@dataclass(frozen=True, slots=True)
class Answer:
    """What an answer to CreateContainer leaves the container, as far as GPUs go: the GPU minors its
    device cgroup opens (None: every device, a privileged container), NVIDIA_VISIBLE_DEVICES, and
    the CDI devices of a GPU kind it is given."""

    opened: frozenset[int] | None
    visible: str | None
    cdi: frozenset[str]


def answer(rules: Sequence[DeviceRule], visible: str | None, cdi: Iterable[str]) -> Answer:
    """`rules`: the spec's device-cgroup rules followed by those an adjustment adds, in order."""
    return Answer(opened_gpus(rules), visible, frozenset(n for n in cdi if gpu_cdi_name(n) is not None))


def opened_gpus(rules: Sequence[DeviceRule]) -> frozenset[int] | None:
    """The GPU minors `rules` let be read or written (the last rule matching a device decides; with
    CAP_MKNOD a rule alone reaches a device); None when they open every device."""
    if every_device(rules):
        return None
    if any(r.opens and r.minor is None and r.matches("c", GPU_MAJOR, 0) for r in rules):
        candidates: Iterable[int] = GPU_MINORS  # a rule for every minor of the GPUs' major
    else:
        candidates = {r.minor for r in rules if r.opens and r.minor is not None and r.minor in GPU_MINORS}
    ways, _ = reached(Reach(rules=tuple(rules)), [Gpu(m, m, "") for m in sorted(candidates)])
    return frozenset(ways)


def escapes(own: Answer, final: Answer) -> list[str]:
    """What the runtime's final adjustment (every plugin's, merged) gives the container beyond what
    crihook's answer left it, one phrase each: the ValidateContainerAdjustment check (NRI v0.10+)."""
    out: list[str] = []
    if own.opened is not None:
        if final.opened is None:
            out.append("a device-cgroup rule allowing every device")
        elif extra := sorted(final.opened - own.opened):
            many = f"{extra[0]} to {extra[-1]} ({len(extra)} of them)"
            minors = ", ".join(map(str, extra)) if len(extra) <= 8 else many
            out.append(f"GPU minor {minors} through a device node or device-cgroup rule")
    if final.visible != own.visible:
        out.append(f"NVIDIA_VISIBLE_DEVICES={final.visible or ''} where crihook set {own.visible or 'nothing'}")
    if extra_cdi := sorted(final.cdi - own.cdi):
        out.append(f"CDI device {', '.join(extra_cdi)}")
    return out


def start_refusal(runtime: NriRuntime, *, cdi_inject: bool) -> str | None:
    """Why crihook must not register with this runtime at all: a configuration whose every GPU
    container it would have to refuse. None when it may."""
    if cdi_inject and not runtime.cdi_devices:
        return (
            f'gpu.inject = "cdi" needs CDI devices in NRI adjustments, which {runtime.ref} drops; '
            'containerd 2.1 or 1.7.30 applies them (or use gpu.inject = "env+devices", or proxy mode)'
        )
    return None
