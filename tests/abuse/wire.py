"""A hostile HTTP/2 client: raw frames on a plain socket, written exactly as a test says.

Theory of operation
-------------------
The abuse tests must send what no well-behaved library would (frames on the wrong stream, bad
lengths, floods, header blocks that never end), so this client has no rules of its own. It owns
its frame encoders (a few lines each, independent of the server's codecs: a bug there must not
hide a bug in the server) and HPACK *literals* for the blocks it sends, so that any name or value
(uppercase, ``connection``, pseudo-headers in any order) goes out byte for byte.

:class:`RawClient` is one TCP connection to 127.0.0.1. ``send`` writes bytes with a bounded wait:
a server that stops reading makes it return False instead of blocking the test (that is how a test
sees "limited"). A reader thread (``start_reader``), when the test wants one, cuts what the server
sends into frames and records what matters: GOAWAY, RST_STREAM, the decoded header blocks, the
windows the server grants, PING ACKs, the largest frame, and the end of the connection. It ACKs
the server's SETTINGS as any client must. A never-reading client simply does not start it.

:meth:`RawClient.barrier` sends a PING and waits for its ACK: the server handles a connection's
frames in order, so once the ACK is back, whatever the server answered to the frames sent before
the PING has arrived too. Tests wait for that instead of sleeping.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import hpack

__all__ = [
    "ADS_PATH",
    "PREFACE",
    "FrameType",
    "Goaway",
    "H2Code",
    "RawClient",
    "frame",
    "grpc_message",
    "literal_block",
    "parse_frames",
    "request_headers",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ADS_PATH = b"/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
DEFAULT_WINDOW = 65_535
MAX_FRAME = 16_384

T = TypeVar("T")


class FrameType:
    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4


class H2Code:
    """RFC 9113 section 7 error codes."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    ENHANCE_YOUR_CALM = 0xB

    @classmethod
    def name(cls, code: int) -> str:
        for key, value in vars(cls).items():
            if key.isupper() and value == code:
                return key
        return f"0x{code:x}"


# -- encoders ---------------------------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"", *, length: int | None = None) -> bytes:
    """One frame; ``length`` overrides the length field (to lie about it)."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def settings_frame(entries: Iterable[tuple[int, int]], *, stream_id: int = 0) -> bytes:
    return frame(FrameType.SETTINGS, 0, stream_id, b"".join(struct.pack(">HI", k, v) for k, v in entries))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream_id, struct.pack(">I", code))


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """HPACK literals without indexing, new names, no Huffman: sent exactly as given."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value
    return bytes(out)


def table_size_update(size: int) -> bytes:
    return _hpack_int(size, 5, 0x20)


def request_headers(path: bytes = ADS_PATH) -> list[tuple[bytes, bytes]]:
    """The headers of a gRPC call, as grpc core sends them."""
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"127.0.0.1"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]


def headers_frame(
    stream_id: int, headers: Iterable[tuple[bytes, bytes]] | None = None, *, end_stream: bool = False
) -> bytes:
    """A header block in HEADERS (+ CONTINUATION frames when it is over the default MAX_FRAME_SIZE)."""
    block = literal_block(request_headers() if headers is None else headers)
    pieces = [block[i : i + MAX_FRAME] for i in range(0, len(block), MAX_FRAME)]
    end = END_STREAM if end_stream else 0
    if len(pieces) == 1:
        return frame(FrameType.HEADERS, END_HEADERS | end, stream_id, block)
    return b"".join(
        [
            frame(FrameType.HEADERS, end, stream_id, pieces[0]),
            *(frame(FrameType.CONTINUATION, 0, stream_id, p) for p in pieces[1:-1]),
            frame(FrameType.CONTINUATION, END_HEADERS, stream_id, pieces[-1]),
        ]
    )


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


def data_frames(stream_id: int, data: bytes, *, end_stream: bool = False, size: int = MAX_FRAME) -> bytes:
    """``data`` cut into DATA frames of ``size`` bytes (no regard for windows)."""
    chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    out = [frame(FrameType.DATA, 0, stream_id, c) for c in chunks[:-1]]
    out.append(frame(FrameType.DATA, END_STREAM if end_stream else 0, stream_id, chunks[-1]))
    return b"".join(out)


# -- what the server sent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Goaway:
    last_stream: int
    code: int
    debug: bytes

    def __str__(self) -> str:
        return f"GOAWAY {H2Code.name(self.code)} ({self.debug[:120]!r})"


