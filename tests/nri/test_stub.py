"""The plugin stub against a runtime played by the test (fakeruntime.py): registration, the calls it
serves and the ones it answers Unimplemented, Synchronize in chunks, handler failures, calls back to
the runtime, and every way a connection can break: the plugin drops it, dials again, never crashes.
The same flows against real containerd 1.7 and 2.x are in test_runtime.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from crihook.base.metrics import NRI_UNREGISTERED
from crihook.nri import mux, ttrpc
from crihook.nri.stub import Code, ConnectionLost, Plugin, RpcError, _Service, event_mask, inherited_socket
from crihook.nri.ttrpc import Frame, MessageType
from crihook.proto import nri_v1alpha1_pb2 as api
from tests.nri.fakeruntime import FakeRuntime, Peer
from tests.support.nriplugin import NoChange

EVENTS = event_mask(api.CREATE_CONTAINER, api.STOP_CONTAINER)


class Recorder:
    """A Handler that records what it was given and answers with an env adjustment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail: Exception | None = None

    async def configure(self, request: api.ConfigureRequest) -> int:
        self.calls.append(("configure", request.runtime_name))
        return EVENTS

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        self.calls.append(("synchronize", ([p.id for p in pods], [c.id for c in containers])))
        return [api.ContainerUpdate(container_id=c.id) for c in containers]

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        self.calls.append(("create", request.container.id))
        if self.fail is not None:
            raise self.fail
        return api.CreateContainerResponse(adjust=api.ContainerAdjustment(env=[api.KeyValue(key="A", value="1")]))

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        self.calls.append(("update", request.container.id))
        return api.UpdateContainerResponse()

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        self.calls.append(("stop", request.container.id))
        return api.StopContainerResponse()

    async def validate_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        self.calls.append(("validate", request.container.id))
        return api.ValidateContainerAdjustmentResponse(reject=True, reason="no")

    async def state_change(self, event: api.StateChangeEvent) -> None:
        self.calls.append(("state", event.event))

    async def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


@contextlib.asynccontextmanager
async def running(plugin: Plugin) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(plugin.run())
    try:
        yield task
    finally:
        plugin.stop()
        await asyncio.wait_for(task, 10)


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "nri.sock"


def plugin(handler: Recorder, sock: Path, **kw: float) -> Plugin:
    return Plugin(handler, "test", "10", str(sock), backoff=0.01, max_backoff=0.05, **kw)


# -- the handshake and the calls ------------------------------------------------------------------


async def test_registers_configures_and_synchronizes(sock: Path) -> None:
    rec = Recorder()
    async with FakeRuntime(sock) as rt, running(plugin(rec, sock)):
        peer = await rt.accept()
        registered = await peer.register()
        assert (registered.plugin_name, registered.plugin_idx) == ("test", "10")
        configured = await peer.call("Configure", api.ConfigureRequest(runtime_name="rt"), api.ConfigureResponse)
        assert configured.events == EVENTS == (1 << 3) | (1 << 9)
        # fail the request and stay registered when an answer is late (NRI v0.12.4+)
        policy = configured.failure_policy
        assert (policy.fail_request, policy.keep_connected) == (True, True)
        sync = api.SynchronizeRequest(pods=[api.PodSandbox(id="p")], containers=[api.Container(id="c")])
        answer = await peer.call("Synchronize", sync, api.SynchronizeResponse)
        assert [u.container_id for u in answer.update] == ["c"] and not answer.more
    assert rec.calls == [("configure", "rt"), ("synchronize", (["p"], ["c"]))]


async def test_synchronize_in_chunks_reaches_the_handler_once(sock: Path) -> None:
    rec = Recorder()
    chunks = [
        api.SynchronizeRequest(pods=[api.PodSandbox(id="p1")], containers=[api.Container(id="c1")], more=True),
        api.SynchronizeRequest(pods=[api.PodSandbox(id="p2")], more=True),
        api.SynchronizeRequest(containers=[api.Container(id="c2")]),
    ]
    async with FakeRuntime(sock) as rt, running(plugin(rec, sock)):
        peer = await rt.accept()
        await peer.register()
        await peer.call("Configure", api.ConfigureRequest(), api.ConfigureResponse)
        answers = [await peer.call("Synchronize", c, api.SynchronizeResponse) for c in chunks]
    # a chunk with more is answered more, without updates (containerd/nri plugin.go checks both)
    assert [(a.more, len(a.update)) for a in answers] == [(True, 0), (True, 0), (False, 2)]
    assert rec.calls[1:] == [("synchronize", (["p1", "p2"], ["c1", "c2"]))]


