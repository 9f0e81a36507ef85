"""The kubelet plugin of crihook's DRA driver: registration and the DRAPlugin service, v1 and v1beta1.

Kubelet finds the plugin by its registration socket in `<kubelet root>/plugins_registry/`, asks
`GetInfo` (type DRAPlugin, the driver's name, the service socket, the versions served) and says how
registration went through `NotifyRegistrationStatus`. Before a pod's containers are created it calls
`NodePrepareResources` with the pod's claims of this driver; after they are gone,
`NodeUnprepareResources`. Both are idempotent and answer per claim: one claim that fails (not found,
another UID, not allocated, a GPU the node lacks) carries its error, the others are prepared.

Prepare reads the claim from the API server, takes this driver's results on this node's pool
(dra/claims.py), numbers together the claims a container of the pod holds together (the pod read
through the claims' reservedFor), writes the claim's CDI spec, then names the claim in the
checkpoint (dra/state.py);
a claim the checkpoint names is answered from it, so kubelet's repeated calls, and calls after a
restart, need no API server. Unprepare removes the claim from the checkpoint, then its spec.
Blocking work (the API calls, NVML, the files) runs on worker threads, a lone claim's in one hop;
calls for one claim are serialised, calls for different claims run at once (each claim has a
checkpoint file of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from crihook.base import dra
from crihook.devices import drashares
from crihook.dra import claims as cl
from crihook.dra.state import State, remove, write_atomic
from crihook.hooks.gpu import node_number
from crihook.hooks.gpu_edit import GpuLookup
from crihook.hooks.grant import HamiCore, make_hami_dir
from crihook.hooks.reach import DeviceNode
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from crihook.proto import pluginregistration_v1_pb2 as reg_pb
from crihook.proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger("crihook.dra")

PLUGIN_TYPE = "DRAPlugin"
VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# Seconds one read of a claim or pod may take: a read left waiting forever on a lost answer would
# hold the claim's lock, and every call kubelet makes again for it would wait behind it.
FETCH_TIMEOUT = 10.0
SPEC_PREFIX = f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_"  # + claim UID + ".json"

# (namespace, name) -> the object as the API server holds it (JSON), called on a worker thread;
# raises ClaimError
Fetch = Callable[[str, str], Mapping[str, Any]]


@dataclass(frozen=True)
class Paths:
    """Where the plugin's sockets and files are."""

    kubelet_root: Path = Path("/var/lib/kubelet")
    state_dir: Path = Path("/var/lib/crihook")
    cdi_dir: Path = Path("/var/run/cdi")
    dev_root: str = "/dev"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_root / "plugins_registry" / f"{dra.DRIVER}-reg.sock"

    @property
    def service_socket(self) -> Path:
        return self.kubelet_root / "plugins" / dra.DRIVER / "dra.sock"

    @property
    def checkpoint(self) -> Path:
        return self.state_dir / drashares.DIR

    def spec_file(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"{SPEC_PREFIX}{claim_uid}.json"


@dataclass(frozen=True)
class Claim:
    namespace: str
    uid: str
    name: str


class Driver:
    """Prepares and unprepares claims; the servicers below translate kubelet's messages."""

    def __init__(
        self,
        node: str,
        gpus: GpuLookup,
        fetch: Fetch,
        paths: Paths,
        hami: HamiCore | None = None,
        exists: Callable[[str], bool] = os.path.exists,
        fetch_pod: Fetch | None = None,
        number: Callable[[str], DeviceNode | None] | None = None,
        taken: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        """`fetch`: a claim by namespace and name; `fetch_pod`: a pod (None: claims are numbered
        alone); `number`: a device node's type and numbers by its path (None: read from the file);
        `taken`: the minors crihook's allocator gave out, as the slice publisher last saw them (a
        claim allocated one of them is refused)."""
        self.node = node
        self.gpus = gpus
        self.fetch = fetch
        self.fetch_pod = fetch_pod
        self.taken = taken
        self.paths = paths
        self.hami = hami or HamiCore()
        self.exists = exists
        self.number = number or device_number
        self.state = State(paths.checkpoint)
        self._claim_locks: dict[str, asyncio.Lock] = {}
        self.registered: asyncio.Event = asyncio.Event()
        self.registration_error = ""

    def start(self) -> None:
        """Read the checkpoint and remove the CDI specs it does not name (a crash between writing a
        spec and naming its claim). Raises StateError."""
        self.state.load()
        for path in sorted(self.paths.cdi_dir.glob(f"{SPEC_PREFIX}*.json")):
            uid = path.name[len(SPEC_PREFIX) : -len(".json")]
            if uid not in self.state.claims:
                remove(path)
                log.info("CDI spec of no prepared claim removed", extra={"file": str(path)})
        log.info("prepared claims read", extra={"claims": len(self.state.claims), "dir": str(self.paths.checkpoint)})

    async def prepare(self, claims: Sequence[Claim]) -> dict[str, cl.Prepared | str]:
        """Claim UID -> the prepared claim, or the error for that claim. The claims of one call are
        one pod's: those its containers hold together are numbered together in their specs."""
        async with contextlib.AsyncExitStack() as stack:
            for uid in sorted({c.uid for c in claims}):  # one order: calls sharing claims never wait in a circle
                await stack.enter_async_context(self._claim_locks.setdefault(uid, asyncio.Lock()))
            if len(claims) == 1 and claims[0].uid not in self.state.claims:  # most pods: one worker-thread hop
                return {claims[0].uid: await asyncio.to_thread(self._prepare_alone, claims[0])}
            found = await asyncio.gather(*(self._resolve(c) for c in claims))
            out: dict[str, cl.Prepared | str] = {}
            for c, r in zip(claims, found, strict=True):
                out[c.uid] = r if isinstance(r, str) else r[0]
            resolved = {c.uid: r for c, r in zip(claims, found, strict=True) if not isinstance(r, str)}
            groups = await self._groups(resolved)
            for c in claims:
                if c.uid not in resolved:
                    continue
                p, doc = resolved[c.uid]
                uids = groups.get(c.uid)
                group = None if uids is None else tuple(resolved[u][0] for u in uids if u in resolved)
                try:
                    out[c.uid] = await asyncio.to_thread(self._settle, p, group, doc is not None)
                except cl.ClaimError as e:
                    out[c.uid] = self._failed(c, str(e))
                    continue
                if doc is not None:
                    self._prepared(c, p)
        return out

    def _prepared(self, c: Claim, p: cl.Prepared) -> None:
        devices = ",".join(d.device for d in p.devices)
        log.info("claim prepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid, "devices": devices})

    def _prepare_alone(self, c: Claim) -> cl.Prepared | str:
        """On a worker thread: a new claim, the only one of its call, read, resolved and settled."""
        found = self._read(c)
        if isinstance(found, str):
            return found
        try:
            done = self._settle(found[0], None, True)
        except cl.ClaimError as e:
            return self._failed(c, str(e))
        self._prepared(c, done)
        return done

    async def _resolve(self, c: Claim) -> tuple[cl.Prepared, Mapping[str, Any] | None] | str:
        """The claim as the checkpoint holds it (no document), or read and resolved; or its error."""
        held = self.state.claims.get(c.uid)
        if held is not None:
            return held, None
        return await asyncio.to_thread(self._read, c)

    def _read(self, c: Claim) -> tuple[cl.Prepared, Mapping[str, Any]] | str:
        """On a worker thread: the claim read from the API server and resolved, or its error."""
        try:
            doc = self.fetch(c.namespace, c.name)
            return cl.resolve(doc, c.uid, self.node, self.gpus, self.taken()), doc
        except cl.ClaimError as e:
            return self._failed(c, str(e))

    def _failed(self, c: Claim, error: str) -> str:
        log.warning("claim not prepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid, "error": error})
        return error

    async def _groups(
        self, resolved: Mapping[str, tuple[cl.Prepared, Mapping[str, Any] | None]]
    ) -> dict[str, tuple[str, ...]]:
        """Claim UID -> the UIDs of the call's claims its containers hold with it (() alone), from
        the pod the new claims are reserved for; nothing (held claims keep their numbering, new ones
        are alone) when fewer than two hold GPUs, when none is new, or when the pod can not be told."""
        members = {uid: r for uid, r in resolved.items() if r[0].devices}
        docs = [doc for _, doc in members.values() if doc is not None]
        if len(members) < 2 or not docs or self.fetch_pod is None:
            return {}
        pods = [{(r.get("name"), r.get("uid")) for r in _reserved(doc)} for doc in docs]
        common = set.intersection(*pods)
        some = next(iter(members.values()))[0]
        if len(common) != 1:
            log.warning("claims numbered alone: not reserved for one pod", extra={"pods": len(common)})
            return {}
        ((name, pod_uid),) = common
        try:
            pod = await asyncio.to_thread(self.fetch_pod, some.namespace, str(name))
        except cl.ClaimError as e:
            log.warning("claims numbered alone: the pod can not be read", extra={"error": str(e)})
            return {}
        if (pod.get("metadata") or {}).get("uid") != pod_uid:
            return {}
        groups, problems = cl.pod_groups(pod, {p.name: uid for uid, (p, _) in members.items()})
        for problem in problems:
            log.warning("claim numbered alone", extra={"pod": f"{some.namespace}/{name}", "problem": problem})
        return {uid: g if len(g) > 1 else () for uid, g in groups.items()}

    def _settle(self, p: cl.Prepared, group: Sequence[cl.Prepared] | None, new: bool) -> cl.Prepared:
        """On a worker thread: a new claim, or a held one whose group changed, gets its spec, then
        its checkpoint file; a held one keeps its own, written again if missing (/var/run is
        emptied at boot). `group`: the claims numbered with it (None: as it was, or alone)."""
        uids = tuple(sorted(m.uid for m in group)) if group is not None and len(group) > 1 else ()
        if new or (group is not None and uids != p.group):
            done = cl.with_spec(p, group or (), self.gpus, self.exists, self.paths.dev_root, self.hami)
            if done.spec:
                self._write(done.uid, done.spec)
            self.state.put(done)
            return done
        if p.devices and not self.paths.spec_file(p.uid).exists():
            self._write_spec(p)
        return p

    async def unprepare(self, claims: Sequence[Claim]) -> dict[str, str]:
        """Claim UID -> "" or the error for that claim."""
        done = await asyncio.gather(*(self._locked(c, self._unprepare) for c in claims))
        return {c.uid: r for c, r in zip(claims, done, strict=True)}

    async def _locked(self, c: Claim, work: Callable[[Claim], Awaitable[Any]]) -> Any:
        """One call at a time per claim; the lock goes when the claim is unprepared."""
        async with self._claim_locks.setdefault(c.uid, asyncio.Lock()):
            return await work(c)

    def _write(self, uid: str, spec: Mapping[str, Any]) -> None:
        """HAMi-core's directories made, then the spec. Raises ClaimError."""
        for d in cl.spec_dirs(spec):
            try:
                make_hami_dir(d)
            except OSError as e:
                raise cl.ClaimError(f"HAMi-core directory {d} can not be made ({e.strerror or e})") from None
        doc = cl.numbered(spec, self.number)
        write_atomic(self.paths.spec_file(uid), json.dumps(doc, indent=1).encode(), 0o644)

    async def _unprepare(self, c: Claim) -> str:
        if c.uid not in self.state.claims:
            return ""  # never prepared here, or already unprepared
        await asyncio.to_thread(self._drop, c.uid)
        self._claim_locks.pop(c.uid, None)  # held by this call: a waiter still holds its own reference
        log.info("claim unprepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid})
        return ""

    def _drop(self, uid: str) -> None:
        self.state.drop(uid)
        remove(self.paths.spec_file(uid))

    def _write_spec(self, p: cl.Prepared) -> None:
        """A prepared claim's spec again, from the checkpoint's facts (its group's, those still
        prepared). Raises ClaimError."""
        group = [self.state.claims[u] for u in p.group if u in self.state.claims] or [p]
        self._write(p.uid, cl.cdi_spec(p, group, self.gpus, self.exists, self.paths.dev_root, self.hami))


def device_number(path: str) -> DeviceNode | None:
    """The device node at `path` as this process sees it; None where there is none."""
    try:
        return node_number(path)
    except OSError:
        return None


def _reserved(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pods a claim is reserved for (status.reservedFor)."""
    found = (doc.get("status") or {}).get("reservedFor") or ()
    return [r for r in found if r.get("resource") == "pods" and not r.get("apiGroup")]


def _claims(request: Any) -> list[Claim]:
    return [Claim(c.namespace, c.uid, c.name) for c in request.claims]


def _fill(pb: Any, response: Any, out: Mapping[str, cl.Prepared | str]) -> None:
    """One claim's answer per UID: its devices with their CDI ids, or its error."""
    shares = "share_id" in pb.Device.DESCRIPTOR.fields_by_name
    for uid, r in out.items():
        entry = response.claims[uid]
        if isinstance(r, str):
            entry.error = r
            continue
        for d in r.devices:
            dev = entry.devices.add(
                request_names=list(d.requests), pool_name=d.pool, device_name=d.device, cdi_device_ids=r.cdi_ids(d)
            )
            if shares and d.share_id:
                dev.share_id = d.share_id


class _DraService:
    """DRAPlugin of one version (`pb`: its messages); v1 and v1beta1 differ in their package and in
    v1's share id alone."""

    def __init__(self, driver: Driver, pb: Any) -> None:
        self.driver = driver
        self.pb = pb

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = self.pb.NodePrepareResourcesResponse()
        _fill(self.pb, response, await self.driver.prepare(_claims(request)))
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = self.pb.NodeUnprepareResourcesResponse()
        for uid, error in (await self.driver.unprepare(_claims(request))).items():
            response.claims[uid].error = error
        return response


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=dra.DRIVER,
            endpoint=str(self.driver.paths.service_socket),
            supported_versions=list(VERSIONS),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            log.info("registered with kubelet", extra={"driver": dra.DRIVER})
            self.driver.registration_error = ""
            self.driver.registered.set()
        else:
            log.error("kubelet refused the registration", extra={"driver": dra.DRIVER, "error": request.error})
            self.driver.registration_error = request.error
            self.driver.registered.clear()
        return reg_pb.RegistrationStatusResponse()


class Plugin:
    """The two gRPC servers: the service socket first (kubelet calls it as soon as it has
    registered the plugin), then the registration socket kubelet watches for."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self._servers: list[tuple[grpc.aio.Server, Path]] = []

    async def start(self) -> None:
        paths = self.driver.paths
        service = grpc.aio.server()
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_DraService(self.driver, dra_v1_pb2), service)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(_DraService(self.driver, dra_v1beta1_pb2), service)
        await self._listen(service, paths.service_socket)
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self.driver), registration)
        await self._listen(registration, paths.registration_socket)

    async def _listen(self, server: grpc.aio.Server, socket: Path) -> None:
        socket.parent.mkdir(parents=True, exist_ok=True)
        remove(socket)  # a socket left by a driver that did not stop cleanly
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        self._servers.append((server, socket))
        log.info("serving", extra={"socket": str(socket)})

    async def stop(self, grace: float = 1.0) -> None:
        """The registration socket goes first: kubelet unregisters the plugin when it disappears."""
        for server, socket in reversed(self._servers):
            remove(socket)
            await server.stop(grace)
        self._servers.clear()


# where each kind is read (resource.k8s.io/v1 ResourceClaim, core/v1 Pod)
_PATHS = {
    "claim": "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
    "pod": "/api/v1/namespaces/{namespace}/pods/{name}",
}


def api_fetch(api_client: Any, kind: str = "claim") -> Fetch:
    """A Fetch through the kubernetes client's ApiClient (its configuration, credentials and
    connection pool): a ResourceClaim or, with kind "pod", a Pod; the object as JSON. Raises
    ClaimError. The request is built with the client's `param_serialize` and sent with `call_api`,
    the two steps of its generated read methods without their per-call argument validation, which
    cost more CPU than the rest of a prepare (0.94 against 0.35 ms a read, measured against the fake
    API server)."""
    path = _PATHS[kind]

    def read(namespace: str, name: str) -> Mapping[str, Any]:
        request = api_client.param_serialize(
            method="GET",
            resource_path=path,
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        try:
            response: Any = api_client.call_api(*request, _request_timeout=FETCH_TIMEOUT)
            response.read()
        except Exception as e:  # unreachable API server: kubelet asks again
            raise cl.ClaimError(f"{kind} {namespace}/{name}: API server not reachable ({e})") from None
        if response.status == 404:
            raise cl.ClaimError(f"{kind} {namespace}/{name} not found")
        if not 200 <= response.status < 300:
            raise cl.ClaimError(f"{kind} {namespace}/{name}: API server answered {response.status} {response.reason}")
        try:
            doc: Mapping[str, Any] = json.loads(response.data)
        except ValueError as e:
            raise cl.ClaimError(f"{kind} {namespace}/{name}: the API server's answer is not JSON ({e})") from None
        return doc

    return read
