"""crihook's own CRI client of the runtime, for both front doors: wait until the runtime answers,
list its sandboxes and containers (the store's rebuild in proxy mode, the catch-up after a
Synchronize in NRI mode) and stop containers (NRI mode's eviction). The calls kubelet makes do not
come through here: proxy mode relays them byte for byte (proxy/relay.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from crihook.node.container import listed_container, spec_container
from crihook.node.pod import listed_nri_pod, listed_pod
from crihook.node.records import ContainerRecord, PodRecord
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import runtime_v1_pb2_grpc as cri_grpc

log = logging.getLogger("crihook.node")

LIST_TIMEOUT = 30.0  # seconds for one list call: a node with thousands of containers answers in well under
STATUS_TIMEOUT = 10.0
STOP_TIMEOUT = 30.0
_RECEIVE = [("grpc.max_receive_message_length", 64 << 20)]  # a node's whole list in one answer


class RuntimeUnreachable(Exception):
    """The runtime did not answer CRI within the patience given; the message says where and why."""


def _channel(endpoint: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(endpoint, options=_RECEIVE)


async def wait_for_runtime(endpoint: str, patience: float) -> None:
    """Call Version until the runtime answers, backing off from 0.1 s to 5 s; RuntimeUnreachable
    after `patience` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    delay = 0.1
    last = ""
    while True:
        async with _channel(endpoint) as ch:
            try:
                v = await cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(version="v1"), timeout=5)
                log.info(
                    "runtime reachable",
                    extra={"runtime": v.runtime_name, "version": v.runtime_version, "api": v.runtime_api_version},
                )
                return
            except grpc.aio.AioRpcError as e:
                last = e.details() or e.code().name
        if loop.time() + delay > deadline:
            raise RuntimeUnreachable(f"runtime at {endpoint} did not answer within {patience:.0f}s: {last}")
        log.warning("waiting for runtime", extra={"runtime": endpoint, "error": last, "retry_in": delay})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def _statuses(
    call: Callable[..., Awaitable[Any]], ids: list[str], make: Callable[[str], Message], what: str, parallel: int = 8
) -> dict[str, Any]:
    """The verbose status of each object (what the runtime's lists leave out: a sandbox's cgroup
    parent and runtime handler, a container's spec, envs and resources). One removed since it was
    listed is left out; one whose status can not be had is left out and logged."""
    gate = asyncio.Semaphore(parallel)

    async def one(object_id: str) -> Any:
        async with gate:
            try:
                return await call(make(object_id), timeout=STATUS_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    log.warning(f"{what} status unavailable", extra={"id": object_id[:13], "error": e.details()})
                return None

    found = await asyncio.gather(*(one(i) for i in ids))
    return {i: status for i, status in zip(ids, found, strict=True) if status is not None}


@dataclass
class Listing:
    """One look at the runtime over CRI: its sandboxes and containers, and the verbose statuses
    asked for."""

    sandboxes: list[cri.PodSandbox]
    containers: list[cri.Container]
    sandbox_status: dict[str, cri.PodSandboxStatusResponse]
    container_status: dict[str, cri.ContainerStatusResponse]


async def list_runtime(endpoint: str, sandbox_status: bool, status_of: Callable[[str], bool]) -> Listing:
    """The runtime's sandboxes and containers, with every sandbox's verbose status when
    `sandbox_status`, and the verbose status of the containers `status_of` picks."""
    async with _channel(endpoint) as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)
        sandboxes = await stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=LIST_TIMEOUT)
        containers = await stub.ListContainers(cri.ListContainersRequest(), timeout=LIST_TIMEOUT)
        pod_status = {}
        if sandbox_status:
            pod_status = await _statuses(
                stub.PodSandboxStatus,
                [s.id for s in sandboxes.items],
                lambda i: cri.PodSandboxStatusRequest(pod_sandbox_id=i, verbose=True),
                "sandbox",
            )
        ctr_status = await _statuses(
            stub.ContainerStatus,
            [c.id for c in containers.containers if status_of(c.id)],
            lambda i: cri.ContainerStatusRequest(container_id=i, verbose=True),
            "container",
        )
    return Listing(list(sandboxes.items), list(containers.containers), pod_status, ctr_status)


async def list_records(endpoint: str, known: Collection[str] = ()) -> tuple[list[PodRecord], list[ContainerRecord]]:
    """The runtime's sandboxes and containers as store records; `known`: the containers the store
    has, whose envs and resources are its own (the runtime is asked only about the others)."""
    seen = await list_runtime(endpoint, True, lambda cid: cid not in known)
    pods = [listed_pod(s, seen.sandbox_status.get(s.id)) for s in seen.sandboxes]
    ctrs = [listed_container(c, seen.container_status.get(c.id)) for c in seen.containers]
    return pods, ctrs


async def list_as_nri(endpoint: str) -> tuple[list[nri.PodSandbox], list[nri.Container]]:
    """Every sandbox and container the runtime lists over CRI, in whatever state, as NRI would show
    them: a container that was being created when containerd died, or whose creation raced a
    Synchronize, is listed by CRI but by no Synchronize. One removed while listed is left out."""
    seen = await list_runtime(endpoint, False, lambda cid: True)
    status = seen.container_status
    containers = [spec_container(c, status[c.id]) for c in seen.containers if c.id in status]
    return [listed_nri_pod(s) for s in seen.sandboxes], containers


async def created_since(endpoint: str, since_ns: int) -> list[str]:
    """The ids of the containers the runtime lists as created after `since_ns` (wall-clock
    nanoseconds, CRI's `created_at`), oldest first."""
    async with _channel(endpoint) as ch:
        listed = await cri_grpc.RuntimeServiceStub(ch).ListContainers(cri.ListContainersRequest(), timeout=LIST_TIMEOUT)
    newer = sorted((c.created_at, c.id) for c in listed.containers if c.created_at > since_ns)
    return [cid for _, cid in newer]


async def stop_containers(endpoint: str, ids: Sequence[str]) -> None:
    """CRI StopContainer with no grace for each of `ids`, on the runtime's own socket: what
    containerd's own NRI eviction does. The first failure raises."""
    async with _channel(endpoint) as channel:
        stub = cri_grpc.RuntimeServiceStub(channel)
        for cid in ids:
            await stub.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=STOP_TIMEOUT)