async def test_lifecycle_calls_reach_the_handler(sock: Path) -> None:
    rec = Recorder()
    pod, ctr = api.PodSandbox(id="p"), api.Container(id="c")
    async with FakeRuntime(sock) as rt, running(plugin(rec, sock)):
        peer = await rt.accept()
        await peer.handshake()
        created = await peer.call(
            "CreateContainer", api.CreateContainerRequest(pod=pod, container=ctr), api.CreateContainerResponse
        )
        assert [(e.key, e.value) for e in created.adjust.env] == [("A", "1")]
        await peer.call("UpdateContainer", api.UpdateContainerRequest(pod=pod, container=ctr), api.Empty)
        await peer.call("StopContainer", api.StopContainerRequest(pod=pod, container=ctr), api.Empty)
        validate = api.ValidateContainerAdjustmentRequest(pod=pod, container=ctr)
        verdict = await peer.call("ValidateContainerAdjustment", validate, api.ValidateContainerAdjustmentResponse)
        assert (verdict.reject, verdict.reason) == (True, "no")
        event = api.StateChangeEvent(event=api.REMOVE_CONTAINER, pod=pod, container=ctr)
        await peer.call("StateChange", event, api.Empty)
        await peer.call("Shutdown", api.Empty(), api.Empty)
    assert rec.calls[2:] == [
        ("create", "c"),
        ("update", "c"),
        ("stop", "c"),
        ("validate", "c"),
        ("state", api.REMOVE_CONTAINER),
        ("shutdown", None),
    ]


@pytest.mark.parametrize(
    ("service", "method"),
    [
        ("nri.pkg.api.v1alpha1.Plugin", "RunPodSandbox"),  # NRI v0.12 runtimes fall back to StateChange
        ("nri.pkg.api.v1alpha1.Plugin", "NoSuchMethod"),
        ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin"),
        ("grpc.health.v1.Health", "Check"),
    ],
)
async def test_what_is_not_served_answers_unimplemented(sock: Path, service: str, method: str) -> None:
    rec = Recorder()
    async with FakeRuntime(sock) as rt, running(plugin(rec, sock)):
        peer = await rt.accept()
        await peer.handshake()
        response = await peer.call_raw(method, b"", service=service)
        assert response.status.code == Code.UNIMPLEMENTED == 12
        assert method in response.status.message or service in response.status.message
        # and the connection goes on
        await peer.call("StopContainer", api.StopContainerRequest(), api.StopContainerResponse)
    assert rt.peers.empty()


@pytest.mark.parametrize(
    ("failure", "code", "text"),
    [
        (RpcError(Code.INVALID_ARGUMENT, "pod default/x: bad annotation"), 3, "pod default/x: bad annotation"),
        (KeyError("gpu-7"), 2, "CreateContainer: 'gpu-7'"),
    ],
)
async def test_a_failing_handler_fails_that_call_only(sock: Path, failure: Exception, code: int, text: str) -> None:
    rec = Recorder()
    rec.fail = failure
    async with FakeRuntime(sock) as rt, running(plugin(rec, sock)):
        peer = await rt.accept()
        await peer.handshake()
        response = await peer.call_raw("CreateContainer", api.CreateContainerRequest().SerializeToString())
        assert (response.status.code, response.status.message) == (code, text)
        rec.fail = None
        ok = await peer.call("CreateContainer", api.CreateContainerRequest(), api.CreateContainerResponse)
        assert len(ok.adjust.env) == 1
    assert rt.peers.empty()  # never reconnected


class Slow(Recorder):
    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        if request.container.id == "slow":
            await asyncio.sleep(600)
        return await super().create_container(request)