@dataclass
class Received:
    """What the reader thread saw, guarded by :attr:`RawClient.cond`."""

    goaway: Goaway | None = None
    resets: dict[int, int] = field(default_factory=dict)
    """stream id -> RST_STREAM error code"""
    headers: dict[int, list[list[tuple[bytes, bytes]]]] = field(default_factory=dict)
    """stream id -> its decoded header blocks (response headers, trailers)"""
    data: dict[int, int] = field(default_factory=dict)
    """stream id -> DATA bytes received"""
    ended: set[int] = field(default_factory=set)
    """streams the server ended (END_STREAM)"""
    counts: dict[int, int] = field(default_factory=dict)
    """frame type -> frames received"""
    ping_acks: set[bytes] = field(default_factory=set)
    settings: int = 0
    """SETTINGS frames (not ACKs) received"""
    largest_frame: int = 0
    bytes: int = 0
    closed: str | None = None
    """why the connection ended (EOF, reset), once it has"""
    goaway_time: float | None = None
    """when (time.monotonic) the first GOAWAY was read"""
    closed_time: float | None = None
    """when (time.monotonic) the end of the connection was read"""
    errors: list[str] = field(default_factory=list)
    """what the reader could not make sense of"""

    def grpc_status(self, stream_id: int) -> int | None:
        for block in self.headers.get(stream_id, []):
            for name, value in block:
                if name == b"grpc-status":
                    return int(value)
        return None

    def describe(self) -> str:
        kinds = {v: k for k, v in vars(FrameType).items() if k.isupper()}
        counts = ", ".join(f"{kinds.get(k, k)}: {n}" for k, n in sorted(self.counts.items()))
        resets = {sid: H2Code.name(code) for sid, code in list(self.resets.items())[:10]}
        statuses = {sid: self.grpc_status(sid) for sid in list(self.headers)[:10]}
        return (
            f"received {self.bytes} bytes ({counts}); goaway: {self.goaway}; resets: {resets}; "
            f"grpc-status per stream: {statuses}; largest frame: {self.largest_frame}; "
            f"closed: {self.closed}; reader errors: {self.errors[:3]}"
        )


