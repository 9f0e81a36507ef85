"""Kubelet's device-manager checkpoint (`kubelet_internal_checkpoint`): which device-plugin devices
each pod's containers hold, and what each plugin told kubelet to inject into them.

`parse_checkpoint` is a pure function over the file's bytes so the GPU hook and the device
reporter read it the same way. `CheckpointReader` is the file edge: it re-parses only when the file
changed, and copes with kubelet replacing it while we read.

Layouts accepted: `DeviceIDs` as a list (kubelet 1.19 and older) or as a map of NUMA node to list
(1.20 and newer, "-1" when the plugin reports no topology). `AllocResp` is the plugin's
`v1beta1.ContainerAllocateResponse`, base64 in the JSON. Keys kubelet adds later are ignored and the
checksum is not verified: kubelet may change how it computes it, and we only read.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from crihook.base.errors import InputError
from crihook.base.spec import Device, Mount
from crihook.proto import deviceplugin_v1beta1_pb2 as dp

log = logging.getLogger("crihook.checkpoint")

MAX_CHECKPOINT_BYTES = 64 << 20  # thousands of pods' entries fit in a few MiB
NO_TOPOLOGY = -1  # the NUMA key kubelet uses when a plugin reports no topology, and for the old list layout
_REPLICA = re.compile(r"::[0-9]+\Z")
_K = TypeVar("_K")


class CheckpointError(InputError):
    """The checkpoint can not be read; names the field."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__("kubelet checkpoint", where, reason)


