"""One HTTP/2 connection for gRPC, sans-IO: bytes in, events out, bytes to send.

Theory of operation. A :class:`Connection` plays the server or the client role (RFC 9113). The I/O
adapter feeds it what the socket read (:meth:`Connection.receive`, which returns :class:`Event`
values), calls ``send_*`` methods to queue frames, and writes what :meth:`Connection.data_to_send`
hands back. Nothing here touches a socket, a clock other than the one passed in, or asyncio.

Every rule of RFC 9113 that a peer can trip is checked where its frame is read, with the error code
the RFC names: a *connection error* queues GOAWAY and ends the connection (a
:class:`ConnectionTerminated` event, then :attr:`Connection.closed`); a *stream error* queues
RST_STREAM and ends the stream (:class:`StreamReset` with ``remote=False``). What the RFC leaves to
the implementation is bounded by :class:`Limits`, with defaults like nghttp2's and Envoy's; a peer
over a limit gets GOAWAY ENHANCE_YOUR_CALM.

gRPC messages (5-byte prefix + body) are reassembled here, in linear time: a message wholly
inside one DATA frame is sliced out of it; one that spans frames is appended to one buffer, sized
by its prefix and bounded by :attr:`Limits.max_message_size`. Flow control windows are given back
as data is *consumed*: the bytes of a partial message when they enter the bounded reassembly
buffer, padding and discarded data at once, and the bytes of a delivered message when the
application calls :meth:`Connection.acknowledge` (so a peer cannot make the application hold more
than the windows it was granted). Outgoing messages wait in their stream, as views of the caller's
bytes (shared between streams, never copied), until the peer's windows let them out.

A peer that does not read cannot grow our output without bound: the adapter reports a full socket
buffer with :attr:`Connection.writing_paused`. Then DATA waits in its streams, and what the peer
makes us owe is counted: the control frames (SETTINGS and PING ACKs, RST_STREAMs) past
:attr:`Limits.max_queued_control_frames`, and the messages queued in streams past
:attr:`Limits.max_queued_messages`, end the connection (ENHANCE_YOUR_CALM; nghttp2's
max_outbound_ack, Envoy's max_outbound_control_frames and max_outbound_frames). The peer is still
read meanwhile, as nghttp2 and Envoy read it (Envoy's HTTP/2 codec only tells its streams that the
connection is backed up): a connection that stopped reading would never see the flood, or the
error, that must end it, and would hold its descriptor for as long as the peer likes. A peer that
grants no flow-control window fills no socket: the DATA it is owed is counted instead, and past
:attr:`Limits.max_owed_bytes` the connection ends too.

Why pilotfish's own code and not the ``h2`` package's state machine (the hardened transport's choice, measured by
``python -m bench.h2_core_compare``, BENCHMARKS.md): both under the same ``GrpcServer`` adapter,
the package wrapped to this interface and these limits (bench/h2_package_core.py), both hold all
50 attacks of tests/abuse; a push to 1,000 proxies costs the server 1.6x the CPU on the package
(0.100 against 0.063 CPU-s per push, mean of six interleaved runs each; every pair 1.4-1.8x), and
an idle stream 2-3x the memory. The package stays the test oracle
(tests/unit/transport/test_transport_h2_properties.py).

Time-outs are the adapter's, which owns the clock and the timers: it reads
:attr:`Connection.preface_received` (handshake timeout), :attr:`Connection.open_streams` and
:attr:`Connection.last_peer_stream` (idle timeout) from a periodic sweep, and ends a connection
with :meth:`Connection.close`. Connection counts (in total, per address) are the adapter's too:
a connection it refuses never gets a :class:`Connection`.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import hpack

from pilotfish.transport import frames as f
from pilotfish.transport.frames import ErrorCode, Setting

__all__ = [
    "Connection",
    "ConnectionTerminated",
    "Event",
    "HeadersReceived",
    "Limits",
    "MessageReceived",
    "MessageRejected",
    "ProtocolUsageError",
    "Role",
    "StreamEnded",
    "StreamReset",
]

_KiB = 1024
_MiB = 1024 * 1024


class Role(enum.Enum):
    SERVER = "server"
    CLIENT = "client"


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one connection lets a peer make it hold or do. Defaults follow nghttp2, Envoy and
    grpc-core; each limit names the attack it stops."""

    max_concurrent_streams: int = 100
    """Streams the peer may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS, nghttp2's
    default). A stream past it is refused (RST_STREAM REFUSED_STREAM)."""
    initial_window_size: int = 1 * _MiB
    """Receive window of each stream (SETTINGS_INITIAL_WINDOW_SIZE): DATA a peer may send on a
    stream before the application consumes it."""
    connection_window_size: int = 16 * _MiB
    """Receive window of the connection: DATA in flight on all streams together."""
    max_message_size: int = 4 * _MiB
    """Largest gRPC message received (grpc-core's default). A larger one is rejected
    (:class:`MessageRejected`, RESOURCE_EXHAUSTED) before any of it is buffered."""
    max_header_list_size: int = 64 * _KiB
    """Decoded size of a header list (SETTINGS_MAX_HEADER_LIST_SIZE; Envoy's is 60 KiB)."""
    max_header_block_size: int = 64 * _KiB
    """Encoded bytes of one header block (HEADERS + CONTINUATION); over it: ENHANCE_YOUR_CALM
    (the CONTINUATION flood of 2024)."""
    max_continuation_frames: int = 8
    """CONTINUATION frames in one header block (nghttp2's 2024 limit); over it: ENHANCE_YOUR_CALM."""
    max_table_size_updates: int = 2
    """HPACK dynamic table size updates at the start of one header block (RFC 7541 needs at most
    two: the smallest size and the final one); over it: ENHANCE_YOUR_CALM."""
    max_settings_entries: int = 32
    """Parameters in one SETTINGS frame (nghttp2's default); over it: ENHANCE_YOUR_CALM."""
    max_queued_control_frames: int = 1000
    """Control frames we owe (SETTINGS/PING ACKs, RST_STREAM) queued while the peer does not read
    (nghttp2's max_outbound_ack, Envoy's max_outbound_control_frames); over it: the connection
    ends (ENHANCE_YOUR_CALM), since the peer is flooding us without reading."""
    max_queued_messages: int = 10_000
    """Messages queued in streams while the peer does not read (the answers to requests it goes on
    sending; Envoy's max_outbound_frames, 10,000); over it: the connection ends (ENHANCE_YOUR_CALM).
    Queued messages are views of bytes shared with other streams, so this bounds their count, not
    a copy of each."""
    reset_burst: int = 1000
    """Stream resets (by the peer, or by us for its errors) allowed at once: a token bucket
    (nghttp2's stream_reset_burst). Empty bucket: ENHANCE_YOUR_CALM (rapid reset,
    CVE-2023-44487)."""
    reset_rate: float = 33.0
    """Tokens per second returned to the reset bucket (nghttp2's stream_reset_rate)."""
    settings_burst: int = 100
    """SETTINGS frames (not ACKs) a peer may send at once: a token bucket. A peer sends one at the
    start and rarely another; each costs us an ACK. Empty bucket: ENHANCE_YOUR_CALM (a SETTINGS
    flood, answered with ACKs a peer that never reads makes us hold)."""
    settings_rate: float = 10.0
    """Tokens per second returned to the SETTINGS bucket."""
    max_consecutive_empty_frames: int = 1
    """DATA frames in a row with no payload and no END_STREAM (Envoy's
    max_consecutive_inbound_frames_with_empty_payload, CVE-2019-9518); over it: ENHANCE_YOUR_CALM."""
    max_remembered_resets: int = 256
    """Streams we reset whose late frames are ignored rather than answered (bounded memory)."""
    max_owed_bytes: int = 64 * _MiB
    """DATA we owe the peer, on all its streams, that its flow-control windows (or a full socket)
    hold back, plus :data:`OWED_PIECE_COST` per piece of it held; over it: the connection ends
    (ENHANCE_YOUR_CALM). A peer that grants no window does not fill the socket, so it is still
    read from: without this, each request it sends could leave another response owed (Envoy ends
    a stream whose buffer overflows its watermark the same way)."""


