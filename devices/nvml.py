"""NVML access shared by the gpu hook and the device reporter, through `pynvml`.

`Nvml` owns the library: it loads it (the driver's libnvidia-ml.so.1, or the path in
`node.nvml_library`), initialises it once and keeps it initialised, and answers a snapshot of the
node's GPUs with or without the pairwise topology. A node without the driver answers zero GPUs and a
reason; the reason is logged once (again only when it changes) and initialisation is retried no more
than once per `retry_seconds`, so a GPU-less node neither crashes nor spins.

`GpuIndex` is the hot-path view (the `GpuLookup` of hooks/gpu_edit.py): minor and UUID maps served
from memory, refreshed on a miss at most once per `min_refresh_seconds`, and fed by the reporter's
snapshots so it rarely needs NVML itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from crihook.devices import sysfs
from crihook.devices.usage import GpuProcess, GpuState, sm_by_pid

log = logging.getLogger("crihook.devices.nvml")

DEFAULT_LIBRARY = "libnvidia-ml.so.1"
_NOT_THERE = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML and sysfs describe it."""

    index: int  # NVML index (PCI order); not the CUDA index, not the minor
    minor: int  # /dev/nvidia<minor>
    uuid: str
    name: str  # NVML's product name, e.g. "NVIDIA H100 80GB HBM3"
    memory_total: int  # bytes; 0 when the GPU could not be asked
    pci_bus_id: str  # sysfs spelling, 0000:1b:00.0
    numa_node: int = sysfs.UNKNOWN
    socket: int = sysfs.UNKNOWN
    pcie_root: str = ""  # PCIe root port above the GPU (sysfs), "" unknown
    pcie_root_complex: str = ""  # the host bridge above it, "pci0000:17" (sysfs), "" unknown
    healthy: bool = True
    health_reason: str = ""  # why not healthy
    mig_enabled: bool = False
    # with MIG enabled, the MIG devices configured now: (NVML's MIG device index under this GPU, the
    # MIG device's UUID), which is how NVIDIA's device plugin names them (index and uuid strategies)
    mig_devices: tuple[tuple[int, str], ...] = ()
    cuda_capability: str = ""  # CUDA compute capability, "9.0"; "" when NVML does not say


@dataclass(frozen=True, slots=True)
class LinkEnd:
    """The far end of one active NVLink of a GPU."""

    remote_pci: str  # sysfs spelling
    to_switch: bool  # an NVSwitch, not a GPU
    version: int  # as nvmlDeviceGetNvLinkVersion reports it


@dataclass(frozen=True, slots=True)
class GpuTopology:
    """Pairwise interconnect, rows and columns in NVML index order (`minors` says which GPU)."""

    minors: tuple[int, ...]
    nvlinks: tuple[tuple[int, ...], ...]  # active NVLinks between the pair, direct or through NVSwitches
    nvlink_versions: tuple[tuple[int, ...], ...]  # lowest version among those links, 0 for none
    pcie: tuple[tuple[int, ...], ...]  # NVML_TOPOLOGY_* of the pair's common ancestor, 0 on the diagonal
    nvswitch: bool  # the GPUs reach each other through NVSwitches


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """What NVML says about the node at one moment. `reason` is set when NVML could not be used;
    then `gpus` is empty."""

    driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    topology: GpuTopology | None = None  # None when not asked for, or no NVML
    reason: str = ""
    taken_at: float = field(default=0.0, compare=False)


