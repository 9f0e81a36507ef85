"""The frame relay against a real gRPC server and client (grpcio), with a scripted interceptor.

Methods and bodies are raw bytes here: the relay never decodes messages it does not claim, so
these tests need no CRI schema.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from crihook.base.metrics import CRI_CALLS
from crihook.proxy.relay import Rejected, Relay, deadline_of


def ident(b: bytes) -> bytes:
    return b


@dataclass
class Spec:
    modifies: bool


@dataclass
class ScriptedInterceptor:
    """`/t.S/Modify*` is rewritten (or refused when the body starts with b"refuse"),
    `/t.S/Observe*` is watched; everything else passes through."""

    grow: int = 0
    posts: list[tuple[bytes, bytes | None, int]] = field(default_factory=list)
    messages: list[bytes | None] = field(default_factory=list)
    delay: float = 0.0
    deadlines: list[float | None] = field(default_factory=list)

    def classify(self, path: bytes) -> Spec | None:
        if path.startswith(b"/t.S/Modify"):
            return Spec(True)
        if path.startswith(b"/t.S/Observe"):
            return Spec(False)
        return None

    async def pre(self, spec: Spec, request: bytes, deadline: float | None) -> bytes:
        self.deadlines.append(deadline)
        if self.delay:
            await asyncio.sleep(self.delay)
        if request.startswith(b"refuse"):
            raise Rejected(9, "refused by test: 100% sure, ünïcode")
        return request + b"+" * self.grow

    def post(self, spec: Spec, request: bytes, response: bytes | None, status: int, message: bytes | None) -> None:
        self.posts.append((request, response, status))
        self.messages.append(message)


class Backend(grpc.GenericRpcHandler):
    """Echoes; `Fail` aborts with NOT_FOUND and details; `Stream` streams; `Slow` sleeps."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("Stream"):
            return grpc.unary_stream_rpc_method_handler(self.stream, ident, ident)

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self.unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary, ident, ident)

    async def unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if method.endswith("Fail"):
            await context.abort(grpc.StatusCode.NOT_FOUND, 'container "x" not found')
        if method.endswith("Slow"):
            await asyncio.sleep(2)
        context.set_trailing_metadata((("x-trailer", "kept"),))
        return b"echo:" + request

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(50):
            yield b"part%d" % i


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, ScriptedInterceptor, Relay, str]]:
    backend = str(tmp_path / "backend.sock")
    front = str(tmp_path / "front.sock")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([Backend()])
    server.add_insecure_port(f"unix://{backend}")
    await server.start()
    interceptor = ScriptedInterceptor()
    relay = Relay(backend, interceptor, max_message=1 << 20)
    await relay.start(front)
    channel = grpc.aio.insecure_channel(f"unix://{front}", options=[("grpc.max_receive_message_length", 8 << 20)])
    yield channel, interceptor, relay, backend
    await channel.close()
    await relay.drain(1)
    await server.stop(0)


def unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)


async def test_pass_through_keeps_bodies_status_details_and_trailers(setup) -> None:
    channel, interceptor, _, _ = setup
    ok_before = CRI_CALLS.value("/t.S/Echo", "OK")
    notfound_before = CRI_CALLS.value("/t.S/Fail", "NOT_FOUND")
    call = unary(channel, "/t.S/Echo")(b"hello")
    assert await call == b"echo:hello"
    assert ("x-trailer", "kept") in tuple(await call.trailing_metadata())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(channel, "/t.S/Fail")(b"")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == 'container "x" not found'
    assert interceptor.posts == []
    assert CRI_CALLS.value("/t.S/Echo", "OK") == ok_before + 1
    assert CRI_CALLS.value("/t.S/Fail", "NOT_FOUND") == notfound_before + 1


async def test_server_streaming_and_deadlines_pass(setup) -> None:
    channel, _, relay, _ = setup
    parts = [
        p async for p in channel.unary_stream("/t.S/Stream", request_serializer=ident, response_deserializer=ident)(b"")
    ]
    assert parts == [b"part%d" % i for i in range(50)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(channel, "/t.S/Slow")(b"", timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.05)
    assert relay.in_flight() == 0


async def test_claimed_call_gets_the_client_deadline(setup) -> None:
    """The interceptor learns when the client gives up (grpc-timeout), to leave hooks that much."""
    channel, interceptor, _, _ = setup
    before = time.monotonic()
    assert await unary(channel, "/t.S/Modify")(b"x", timeout=7.5) == b"echo:x"
    assert await unary(channel, "/t.S/Modify")(b"y") == b"echo:y"  # no deadline set by the client
    first, second = interceptor.deadlines
    # gRPC's client sends the time left when the header goes out, rounded up to a coarser unit
    # (grpc-core's timeout encoding), so the relay may see a deadline a little past the client's own
    assert first is not None and before + 7.0 < first <= time.monotonic() + 7.5 + 0.1
    assert second is None


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(b"2S", 2.0), (b"1500m", 1.5), (b"99999999u", 99.999999), (b"1H", 3600.0), (b"7M", 420.0), (b"5n", 5e-9)],
)
def test_grpc_timeout_units(header: bytes, seconds: float) -> None:
    now = time.monotonic()
    deadline = deadline_of(header)
    assert deadline is not None and abs(deadline - now - seconds) < 0.05