async def test_a_slow_handler_is_refused_before_the_runtimes_deadline(sock: Path) -> None:
    """The runtime drops a plugin that answers late and creates the container unadjusted; an error
    answer before its deadline fails that container only."""
    async with FakeRuntime(sock) as rt, running(plugin(Slow(), sock)):
        peer = await rt.accept()
        await peer.handshake()
        slow = api.CreateContainerRequest(container=api.Container(id="slow")).SerializeToString()
        response = await peer.call_raw("CreateContainer", slow, timeout_nano=400_000_000)  # waits 10 s at most
        assert response.status.code == Code.DEADLINE_EXCEEDED
        assert (
            response.status.message == "CreateContainer: no answer within 0.36 s, refused before the runtime's deadline"
        )
        quick = api.CreateContainerRequest(container=api.Container(id="quick")).SerializeToString()
        # a long deadline: whether a loaded machine answers within 0.36 s is not what this checks
        assert (await peer.call_raw("CreateContainer", quick, timeout_nano=10_000_000_000)).status.code == 0
    assert rt.peers.empty()


class Long(Recorder):
    """Answers CreateContainer with a 5 KiB adjustment, or a 5 KiB refusal when `fail` is set."""

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        if self.fail is not None:
            raise self.fail
        return api.CreateContainerResponse(
            adjust=api.ContainerAdjustment(env=[api.KeyValue(key="A", value="y" * 5120)])
        )


async def test_answers_longer_than_the_runtimes_read_buffer_reach_it_and_keep_the_connection(sock: Path) -> None:
    """The runtime reads a logical connection 4096 bytes at a time and ends it at a longer frame
    (fakeruntime.GoReader): a 5 KiB adjustment and a 5 KiB refusal arrive whole."""
    handler = Long()
    async with FakeRuntime(sock) as rt, running(plugin(handler, sock)):
        peer = await rt.accept()
        await peer.handshake()
        answer = await peer.call("CreateContainer", api.CreateContainerRequest(), api.CreateContainerResponse)
        assert answer.adjust.env[0].value == "y" * 5120
        handler.fail = RpcError(Code.INVALID_ARGUMENT, "z" * 5120)
        refused = await peer.call_raw("CreateContainer", b"")
        assert (refused.status.code, refused.status.message) == (Code.INVALID_ARGUMENT, "z" * 5120)
        big_request = api.CreateContainerRequest(container=api.Container(id="c" * 9000))
        assert (await peer.call_raw("CreateContainer", big_request.SerializeToString())).status.code == 3
        assert peer.closed_by is None and not peer.closed.is_set()


class Huge(Recorder):
    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        return api.CreateContainerResponse(adjust=api.ContainerAdjustment(annotations={"big": "x" * (5 << 20)}))


async def test_an_answer_over_the_size_limit_becomes_an_error(sock: Path) -> None:
    async with FakeRuntime(sock) as rt, running(plugin(Huge(), sock)):
        peer = await rt.accept()
        await peer.handshake()
        response = await peer.call_raw("CreateContainer", b"")
        assert response.status.code == Code.RESOURCE_EXHAUSTED == 8
        assert re.fullmatch(r"answer of 52429\d\d bytes is over 4 MiB", response.status.message)
        assert (await peer.call_raw("StopContainer", b"")).status.code == 0
    assert rt.peers.empty()


async def test_an_undecodable_payload_is_invalid_argument(sock: Path) -> None:
    async with FakeRuntime(sock) as rt, running(plugin(Recorder(), sock)):
        peer = await rt.accept()
        await peer.handshake()
        response = await peer.call_raw("CreateContainer", b"\xff\xff\xff")
        assert response.status.code == Code.INVALID_ARGUMENT
        assert "CreateContainerRequest" in response.status.message


async def test_the_request_timeout_from_configure_is_used(sock: Path) -> None:
    p = plugin(Recorder(), sock)
    async with FakeRuntime(sock) as rt, running(p):
        peer = await rt.accept()
        await peer.register()
        request = api.ConfigureRequest(runtime_name="rt", runtime_version="9", request_timeout=1500)
        await peer.call("Configure", request, api.ConfigureResponse)
        assert (p.runtime, p.request_timeout) == ("rt 9", 1.5)