def link_matrix(
    pcis: Sequence[str], links: Sequence[Sequence[LinkEnd]]
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """NVLink count and version for every pair of GPUs, from each GPU's active links.

    Direct links count once per link, as the smaller of the two GPUs' views (a link one side sees
    down is down). Through NVSwitches, a pair shares, on each switch both reach, as many links as the
    less connected of the two has to it, summed over the switches: on a DGX H100 every pair gets
    5+4+4+5 = 18."""
    n = len(pcis)
    direct: list[dict[str, list[int]]] = [{} for _ in range(n)]
    switched: list[dict[str, list[int]]] = [{} for _ in range(n)]
    for i, ends in enumerate(links):
        for e in ends:
            (switched if e.to_switch else direct)[i].setdefault(e.remote_pci, []).append(e.version)
    counts = [[0] * n for _ in range(n)]
    versions = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            a = direct[i].get(pcis[j], [])
            b = direct[j].get(pcis[i], [])
            count = min(len(a), len(b))
            used = (a + b) if count else []
            for switch in switched[i].keys() & switched[j].keys():
                si, sj = switched[i][switch], switched[j][switch]
                count += min(len(si), len(sj))
                used += si + sj
            counts[i][j] = counts[j][i] = count
            versions[i][j] = versions[j][i] = min(used) if used else 0
    return tuple(map(tuple, counts)), tuple(map(tuple, versions))


@dataclass(frozen=True, slots=True)
class ProcessRead:
    """The processes on the node's GPUs at one moment. `reason` is set when NVML could not be used."""

    gpus: tuple[GpuState, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    # GPU UUID -> the newest utilisation sample's timestamp, for the next read to start from
    last_seen: Mapping[str, int] = field(default_factory=dict)
    reason: str = ""


class NvmlUnavailable(Exception):
    """NVML can not be used at all; the message is the reason."""


def _text(value: str | bytes) -> str:
    """pynvml hands char arrays back as str or bytes depending on its version."""
    return value.decode() if isinstance(value, bytes) else value


def _error_text(e: pynvml.NVMLError) -> str:
    try:
        return str(e)
    except Exception:  # the library's own error string may be out of reach too
        return f"NVML error {getattr(e, 'value', '?')}"


_load_lock = threading.Lock()
_loaded_path = ""


def load_library(path: str) -> None:
    """Make pynvml use the library at `path`, or at the first existing one of several paths joined
    by ":" (a driver root's library directories differ by distribution and architecture); pynvml
    itself loads DEFAULT_LIBRARY from the loader path when none is configured. One process uses one
    library."""
    global _loaded_path
    if not path:
        return
    if ":" in path:
        found = next((p for p in path.split(":") if p and os.path.exists(p)), "")
        if not found:
            raise NvmlUnavailable(
                f"{DEFAULT_LIBRARY} not found in {path}: the NVIDIA driver is not installed on this node"
            )
        path = found
    with _load_lock:
        if _loaded_path == path and pynvml.nvmlLib is not None:
            return
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise NvmlUnavailable(f"NVML library {path} can not be loaded ({e})") from None
        with pynvml.libLoadLock:
            pynvml.nvmlLib = lib
            # pynvml caches function pointers by name; they belong to the library they came from
            pynvml._nvmlGetFunctionPointer_cache.clear()
        _loaded_path = path


class Nvml:
    """The NVML library of this process. Thread-safe: calls are serialised, which also keeps a
    snapshot consistent."""

    def __init__(
        self,
        library: str = "",
        sys_root: str = "/sys",
        retry_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.library = library
        self.sys_root = sys_root
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._initialised = False
        self._failed_at: float | None = None
        self._reason = ""
        self._said = ""  # the last reason logged
        self._unread: dict[int, str] = {}  # GPU index -> why its processes were last unreadable, once logged

    def snapshot(self, topology: bool = True) -> NodeGpus:
        """The node's GPUs; with `topology`, also every pair's NVLinks and PCIe level."""
        with self._lock:
            now = self._clock()
            try:
                self._ensure_init(now)
                result = self._discover(topology, now)
            except NvmlUnavailable as e:
                self._failed(str(e), now)
                return NodeGpus(reason=self._reason, taken_at=now)
            if self._said:
                log.info("NVML is usable again", extra={"gpus": len(result.gpus)})
                self._said = ""
            return result

    def processes(self, since: Mapping[str, int]) -> ProcessRead:
        """Every GPU's compute and graphics processes with their memory, and their SM utilisation
        from the driver's samples newer than `since[uuid]` (0: all it keeps). A GPU in MIG mode is
        read per MIG device (the driver samples no per-process utilisation there). A GPU that can
        not be read is left out and logged; a process that ended between NVML's calls is simply
        not listed by the later ones."""
        with self._lock:
            now = self._clock()
            try:
                self._ensure_init(now)
                count = pynvml.nvmlDeviceGetCount()
            except NvmlUnavailable as e:
                self._failed(str(e), now)
                return ProcessRead(reason=self._reason)
            except pynvml.NVMLError as e:
                self._initialised = False
                self._failed(f"NVML stopped answering: {_error_text(e)}", now)
                return ProcessRead(reason=self._reason)
            gpus: list[GpuState] = []
            found: list[GpuProcess] = []
            last_seen: dict[str, int] = {}
            for index in range(count):
                try:
                    gpu, procs, seen = _gpu_processes(index, since)
                except pynvml.NVMLError as e:
                    self._unreadable(index, _error_text(e))
                    continue
                self._unread.pop(index, None)
                gpus.append(gpu)
                found.extend(procs)
                if seen:
                    last_seen[gpu.uuid] = seen
            return ProcessRead(tuple(gpus), tuple(found), last_seen)

    def _unreadable(self, index: int, reason: str) -> None:
        if self._unread.get(index) != reason:
            log.warning("GPU processes unreadable", extra={"index": index, "error": reason})
            self._unread[index] = reason

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                self._initialised = False
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError as e:
                    log.debug("nvmlShutdown failed", extra={"error": _error_text(e)})

    # -- inside the lock -------------------------------------------------------------------------

    def _failed(self, reason: str, now: float) -> None:
        self._reason = reason
        if self._failed_at is None:
            self._failed_at = now
        if reason != self._said:
            log.warning("no GPUs reported: NVML is not usable", extra={"reason": reason})
            self._said = reason

    def _ensure_init(self, now: float) -> None:
        if self._initialised:
            return
        if self._failed_at is not None and now - self._failed_at < self.retry_seconds:
            raise NvmlUnavailable(self._reason)
        self._failed_at = now
        load_library(self.library)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable(
                f"{self.library or DEFAULT_LIBRARY} not found: the NVIDIA driver is not installed on this node"
            ) from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise NvmlUnavailable("nvmlInit: the NVIDIA kernel driver is not loaded") from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"nvmlInit failed: {_error_text(e)}") from None
        self._initialised = True
        self._failed_at = None

    def _discover(self, topology: bool, now: float) -> NodeGpus:
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            # the driver went away under us (unloaded, upgraded): start over at the next try
            self._initialised = False
            raise NvmlUnavailable(f"NVML stopped answering: {_error_text(e)}") from None
        handles = []
        gpus = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append(self._gpu(index, handle))
                handles.append(handle)
            except pynvml.NVMLError as e:
                # without a UUID and minor the GPU can not be named, let alone scheduled
                log.warning("GPU skipped: NVML can not identify it", extra={"index": index, "error": _error_text(e)})
        topo = self._topology(gpus, handles) if topology else None
        return NodeGpus(driver_version=driver, gpus=tuple(gpus), topology=topo, taken_at=now)

    def _gpu(self, index: int, handle: object) -> GpuInfo:
        minor = pynvml.nvmlDeviceGetMinorNumber(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        pci = sysfs.pci_address(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        problems = []
        memory = 0
        try:
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError as e:
            problems.append(f"memory: {_error_text(e)}")
        if _ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle, problems, "retired pages"):
            problems.append("retired pages pending (reset the GPU)")
        remapped = _ask(pynvml.nvmlDeviceGetRemappedRows, handle, problems, "row remapping")
        if remapped and remapped[3]:
            problems.append("row remapping failed")
        mig = _ask(pynvml.nvmlDeviceGetMigMode, handle, problems, "MIG mode")
        mig_enabled = bool(mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
        mig_devices = _mig_devices(handle, problems) if mig_enabled else ()
        numa = sysfs.numa_node(self.sys_root, pci)
        capability = _ask(pynvml.nvmlDeviceGetCudaComputeCapability, handle, [], "compute capability")
        return GpuInfo(
            index=index,
            minor=minor,
            uuid=uuid,
            name=name,
            memory_total=memory,
            pci_bus_id=pci,
            numa_node=numa,
            socket=sysfs.socket_of_node(self.sys_root, numa),
            pcie_root=sysfs.root_port(self.sys_root, pci),
            pcie_root_complex=sysfs.host_bridge(self.sys_root, pci),
            healthy=not problems,
            health_reason="; ".join(problems),
            mig_enabled=mig_enabled,
            mig_devices=mig_devices,
            cuda_capability=f"{capability[0]}.{capability[1]}" if capability else "",
        )

    def _links(self, handle: object) -> list[LinkEnd]:
        ends = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
                version = pynvml.nvmlDeviceGetNvLinkVersion(handle, link)
            except pynvml.NVMLError as e:
                if e.value in _NOT_THERE:
                    continue  # the GPU has no such link
                raise
            ends.append(LinkEnd(sysfs.pci_address(remote), kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, version))
        return ends

    def _topology(self, gpus: Sequence[GpuInfo], handles: Sequence[object]) -> GpuTopology:
        n = len(gpus)
        links: list[list[LinkEnd]] = []
        for g, h in zip(gpus, handles, strict=True):
            try:
                links.append(self._links(h) if g.healthy else [])
            except pynvml.NVMLError as e:
                log.warning("NVLinks unreadable", extra={"minor": g.minor, "error": _error_text(e)})
                links.append([])
        pcie = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                try:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                except pynvml.NVMLError:
                    level = pynvml.NVML_TOPOLOGY_SYSTEM  # unknown: assume the farthest
                pcie[i][j] = pcie[j][i] = int(level)
        counts, versions = link_matrix([g.pci_bus_id for g in gpus], links)
        return GpuTopology(
            minors=tuple(g.minor for g in gpus),
            nvlinks=counts,
            nvlink_versions=versions,
            pcie=tuple(map(tuple, pcie)),
            nvswitch=n > 1 and all(links) and all(e.to_switch for ends in links for e in ends),
        )


def _ask(query: Callable[[object], Any], handle: object, problems: list[str], what: str) -> Any:
    """An optional health query: None when the GPU does not support it; a failure is a problem."""
    try:
        return query(handle)
    except pynvml.NVMLError as e:
        if e.value not in _NOT_THERE:
            problems.append(f"{what}: {_error_text(e)}")
        return None


def _mig_devices(handle: object, problems: list[str]) -> tuple[tuple[int, str], ...]:
    """The MIG devices of a GPU in MIG mode, by index. NVML numbers the slots up to the GPU's
    maximum and answers NOT_FOUND for an empty one, as the device plugin's own enumeration expects."""
    try:
        return tuple((j, pynvml.nvmlDeviceGetUUID(mig)) for j, mig in _mig_handles(handle))
    except pynvml.NVMLError as e:
        # the pods holding its MIG devices through the plugin could not be told apart
        problems.append(f"MIG devices: {_error_text(e)}")
        return ()


def _mig_handles(handle: object) -> list[tuple[int, object]]:
    """(slot, handle) of each MIG device configured on a GPU in MIG mode. NVML numbers the slots up
    to the GPU's maximum and answers NOT_FOUND for an empty one."""
    found = []
    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            found.append((j, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)))
        except pynvml.NVMLError as e:
            if e.value != pynvml.NVML_ERROR_NOT_FOUND:
                raise
    return found


def _listed(query: Callable[[object], Any], handle: object) -> list[Any]:
    """A process list; empty where the device keeps none of that kind."""
    try:
        return list(query(handle))
    except pynvml.NVMLError as e:
        if e.value in _NOT_THERE:
            return []
        raise


def _gpu_processes(index: int, since: Mapping[str, int]) -> tuple[GpuState, list[GpuProcess], int]:
    """One GPU's state, its processes and the newest utilisation timestamp read."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
    try:
        mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    except pynvml.NVMLError as e:
        if e.value not in _NOT_THERE:
            raise
        mig = False
    devices = [(_text(pynvml.nvmlDeviceGetUUID(h)), h) for _, h in _mig_handles(handle)] if mig else [(uuid, handle)]
    sm: dict[int, float] = {}
    newest = 0
    if not mig:
        samples = _listed(lambda h: pynvml.nvmlDeviceGetProcessUtilization(h, since.get(uuid, 0)), handle)
        sm = sm_by_pid((int(s.pid), int(s.smUtil)) for s in samples)
        newest = max((int(s.timeStamp) for s in samples), default=0)
    procs = []
    for device, h in devices:
        for query in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            for p in _listed(query, h):
                pid = int(p.pid)
                procs.append(GpuProcess(pid, uuid, device, int(p.usedGpuMemory or 0), sm.get(pid)))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)  # after the lists: its total includes what they hold
    return GpuState(uuid, minor, int(memory.total), int(memory.used), index), procs, newest


class GpuIndex:
    """minor -> GpuInfo and UUID -> GpuInfo for the hot path; satisfies hooks.gpu_edit.GpuLookup.

    A hit costs two dict lookups. A miss refreshes from NVML (identity and health, no topology), at
    most once per `min_refresh_seconds`, so a pod naming a GPU that does not exist can not make every
    CreateContainer query NVML."""

    def __init__(
        self, nvml: Nvml, min_refresh_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.nvml = nvml
        self.min_refresh_seconds = min_refresh_seconds
        self._clock = clock
        self._refresh_lock = threading.Lock()
        self._by_minor: dict[int, GpuInfo] = {}
        self._by_uuid: dict[str, GpuInfo] = {}
        self._refreshed_at: float | None = None
        self.refreshes = 0
        # changes to what the index holds: what was worked out from it (the gpu hook's placements) is
        # stale once this moves
        self.generation = 0

    def update(self, snapshot: NodeGpus) -> None:
        """Take a snapshot someone else made (the reporter's), if it came from a working NVML."""
        if snapshot.reason:
            return
        # each map is swapped whole: a reader sees the old map or the new one, never a half-built one
        by_minor = {g.minor: g for g in snapshot.gpus}
        if by_minor != self._by_minor:  # the reporter's rounds mostly find the same GPUs
            self._by_minor = by_minor
            self._by_uuid = {g.uuid: g for g in snapshot.gpus}
            self.generation += 1  # after the swap: whoever reads the new generation finds the new maps
        self._refreshed_at = self._clock()

    def _refresh_if_due(self) -> None:
        with self._refresh_lock:  # concurrent misses make one refresh
            now = self._clock()
            if self._refreshed_at is not None and now - self._refreshed_at < self.min_refresh_seconds:
                return
            self.refreshes += 1
            snap = self.nvml.snapshot(topology=False)
            if snap.reason:
                self._refreshed_at = now  # rate-limits the retries too
                return
            self.update(snap)

    def known(self, kind: str, key: Any) -> GpuInfo | None:
        """A lookup by "minor" or "uuid" that never asks NVML (for the event loop): None for a GPU
        the index does not hold."""
        return (self._by_minor if kind == "minor" else self._by_uuid).get(key)

    def by_minor(self, minor: int) -> GpuInfo | None:
        g = self._by_minor.get(minor)
        if g is None:
            self._refresh_if_due()
            g = self._by_minor.get(minor)
        return g

    def by_uuid(self, uuid: str) -> GpuInfo | None:
        g = self._by_uuid.get(uuid)
        if g is None:
            self._refresh_if_due()
            g = self._by_uuid.get(uuid)
        return g

    def all(self) -> list[GpuInfo]:
        if self._refreshed_at is None:
            self._refresh_if_due()
        return sorted(self._by_minor.values(), key=lambda g: g.index)
