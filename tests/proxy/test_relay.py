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
from crihook.proxy.flow import RuntimeWindow
from crihook.proxy.frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    WINDOW_UPDATE,
    ProtocolViolation,
    frame,
)
from crihook.proxy.headers import MAX_HEADER_BLOCK, HeaderBlocks, deadline_of
from crihook.proxy.hpack import encode_literal
from crihook.proxy.link import Link, start
from crihook.proxy.relay import Relay
from crihook.proxy.stream import Rejected, Stream


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
    posts: list[tuple[bytes, bytes | None, grpc.StatusCode]] = field(default_factory=list)
    messages: list[bytes | None] = field(default_factory=list)
    delay: float = 0.0
    deadlines: list[float | None] = field(default_factory=list)
    posts_seen: list[int] = field(default_factory=list)  # how many posts had run when each rewrite began

    def classify(self, path: bytes) -> Spec | None:
        if path.startswith(b"/t.S/Modify"):
            return Spec(True)
        if path.startswith(b"/t.S/Observe"):
            return Spec(False)
        return None

    async def rewrite(self, spec: Spec, request: bytes, deadline: float | None) -> bytes:
        self.deadlines.append(deadline)
        self.posts_seen.append(len(self.posts))
        if self.delay:
            await asyncio.sleep(self.delay)
        if request.startswith(b"refuse"):
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "refused by test: 100% sure, ünïcode")
        return request + b"+" * self.grow

    def post(
        self, spec: Spec, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
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
    assert interceptor.posts[0][2] is grpc.StatusCode.OK and interceptor.posts[0][1] == reply


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
    assert interceptor.posts == [(b"watch me", b"echo:watch me", grpc.StatusCode.OK)]


async def test_post_runs_once_the_caller_has_its_answer_before_any_later_call(setup) -> None:
    """A finished call's bookkeeping runs as soon as its answer is written: a later claimed call's
    `rewrite` finds every earlier call recorded, in order."""
    channel, interceptor, _, _ = setup
    assert await unary(channel, "/t.S/Observe")(b"one") == b"echo:one"
    assert [p[0] for p in interceptor.posts] == [b"one"]
    assert await unary(channel, "/t.S/Observe")(b"two") == b"echo:two"
    assert await unary(channel, "/t.S/Modify")(b"three") == b"echo:three"
    assert interceptor.posts_seen == [2]
    assert [p[0] for p in interceptor.posts] == [b"one", b"two", b"three"]


async def test_a_failing_post_costs_no_other_call_its_bookkeeping() -> None:
    interceptor = ScriptedInterceptor()
    posted = interceptor.post

    def post(spec: Spec, request: bytes, *rest: object) -> None:
        if request == b"bad":
            raise RuntimeError("bookkeeping broke")
        posted(spec, request, *rest)  # type: ignore[arg-type]

    interceptor.post = post  # type: ignore[method-assign]
    relay: Relay[Spec] = Relay("unused", interceptor)
    for body in (b"first", b"bad", b"last"):
        relay.post(Spec(False), body, b"", grpc.StatusCode.OK, None)
    assert [p[0] for p in interceptor.posts] == [b"first", b"last"]


async def test_observed_failures_reach_post_with_status_and_message(setup) -> None:
    channel, interceptor, _, _ = setup
    with pytest.raises(grpc.aio.AioRpcError):
        await unary(channel, "/t.S/ObserveFail")(b"gone?")
    await asyncio.sleep(0.01)
    assert interceptor.posts == [(b"gone?", None, grpc.StatusCode.NOT_FOUND)]
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
    for _ in range(1000):  # the cancelled call's hook task is gone by now, or within 10 s on a loaded machine
        if not relay.in_flight():
            break
        await asyncio.sleep(0.01)
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


# -- the parts, alone -------------------------------------------------------------------------------


def _headers_frames(block: bytes, sid: int, ends_stream: bool, split: int | None) -> list[bytes]:
    """One header block as HEADERS (+ a CONTINUATION when `split`), each frame its own buffer."""
    end = END_STREAM if ends_stream else 0
    if split is None:
        return [frame(HEADERS, END_HEADERS | end, sid, block)]
    return [frame(HEADERS, end, sid, block[:split]), frame(CONTINUATION, END_HEADERS, sid, block[split:])]


@pytest.mark.parametrize("split", [None, 1, 7])
@pytest.mark.parametrize("side", ["request", "response"])
def test_header_blocks_assemble_continuations_the_same_both_ways(split: int | None, side: str) -> None:
    wanted = frozenset((b":path", b"grpc-status"))
    blocks = HeaderBlocks(wanted, side)
    block = encode_literal([(b":path", b"/t.S/Echo"), (b"grpc-status", b"0"), (b"x-other", b"ignored")])
    frames = _headers_frames(block, 5, ends_stream=True, split=split)
    results = [blocks.feed(f, 0, len(f), f[3]) for f in frames]
    assert results[:-1] == [None] * (len(frames) - 1)
    assert results[-1] == {b":path": b"/t.S/Echo", b"grpc-status": b"0"}
    assert blocks.sid == 5 and blocks.ends_stream


def test_header_blocks_read_past_padding_and_priority() -> None:
    block = encode_literal([(b":path", b"/t.S/Echo")])
    payload = bytes([3]) + b"\x00\x00\x00\x00\x10" + block + b"\x00" * 3
    f = frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 3, payload)
    blocks = HeaderBlocks(frozenset((b":path",)), "request")
    assert blocks.feed(f, 0, len(f), HEADERS) == {b":path": b"/t.S/Echo"}
    assert blocks.sid == 3 and not blocks.ends_stream


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([frame(CONTINUATION, END_HEADERS, 1, b"\x82")], "response headers: CONTINUATION without HEADERS"),
        ([frame(HEADERS, 0, 1, b"\x82"), frame(CONTINUATION, END_HEADERS, 3, b"\x82")], "without HEADERS"),
        (
            [frame(HEADERS, 0, 1, b"")]
            + [frame(CONTINUATION, 0, 1, b"\x00" * 16384)] * (MAX_HEADER_BLOCK // 16384 + 1),
            "response header block too large",
        ),
        ([frame(HEADERS, END_HEADERS, 1, b"\x80")], "response headers: header index 0"),
    ],
)
def test_header_blocks_refuse_what_breaks_framing(frames: list[bytes], why: str) -> None:
    blocks = HeaderBlocks(frozenset((b":path",)), "response")
    with pytest.raises(ProtocolViolation, match=why):
        for f in frames:
            blocks.feed(f, 0, len(f), f[3])


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