class SlowSync(Recorder):
    """Fails its first Synchronize, or holds the event loop through it (as a blocking read would),
    then answers as Recorder does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        first = not any(call == "synchronize" for call, _ in self.calls)
        answer = await super().synchronize(pods, containers)
        if first and self.how == "error":
            raise RpcError(Code.DEADLINE_EXCEEDED, "one container's trial took too long")
        if first and self.how == "late":
            time.sleep(0.3)  # noqa: ASYNC251  (past the 0.2 s request timeout, the loop held: no timeout fires)
        return answer


@pytest.mark.parametrize(("how", "reason"), [("error", "sync_failed"), ("late", "sync_late")])
async def test_a_synchronize_the_runtime_did_not_take_gives_the_connection_up(
    sock: Path, how: str, reason: str
) -> None:
    """NRI v0.6.1 neither adds nor closes a plugin whose Synchronize failed: waiting on that
    connection would wait forever, so the plugin closes it and dials again."""
    before = NRI_UNREGISTERED.value(reason)
    p = plugin(SlowSync(how), sock)
    async with FakeRuntime(sock) as rt, running(p):
        first = await rt.accept()
        await first.register()
        configure = api.ConfigureRequest(runtime_name="rt", request_timeout=200)
        await first.call("Configure", configure, api.ConfigureResponse)
        await first.call_raw("Synchronize", api.SynchronizeRequest().SerializeToString())
        await asyncio.wait_for(first.closed.wait(), 10)  # closed by the plugin, the runtime did nothing
        second = await rt.accept()
        await second.handshake()
        assert p.registration is not None and p.registration.dropped is None
    assert NRI_UNREGISTERED.value(reason) == before + 1
    assert p.connections == 2


# -- calls to the runtime -------------------------------------------------------------------------


async def test_update_containers_round_trip(sock: Path) -> None:
    p = plugin(Recorder(), sock)
    with pytest.raises(ConnectionLost, match="not connected"):
        await p.update_containers([api.ContainerUpdate(container_id="c")])
    async with FakeRuntime(sock) as rt, running(p):
        peer = await rt.accept()
        await peer.handshake()
        call = asyncio.create_task(
            p.update_containers(
                [api.ContainerUpdate(container_id="c")], [api.ContainerEviction(container_id="d", reason="r")]
            )
        )
        stream, req = await asyncio.wait_for(peer.requests.get(), 10)
        assert stream % 2 == 1 and req.method == "UpdateContainers" and req.timeout_nano > 0
        sent = api.UpdateContainersRequest.FromString(req.payload)
        assert ([u.container_id for u in sent.update], [(e.container_id, e.reason) for e in sent.evict]) == (
            ["c"],
            [("d", "r")],
        )
        peer.reply(stream, api.UpdateContainersResponse(failed=[api.ContainerUpdate(container_id="c")]))
        assert [u.container_id for u in await call] == ["c"]

        call = asyncio.create_task(p.update_containers([api.ContainerUpdate(container_id="x")]))
        stream, _ = await asyncio.wait_for(peer.requests.get(), 10)
        peer.reply(stream, code=Code.UNAVAILABLE, text="runtime busy")
        with pytest.raises(RpcError, match="UNAVAILABLE: runtime busy"):
            await call


async def test_a_call_waiting_when_the_connection_drops_fails(sock: Path) -> None:
    p = plugin(Recorder(), sock)
    async with FakeRuntime(sock) as rt, running(p):
        peer = await rt.accept()
        await peer.handshake()
        call = asyncio.create_task(p.update_containers([api.ContainerUpdate(container_id="c")]))
        await asyncio.wait_for(peer.requests.get(), 10)
        await peer.close()
        with pytest.raises(ConnectionLost):
            await call
        await (await rt.accept()).handshake()  # and it dials again


# -- broken connections -----------------------------------------------------------------------------


async def test_reconnects_after_the_runtime_closes(sock: Path) -> None:
    rec = Recorder()
    p = plugin(rec, sock)
    async with FakeRuntime(sock) as rt, running(p):
        for _ in range(3):
            peer = await rt.accept()
            await peer.handshake()
            await peer.close()
        await (await rt.accept()).handshake()
    assert p.connections == 4
    assert [c for c, _ in rec.calls].count("configure") == 4


async def test_dials_until_the_socket_appears(sock: Path) -> None:
    p = plugin(Recorder(), sock)
    async with running(p):
        await asyncio.sleep(0.1)  # several failed dials
        assert not p.connected
        async with FakeRuntime(sock) as rt:
            await (await rt.accept()).handshake()
            assert p.connected


async def test_a_registration_the_runtime_never_answers_times_out_and_dials_again(sock: Path) -> None:
    p = plugin(Recorder(), sock, registration_timeout=0.2)
    async with FakeRuntime(sock) as rt, running(p):
        silent = await rt.accept()
        await asyncio.wait_for(silent.requests.get(), 10)  # RegisterPlugin, never answered
        await asyncio.wait_for(silent.closed.wait(), 10)
        await (await rt.accept()).handshake()


async def test_stop_does_not_wait_for_a_registration(sock: Path) -> None:
    p = plugin(Recorder(), sock, registration_timeout=600)
    async with FakeRuntime(sock) as rt:
        task = asyncio.create_task(p.run())
        silent = await rt.accept()
        await asyncio.wait_for(silent.requests.get(), 10)  # RegisterPlugin, never answered
        p.stop()
        await asyncio.wait_for(task, 10)  # well before the registration timeout
        await asyncio.wait_for(silent.closed.wait(), 10)


BROKEN = {
    "oversize ttrpc message": mux.encode(1, struct.pack(">IIBB", ttrpc.MAX_PAYLOAD + 1, 1, 1, 0)),
    "oversize mux frame": struct.pack(">II", 1, mux.MAX_FRAME + 1),
}
# what ttrpc reads past (server.go, client.go): a type it does not know, a response where it serves,
# anything for a stream no call of its own waits on
IGNORED = {
    "unknown ttrpc type": mux.encode(1, struct.pack(">IIBB", 3, 101, 7, 0) + b"abc"),
    "response on the server's conn": mux.encode(1, ttrpc.encode(Frame(101, MessageType.RESPONSE, b""))),
    "request on the client's conn": mux.encode(2, ttrpc.encode(Frame(101, MessageType.REQUEST, b""))),
    "unknown type on the client's conn": mux.encode(2, struct.pack(">IIBB", 0, 101, 9, 0)),
}


@pytest.mark.parametrize("name", IGNORED)
async def test_what_ttrpc_reads_past_keeps_the_connection(sock: Path, name: str) -> None:
    p = plugin(Recorder(), sock)
    async with FakeRuntime(sock) as rt, running(p):
        peer = await rt.accept()
        await peer.handshake()
        peer.send_raw(IGNORED[name])
        answer = await peer.call("CreateContainer", api.CreateContainerRequest(), api.CreateContainerResponse)
        assert answer.adjust.env[0].key == "A"
        assert not peer.closed.is_set() and p.connections == 1


async def test_stream_data_is_answered_as_ttrpc_answers_it_and_the_connection_stays(sock: Path) -> None:
    async with FakeRuntime(sock) as rt, running(plugin(Recorder(), sock)):
        peer = await rt.accept()
        await peer.handshake()
        waiter = asyncio.get_running_loop().create_future()
        peer._pending[101] = waiter
        peer.send(mux.PLUGIN_CONN, Frame(101, MessageType.DATA, b"x"))
        response = await asyncio.wait_for(waiter, 10)
        assert response.status.code == Code.INVALID_ARGUMENT and "stream 101 is not open" in response.status.message
        assert (await peer.call_raw("StopContainer", b"")).status.code == 0


async def test_a_message_of_another_type_where_a_response_is_due_fails_that_call_only(sock: Path) -> None:
    p = plugin(Recorder(), sock)
    async with FakeRuntime(sock) as rt, running(p):
        peer = await rt.accept()
        await peer.handshake()
        calling = asyncio.create_task(p.update_containers())
        stream, _ = await asyncio.wait_for(peer.requests.get(), 10)
        peer.send(mux.RUNTIME_CONN, Frame(stream, 9, b""))
        with pytest.raises(RpcError, match="type 9 where a response was due"):
            await calling
        calling = asyncio.create_task(p.update_containers())
        stream, _ = await asyncio.wait_for(peer.requests.get(), 10)
        peer.reply(stream, api.UpdateContainersResponse())
        assert await calling == []


@pytest.mark.parametrize("name", BROKEN)
async def test_a_broken_frame_drops_the_connection_and_the_plugin_dials_again(
    sock: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    p = plugin(Recorder(), sock)
    async with FakeRuntime(sock) as rt, running(p) as task:
        peer = await rt.accept()
        await peer.handshake()
        peer.send_raw(BROKEN[name])
        await asyncio.wait_for(peer.closed.wait(), 10)
        await (await rt.accept()).handshake()
        assert not task.done()
    lost = [getattr(r, "error", "") for r in caplog.records if r.getMessage() == "connection to the runtime lost"]
    assert len(lost) == 1 and "protocol error" in lost[0], lost


async def test_frames_for_an_unknown_logical_connection_are_ignored(sock: Path) -> None:
    async with FakeRuntime(sock) as rt, running(plugin(Recorder(), sock)):
        peer = await rt.accept()
        await peer.register()
        peer.send_raw(mux.encode(7, b"whatever") + struct.pack(">II", 0, 3) + b"abc")
        await peer.call("Configure", api.ConfigureRequest(), api.ConfigureResponse)
    assert rt.peers.empty()


# -- a pre-registered plugin ------------------------------------------------------------------------


async def test_an_inherited_socket_is_served_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = socket.socketpair()
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", str(ours.fileno()))
    monkeypatch.setenv("NRI_PLUGIN_NAME", "crihook")
    monkeypatch.setenv("NRI_PLUGIN_IDX", "05")
    inherited = inherited_socket()
    assert inherited == (ours.fileno(), "crihook", "05")
    fd, name, index = inherited
    ours.detach()  # the plugin owns the fd now
    rec = Recorder()
    p = Plugin(rec, name, index, fd=fd)
    task = asyncio.create_task(p.run())
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    peer = Peer(reader, writer)
    peer.start()
    registered = await peer.handshake()
    assert registered.events == EVENTS
    await peer.close()
    await asyncio.wait_for(task, 10)  # the runtime went away: so does a pre-registered plugin
    assert p.connections == 1


def test_inherited_socket_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NRI_PLUGIN_SOCKET", raising=False)
    assert inherited_socket() is None
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", "three")
    with pytest.raises(ValueError, match="'three' is not a file descriptor"):
        inherited_socket()


# -- pure parts ---------------------------------------------------------------------------------------


def test_served_methods_take_the_messages_the_schema_names() -> None:
    plugin_service = api.DESCRIPTOR.services_by_name["Plugin"]
    served = _Service(NoChange(), lambda _: None).methods
    assert {name: cls.DESCRIPTOR for name, (cls, _) in served.items()} == {
        name: plugin_service.methods_by_name[name].input_type for name in served
    }
    assert set(served) == {
        "Configure",
        "Synchronize",
        "Shutdown",
        "CreateContainer",
        "UpdateContainer",
        "StopContainer",
        "StateChange",
        "ValidateContainerAdjustment",
    }


def test_event_mask_bits() -> None:
    assert event_mask() == 0
    assert event_mask(api.RUN_POD_SANDBOX) == 1
    assert event_mask(api.CREATE_CONTAINER, api.REMOVE_CONTAINER) == 0b100_0000_1000
    for bad in (api.UNKNOWN, api.LAST):
        with pytest.raises(ValueError, match=f"no NRI event {bad}"):
            event_mask(bad)


@pytest.mark.parametrize(("index", "name"), [("1", "x"), ("100", "x"), ("ab", "x"), ("10", ""), ("10", "a/b")])
def test_plugin_name_and_index_are_checked(index: str, name: str) -> None:
    with pytest.raises(ValueError):
        Plugin(Recorder(), name, index)