_DEFAULT_HEADER_TABLE = 4096
OWED_PIECE_COST = 512
"""What holding one piece of an owed message costs beyond its bytes (its view, the queue's slot):
counted in :attr:`Limits.max_owed_bytes`, so that many small messages count too."""
_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
_RESPONSE_PSEUDO = frozenset({b":status"})
# RFC 9113 section 8.2.1: a field name holds no uppercase letter, control, space or non-ASCII byte.
_BAD_NAME_BYTES = bytes(range(0x00, 0x21)) + bytes(range(0x41, 0x5B)) + bytes(range(0x7F, 0x100))
_SELF_DEPENDENT = 0x100  # not a wire flag: marks a HEADERS frame whose priority names its own stream


# -- events -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadersReceived:
    """A request's or response's headers, or trailers (``end_stream`` and not the first block)."""

    stream_id: int
    headers: list[tuple[bytes, bytes]]
    end_stream: bool
    trailers: bool


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole gRPC message. Give its ``flow_controlled_length`` back with
    :meth:`Connection.acknowledge` once it is consumed."""

    stream_id: int
    data: bytes
    flow_controlled_length: int


@dataclass(frozen=True, slots=True)
class MessageRejected:
    """A message the stream will not deliver (too large, compressed): the application ends the
    call with ``grpc_status``; the rest of the stream's DATA is discarded."""

    stream_id: int
    grpc_status: int
    reason: str


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The peer has sent all it will on the stream (END_STREAM)."""

    stream_id: int
    incomplete_message: bool


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream ended with RST_STREAM: sent by the peer (``remote``) or by us for its error."""

    stream_id: int
    error_code: int
    remote: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    """The connection is over: GOAWAY from the peer (``remote``) or queued by us for its error."""

    error_code: int
    last_stream_id: int
    remote: bool
    reason: str


Event = HeadersReceived | MessageReceived | MessageRejected | StreamEnded | StreamReset | ConnectionTerminated


class ProtocolUsageError(Exception):
    """The application asked the connection for something HTTP/2 forbids (our own bug)."""


_OUT_OF_PLACE = {
    f.PUSH_PROMISE: "PUSH_PROMISE, but push is disabled (SETTINGS_ENABLE_PUSH 0; a client never pushes)",
    f.CONTINUATION: "CONTINUATION on stream {stream_id} without a HEADERS frame before it",
}
"""Frame types that are a connection error wherever they come (a CONTINUATION that continues a
header block is handled before this table is looked at)."""


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _StreamError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# -- streams ----------------------------------------------------------------------------------------

_OWN_PIECE = 4096
"""A piece of a message spanning DATA frames at least this long is kept as it is; shorter ones
are gathered in a bytearray (bounding the memory per byte a trickling peer makes us keep)."""


class _ControlFrames(bytearray):
    """Output made of control frames we owe the peer (never a buffer an application passed)."""

    __slots__ = ()