@pytest.mark.parametrize("header", [None, b"", b"S", b"12", b"1x", b"-1S", b"123456789S", b"1.5S"])
def test_grpc_timeout_not_in_the_format_is_no_deadline(header: bytes | None) -> None:
    assert deadline_of(header) is None


async def test_modified_request_larger_than_windows(setup) -> None:
    """A rewritten body larger than both HTTP/2 windows must flow and keep the connection healthy."""
    channel, interceptor, _, _ = setup
    interceptor.grow = 200_000
    body = b"a" * 150_000
    reply = await unary(channel, "/t.S/Modify")(body)
    assert reply == b"echo:" + body + b"+" * 200_000
    # traffic after the skew still flows, including large pass-through bodies
    results = await asyncio.gather(*(unary(channel, "/t.S/Echo")(b"b" * 70_000) for _ in range(20)))
    assert all(r == b"echo:" + b"b" * 70_000 for r in results)
    assert interceptor.posts[0][2] == 0 and interceptor.posts[0][1] == reply


async def test_refusal_answers_kubelet_and_never_reaches_runtime(setup) -> None:
    channel, interceptor, _, _ = setup
    refused_before = CRI_CALLS.value("/t.S/Modify", "FAILED_PRECONDITION")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(channel, "/t.S/Modify")(b"refuse" + b"x" * 200_000)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "refused by test: 100% sure, ünïcode"
    assert interceptor.posts == []  # the runtime never answered it
    assert await unary(channel, "/t.S/Echo")(b"after") == b"echo:after"
    assert CRI_CALLS.value("/t.S/Modify", "FAILED_PRECONDITION") == refused_before + 1


async def test_observed_calls_are_copied_not_held(setup) -> None:
    channel, interceptor, _, _ = setup
    assert await unary(channel, "/t.S/Observe")(b"watch me") == b"echo:watch me"
    await asyncio.sleep(0.01)
    assert interceptor.posts == [(b"watch me", b"echo:watch me", 0)]


async def test_observed_failures_reach_post_with_status_and_message(setup) -> None:
    channel, interceptor, _, _ = setup
    with pytest.raises(grpc.aio.AioRpcError):
        await unary(channel, "/t.S/ObserveFail")(b"gone?")
    await asyncio.sleep(0.01)
    assert interceptor.posts == [(b"gone?", None, grpc.StatusCode.NOT_FOUND.value[0])]
    assert interceptor.messages == [b'container "x" not found']


async def test_many_concurrent_mixed_calls(setup) -> None:
    channel, interceptor, relay, _ = setup
    interceptor.grow = 3000
    interceptor.delay = 0.001

    async def one(i: int) -> None:
        if i % 4 == 0:
            assert await unary(channel, "/t.S/Modify")(b"m%d" % i) == b"echo:m%d" % i + b"+" * 3000
        else:
            assert await unary(channel, "/t.S/Echo")(b"e%d" % i * 1000) == b"echo:" + b"e%d" % i * 1000

    await asyncio.gather(*(one(i) for i in range(400)))
    assert relay.in_flight() == 0


async def test_client_cancel_while_hooks_run(setup) -> None:
    channel, interceptor, relay, _ = setup
    interceptor.delay = 1.0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(channel, "/t.S/Modify")(b"slow hook", timeout=0.1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    interceptor.delay = 0
    assert await unary(channel, "/t.S/Echo")(b"x") == b"echo:x"
    await asyncio.sleep(0.05)
    assert relay.in_flight() == 0


async def test_runtime_down_fails_fast_unavailable(tmp_path: Path) -> None:
    front = str(tmp_path / "front.sock")
    relay = Relay(str(tmp_path / "nothing.sock"), ScriptedInterceptor())
    await relay.start(front)
    async with grpc.aio.insecure_channel(f"unix://{front}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unary(channel, "/t.S/Echo")(b"x", timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await relay.drain(0.1)


async def test_not_http2_is_dropped(tmp_path: Path, setup) -> None:
    _, _, relay, _ = setup
    reader, writer = await asyncio.open_unix_connection(str(Path(relay.backend_path).parent / "front.sock"))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    received = await asyncio.wait_for(reader.read(), 2)  # returns only at EOF: the relay hung up
    assert b"\x07\x00\x00\x00\x00\x00" in received  # after a GOAWAY frame
    writer.close()