def _stream(out: bytes, window: int) -> Stream[Spec]:
    return Stream(Spec(True), b"/t.S/Modify", True, bytearray(), bytearray(), out=memoryview(out), send_window=window)


def test_runtime_window_sends_a_rewrite_within_both_windows_and_counts_skew() -> None:
    flow: RuntimeWindow[Spec] = RuntimeWindow()
    sink = _Sink()
    flow.up = sink  # type: ignore[assignment]
    flow.window = 10
    stream = _stream(b"x" * 25, window=100)
    flow.pump(1, stream)
    assert sink.frames == [frame(DATA, 0, 1, b"x" * 10)] and flow.window == 0 and flow.skew == 10
    assert flow.connection_update(4, {1: stream}) == 0  # all of it paid back skew: kubelet hears nothing
    assert sink.frames[-1] == frame(DATA, 0, 1, b"x" * 4) and flow.skew == 10 - 4 + 4
    assert flow.connection_update(100, {1: stream}) == 100 - 10  # kubelet is told what the skew leaves
    assert sink.frames[-1] == frame(DATA, END_STREAM, 1, b"x" * 11) and stream.out is None and flow.skew == 11


def test_runtime_window_passes_updates_through_without_skew_and_releases_the_queue() -> None:
    flow: RuntimeWindow[Spec] = RuntimeWindow()
    sink = _Sink()
    flow.up = sink  # type: ignore[assignment]
    flow.window = 0
    queued = frame(DATA, 0, 1, b"y" * 8)
    flow.queue.append(queued)
    assert flow.connection_update(5, {}) is None and sink.frames == []  # 8 bytes do not fit in 5
    assert flow.connection_update(5, {}) is None and sink.frames == [queued] and flow.window == 2


