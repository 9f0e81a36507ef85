"""The scheduler's HTTP server against malformed, split, pipelined and smuggling-shaped requests.

A connection carries well-formed requests, pipelined, then perhaps one that must be refused: an
unreadable request line or header, a second or comma-listed different Content-Length, a
Transfer-Encoding with or without a Content-Length (HTTP/1.1's two framings at once is the classic
request-smuggling shape), a header folded onto the next line (obs-fold), a head over the limit. The
bytes go out split at arbitrary points. What must hold: every well-formed request before the
refused one gets its own answer, in order; the refused one gets an error status and the connection
closes (or it just closes); nothing is ever answered for bytes after it; the server logs no failure
and keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.scheduler import server as srv
from crihook.scheduler import webhook
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare
from tests.support.tlsburst import check_review, http_request, review

WAIT = 5.0  # seconds for the whole exchange of one example: the server answers in milliseconds


@dataclass(frozen=True)
class Good:
    """A well-formed request and what its answer must be."""

    raw: bytes
    code: int
    body: bytes | None = None  # None: an AdmissionReview answer for `uid`
    uid: int = 0

    def wrong(self, code: int, body: bytes) -> str:
        if self.body is None:
            return check_review(self.uid, code, body)
        return "" if (code, body) == (self.code, self.body) else f"wanted {self.code} {self.body!r}"


def good() -> st.SearchStrategy[Good]:
    host = b"Host: 127.0.0.1\r\n"
    plain = [
        Good(b"GET /healthz HTTP/1.1\r\n" + host + b"\r\n", 200, b"ok\n"),
        Good(b"GET /readyz?verbose HTTP/1.1\r\n" + host + b"X-Trace: a b\r\n\r\n", 200, b"ok\n"),
        Good(b"GET /nothing HTTP/1.1\r\n" + host + b"\r\n", 404, b"not found\n"),
        Good(b"DELETE /filter HTTP/1.1\r\n" + host + b"Content-Length: 0\r\n\r\n", 405, b"use GET or POST\n"),
    ]
    reviews = st.integers(1, 999).map(lambda i: Good(http_request("/validate", review(f"uid-{i}")), 200, uid=i))
    return st.one_of(st.sampled_from(plain), reviews)


HEAD = b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
BODY = review("uid-0")
CL = f"Content-Length: {len(BODY)}\r\n".encode()
REFUSED = [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length : 0\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
    b"GET /he\x7flthz HTTP/1.1\r\nHost: x\r\n\r\n",
    HEAD + b"Content-Length: -1\r\n\r\n",
    HEAD + b"Content-Length: +5\r\n\r\n" + BODY,
    HEAD + b"Content-Length: 0x10\r\n\r\n" + BODY,
    HEAD + CL + b"Content-Length: 7\r\n\r\n" + BODY,  # two lengths
    HEAD + f"Content-Length: {len(BODY)}, 7\r\n\r\n".encode() + BODY,
    HEAD + CL + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + BODY,  # both framings
    HEAD + b"Transfer-Encoding: chunked\r\n" + CL + b"\r\n" + BODY,
    HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    HEAD + b"Content-Length:\r\n " + CL.split(b":")[1] + b"\r\n" + BODY,  # obs-fold of the length
    HEAD + b"X-Folded: a\r\n\tb\r\n" + CL + b"\r\n" + BODY,
    b" GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n Host: x\r\n\r\n",  # continuation line at the start of the headers
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (srv.MAX_HEAD + 10) + b"\r\n\r\n",
]


def app() -> srv.App:
    return srv.App(Extender(DeviceShare()), webhook.WebhookConfig(), lambda: True)


class Failures(logging.Handler):
    """Records what the server logs at ERROR: an exception it did not expect."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[srv.Server, Failures]]:
    s = srv.make_server(app(), "127.0.0.1", 0, None, workers=4)
    threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    failures = Failures()
    logger = logging.getLogger("crihook.scheduler")
    logger.addHandler(failures)
    try:
        yield s, failures
    finally:
        logger.removeHandler(failures)
        s.shutdown()
        s.server_close()


def parse_answers(data: bytes) -> tuple[list[tuple[int, bytes, bool]], bytes]:
    """(status, body, says Connection: close) of each whole answer in `data`, and what is left."""
    answers = []
    while (end := data.find(b"\r\n\r\n")) >= 0:
        lines = data[:end].decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(fields.get("content-length", "0"))
        if len(data) < end + 4 + length:
            break
        code = int(lines[0].split()[1])
        answers.append((code, data[end + 4 : end + 4 + length], fields.get("connection", "").lower() == "close"))
        data = data[end + 4 + length :]
    return answers, data


def exchange(port: int, chunks: list[bytes]) -> bytes:
    """Send the chunks one by one (a moment apart, so the server reads them apart), close the
    sending side, and read until the server closes. A server that already closed on a refused
    request may reset the connection: what arrived before the reset counts."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + WAIT
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                time.sleep(0.001)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # reset, or not connected any more: the server closed on a refused request
            pass
        try:
            while data := sock.recv(1 << 16):
                received += data
                assert time.monotonic() < deadline, "the server neither answered nor closed"
        except ConnectionResetError:
            pass
    return bytes(received)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@given(
    goods=st.lists(good(), max_size=4),
    refused=st.none() | st.sampled_from(REFUSED),
    after=st.lists(good(), max_size=2),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=6),
)
def test_answers_stay_in_step_whatever_the_bytes(
    server: tuple[srv.Server, Failures], goods: list[Good], refused: bytes | None, after: list[Good], cuts: list[int]
) -> None:
    s, failures = server
    sent = b"".join(g.raw for g in goods) + (refused + b"".join(g.raw for g in after) if refused else b"")
    answers, rest = parse_answers(exchange(s.server_address[1], split(sent, cuts)))
    assert rest == b"", f"a partial answer: {rest[:200]!r}"
    for i, (want, (code, body, _)) in enumerate(zip(goods, answers, strict=False)):
        assert not want.wrong(code, body), f"answer {i} to {want.raw[:60]!r}: {code} {body[:200]!r}"
    if refused is None:
        assert len(answers) == len(goods), answers
        assert not any(close for _, _, close in answers)
    else:
        # every request before the refused one answered, then at most the refusal, then nothing
        assert len(goods) <= len(answers) <= len(goods) + 1, answers
        if len(answers) > len(goods):
            code, body, close = answers[-1]
            assert code >= 400 and close, (code, body)
    assert failures.records == []


def test_the_server_still_serves_after_the_fuzz(server: tuple[srv.Server, Failures]) -> None:
    s, failures = server
    raw = exchange(s.server_address[1], [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"])
    assert parse_answers(raw) == ([(200, b"ok\n", False)], b"")
    assert failures.records == []