@dataclass(frozen=True, slots=True)
class AllocResp:
    """What a device plugin's Allocate asked kubelet to add to one container."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Device, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PodDeviceEntry:
    pod_uid: str
    container_name: str
    resource_name: str
    devices_by_numa: Mapping[int, tuple[str, ...]]  # NUMA node (NO_TOPOLOGY: none) -> device ids
    alloc_resp: AllocResp | None = None  # None: absent, or not decodable (then alloc_error says why)
    alloc_error: str = ""

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d for ids in self.devices_by_numa.values() for d in ids)


def base_device_id(device_id: str) -> str:
    """The device a plugin id names: time-sliced replicas are `<id>::<n>` (NVIDIA's plugin and others)."""
    return _REPLICA.sub("", device_id)


def gpu_device_ids(index: int, uuid: str, mig_devices: Iterable[tuple[int, str]] = ()) -> tuple[str, ...]:
    """Every id a device plugin gives out for one GPU (replicas aside), as NVIDIA's plugin names
    them under its uuid and index strategies: the GPU's UUID and NVML index, and for each of its MIG
    devices (NVML's index under the GPU, UUID) the MIG UUID and `<GPU index>:<MIG index>`."""
    return (uuid, str(index), *(i for j, mig in mig_devices for i in (mig, f"{index}:{j}")))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The parsed file, indexed once so a hook's per-call questions cost dictionary lookups, not a
    walk over every pod's entries."""

    entries: tuple[PodDeviceEntry, ...] = ()
    registered: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # resource -> healthy ids
    _by_container: Mapping[tuple[str, str], tuple[PodDeviceEntry, ...]] = field(init=False, repr=False, compare=False)
    _by_device: Mapping[str, tuple[PodDeviceEntry, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_container: dict[tuple[str, str], list[PodDeviceEntry]] = {}
        by_device: dict[str, list[PodDeviceEntry]] = {}
        for e in self.entries:
            by_container.setdefault((e.pod_uid, e.container_name), []).append(e)
            for dev_id in e.device_ids:
                holders = by_device.setdefault(base_device_id(dev_id), [])
                if not holders or holders[-1] is not e:
                    holders.append(e)
        object.__setattr__(self, "_by_container", {k: tuple(v) for k, v in by_container.items()})
        object.__setattr__(self, "_by_device", {k: tuple(v) for k, v in by_device.items()})

    def for_container(self, pod_uid: str, container: str) -> tuple[PodDeviceEntry, ...]:
        return self._by_container.get((pod_uid, container), ())

    def holders(self, device_id: str) -> tuple[PodDeviceEntry, ...]:
        """The entries holding `device_id`, or a time-sliced replica of it."""
        return self._by_device.get(device_id, ())


def parse_checkpoint(data: bytes) -> Checkpoint:
    """The checkpoint in `data`. Raises CheckpointError for anything that is not a checkpoint; an
    entry whose AllocResp does not decode is kept, with `alloc_error` set, so one bad entry does not
    hide every other pod's."""
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError("", f"{len(data)} bytes is more than {MAX_CHECKPOINT_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError("", f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError("", "expected a JSON object")
    body = _typed(doc.get("Data"), dict, "Data", "an object")
    raw_entries = _typed(body.get("PodDeviceEntries"), list, "Data.PodDeviceEntries", "a list")
    entries = tuple(_entry(e, f"Data.PodDeviceEntries[{i}]") for i, e in enumerate(raw_entries))
    registered = {}
    for resource, ids in _typed(body.get("RegisteredDevices"), dict, "Data.RegisteredDevices", "an object").items():
        registered[resource] = _strings(ids, f"Data.RegisteredDevices[{resource!r}]")
    return Checkpoint(entries, registered)


def _typed(value: Any, kind: type[_K], where: str, name: str) -> _K:
    """Go's zero value for null or absent, as kubelet's own decoder gives."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise CheckpointError(where, f"expected {name}")
    return value


def _string(value: Any, where: str) -> str:
    return _typed(value, str, where, "a string")


def _strings(value: Any, where: str) -> tuple[str, ...]:
    items = _typed(value, list, where, "a list of strings")
    if not all(isinstance(s, str) for s in items):
        raise CheckpointError(where, "expected a list of strings")
    return tuple(items)


def _entry(e: Any, where: str) -> PodDeviceEntry:
    if not isinstance(e, dict):
        raise CheckpointError(where, "expected an object")
    ids = e.get("DeviceIDs")
    by_numa: dict[int, tuple[str, ...]] = {}
    if isinstance(ids, dict):
        for key, numa_ids in ids.items():
            try:
                node = int(key)
            except ValueError:
                raise CheckpointError(f"{where}.DeviceIDs", f"NUMA node {key[:20]!r} is not an integer") from None
            if not -1 <= node < 1 << 16:
                raise CheckpointError(f"{where}.DeviceIDs", f"NUMA node {key[:20]!r} is out of range")
            by_numa[node] = _strings(numa_ids, f"{where}.DeviceIDs[{key!r}]")
    elif ids is not None:
        by_numa[NO_TOPOLOGY] = _strings(ids, f"{where}.DeviceIDs")
    resp, error = _alloc_resp(e.get("AllocResp"), f"{where}.AllocResp")
    return PodDeviceEntry(
        pod_uid=_string(e.get("PodUID"), f"{where}.PodUID"),
        container_name=_string(e.get("ContainerName"), f"{where}.ContainerName"),
        resource_name=_string(e.get("ResourceName"), f"{where}.ResourceName"),
        devices_by_numa=by_numa,
        alloc_resp=resp,
        alloc_error=error,
    )


def _alloc_resp(value: Any, where: str) -> tuple[AllocResp | None, str]:
    if value is None:
        return None, ""
    if not isinstance(value, str):
        raise CheckpointError(where, "expected base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
        msg = dp.ContainerAllocateResponse.FromString(raw)
    except (binascii.Error, ValueError, DecodeError) as e:
        return None, f"{where}: not a device-plugin ContainerAllocateResponse ({e})"
    return decode_alloc_resp(msg), ""


def decode_alloc_resp(msg: dp.ContainerAllocateResponse) -> AllocResp:
    return AllocResp(
        envs=dict(msg.envs),
        mounts=tuple(Mount(m.container_path, m.host_path, m.read_only) for m in msg.mounts),
        devices=tuple(Device(d.container_path, d.host_path, d.permissions) for d in msg.devices),
        annotations=dict(msg.annotations),
        cdi_devices=tuple(c.name for c in msg.cdi_devices),
    )


class CheckpointReader:
    """The checkpoint at `path`, parsed again only when the file changed.

    Kubelet replaces the file by rename, so one open() sees one whole version. A file that does not
    parse is read again a few times, milliseconds apart, in case a writer that writes in place was
    caught mid-way; only then is it reported. A missing file is an empty checkpoint: no device
    plugin has allocated anything yet. A missing directory is that too, but kubelet creates it
    whenever it runs (whatever its --root-dir), so it means the path is wrong: that is logged.
    """

    RETRIES = 3

    def __init__(self, path: str, sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = path
        self._sleep = sleep
        self._lock = threading.Lock()
        self._key: tuple[int, int, int, int] | None = None
        self._value = Checkpoint()
        self._failed: tuple[tuple[int, int, int, int], CheckpointError] | None = None  # no retries for a known-bad file
        self._no_dir_said = False

    def read(self) -> Checkpoint:
        """Raises CheckpointError (unreadable or malformed after retries)."""
        with self._lock:
            last: CheckpointError | None = None
            for attempt in range(self.RETRIES):
                try:
                    with open(self.path, "rb") as f:
                        before = os.fstat(f.fileno())
                        key = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
                        if key == self._key:
                            return self._value
                        if self._failed is not None and self._failed[0] == key:
                            raise CheckpointError(self._failed[1].where, self._failed[1].reason)
                        data = f.read(MAX_CHECKPOINT_BYTES + 1)
                except FileNotFoundError:
                    self._key, self._value = None, Checkpoint()
                    self._check_dir()
                    return self._value
                except OSError as e:
                    raise CheckpointError("", f"{self.path}: {e.strerror or e}") from None
                try:
                    value = parse_checkpoint(data)
                except CheckpointError as e:
                    last = e
                    self._failed = (key, e)
                    self._sleep(0.005 * (attempt + 1))
                    continue
                self._key, self._value, self._failed = key, value, None
                return value
            assert last is not None
            raise last

    def _check_dir(self) -> None:
        directory = os.path.dirname(self.path) or "."
        if os.path.isdir(directory):
            self._no_dir_said = False
        elif not self._no_dir_said:
            self._no_dir_said = True
            log.warning(
                "kubelet checkpoint directory missing: device-plugin allocations can not be seen",
                extra={"dir": directory, "fix": "node.kubelet_checkpoint names a directory kubelet does not use"},
            )
