"""An in-process CRI runtime for `crihook demo` on machines where containerd can not run.

It speaks runtime.v1 on a unix socket like containerd does and keeps, for each container, the exact
ContainerConfig it was asked to create. `ContainerStatus(verbose=True)` returns that config's env,
devices and mounts under info["info"]["runtimeSpec"], shaped like the OCI spec containerd reports
there, so a client reads both runtimes the same way and sees what a real container would be given.
Nothing runs: there are no processes, images or namespaces, and that is all it is for.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from crihook import __version__
from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import runtime_v1_pb2_grpc as api_grpc


@dataclass
class _Pod:
    id: str
    config: api.PodSandboxConfig
    created: int
    state: api.PodSandboxState = api.SANDBOX_READY


@dataclass
class _Container:
    id: str
    pod_id: str
    config: api.ContainerConfig
    created: int
    state: api.ContainerState = api.CONTAINER_CREATED
    started: int = 0
    finished: int = 0
    resources: api.LinuxContainerResources = field(default_factory=api.LinuxContainerResources)


def _text(b: bytes | str) -> str:
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b


def container_spec(config: api.ContainerConfig, cgroups_path: str) -> dict[str, object]:
    """The parts of the OCI runtime spec a device hook decides, shaped as containerd reports them in
    its verbose ContainerStatus (process.env, mounts, linux.devices), and the container's cgroup
    (linux.cgroupsPath), which attributes its processes' GPU use."""
    return {
        "process": {"env": [f"{_text(kv.key)}={_text(kv.value)}" for kv in config.envs]},
        "mounts": [
            {"destination": m.container_path, "source": m.host_path, "options": ["ro" if m.readonly else "rw"]}
            for m in config.mounts
        ],
        "linux": {
            "devices": [{"path": d.container_path, "hostPath": d.host_path} for d in config.devices],
            "cgroupsPath": cgroups_path,
        },
        "cdiDevices": [c.name for c in config.CDI_devices],
    }