class RawClient:
    """One TCP connection to the server under test, driven frame by frame."""

    def __init__(
        self,
        port: int,
        *,
        preface: bool = True,
        settings: Iterable[tuple[int, int]] = (),
        rcvbuf: int | None = None,
        source: str = "127.0.0.1",
        send_timeout: float = 2.0,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so that the window scale is small too
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind((source, 0))
        self.sock.settimeout(5.0)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(send_timeout)
        self.sent = 0
        self.send_stalled = False
        """A send waited ``send_timeout`` without progress: the server stopped reading."""
        self.send_failed: str | None = None
        self.cond = threading.Condition()
        self.got = Received()
        self.windows: dict[int, int] = {0: DEFAULT_WINDOW}
        self.initial_window = DEFAULT_WINDOW
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._decoder = hpack.Decoder(max_header_list_size=1 << 30)
        self._fragments: dict[int, bytearray] = {}
        if preface:
            self.send(PREFACE + settings_frame(settings))

    # -- sending --------------------------------------------------------------------------------

    def send(self, data: bytes) -> bool:
        """Write ``data``; False (and nothing more is sent) once the server stops taking it or closes."""
        if self.send_failed is not None:
            return False
        view = memoryview(data)
        with self._send_lock:
            try:
                while view:
                    n = self.sock.send(view)
                    self.sent += n
                    view = view[n:]
            except TimeoutError:
                self.send_stalled = True
                self.send_failed = "send stalled: the server stopped reading"
                return False
            except OSError as exc:
                self.send_failed = f"send failed: {exc}"
                return False
        return True

    def send_all(self, chunks: Iterable[bytes], *, until: Callable[[], bool] | None = None) -> bool:
        """Send chunk after chunk; stop early (False) when the server stops reading or closes,
        or when ``until()`` holds (checked between chunks)."""
        for chunk in chunks:
            if until is not None and until():
                return False
            if not self.send(chunk):
                return False
        return True

    def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = True, timeout: float = 10.0) -> bool:
        """Send ``data`` on a stream within the windows the server grants (needs the reader).
        Stops (False) when the stream or connection ends, or no window opens for ``timeout``."""
        view = memoryview(data)
        while True:
            with self.cond:
                ok = self.cond.wait_for(
                    lambda: (
                        self._stream_over(stream_id)
                        or (min(self.windows[0], self.windows.get(stream_id, self.initial_window)) > 0)
                    ),
                    timeout,
                )
                if not ok or self._stream_over(stream_id):
                    return False
                budget = min(self.windows[0], self.windows.get(stream_id, self.initial_window), MAX_FRAME, len(view))
                self.windows[0] -= budget
                self.windows[stream_id] = self.windows.get(stream_id, self.initial_window) - budget
            last = budget == len(view)
            chunk = bytes(view[:budget])
            view = view[budget:]
            if not self.send(frame(FrameType.DATA, END_STREAM if last and end_stream else 0, stream_id, chunk)):
                return False
            if last:
                return True

    def _stream_over(self, stream_id: int) -> bool:
        got = self.got
        return got.closed is not None or got.goaway is not None or stream_id in got.resets or stream_id in got.ended

    def barrier(self, timeout: float = 10.0) -> bool:
        """PING and wait for the ACK (or the end of the connection): the server has handled all
        that was sent before. True when the ACK came."""
        payload = os.urandom(8)
        if not self.send(frame(FrameType.PING, 0, 0, payload)):
            self.wait_for(lambda got: got.closed is not None, timeout=timeout)
            return False
        self.wait_for(lambda got: payload in got.ping_acks or got.closed is not None, timeout=timeout)
        with self.cond:
            return payload in self.got.ping_acks

    def wait_for(self, predicate: Callable[[Received], T], *, timeout: float) -> T | None:
        """Wait (on the reader's notifications) until ``predicate(received)`` is truthy."""
        with self.cond:
            self.cond.wait_for(lambda: predicate(self.got), timeout)
            return predicate(self.got) or None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._reader is not None:
            self._reader.join(5.0)

    # -- receiving ------------------------------------------------------------------------------

    def start_reader(self) -> RawClient:
        """Read in a thread; wait for the server's SETTINGS and ACK them before anything else is
        sent (an ACK sent later could land inside a header block the test is writing)."""
        self._reader = threading.Thread(target=self._read_loop, name="raw-h2-reader", daemon=True)
        self._reader.start()
        if self.wait_for(lambda got: got.settings or got.closed, timeout=5.0) and not self.got.closed:
            self.send(frame(FrameType.SETTINGS, ACK, 0))
        return self

    def _read_loop(self) -> None:
        buffer = bytearray()
        sock = self.sock
        reason = "EOF"
        while True:
            try:
                sock.settimeout(None)
                chunk = sock.recv(1 << 20)
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                break
            if not chunk:
                break
            buffer += chunk
            offset = 0
            with self.cond:
                self.got.bytes += len(chunk)
                while len(buffer) - offset >= 9:
                    length = int.from_bytes(buffer[offset : offset + 3], "big")
                    if len(buffer) - offset - 9 < length:
                        break
                    kind, flags = buffer[offset + 3], buffer[offset + 4]
                    stream_id = int.from_bytes(buffer[offset + 5 : offset + 9], "big") & 0x7FFF_FFFF
                    payload = bytes(buffer[offset + 9 : offset + 9 + length])
                    offset += 9 + length
                    self._on_frame(kind, flags, stream_id, payload)
                del buffer[:offset]
                self.cond.notify_all()
        with self.cond:
            if buffer:
                self.got.errors.append(f"{len(buffer)} bytes of an incomplete frame at the end")
            self.got.closed = reason
            self.got.closed_time = time.monotonic()
            self.cond.notify_all()

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        got = self.got
        got.counts[kind] = got.counts.get(kind, 0) + 1
        got.largest_frame = max(got.largest_frame, len(payload))
        if kind == FrameType.GOAWAY and len(payload) >= 8:
            last, code = struct.unpack_from(">II", payload)
            got.goaway = Goaway(last & 0x7FFF_FFFF, code, payload[8:])
            if got.goaway_time is None:
                got.goaway_time = time.monotonic()
        elif kind == FrameType.RST_STREAM and len(payload) == 4:
            got.resets[stream_id] = struct.unpack(">I", payload)[0]
        elif kind == FrameType.PING and flags & ACK:
            got.ping_acks.add(payload)
        elif kind == FrameType.SETTINGS and not flags & ACK:
            for offset in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, offset)
                if key == 0x4:
                    delta, self.initial_window = value - self.initial_window, value
                    for sid in self.windows:
                        if sid:
                            self.windows[sid] += delta
            got.settings += 1
            if got.settings > 1:  # the first is ACKed by start_reader; later ones (rare) from a thread,
                # so that the reader never waits on a send the server may not be reading
                threading.Thread(target=self.send, args=(frame(FrameType.SETTINGS, ACK, 0),), daemon=True).start()
        elif kind == FrameType.WINDOW_UPDATE and len(payload) == 4:
            increment = struct.unpack(">I", payload)[0] & 0x7FFF_FFFF
            self.windows[stream_id] = self.windows.get(stream_id, self.initial_window) + increment
        elif kind == FrameType.DATA:
            got.data[stream_id] = got.data.get(stream_id, 0) + len(payload)
            if flags & END_STREAM:
                got.ended.add(stream_id)
        elif kind in (FrameType.HEADERS, FrameType.CONTINUATION):
            fragment = self._fragments.setdefault(stream_id, bytearray())
            fragment += payload  # padding and priority: the server sends neither
            if flags & END_HEADERS:
                del self._fragments[stream_id]
                try:
                    block = [(bytes(n), bytes(v)) for n, v in self._decoder.decode(bytes(fragment), raw=True)]
                except hpack.HPACKError as exc:
                    got.errors.append(f"undecodable header block on stream {stream_id}: {exc}")
                    block = []
                got.headers.setdefault(stream_id, []).append(block)
            if flags & END_STREAM:
                got.ended.add(stream_id)


def parse_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame in ``data`` (a server's bytes)."""
    out, offset = [], 0
    while len(data) - offset >= 9:
        length = int.from_bytes(data[offset : offset + 3], "big")
        if len(data) - offset - 9 < length:
            break
        stream_id = int.from_bytes(data[offset + 5 : offset + 9], "big") & 0x7FFF_FFFF
        out.append((data[offset + 3], data[offset + 4], stream_id, data[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    return out


def wait(condition: Callable[[], T], *, timeout: float, interval: float = 0.02) -> T | None:
    """Poll ``condition`` until truthy or ``timeout``; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
