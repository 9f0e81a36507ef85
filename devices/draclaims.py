"""Kubelet's DRA manager checkpoint (`<root dir>/dra_manager_state`): which ResourceClaims each pod
holds on this node, and the CDI devices their drivers prepared for them.

Kubelet writes it whenever a claim is prepared or released (pkg/kubelet/cm/dra/state): an object
whose `Data` is the JSON text of `{"kind": "DRACheckpoint", "apiVersion":
"checkpoint.dra.kubelet.k8s.io/v1", "ClaimInfoStateList": [...]}`, each claim with `ClaimUID`,
`ClaimName`, `Namespace`, `PodUIDs` (a set: an object with empty values), and `DriverState` mapping
each driver to `{"Devices": [{"PoolName", "DeviceName", "RequestNames", "CDIDeviceIDs"}]}`. The
checksum is not verified (we only read). A claim names no container: every container of a pod that
holds a claim may use it (the pod spec's `resources.claims` says which; kubelet passes their CDI
devices in CRI's CDI_devices).

`parse_claims` is pure; `ClaimsReader` is the file edge, parsing again only when the file changed.
A missing file is no claims: kubelet writes it only once DRA has prepared something.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base.errors import InputError

STATE_FILE = "dra_manager_state"
MAX_BYTES = 64 << 20


class ClaimsError(InputError):
    """The checkpoint can not be read; names the field."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__("kubelet DRA checkpoint", where, reason)


@dataclass(frozen=True, slots=True)
class Claim:
    """One prepared claim: who holds it and the CDI devices its drivers prepared."""

    uid: str
    name: str
    namespace: str
    pod_uids: frozenset[str]
    cdi_devices: tuple[str, ...]  # qualified CDI names, every driver's
    requests: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (CDI name, the requests of its device)

    def requests_of(self, cdi_device: str) -> tuple[str, ...]:
        """The claim's requests a CDI device of it serves."""
        return next((names for n, names in self.requests if n == cdi_device), ())


@dataclass(frozen=True, slots=True)
class Claims:
    """The parsed checkpoint, indexed by pod UID."""

    claims: tuple[Claim, ...] = ()
    _by_pod: Mapping[str, tuple[Claim, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_pod: dict[str, list[Claim]] = {}
        for c in self.claims:
            for uid in c.pod_uids:
                by_pod.setdefault(uid, []).append(c)
        object.__setattr__(self, "_by_pod", {k: tuple(v) for k, v in by_pod.items()})

    def for_pod(self, pod_uid: str) -> tuple[Claim, ...]:
        return self._by_pod.get(pod_uid, ())

    def cdi_devices(self, pod_uid: str) -> frozenset[str]:
        """Every CDI device of the pod's claims."""
        return frozenset(n for c in self.for_pod(pod_uid) for n in c.cdi_devices)


def _obj(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ClaimsError(where, "expected an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ClaimsError(where, "expected a list")
    return value


def _str(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ClaimsError(where, "expected a string")
    return value


def parse_claims(data: bytes) -> Claims:
    """The claims in `data`. Raises ClaimsError for anything that is not the checkpoint."""
    if len(data) > MAX_BYTES:
        raise ClaimsError("", f"{len(data)} bytes is more than {MAX_BYTES}")
    try:
        doc = json.loads(data)
        outer = _obj(doc, "")
        inner = outer.get("Data")
        body = _obj(json.loads(inner) if isinstance(inner, str) else inner, "Data")
    except (ValueError, RecursionError) as e:
        raise ClaimsError("Data", f"not valid JSON ({e})") from None
    out = []
    for i, raw in enumerate(_list(body.get("ClaimInfoStateList"), "Data.ClaimInfoStateList")):
        where = f"Data.ClaimInfoStateList[{i}]"
        c = _obj(raw, where)
        pods = c.get("PodUIDs")
        pod_uids = pods.keys() if isinstance(pods, dict) else _list(pods, f"{where}.PodUIDs")
        cdi: list[str] = []
        requests: list[tuple[str, tuple[str, ...]]] = []
        for driver, state in _obj(c.get("DriverState"), f"{where}.DriverState").items():
            for j, dev in enumerate(_list(_obj(state, f"{where}.DriverState[{driver!r}]").get("Devices"), where)):
                at = f"{where}.DriverState[{driver!r}].Devices[{j}]"
                device = _obj(dev, at)
                names = tuple(
                    _str(r, f"{at}.RequestNames") for r in _list(device.get("RequestNames"), f"{at}.RequestNames")
                )
                ids = [_str(n, f"{at}.CDIDeviceIDs") for n in _list(device.get("CDIDeviceIDs"), where)]
                cdi.extend(ids)
                requests += [(n, names) for n in ids]
        out.append(
            Claim(
                uid=_str(c.get("ClaimUID"), f"{where}.ClaimUID"),
                name=_str(c.get("ClaimName"), f"{where}.ClaimName"),
                namespace=_str(c.get("Namespace"), f"{where}.Namespace"),
                pod_uids=frozenset(_str(u, f"{where}.PodUIDs") for u in pod_uids),
                cdi_devices=tuple(cdi),
                requests=tuple(requests),
            )
        )
    return Claims(tuple(out))


class ClaimsReader:
    """The checkpoint at `path`, parsed again only when the file changed (kubelet replaces it by
    rename, so one open() sees one whole version)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._key: tuple[int, int, int, int] | None = None
        self._value = Claims()

    def read(self) -> Claims:
        """Raises ClaimsError (unreadable or malformed)."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    st = os.fstat(f.fileno())
                    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                    if key == self._key:
                        return self._value
                    data = f.read(MAX_BYTES + 1)
            except FileNotFoundError:
                self._key, self._value = None, Claims()
                return self._value
            except OSError as e:
                raise ClaimsError("", f"{self.path}: {e.strerror or e}") from None
            self._value, self._key = parse_claims(data), key
            return self._value