class EmbeddedRuntime(api_grpc.RuntimeServiceServicer):
    """Pod and container bookkeeping with containerd's answers for the calls kubelet makes."""

    def __init__(self) -> None:
        self.pods: dict[str, _Pod] = {}
        self.containers: dict[str, _Container] = {}
        self._ids = itertools.count(1)

    def _new_id(self) -> str:
        return f"{next(self._ids):064x}"

    async def _missing(self, context: grpc.aio.ServicerContext[Any, Any], what: str, ident: str) -> None:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f'an error occurred when try to find {what} "{ident}": not found'
        )

    async def Version(
        self, request: api.VersionRequest, context: grpc.aio.ServicerContext[api.VersionRequest, api.VersionResponse]
    ) -> api.VersionResponse:
        return api.VersionResponse(
            version="0.1.0", runtime_name="crihook-embedded", runtime_version=__version__, runtime_api_version="v1"
        )

    async def Status(
        self, request: api.StatusRequest, context: grpc.aio.ServicerContext[api.StatusRequest, api.StatusResponse]
    ) -> api.StatusResponse:
        conditions = [api.RuntimeCondition(type=t, status=True) for t in ("RuntimeReady", "NetworkReady")]
        return api.StatusResponse(status=api.RuntimeStatus(conditions=conditions))

    async def RunPodSandbox(
        self,
        request: api.RunPodSandboxRequest,
        context: grpc.aio.ServicerContext[api.RunPodSandboxRequest, api.RunPodSandboxResponse],
    ) -> api.RunPodSandboxResponse:
        pod = _Pod(self._new_id(), request.config, time.time_ns())
        self.pods[pod.id] = pod
        return api.RunPodSandboxResponse(pod_sandbox_id=pod.id)

    async def StopPodSandbox(
        self,
        request: api.StopPodSandboxRequest,
        context: grpc.aio.ServicerContext[api.StopPodSandboxRequest, api.StopPodSandboxResponse],
    ) -> api.StopPodSandboxResponse:
        pod = self.pods.get(request.pod_sandbox_id)
        if pod is not None:
            pod.state = api.SANDBOX_NOTREADY
            for c in self.containers.values():
                if c.pod_id == pod.id and c.state == api.CONTAINER_RUNNING:
                    c.state, c.finished = api.CONTAINER_EXITED, time.time_ns()
        return api.StopPodSandboxResponse()

    async def RemovePodSandbox(
        self,
        request: api.RemovePodSandboxRequest,
        context: grpc.aio.ServicerContext[api.RemovePodSandboxRequest, api.RemovePodSandboxResponse],
    ) -> api.RemovePodSandboxResponse:
        self.pods.pop(request.pod_sandbox_id, None)
        for cid in [c.id for c in self.containers.values() if c.pod_id == request.pod_sandbox_id]:
            del self.containers[cid]
        return api.RemovePodSandboxResponse()

    async def PodSandboxStatus(
        self,
        request: api.PodSandboxStatusRequest,
        context: grpc.aio.ServicerContext[api.PodSandboxStatusRequest, api.PodSandboxStatusResponse],
    ) -> api.PodSandboxStatusResponse:
        pod = self.pods.get(request.pod_sandbox_id)
        if pod is None:
            await self._missing(context, "sandbox", request.pod_sandbox_id)
            raise AssertionError("unreachable")
        cfg = pod.config
        status = api.PodSandboxStatus(
            id=pod.id,
            metadata=cfg.metadata,
            state=pod.state,
            created_at=pod.created,
            labels=cfg.labels,
            annotations=cfg.annotations,
        )
        return api.PodSandboxStatusResponse(status=status)

    async def ListPodSandbox(
        self,
        request: api.ListPodSandboxRequest,
        context: grpc.aio.ServicerContext[api.ListPodSandboxRequest, api.ListPodSandboxResponse],
    ) -> api.ListPodSandboxResponse:
        items = [
            api.PodSandbox(
                id=p.id,
                metadata=p.config.metadata,
                state=p.state,
                created_at=p.created,
                labels=p.config.labels,
                annotations=p.config.annotations,
            )
            for p in self.pods.values()
            if not request.filter.id or p.id == request.filter.id
        ]
        return api.ListPodSandboxResponse(items=items)

    async def CreateContainer(
        self,
        request: api.CreateContainerRequest,
        context: grpc.aio.ServicerContext[api.CreateContainerRequest, api.CreateContainerResponse],
    ) -> api.CreateContainerResponse:
        if request.pod_sandbox_id not in self.pods:
            await self._missing(context, "sandbox", request.pod_sandbox_id)
        c = _Container(self._new_id(), request.pod_sandbox_id, request.config, time.time_ns())
        c.resources.CopyFrom(request.config.linux.resources)
        self.containers[c.id] = c
        return api.CreateContainerResponse(container_id=c.id)

    async def _container(self, context: grpc.aio.ServicerContext[Any, Any], cid: str) -> _Container:
        c = self.containers.get(cid)
        if c is None:
            await self._missing(context, "container", cid)
            raise AssertionError("unreachable")
        return c

    async def StartContainer(
        self,
        request: api.StartContainerRequest,
        context: grpc.aio.ServicerContext[api.StartContainerRequest, api.StartContainerResponse],
    ) -> api.StartContainerResponse:
        c = await self._container(context, request.container_id)
        c.state, c.started = api.CONTAINER_RUNNING, time.time_ns()
        return api.StartContainerResponse()

    async def StopContainer(
        self,
        request: api.StopContainerRequest,
        context: grpc.aio.ServicerContext[api.StopContainerRequest, api.StopContainerResponse],
    ) -> api.StopContainerResponse:
        c = self.containers.get(request.container_id)
        if c is not None and c.state == api.CONTAINER_RUNNING:
            c.state, c.finished = api.CONTAINER_EXITED, time.time_ns()
        return api.StopContainerResponse()

    async def RemoveContainer(
        self,
        request: api.RemoveContainerRequest,
        context: grpc.aio.ServicerContext[api.RemoveContainerRequest, api.RemoveContainerResponse],
    ) -> api.RemoveContainerResponse:
        self.containers.pop(request.container_id, None)
        return api.RemoveContainerResponse()

    async def ListContainers(
        self,
        request: api.ListContainersRequest,
        context: grpc.aio.ServicerContext[api.ListContainersRequest, api.ListContainersResponse],
    ) -> api.ListContainersResponse:
        f = request.filter
        items = [
            api.Container(
                id=c.id,
                pod_sandbox_id=c.pod_id,
                metadata=c.config.metadata,
                image=c.config.image,
                state=c.state,
                created_at=c.created,
                labels=c.config.labels,
                annotations=c.config.annotations,
            )
            for c in self.containers.values()
            if (not f.id or c.id == f.id) and (not f.pod_sandbox_id or c.pod_id == f.pod_sandbox_id)
        ]
        return api.ListContainersResponse(containers=items)

    async def ContainerStatus(
        self,
        request: api.ContainerStatusRequest,
        context: grpc.aio.ServicerContext[api.ContainerStatusRequest, api.ContainerStatusResponse],
    ) -> api.ContainerStatusResponse:
        c = await self._container(context, request.container_id)
        cfg = c.config
        status = api.ContainerStatus(
            id=c.id,
            metadata=cfg.metadata,
            state=c.state,
            created_at=c.created,
            started_at=c.started,
            finished_at=c.finished,
            image=cfg.image,
            labels=cfg.labels,
            annotations=cfg.annotations,
            mounts=cfg.mounts,
            resources=api.ContainerResources(linux=c.resources),
        )
        pod = self.pods.get(c.pod_id)
        # containerd's cgroupfs driver: the sandbox's cgroup parent joined with the container id
        parent = pod.config.linux.cgroup_parent if pod is not None else ""
        spec = container_spec(cfg, f"{parent.rstrip('/')}/{c.id}")
        info = {"info": json.dumps({"runtimeSpec": spec})} if request.verbose else {}
        return api.ContainerStatusResponse(status=status, info=info)

    async def UpdateContainerResources(
        self,
        request: api.UpdateContainerResourcesRequest,
        context: grpc.aio.ServicerContext[api.UpdateContainerResourcesRequest, api.UpdateContainerResourcesResponse],
    ) -> api.UpdateContainerResourcesResponse:
        c = await self._container(context, request.container_id)
        c.resources.MergeFrom(request.linux)
        return api.UpdateContainerResourcesResponse()


async def serve(socket_path: str) -> tuple[grpc.aio.Server, EmbeddedRuntime]:
    """Start the embedded runtime on a unix socket; the caller stops the server."""
    server = grpc.aio.server()
    runtime = EmbeddedRuntime()
    api_grpc.add_RuntimeServiceServicer_to_server(runtime, server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    return server, runtime
