"""The least interception of a CreateContainer anyone could write in Python, kept as a yardstick
beside crihook's floor: what an intercepted call costs with none of crihook's structure.

    python bench/least_intercept.py LISTEN_SOCKET BACKEND_SOCKET ANSWER_FILE

Like bench/byte_relay.py it pairs each connection with one to the backend on uvloop, and containerd's
frames go back to kubelet as they arrive, never parsed. kubelet's frames are split, each header
block is followed through HPACK for its `:path` (crihook's own `Follower`: the least that stays in
step with the dynamic table), and a CreateContainer's DATA is held until its end; the request is
then decoded, ANSWER_FILE (a serialized ContainerConfig, read at the first call) merged into its
config, and encoded again, and the DATA goes out in one write behind the frames read with it.
kubelet's windows are refunded for what was held.

It keeps no stream object, no deadline, no status, no metrics and no record, and it ignores the
flow-control skew a longer message brings (bench/proxy_bench.py's calls come one at a time, far
inside every window), so it is not a proxy anyone could run: it is the cost of seeing and changing
one request, set against what crihook's `--floor` target does for the same answer.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
from pathlib import Path

import uvloop

from crihook.proto import runtime_v1_pb2 as api
from crihook.proxy.hpack import Follower

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, CONTINUATION, WINDOW_UPDATE = 0, 1, 9, 8
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20
CREATE = b"/runtime.v1.RuntimeService/CreateContainer"
MAX_FRAME = 16384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which containerd keeps
_FH = struct.Struct(">HBBBI")


def frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


class Up(asyncio.Protocol):
    """containerd's side: everything straight back to kubelet."""

    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class Down(asyncio.Protocol):
    """kubelet's side: frames split, CreateContainer's request held, rewritten and sent."""

    def __init__(self, backend: str, answer: Path) -> None:
        self.backend = backend
        self.answer_file = answer
        self.answer: bytes | None = None
        self.hpack = Follower(frozenset((b":path",)))
        self.held: dict[int, bytearray] = {}
        self.block = bytearray()  # a header block waiting for its CONTINUATIONs
        self.buf = b""
        self.preface = False
        self.early: list[bytes] = []
        self.down: asyncio.Transport | None = None
        self.up: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.down = transport  # type: ignore[assignment]
        self.connecting = asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        assert self.down is not None
        try:
            up, _ = await asyncio.get_running_loop().create_unix_connection(lambda: Up(self.down), self.backend)  # type: ignore[arg-type]
        except OSError:
            self.down.close()
            return
        self.up = up
        for data in self.early:
            self.data_received(data)
        self.early.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()

    def data_received(self, data: bytes) -> None:
        up = self.up
        if up is None:
            self.early.append(data)
            return
        buf = self.buf + data if self.buf else data
        pos, n = 0, len(buf)
        if not self.preface:
            if len(buf) < len(PREFACE):
                self.buf = buf
                return
            self.preface, pos = True, len(PREFACE)
        out: list[bytes] = []
        run = 0
        refund = 0
        held = self.held
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _FH.unpack_from(buf, pos)
            end = pos + 9 + ((hi << 8) | lo)
            if end > n:
                break
            if ftype == DATA and sid in held:
                out.append(buf[run:pos])
                run = end
                start, stop = pos + 9, end
                if flags & PADDED:
                    start, stop = start + 1, stop - buf[start]
                body = held[sid]
                body += buf[start:stop]
                refund += end - pos - 9
                if flags & END_STREAM:
                    del held[sid]
                    out.append(self.rewritten(sid, body))
                elif end > pos + 9:
                    out.append(frame(WINDOW_UPDATE, 0, sid, (end - pos - 9).to_bytes(4, "big")))
            elif ftype in (HEADERS, CONTINUATION):
                start, stop = pos + 9, end
                if ftype == HEADERS:
                    if flags & PADDED:
                        start, stop = start + 1, stop - buf[start]
                    if flags & PRIORITY:
                        start += 5
                self.block += buf[start:stop]
                if flags & END_HEADERS:
                    found = self.hpack.decode(bytes(self.block))
                    self.block.clear()
                    if found.get(b":path") == CREATE:
                        held[sid] = bytearray()
            pos = end
        self.buf = buf[pos:]
        if run < pos:
            out.append(buf[run:pos])
        up.write(b"".join(out) if len(out) != 1 else out[0])
        if refund:  # kubelet's connection window back (stream refunds went towards containerd above)
            assert self.down is not None
            self.down.write(frame(WINDOW_UPDATE, 0, 0, refund.to_bytes(4, "big")))

    def rewritten(self, sid: int, body: bytearray) -> bytes:
        """The held request decoded, the answer merged into its config, encoded, framed."""
        if self.answer is None:
            self.answer = self.answer_file.read_bytes()
        msg = api.CreateContainerRequest.FromString(bytes(body[5:]))
        msg.config.MergeFromString(self.answer)
        raw = msg.SerializeToString()
        grpc_body = b"\x00" + len(raw).to_bytes(4, "big") + raw
        chunks = [grpc_body[i : i + MAX_FRAME] for i in range(0, len(grpc_body), MAX_FRAME)]
        return b"".join(frame(DATA, END_STREAM if i == len(chunks) - 1 else 0, sid, c) for i, c in enumerate(chunks))


async def main(listen: str, backend: str, answer: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: Down(backend, Path(answer)), listen)
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("listen", help="the socket kubelet's side connects to")
    ap.add_argument("backend", help="containerd's socket")
    ap.add_argument("answer", help="a serialized ContainerConfig, merged into every CreateContainer")
    args = ap.parse_args()
    uvloop.run(main(args.listen, args.backend, args.answer))