class _Down(_Sink):
    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("delay", [0.0, 0.01], ids=["at-once", "waits"])
@pytest.mark.parametrize("body", [b"hello", b"refuse"])
async def test_a_held_request_follows_its_headers_in_one_write_unless_the_rewrite_waits(
    body: bytes, delay: float
) -> None:
    """containerd gets the HEADERS kubelet sent and what `rewrite` made of the held DATA (the
    rewrite, or the reset of a refused call): in one write when the rewrite never waits (one send,
    the call arrives whole), else the HEADERS at once and the rest once the rewrite is done."""
    interceptor = ScriptedInterceptor(grow=3, delay=delay)
    link: Link[Spec] = Link(Relay("unused", interceptor), _Down())  # type: ignore[arg-type]
    up = _Sink()
    link.up = link.flow.up = up  # type: ignore[assignment]
    headers = frame(HEADERS, END_HEADERS, 1, encode_literal([(b":method", b"POST"), (b":path", b"/t.S/Modify")]))
    link.down_data(PREFACE + headers + frame(DATA, END_STREAM, 1, b"\x00" + len(body).to_bytes(4, "big") + body))
    if body == b"refuse":
        then = frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big"))  # CANCEL
    else:
        then = frame(DATA, END_STREAM, 1, b"\x00" + (len(body) + 3).to_bytes(4, "big") + body + b"+++")
    if not delay:
        assert up.frames == [PREFACE + headers + then]
        assert all(st.task is None for st in link.streams.values())  # no task made
        return
    assert up.frames == [PREFACE + headers]
    task = link.streams[1].task
    assert task is not None
    await asyncio.wait([task])
    assert up.frames == [PREFACE + headers, then]


async def test_an_answer_before_the_upload_ends_stops_the_upload_in_the_same_batch() -> None:
    """containerd may answer a held, rewritten request before it has all of it (an early error). Its
    trailers end the call even when a connection WINDOW_UPDATE follows in the same read, which would
    otherwise release the rest of the upload onto a finished stream."""
    link: Link[Spec] = Link(Relay("unused", ScriptedInterceptor()), _Down())  # type: ignore[arg-type]
    up = _Sink()
    link.up = link.flow.up = up  # type: ignore[assignment]
    link.flow.window = 0  # containerd's window is spent: the rest of the rewrite waits
    link.streams[1] = _stream(b"x" * 50, window=1000)
    link.active[1] = (b"/t.S/Modify", time.perf_counter())
    trailers = encode_literal([(b":status", b"200"), (b"grpc-status", b"8"), (b"grpc-message", b"too big")])
    link.up_data(
        frame(HEADERS, END_STREAM | END_HEADERS, 1, trailers) + frame(WINDOW_UPDATE, 0, 0, (100).to_bytes(4, "big"))
    )
    assert 1 not in link.streams and up.frames == []  # nothing more of it went to containerd


async def test_start_runs_a_coroutine_at_once_and_a_task_finishes_one_that_waits() -> None:
    async def now() -> int:
        return 1

    done = start(now())
    assert done.done() and done.result() == 1  # never waited: done before start returns

    seen: list[str] = []

    async def waits(then: float) -> int:
        seen.append("first step")
        try:
            await asyncio.sleep(then)
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return 2

    later = start(waits(0.001))
    assert seen == ["first step"] and not later.done()
    assert await later == 2
    stopped = start(waits(10))
    await asyncio.sleep(0)
    stopped.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopped
    assert seen[-1] == "cancelled"