class _Stream:
    __slots__ = (
        "headers_received",
        "id",
        "local_closed",
        "message",
        "message_have",
        "message_need",
        "message_parts",
        "pending",
        "pending_end",
        "recv_window",
        "rejected",
        "remote_closed",
        "send_window",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0
        """Bytes consumed and not yet given back with WINDOW_UPDATE."""
        self.headers_received = False
        self.local_closed = False
        self.remote_closed = False
        self.rejected = False
        self.message: bytearray | None = None
        """The partial message's prefix (or what there is of it) when one spans DATA frames."""
        self.message_need = 0
        """Total length (prefix included) of the partial message, 0 while its prefix is incomplete."""
        self.message_have = 0
        """Bytes (prefix included) of the partial message received so far, once its prefix is complete."""
        self.message_parts: list[bytes | bytearray] = []
        """The partial message's body so far, in pieces."""
        self.pending: deque[memoryview] | None = None
        self.pending_end: bytes | None = None
        """The header block that ends our side, waiting behind pending DATA (b"" = empty DATA)."""


# -- the connection ---------------------------------------------------------------------------------


class Connection:
    """One HTTP/2 connection (see the module docstring)."""

    __slots__ = (
        "_block",
        "_block_flags",
        "_block_frames",
        "_block_stream",
        "_buffer",
        "_clock",
        "_decoder",
        "_empty_frames",
        "_ended",
        "_goaway_sent",
        "_highest_remote",
        "_needed",
        "_next_local",
        "_on_output",
        "_out",
        "_owed",
        "_peer_initial_window",
        "_peer_max_frame",
        "_peer_max_streams",
        "_preface_pending",
        "_queued_control",
        "_queued_messages",
        "_recv_window",
        "_reset_by_us",
        "_reset_time",
        "_reset_tokens",
        "_send_window",
        "_settings_seen",
        "_settings_time",
        "_settings_tokens",
        "_streams",
        "_table_update",
        "_unacked",
        "_waiting",
        "closed",
        "limits",
        "role",
        "terminated",
        "writing_paused",
    )

    def __init__(
        self,
        *,
        role: Role,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_output: Callable[[], None] | None = None,
    ) -> None:
        self.role = role
        self.limits = limits = limits or Limits()
        self._clock = clock
        self._on_output = on_output
        """Called when output is queued and none was waiting (an adapter schedules a write)."""
        self._out: list[bytes | bytearray | memoryview] = []
        self._queued_control = 0
        self._owed = 0
        """Bytes of DATA waiting in streams, plus OWED_PIECE_COST per piece (Limits.max_owed_bytes)."""
        self._queued_messages = 0
        self.writing_paused = False
        """Set by the adapter while the socket does not take more (asyncio's pause_writing)."""
        self.closed = False
        """A GOAWAY has been sent or received for an error: read nothing more."""
        self.terminated: ConnectionTerminated | None = None
        """Why we ended the connection, once we have (also when a ``send_*`` call did: no event then)."""
        self._buffer = bytearray()
        self._needed = 0
        self._empty_frames = 0
        """Bytes :attr:`_buffer` must hold before a frame in it can be read."""
        self._preface_pending = role is Role.SERVER
        self._settings_seen = False
        self._decoder = hpack.Decoder(max_header_list_size=limits.max_header_list_size)
        self._decoder.max_allowed_table_size = _DEFAULT_HEADER_TABLE
        self._streams: dict[int, _Stream] = {}
        self._reset_by_us: dict[int, None] = {}
        """Streams we reset lately: their late frames are ignored."""
        self._ended: dict[int, None] = {}
        """Streams that ended lately: a HEADERS on one is a stream error, not an unexpected id."""
        self._highest_remote = 0
        self._next_local = 1 if role is Role.CLIENT else 2
        self._block_stream = 0
        self._block_flags = 0
        self._block: bytearray = bytearray()
        self._block_frames = 0
        self._send_window = f.DEFAULT_WINDOW
        self._recv_window = limits.connection_window_size
        self._unacked = 0
        self._peer_initial_window = f.DEFAULT_WINDOW
        self._peer_max_frame = f.DEFAULT_MAX_FRAME
        self._peer_max_streams = 2**31 - 1
        self._table_update = b""
        self._waiting: dict[_Stream, None] = {}
        self._reset_tokens = float(limits.reset_burst)
        self._reset_time = clock()
        self._settings_tokens = float(limits.settings_burst)
        self._settings_time = self._reset_time
        self._goaway_sent = False
        if role is Role.CLIENT:
            self._queue(f.CONNECTION_PREFACE)
        ours = {
            Setting.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            Setting.INITIAL_WINDOW_SIZE: limits.initial_window_size,
            Setting.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
            Setting.ENABLE_PUSH: 0,
        }
        self._queue(f.settings(ours))
        if limits.connection_window_size > f.DEFAULT_WINDOW:
            self._queue(f.window_update(0, limits.connection_window_size - f.DEFAULT_WINDOW))
        else:
            self._recv_window = f.DEFAULT_WINDOW

    # -- output --------------------------------------------------------------------------------

    def _queue(self, data: bytes | bytearray | memoryview) -> None:
        out = self._out
        if not out and self._on_output is not None:
            self._on_output()
        out.append(data)

    def _queue_control(self, data: bytes) -> None:
        """A frame we owe the peer in answer to its own (ACK, RST_STREAM). Consecutive ones share
        one buffer: a flood of PINGs read in one go is answered by one piece of output, not by a
        17-byte object per PING for the socket's write queue to hold."""
        out = self._out
        if out and type(out[-1]) is _ControlFrames:
            out[-1] += data  # ours (a bytearray), checked above
        else:
            self._queue(_ControlFrames(data))
        if self.writing_paused:
            self._queued_control += 1
            if self._queued_control > self.limits.max_queued_control_frames:
                raise _ConnectionError(
                    ErrorCode.ENHANCE_YOUR_CALM,
                    f"more than {self.limits.max_queued_control_frames} control frames owed "
                    "to a peer that does not read (Limits.max_queued_control_frames)",
                )

    def data_to_send(self) -> bytes:
        """Everything queued since the last call, as one byte string."""
        return b"".join(self.take_output())

    def take_output(self) -> list[bytes | bytearray | memoryview]:
        """Everything queued since the last call, as pieces for one ``writelines`` (no copy)."""
        out, self._out = self._out, []
        return out

    @property
    def wants_to_read(self) -> bool:
        """False once the connection is over: the adapter stops reading. (A peer that does not
        read, :attr:`writing_paused`, is still read: see the module docstring.)"""
        return not self.closed

    def resume_writing(self) -> None:
        """The socket takes data again: send what the windows allow."""
        self.writing_paused = False
        self._queued_control = 0
        self._queued_messages = 0
        self._drain_waiting()

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """Take bytes read from the socket; return what they mean."""
        events: list[Event] = []
        if self.closed:
            return events
        offset = 0
        if self._buffer:  # a frame (or the preface) cut short by an earlier read
            # Complete just that frame from the new bytes (not the whole read joined to it: a
            # large message arrives in reads that rarely end on a frame boundary).
            buffer, view = self._buffer, memoryview(data)
            while True:
                take = self._needed - len(buffer)
                if len(data) - offset < take:
                    buffer += view[offset:]  # still short: appending keeps a trickled frame linear
                    return events
                buffer += view[offset : offset + take]
                offset += take
                if self._preface_pending or len(buffer) > 9:
                    break
                length = f.parse_frame_header(buffer, 0)[0]
                if not length or length > f.DEFAULT_MAX_FRAME:
                    break  # complete (or refused by its header alone)
                self._needed = 9 + length
            view.release()
            frame = bytes(buffer)
            buffer.clear()
            self._parse(frame, 0, events)
            if self.closed or offset == len(data):
                return events
            assert not self._buffer  # (what was completed was one whole frame, or the preface)
        self._parse(data, offset, events)
        return events

    def _parse(self, data: bytes, offset: int, events: list[Event]) -> None:
        """Read the preface and frames in ``data`` from ``offset``; keep a cut-short one."""
        end = len(data)
        try:
            if self._preface_pending:
                size = len(f.CONNECTION_PREFACE)
                if not f.CONNECTION_PREFACE.startswith(data[offset : offset + size]):
                    raise _ConnectionError(
                        ErrorCode.PROTOCOL_ERROR,
                        "the client did not send the HTTP/2 connection preface (is it speaking HTTP/1.1 or TLS?)",
                    )
                if end - offset < size:
                    self._buffer += data[offset:]
                    self._needed = size
                    return
                self._preface_pending = False
                offset += size
            view = memoryview(data)
            while end - offset >= 9 and not self.closed:
                length, kind, flags, stream_id = f.parse_frame_header(data, offset)
                if length > f.DEFAULT_MAX_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE
                    raise _ConnectionError(
                        ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes is over SETTINGS_MAX_FRAME_SIZE 16384"
                    )
                if end - offset < 9 + length:
                    break
                start = offset + 9
                offset = start + length
                self._on_frame(kind, flags, stream_id, view[start:offset], events)
        except _ConnectionError as exc:
            self._terminate(exc.code, exc.reason, events)
            return
        if offset < end and not self.closed:
            self._buffer += view[offset:]
            self._needed = 9 if end - offset < 9 else 9 + f.parse_frame_header(data, offset)[0]

    def _terminate(self, code: int, reason: str, events: list[Event]) -> None:
        self._queue(f.goaway(self._highest_remote, code, reason.encode()[:256]))
        self._goaway_sent = True
        self.closed = True
        self.terminated = ConnectionTerminated(code, self._highest_remote, False, reason)
        events.append(self.terminated)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if not self._settings_seen:
            if kind != f.SETTINGS or flags & f.ACK:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "the peer's first frame is not SETTINGS")
            self._settings_seen = True
        if self._block_stream:
            if kind != f.CONTINUATION or stream_id != self._block_stream:
                raise _ConnectionError(
                    ErrorCode.PROTOCOL_ERROR,
                    f"header block of stream {self._block_stream} interrupted by a frame of "
                    f"type {kind} on stream {stream_id}",
                )
            self._on_continuation(flags, payload, events)
            return
        try:
            if kind == f.DATA:
                self._on_data(flags, stream_id, payload, events)
            elif kind == f.HEADERS:
                self._on_headers(flags, stream_id, payload, events)
            elif kind == f.PRIORITY:
                self._on_priority(stream_id, payload)
            elif kind == f.RST_STREAM:
                self._on_rst_stream(stream_id, payload, events)
            elif kind == f.SETTINGS:
                self._on_settings(flags, stream_id, payload)
            elif kind == f.PING:
                self._on_ping(flags, stream_id, payload)
            elif kind == f.GOAWAY:
                self._on_goaway(stream_id, payload, events)
            elif kind == f.WINDOW_UPDATE:
                self._on_window_update(stream_id, payload, events)
            elif kind in _OUT_OF_PLACE:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, _OUT_OF_PLACE[kind].format(stream_id=stream_id))
            # Unknown frame types are ignored (RFC 9113 section 5.5).
        except _StreamError as exc:
            self._reset(stream_id, exc.code, exc.reason, events)

    # -- stream bookkeeping ------------------------------------------------------------------------

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) == (self.role is Role.CLIENT)

    def _is_idle(self, stream_id: int) -> bool:
        if self._is_local(stream_id):
            return stream_id >= self._next_local
        return stream_id > self._highest_remote

    def _spend_reset_token(self) -> None:
        now = self._clock()
        limits = self.limits
        self._reset_tokens = min(
            float(limits.reset_burst), self._reset_tokens + (now - self._reset_time) * limits.reset_rate
        )
        self._reset_time = now
        self._reset_tokens -= 1
        if self._reset_tokens < 0:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {limits.reset_burst} stream resets at {limits.reset_rate}/s "
                "(rapid reset; Limits.reset_burst, Limits.reset_rate)",
            )

    def _close_stream(self, stream: _Stream) -> None:
        self._streams.pop(stream.id, None)
        ended = self._ended
        ended[stream.id] = None
        if len(ended) > self.limits.max_remembered_resets:
            del ended[next(iter(ended))]  # the oldest (dicts keep insertion order)
        self._waiting.pop(stream, None)
        self._forget_pending(stream)

    def _forget_pending(self, stream: _Stream) -> None:
        pending, stream.pending = stream.pending, None
        if pending:
            self._owed -= sum(map(len, pending)) + OWED_PIECE_COST * len(pending)

    def _remember_reset(self, stream_id: int) -> None:
        resets = self._reset_by_us
        resets[stream_id] = None
        if len(resets) > self.limits.max_remembered_resets:
            del resets[next(iter(resets))]

    def _reset(self, stream_id: int, code: int, reason: str, events: list[Event]) -> None:
        """A stream error: RST_STREAM, forget the stream."""
        self._spend_reset_token()
        self._queue_control(f.rst_stream(stream_id, code))
        stream = self._streams.get(stream_id)
        if stream is not None:  # (a stream that was not open has no frames in flight to forgive)
            self._close_stream(stream)
            self._remember_reset(stream_id)
        events.append(StreamReset(stream_id, code, False, reason))

    def _maybe_close(self, stream: _Stream) -> None:
        if stream.local_closed and stream.remote_closed:
            self._close_stream(stream)

    def _closed_stream_frame(self, stream_id: int, what: str) -> None:
        """A frame that needs an open stream, on one that is closed (not idle)."""
        if stream_id in self._reset_by_us:
            return  # sent before the peer saw our RST_STREAM: ignored (RFC 9113 section 5.1)
        raise _StreamError(ErrorCode.STREAM_CLOSED, f"{what} on closed stream {stream_id}")

    # -- frames ------------------------------------------------------------------------------------

    def _on_data(self, flags: int, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size or flags & f.END_STREAM:
            self._empty_frames = 0
        else:
            self._empty_frames += 1
            if self._empty_frames > self.limits.max_consecutive_empty_frames:
                raise _ConnectionError(
                    ErrorCode.ENHANCE_YOUR_CALM,
                    f"more than {self.limits.max_consecutive_empty_frames} empty DATA frames in a "
                    "row (Limits.max_consecutive_empty_frames)",
                )
        if size > self._recv_window:
            raise _ConnectionError(
                ErrorCode.FLOW_CONTROL_ERROR, f"DATA of {size} bytes past the connection window ({self._recv_window})"
            )
        self._recv_window -= size
        stream = self._streams.get(stream_id)
        if stream is None:
            if self._is_idle(stream_id):
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._give_back(None, size)
            self._closed_stream_frame(stream_id, "DATA")
            return
        if stream.remote_closed:
            self._give_back(None, size)
            raise _StreamError(ErrorCode.STREAM_CLOSED, f"DATA on stream {stream_id} after its END_STREAM")
        if not stream.headers_received:
            self._give_back(None, size)
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"DATA on stream {stream_id} before its HEADERS")
        if size > stream.recv_window:
            self._give_back(None, size)
            raise _StreamError(
                ErrorCode.FLOW_CONTROL_ERROR,
                f"DATA of {size} bytes past stream {stream_id}'s window ({stream.recv_window})",
            )
        stream.recv_window -= size
        content = f.frame_content(f.DATA, flags, payload) if flags & f.PADDED else payload
        if content is None:
            raise _ConnectionError(
                ErrorCode.PROTOCOL_ERROR, f"DATA on stream {stream_id}: padding longer than the frame"
            )
        owed = self._on_messages(stream, content, events) if content else 0
        if owed != size:  # padding, a partial message, discarded data: consumed now
            self._give_back(stream, size - owed)
        if flags & f.END_STREAM:
            stream.remote_closed = True
            incomplete = stream.message is not None
            stream.message, stream.message_parts = None, []
            events.append(StreamEnded(stream_id, incomplete))
            self._maybe_close(stream)

    def _on_messages(self, stream: _Stream, data: memoryview, events: list[Event]) -> int:
        """Deliver the whole messages in ``data``; keep a partial one. Returns the bytes delivered
        (the application acknowledges them); the rest count as consumed now."""
        if stream.rejected:
            return 0
        delivered = 0
        offset, end = 0, len(data)
        if stream.message is not None:  # continue the partial message
            buffer = stream.message
            if not stream.message_need:
                take = min(5 - len(buffer), end)
                buffer += data[:take]
                offset = take
                if len(buffer) < 5:
                    return 0
                compressed, length = f.parse_grpc_prefix(buffer, 0)
                if compressed or length > self.limits.max_message_size:
                    self._reject(stream, compressed, length, events)
                    return 0
                stream.message_need = 5 + length
                stream.message_have = len(buffer)
                stream.message_parts = []
            parts = stream.message_parts
            take = min(stream.message_need - stream.message_have, end - offset)
            # The body in pieces, joined once at the end: one copy per byte instead of a
            # bytearray grown frame by frame (each growth a copy of all so far) and sliced.
            # Small pieces share a bytearray, so a peer trickling one-byte frames costs no more
            # memory than the bytes it sent.
            if take >= _OWN_PIECE:
                parts.append(bytes(data[offset : offset + take]))
            elif parts and type(parts[-1]) is bytearray:
                parts[-1] += data[offset : offset + take]
            else:
                parts.append(bytearray(data[offset : offset + take]))
            offset += take
            stream.message_have += take
            if stream.message_have < stream.message_need:
                return 0
            stream.message, stream.message_need, stream.message_parts = None, 0, []
            events.append(MessageReceived(stream.id, b"".join(parts), take))
            delivered += take
        limit, parse = self.limits.max_message_size, f.parse_grpc_prefix
        while end - offset >= 5:
            compressed, length = parse(data, offset)
            if compressed or length > limit:
                self._reject(stream, compressed, length, events)
                return delivered
            total = 5 + length
            if end - offset < total:
                break
            events.append(MessageReceived(stream.id, bytes(data[offset + 5 : offset + total]), total))
            delivered += total
            offset += total
        if offset < end:
            if end - offset >= 5:  # the prefix here: the body in pieces (above)
                stream.message = bytearray(data[offset : offset + 5])
                stream.message_need, stream.message_have = 5 + f.parse_grpc_prefix(data, offset)[1], end - offset
                stream.message_parts = (
                    [bytes(data[offset + 5 :])] if end - offset >= 5 + _OWN_PIECE else [bytearray(data[offset + 5 :])]
                )
            else:
                stream.message = bytearray(data[offset:])
        return delivered

    def _reject(self, stream: _Stream, compressed: int, length: int, events: list[Event]) -> None:
        """The stream's next message is compressed or too large: it is not read."""
        if compressed:
            reason = f"stream {stream.id}: a compressed message; pilotfish accepts uncompressed messages only"
            status = f.GrpcStatus.UNIMPLEMENTED
        elif length > self.limits.max_message_size:
            reason = (
                f"stream {stream.id}: a message of {length} bytes is over the limit of "
                f"{self.limits.max_message_size} (Limits.max_message_size)"
            )
            status = f.GrpcStatus.RESOURCE_EXHAUSTED
        stream.rejected = True
        stream.message, stream.message_need, stream.message_parts = None, 0, []
        events.append(MessageRejected(stream.id, status, reason))

    def _give_back(self, stream: _Stream | None, size: int) -> None:
        """``size`` received bytes are consumed: reopen the windows (in batches of half a window)."""
        if size <= 0:
            return
        self._unacked += size
        if self._unacked >= self.limits.connection_window_size // 2:
            self._queue(f.window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
            if stream.unacked >= self.limits.initial_window_size // 2:
                self._queue(f.window_update(stream.id, stream.unacked))
                stream.recv_window += stream.unacked
                stream.unacked = 0

    def acknowledge(self, stream_id: int, size: int) -> None:
        """The application has consumed ``size`` bytes of messages delivered on ``stream_id``."""
        self._give_back(self._streams.get(stream_id), size)

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        content = f.frame_content(f.HEADERS, flags, payload)
        if content is None:
            raise _ConnectionError(
                ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}: padding longer than the frame"
            )
        self._block_flags = flags
        if flags & f.PRIORITY_FLAG and f.unpack_u32(payload, 1 if flags & f.PADDED else 0) & 0x7FFF_FFFF == stream_id:
            self._block_flags |= _SELF_DEPENDENT  # a stream error, once the block is decoded (HPACK state)
        self._check_block_size(len(content))
        self._block_stream = stream_id
        self._block = bytearray(content)
        self._block_frames = 0
        if flags & f.END_HEADERS:
            self._end_block(events)

    def _check_block_size(self, size: int) -> None:
        if size > self.limits.max_header_block_size:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"header block over {self.limits.max_header_block_size} bytes (Limits.max_header_block_size)",
            )

    def _on_continuation(self, flags: int, payload: memoryview, events: list[Event]) -> None:
        self._block_frames += 1
        if self._block_frames > self.limits.max_continuation_frames:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {self.limits.max_continuation_frames} CONTINUATION frames in one "
                "header block (Limits.max_continuation_frames)",
            )
        self._check_block_size(len(self._block) + len(payload))
        self._block += payload
        if flags & f.END_HEADERS:
            self._end_block(events)

    def _end_block(self, events: list[Event]) -> None:
        stream_id, flags, block = self._block_stream, self._block_flags, bytes(self._block)
        self._block_stream, self._block = 0, bytearray()
        self._count_table_updates(block)
        try:
            headers = [(bytes(name), bytes(value)) for name, value in self._decoder.decode(block, raw=True)]
        except hpack.OversizedHeaderListError as exc:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"stream {stream_id}: header list over {self.limits.max_header_list_size} "
                f"bytes (Limits.max_header_list_size): {exc}",
            ) from None
        except (hpack.HPACKError, UnicodeDecodeError, ValueError) as exc:
            raise _ConnectionError(
                ErrorCode.COMPRESSION_ERROR, f"stream {stream_id}: undecodable header block: {exc}"
            ) from None
        try:
            self._on_header_list(stream_id, flags, headers, events)
        except _StreamError as exc:
            self._reset(stream_id, exc.code, exc.reason, events)

    def _count_table_updates(self, block: bytes) -> None:
        """Count the dynamic table size updates (pattern 001xxxxx) that open ``block``."""
        count, offset, end = 0, 0, len(block)
        while offset < end and block[offset] & 0xE0 == 0x20:
            count += 1
            if count > self.limits.max_table_size_updates:
                raise _ConnectionError(
                    ErrorCode.ENHANCE_YOUR_CALM,
                    f"more than {self.limits.max_table_size_updates} HPACK table size updates "
                    "in one header block (Limits.max_table_size_updates)",
                )
            first = block[offset] & 0x1F
            offset += 1
            if first == 0x1F:  # a multi-byte integer: continuation bytes have the high bit set
                while offset < end and block[offset] & 0x80:
                    offset += 1
                offset += 1

    def _on_header_list(
        self, stream_id: int, flags: int, headers: list[tuple[bytes, bytes]], events: list[Event]
    ) -> None:
        end_stream = bool(flags & f.END_STREAM)
        stream = self._streams.get(stream_id)
        if stream is None:
            if not self._is_idle(stream_id):
                if stream_id not in self._ended and stream_id not in self._reset_by_us:
                    raise _ConnectionError(
                        ErrorCode.PROTOCOL_ERROR,
                        f"HEADERS opening stream {stream_id} after stream "
                        f"{self._highest_remote} (stream ids must increase)",
                    )
                self._closed_stream_frame(stream_id, "HEADERS")
                return
            if self._is_local(stream_id):
                raise _ConnectionError(
                    ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, which we never opened"
                )
            if self.role is Role.CLIENT:
                raise _ConnectionError(
                    ErrorCode.PROTOCOL_ERROR, f"the server opened stream {stream_id} (servers never open streams)"
                )
            self._highest_remote = stream_id  # a lower one later is a connection error (idle check)
            if self._goaway_sent:
                return
            if len(self._streams) >= self.limits.max_concurrent_streams:
                self._spend_reset_token()
                self._queue_control(f.rst_stream(stream_id, ErrorCode.REFUSED_STREAM))
                self._remember_reset(stream_id)
                return
            stream = _Stream(stream_id, self._peer_initial_window, self.limits.initial_window_size)
            self._streams[stream_id] = stream
        elif stream.remote_closed:
            raise _StreamError(ErrorCode.STREAM_CLOSED, f"HEADERS on stream {stream_id} after its END_STREAM")
        if flags & _SELF_DEPENDENT:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id} depends on itself")
        trailers = stream.headers_received
        if trailers and not end_stream:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"trailers on stream {stream_id} without END_STREAM")
        _check_fields(headers, stream_id, self.role, trailers)
        stream.headers_received = True
        events.append(HeadersReceived(stream_id, headers, end_stream, trailers))
        if end_stream:
            stream.remote_closed = True
            events.append(StreamEnded(stream_id, stream.message is not None))
            stream.message, stream.message_parts = None, []
            self._maybe_close(stream)

    def _on_priority(self, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise _StreamError(
                ErrorCode.FRAME_SIZE_ERROR, f"PRIORITY of {len(payload)} bytes on stream {stream_id} (must be 5)"
            )
        if f.unpack_u32(payload) & 0x7FFF_FFFF == stream_id:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id} depends on itself")
        # Priorities are advice (RFC 9113 deprecates them): otherwise ignored.

    def _on_rst_stream(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise _ConnectionError(
                ErrorCode.FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes on stream {stream_id} (must be 4)"
            )
        if self._is_idle(stream_id):
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        self._spend_reset_token()
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._close_stream(stream)
            code = f.unpack_u32(payload)
            events.append(StreamReset(stream_id, code, True, f"reset by the peer (error code {code})"))

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"SETTINGS on stream {stream_id}")
        if flags & f.ACK:
            if payload:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(
                ErrorCode.FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes (not a multiple of 6)"
            )
        limits = self.limits
        now = self._clock()
        self._settings_tokens = (
            min(
                float(limits.settings_burst), self._settings_tokens + (now - self._settings_time) * limits.settings_rate
            )
            - 1
        )
        self._settings_time = now
        if self._settings_tokens < 0:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {limits.settings_burst} SETTINGS frames at {limits.settings_rate}/s "
                "(a SETTINGS flood; Limits.settings_burst, Limits.settings_rate)",
            )
        if len(payload) // 6 > self.limits.max_settings_entries:
            raise _ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"SETTINGS with {len(payload) // 6} entries, over "
                f"{self.limits.max_settings_entries} (Limits.max_settings_entries)",
            )
        for key, value in f.parse_settings(payload):
            self._apply_setting(key, value)
        self._queue_control(f.frame(f.SETTINGS, f.ACK, 0))
        self._drain_all()

    def _apply_setting(self, key: int, value: int) -> None:
        """One entry of the peer's SETTINGS (unknown ones are ignored, RFC 9113 section 6.5.2)."""
        if key == Setting.ENABLE_PUSH:
            if value > 1 or (value == 1 and self.role is Role.CLIENT):
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
        elif key == Setting.INITIAL_WINDOW_SIZE:
            if value > f.MAX_WINDOW:
                raise _ConnectionError(
                    ErrorCode.FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value} over 2^31-1"
                )
            delta, self._peer_initial_window = value - self._peer_initial_window, value
            for stream in self._streams.values():
                stream.send_window += delta
                if stream.send_window > f.MAX_WINDOW:
                    raise _ConnectionError(
                        ErrorCode.FLOW_CONTROL_ERROR,
                        f"SETTINGS_INITIAL_WINDOW_SIZE {value} overflows stream {stream.id}'s window",
                    )
        elif key == Setting.MAX_FRAME_SIZE:
            if not f.DEFAULT_MAX_FRAME <= value <= f.MAX_FRAME_SIZE_LIMIT:
                raise _ConnectionError(
                    ErrorCode.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} outside 16384..16777215"
                )
            self._peer_max_frame = value
        elif key == Setting.MAX_CONCURRENT_STREAMS:
            self._peer_max_streams = value
        elif key == Setting.HEADER_TABLE_SIZE and value < _DEFAULT_HEADER_TABLE:
            # We never index, but a decoder that shrank its table expects to hear it.
            self._table_update = f.table_size_update(value)

    def _on_ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"PING on stream {stream_id}")
        if len(payload) != 8:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"PING of {len(payload)} bytes (must be 8)")
        if not flags & f.ACK:
            self._queue_control(f.frame(f.PING, f.ACK, 0, bytes(payload)))

    def _on_goaway(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"GOAWAY on stream {stream_id}")
        if len(payload) < 8:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"GOAWAY of {len(payload)} bytes (at least 8)")
        last, code = f.unpack_u32(payload) & 0x7FFF_FFFF, f.unpack_u32(payload, 4)
        debug = bytes(payload[8 : 8 + 200]).decode("utf-8", "replace")
        events.append(ConnectionTerminated(code, last, True, f"GOAWAY from the peer: {debug}"))
        if code != ErrorCode.NO_ERROR:
            self.closed = True

    def _on_window_update(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if len(payload) != 4:
            raise _ConnectionError(
                ErrorCode.FRAME_SIZE_ERROR, f"WINDOW_UPDATE of {len(payload)} bytes on stream {stream_id} (must be 4)"
            )
        increment = f.unpack_u32(payload) & 0x7FFF_FFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                raise _ConnectionError(
                    ErrorCode.FLOW_CONTROL_ERROR, "WINDOW_UPDATE overflows the connection window past 2^31-1"
                )
            self._drain_waiting()
            return
        if self._is_idle(stream_id):
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
        stream = self._streams.get(stream_id)
        if not increment:
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE of 0 on stream {stream_id}")
        if stream is None:
            return  # a closed stream: allowed for a short while (RFC 9113 section 6.9)
        stream.send_window += increment
        if stream.send_window > f.MAX_WINDOW:
            raise _StreamError(
                ErrorCode.FLOW_CONTROL_ERROR, f"WINDOW_UPDATE overflows stream {stream_id}'s window past 2^31-1"
            )
        self._drain(stream)

    # -- sending -----------------------------------------------------------------------------------

    def open_stream(self) -> int:
        """(Client) the id of a new stream; send its headers with :meth:`send_headers`."""
        if self.role is not Role.CLIENT:
            raise ProtocolUsageError("a server does not open streams")
        if (
            sum(1 for s in self._streams.values() if not s.local_closed or not s.remote_closed)
            >= self._peer_max_streams
        ):
            raise ProtocolUsageError(f"the peer allows {self._peer_max_streams} concurrent streams")
        stream_id, self._next_local = self._next_local, self._next_local + 2
        self._streams[stream_id] = _Stream(stream_id, self._peer_initial_window, self.limits.initial_window_size)
        return stream_id

    def _stream_for_send(self, stream_id: int) -> _Stream | None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self.closed:
            return None
        return stream

    def send_headers(
        self,
        stream_id: int,
        headers: Iterable[tuple[bytes, bytes]],
        *,
        end_stream: bool = False,
        abandon_pending: bool = False,
    ) -> None:
        """Queue a header block (literals, see :func:`frames.header_block`): HEADERS, then
        CONTINUATION frames when it is larger than the peer's SETTINGS_MAX_FRAME_SIZE.
        With ``end_stream`` (trailers) it waits behind the stream's pending DATA."""
        self.send_header_block(
            stream_id, f.header_block(headers), end_stream=end_stream, abandon_pending=abandon_pending
        )

    def send_header_block(
        self, stream_id: int, block: bytes, *, end_stream: bool = False, abandon_pending: bool = False
    ) -> None:
        """:meth:`send_headers` of a header block encoded beforehand (literals, never indexed).
        With ``abandon_pending``, DATA still waiting for window is dropped (a server that stops)."""
        stream = self._stream_for_send(stream_id)
        if stream is None:
            return
        if abandon_pending:
            self._forget_pending(stream)
            self._waiting.pop(stream, None)
        if end_stream:
            stream.local_closed = True
            if stream.pending:
                stream.pending_end = block
                return
        self._write_block(stream_id, block, end_stream)
        if end_stream:
            self._ended_locally(stream)

    def _write_block(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        limit = self._peer_max_frame
        first, rest = block[:limit], block[limit:]
        flags = (f.END_STREAM if end_stream else 0) | (0 if rest else f.END_HEADERS)
        self._queue(f.frame(f.HEADERS, flags, stream_id, first))
        while rest:
            piece, rest = rest[:limit], rest[limit:]
            self._queue(f.frame(f.CONTINUATION, 0 if rest else f.END_HEADERS, stream_id, piece))

    def _ended_locally(self, stream: _Stream) -> None:
        if not stream.remote_closed and self.role is Role.SERVER:
            # RFC 9113 section 8.1: the response is complete, the request need not be.
            self._queue(f.rst_stream(stream.id, ErrorCode.NO_ERROR))
            self._remember_reset(stream.id)
            self._close_stream(stream)
            return
        self._maybe_close(stream)

    def send_message(self, stream_id: int, *parts: bytes) -> None:
        """Queue one gRPC message, the concatenation of ``parts`` (which are never copied; shared
        bytes stay shared). What flow control does not allow yet waits in the stream."""
        stream = self._stream_for_send(stream_id)
        if stream is None:
            return
        length = 0
        for part in parts:
            length += len(part)
        size = length + 5
        if (
            stream.pending is None
            and size <= stream.send_window
            and size <= self._send_window
            and size <= self._peer_max_frame
            and not self.writing_paused
        ):
            # The usual case: one frame the peer's windows take whole (Envoy opens 256 MiB ones).
            stream.send_window -= size
            self._send_window -= size
            out = self._out
            if not out and self._on_output is not None:
                self._on_output()
            out.append(f.data_frame_header_and_prefix(stream_id, length))
            out.extend(parts)
            return
        if self.writing_paused:
            self._queued_messages += 1
            if self._queued_messages > self.limits.max_queued_messages:
                self._terminate(
                    ErrorCode.ENHANCE_YOUR_CALM,
                    f"more than {self.limits.max_queued_messages} messages queued for a peer that does "
                    "not read (Limits.max_queued_messages)",
                    [],
                )
                return
        if stream.pending is None:
            stream.pending = deque()
        pending = stream.pending
        before = len(pending)
        pending.append(memoryview(f.grpc_prefix(length)))
        pending.extend(memoryview(p) for p in parts if p)
        self._owed += size + OWED_PIECE_COST * (len(pending) - before)
        self._drain(stream)
        if self._owed > self.limits.max_owed_bytes:
            self._terminate(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {self.limits.max_owed_bytes} bytes of messages "
                "owed to a peer that does not take them (Limits.max_owed_bytes)",
                [],
            )

    def end_stream(self, stream_id: int) -> None:
        """(Client) half-close: an empty DATA frame with END_STREAM, after any pending DATA."""
        stream = self._stream_for_send(stream_id)
        if stream is None:
            return
        stream.local_closed = True
        if stream.pending:
            stream.pending_end = b""
            return
        self._queue(f.frame(f.DATA, f.END_STREAM, stream_id))
        self._ended_locally(stream)

    def reset_stream(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """End a stream with RST_STREAM ``code``."""
        stream = self._streams.get(stream_id)
        if stream is None or self.closed:
            return
        self._queue(f.rst_stream(stream_id, code))
        self._remember_reset(stream_id)
        self._close_stream(stream)

    def discard(self) -> None:
        """The socket is gone: drop what is held for the peer (queued output, the messages
        streams wait to send, a partial frame), so that it is freed at once, however long
        something else still refers to this connection (a frozen or uncollected cycle)."""
        self.closed = True
        self._out = []
        self._buffer = bytearray()
        self._block = bytearray()
        for stream in self._streams.values():
            stream.pending = None
        self._streams.clear()
        self._waiting.clear()
        self._owed = 0

    def close(self, code: int = ErrorCode.NO_ERROR, reason: str = "") -> None:
        """GOAWAY: no new streams. With NO_ERROR the open ones may still finish."""
        if self._goaway_sent and code == ErrorCode.NO_ERROR:
            return
        self._goaway_sent = True
        self._queue(f.goaway(self._highest_remote, code, reason.encode()[:256]))
        if code != ErrorCode.NO_ERROR:
            self.closed = True

    def _drain(self, stream: _Stream) -> None:
        if not self._drain_stream(stream) and (self.writing_paused or self._send_window <= 0):
            self._waiting[stream] = None

    def _drain_all(self) -> None:
        for stream in list(self._streams.values()):
            if stream.pending:
                self._drain(stream)

    def _drain_waiting(self) -> None:
        while self._waiting and not self.writing_paused and self._send_window > 0:
            stream = next(iter(self._waiting))
            del self._waiting[stream]
            if not self._drain_stream(stream) and (self.writing_paused or self._send_window <= 0):
                self._waiting[stream] = None
                return

    def _drain_stream(self, stream: _Stream) -> bool:
        """Send what the windows allow of ``stream``'s pending DATA; True when all of it went."""
        pending = stream.pending
        if pending is None:
            return True
        while pending:
            budget = min(stream.send_window, self._send_window, self._peer_max_frame)
            if self.writing_paused or budget <= 0:
                return False
            size = 0
            pieces: list[memoryview] = []
            while pending and size < budget:
                chunk = pending[0]
                take = min(len(chunk), budget - size)
                if take == len(chunk):
                    pieces.append(chunk)
                    pending.popleft()
                    self._owed -= OWED_PIECE_COST
                else:
                    pieces.append(chunk[:take])
                    pending[0] = chunk[take:]
                size += take
            self._owed -= size
            self._queue(f.frame_header(size, f.DATA, 0, stream.id))
            for piece in pieces:
                self._queue(piece)
            stream.send_window -= size
            self._send_window -= size
        stream.pending = None
        if stream.pending_end is not None:
            block, stream.pending_end = stream.pending_end, None
            if block:
                self._write_block(stream.id, block, True)
            else:
                self._queue(f.frame(f.DATA, f.END_STREAM, stream.id))
            self._ended_locally(stream)
        return True

    # -- introspection -----------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def preface_received(self) -> bool:
        """Whether the peer has completed its connection preface (RFC 9113 section 3.4): a
        client its magic and first SETTINGS, a server its first SETTINGS. The adapter closes a
        connection that has not within its handshake timeout (no clock here)."""
        return self._settings_seen and not self._preface_pending

    @property
    def last_peer_stream(self) -> int:
        """The highest stream id the peer has opened (0: none yet). The adapter tells an idle
        connection from one whose streams come and go between two looks by whether it changed."""
        return self._highest_remote

    def send_window(self, stream_id: int = 0) -> int:
        """Bytes of DATA the peer lets us send now on ``stream_id`` (0: the connection)."""
        if not stream_id:
            return self._send_window
        stream = self._streams.get(stream_id)
        return stream.send_window if stream is not None else 0


def _check_fields(headers: Sequence[tuple[bytes, bytes]], stream_id: int, role: Role, trailers: bool) -> None:
    """RFC 9113 section 8.2-8.3: a malformed field section is a stream error (PROTOCOL_ERROR)."""
    allowed = _RESPONSE_PSEUDO if role is Role.CLIENT else _REQUEST_PSEUDO
    seen: set[bytes] = set()
    regular = False
    for name, value in headers:
        if not name or name.translate(None, _BAD_NAME_BYTES) != name:
            raise _StreamError(
                ErrorCode.PROTOCOL_ERROR,
                f"stream {stream_id}: header name {name[:64]!r} is "
                "empty or has uppercase, space, control or non-ASCII bytes",
            )
        if (
            b"\0" in value
            or b"\r" in value
            or b"\n" in value
            or value[:1] in (b" ", b"\t")
            or value[-1:] in (b" ", b"\t")
        ):
            raise _StreamError(
                ErrorCode.PROTOCOL_ERROR,
                f"stream {stream_id}: header {name[:64]!r} has a value with NUL, CR, LF or surrounding whitespace",
            )
        if name.startswith(b":"):
            if trailers or regular:
                raise _StreamError(
                    ErrorCode.PROTOCOL_ERROR,
                    f"stream {stream_id}: pseudo-header {name!r} after regular headers or in trailers",
                )
            if name not in allowed:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: unknown pseudo-header {name[:64]!r}")
            if name in seen:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: duplicate {name!r}")
            seen.add(name)
            continue
        regular = True
        if name in _CONNECTION_HEADERS:
            raise _StreamError(
                ErrorCode.PROTOCOL_ERROR,
                f"stream {stream_id}: connection-specific header {name!r} (not allowed in HTTP/2)",
            )
        if name == b"te" and value != b"trailers":
            raise _StreamError(
                ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: te {value[:64]!r} (only 'trailers' is allowed)"
            )
    if trailers:
        return
    if role is Role.SERVER:
        missing = {b":method", b":scheme", b":path"} - seen
        if missing:
            raise _StreamError(
                ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: request without {b', '.join(sorted(missing)).decode()}"
            )
        if not dict(headers).get(b":path"):
            raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: empty :path")
    elif b":status" not in seen:
        raise _StreamError(ErrorCode.PROTOCOL_ERROR, f"stream {stream_id}: response without :status")
