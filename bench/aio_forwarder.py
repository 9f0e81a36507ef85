"""The design crihook did not choose, kept as a yardstick: a bare grpc-aio server on uvloop that
forwards every method as raw bytes through a grpc-aio channel (unary and server-streaming).

    python bench/aio_forwarder.py LISTEN_SOCKET BACKEND_SOCKET

`bench/proxy_bench.py` runs it beside crihook so both are measured against the same containerd in
one run.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc
import uvloop

from crihook.proto.methods import SERVER_STREAMING

LIMITS = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]


def ident(b: bytes) -> bytes:
    return b


class Forwarder(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method in SERVER_STREAMING:
            upstream_stream = self.channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)

            async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for item in upstream_stream(request, timeout=context.time_remaining()):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, ident, ident)
        upstream = self.channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await upstream(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
                raise

        return grpc.unary_unary_rpc_method_handler(unary, ident, ident)


async def main(listen: str, backend: str) -> None:
    channel = grpc.aio.insecure_channel(f"unix://{backend}", options=LIMITS)
    server = grpc.aio.server(options=LIMITS)
    server.add_generic_rpc_handlers([Forwarder(channel)])
    server.add_insecure_port(f"unix://{listen}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("listen", help="unix socket to serve on")
    ap.add_argument("backend", help="unix socket to forward to")
    args = ap.parse_args()
    uvloop.run(main(args.listen, args.backend))
