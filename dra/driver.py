"""The kubelet plugin of crihook's DRA driver: registration and the DRAPlugin service, v1 and v1beta1.

Kubelet finds the plugin by its registration socket in `<kubelet root>/plugins_registry/`, asks
`GetInfo` (type DRAPlugin, the driver's name, the service socket, the versions served) and says how
registration went through `NotifyRegistrationStatus`. Before a pod's containers are created it calls
`NodePrepareResources` with the pod's claims of this driver; after they are gone,
`NodeUnprepareResources`. Both are idempotent and answer per claim: one claim that fails (not found,
another UID, not allocated, a GPU the node lacks) carries its error, the others are prepared.

Prepare reads the claim from the API server, takes this driver's results on this node's pool
(dra/claims.py), writes the claim's CDI spec, then names the claim in the checkpoint (dra/state.py);
a claim the checkpoint names is answered from it, so kubelet's repeated calls, and calls after a
restart, need no API server. Unprepare removes the claim from the checkpoint, then its spec.
Blocking work (the API call, NVML, the files) runs on worker threads; calls for one claim are
serialised, calls for different claims run at once (each claim has a checkpoint file of its own).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from crihook.base import dra
from crihook.dra import claims as cl
from crihook.dra.state import State, remove, write_atomic
from crihook.hooks.gpu_edit import GpuLookup
from crihook.hooks.grant import HamiCore
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from crihook.proto import pluginregistration_v1_pb2 as reg_pb
from crihook.proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger("crihook.dra")

PLUGIN_TYPE = "DRAPlugin"
VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
SPEC_PREFIX = f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_"  # + claim UID + ".json"

# (namespace, name) -> the claim as the API server holds it (JSON); raises ClaimError
Fetch = Callable[[str, str], Awaitable[Mapping[str, Any]]]


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
        return self.state_dir / "dra"

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
    ) -> None:
        self.node = node
        self.gpus = gpus
        self.fetch = fetch
        self.paths = paths
        self.hami = hami or HamiCore()
        self.exists = exists
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
                remove(path, durable=False)
                log.info("CDI spec of no prepared claim removed", extra={"file": str(path)})
        log.info("prepared claims read", extra={"claims": len(self.state.claims), "dir": str(self.paths.checkpoint)})

    async def prepare(self, claims: Sequence[Claim]) -> dict[str, cl.Prepared | str]:
        """Claim UID -> the prepared claim, or the error for that claim."""
        done = await asyncio.gather(*(self._locked(c, self._prepare) for c in claims))
        return {c.uid: r for c, r in zip(claims, done, strict=True)}

    async def unprepare(self, claims: Sequence[Claim]) -> dict[str, str]:
        """Claim UID -> "" or the error for that claim."""
        done = await asyncio.gather(*(self._locked(c, self._unprepare) for c in claims))
        return {c.uid: r for c, r in zip(claims, done, strict=True)}

    async def _locked(self, c: Claim, work: Callable[[Claim], Awaitable[Any]]) -> Any:
        """One call at a time per claim; the lock goes when the claim is unprepared."""
        async with self._claim_locks.setdefault(c.uid, asyncio.Lock()):
            return await work(c)

    async def _prepare(self, c: Claim) -> cl.Prepared | str:
        held = self.state.claims.get(c.uid)
        try:
            if held is not None:
                if not self.paths.spec_file(c.uid).exists():  # /var/run emptied by a reboot
                    await asyncio.to_thread(self._write_spec, held)
                return held
            doc = await self.fetch(c.namespace, c.name)
            prepared = await asyncio.to_thread(self._prepare_and_write, doc, c.uid)
        except cl.ClaimError as e:
            log.warning("claim not prepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid, "error": str(e)})
            return str(e)
        devices = ",".join(d.device for d in prepared.devices)
        log.info("claim prepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid, "devices": devices})
        return prepared

    def _prepare_and_write(self, doc: Mapping[str, Any], uid: str) -> cl.Prepared:
        """On a worker thread: the claim prepared, its spec written, then the checkpoint naming it."""
        prepared = cl.prepare(doc, uid, self.node, self.gpus, self.exists, self.paths.dev_root, self.hami)
        if prepared.spec:
            self._write(uid, prepared.spec)
        self.state.put(prepared)
        return prepared

    def _write(self, uid: str, spec: Mapping[str, Any]) -> None:
        """HAMi-core's directories made (every user writes there, as HAMi's device plugin makes
        them), then the spec. Raises ClaimError."""
        for d in cl.spec_dirs(spec):
            try:
                os.makedirs(d, exist_ok=True)
                if stat.S_IMODE(os.stat(d).st_mode) != 0o777:
                    os.chmod(d, 0o777)
            except OSError as e:
                raise cl.ClaimError(f"HAMi-core directory {d} can not be made ({e.strerror or e})") from None
        write_atomic(self.paths.spec_file(uid), json.dumps(spec, indent=1).encode(), 0o644, durable=False)

    async def _unprepare(self, c: Claim) -> str:
        if c.uid not in self.state.claims:
            return ""  # never prepared here, or already unprepared
        await asyncio.to_thread(self._drop, c.uid)
        self._claim_locks.pop(c.uid, None)  # held by this call: a waiter still holds its own reference
        log.info("claim unprepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid})
        return ""

    def _drop(self, uid: str) -> None:
        self.state.drop(uid)
        remove(self.paths.spec_file(uid), durable=False)

    def _write_spec(self, p: cl.Prepared) -> None:
        """A prepared claim's spec again, from the checkpoint's facts. Raises ClaimError."""
        if p.devices:
            self._write(p.uid, cl.cdi_spec(p, self.gpus, self.exists, self.paths.dev_root, self.hami))


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


class _DraV1(dra_v1_pb2_grpc.DRAPluginServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = dra_v1_pb2.NodePrepareResourcesResponse()
        _fill(dra_v1_pb2, response, await self.driver.prepare(_claims(request)))
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra_v1_pb2.NodeUnprepareResourcesResponse()
        for uid, error in (await self.driver.unprepare(_claims(request))).items():
            response.claims[uid].error = error
        return response


class _DraV1beta1(dra_v1beta1_pb2_grpc.DRAPluginServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = dra_v1beta1_pb2.NodePrepareResourcesResponse()
        _fill(dra_v1beta1_pb2, response, await self.driver.prepare(_claims(request)))
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra_v1beta1_pb2.NodeUnprepareResourcesResponse()
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
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_DraV1(self.driver), service)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(_DraV1beta1(self.driver), service)
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


def api_fetch(api_client: Any) -> Fetch:
    """A Fetch through the kubernetes client (ResourceV1Api), on a worker thread; the claim as JSON."""
    from kubernetes.client import ResourceV1Api
    from kubernetes.client.exceptions import ApiException

    api = ResourceV1Api(api_client)

    def read(namespace: str, name: str) -> Mapping[str, Any]:
        try:
            response: Any = api.read_namespaced_resource_claim(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                raise cl.ClaimError(f"claim {namespace}/{name} not found") from None
            raise cl.ClaimError(f"claim {namespace}/{name}: API server answered {e.status} {e.reason}") from None
        except Exception as e:  # unreachable API server: kubelet asks again
            raise cl.ClaimError(f"claim {namespace}/{name}: API server not reachable ({e})") from None
        doc: Mapping[str, Any] = json.loads(response.data)
        return doc

    async def fetch(namespace: str, name: str) -> Mapping[str, Any]:
        return await asyncio.to_thread(read, namespace, name)

    return fetch
