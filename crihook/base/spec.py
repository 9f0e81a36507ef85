"""What a container is given from outside its image: bind mounts and device nodes. The hooks' view of a
container, the device plugins' responses in kubelet's checkpoint and the CDI specs all speak these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    readonly: bool = False
    selinux_relabel: bool = False
    # runtime.v1.MountPropagation: 0 private, 1 host-to-container, 2 bidirectional
    propagation: int = 0


@dataclass(frozen=True, slots=True)
class Device:
    container_path: str
    host_path: str
    permissions: str = "rwm"
    # (type, major, minor) when the message said (NRI shows the runtime's finished spec); a CRI
    # request names the host path only, and the runtime reads the numbers from it
    number: tuple[str, int, int] | None = None
