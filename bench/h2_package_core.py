"""The `h2` package's state machine behind the interface of pilotfish's own HTTP/2 core: a baseline.

Theory of operation. Whether pilotfish's transport stays its own code
(:class:`pilotfish.transport.h2.Connection`) or sits on python-hyper's ``h2`` package is decided by
measurement, both under the same adapter. :class:`H2PackageConnection` is the second candidate: it
is a :class:`pilotfish.transport.aio.HTTP2Core` (what the adapter drives of a core; mypy checks
that it still is, see bench/h2_core_launch.py) and yields the same events, but every frame is
parsed, checked, queued and serialized by ``h2.connection.H2Connection``.
``GrpcServer(connection_factory=...)`` runs it. It lives in bench/ because it is a measurement
baseline, not a second stack: production code never imports it.

What this wrapper adds to the package, because gRPC or :class:`~pilotfish.transport.h2.Limits`
need it and the package has no such rule (the same code as the own core would be, so that the
comparison is of the state machines, not of features):

- gRPC message reassembly (5-byte prefix + body), linear, bounded by ``max_message_size``; windows
  given back as messages are consumed (``acknowledge``), partial and discarded bytes at once;
- outgoing DATA that waits for window (the package raises instead of queueing), cut at the peer's
  SETTINGS_MAX_FRAME_SIZE; held while the socket is full (``writing_paused``);
- the reset bucket (rapid reset), the SETTINGS bucket, empty-DATA frames in a row, control
  frames owed and messages queued for a peer that does not read (which is still read): each ends
  the connection with ENHANCE_YOUR_CALM, as the own core does;
- a server that ends its side of a stream the client has not ended resets it (NO_ERROR, RFC 9113
  section 8.1), as the own core does.

Limits the package holds itself: ``max_concurrent_streams`` (a stream past it is a connection
error PROTOCOL_ERROR, where the own core refuses just that stream), ``initial_window_size``,
``connection_window_size``, ``max_header_list_size`` (ENHANCE_YOUR_CALM), closed streams
remembered (65,536, where the own core keeps ``max_remembered_resets``). The package has no rule
for ``max_header_block_size``, ``max_continuation_frames`` (it buffers up to 64 CONTINUATION
frames, a module constant), ``max_table_size_updates`` and ``max_settings_entries``, and it calls a
SETTINGS ACK with a payload PROTOCOL_ERROR where RFC 9113 names FRAME_SIZE_ERROR: the wrapper's
:class:`_GuardedFrameBuffer` (the package's frame buffer with a check per parsed frame) adds the
four limits (ENHANCE_YOUR_CALM) and the RFC's code. Without it the package failed 3 of the 50
attacks of tests/abuse (a block of 16,202 table size updates: 1.4 CPU-s; SETTINGS of 2,730
entries accepted; the ACK's error code).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

import hpack
from h2 import events as h2e
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import DenialOfServiceError, FrameDataMissingError, H2Error, ProtocolError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes, Settings
from hyperframe.frame import ContinuationFrame, Frame, HeadersFrame, SettingsFrame

from pilotfish.transport.frames import GrpcStatus, parse_grpc_prefix
from pilotfish.transport.h2 import (
    ConnectionTerminated,
    Event,
    HeadersReceived,
    Limits,
    MessageReceived,
    MessageRejected,
    Role,
    StreamEnded,
    StreamReset,
)

__all__ = ["H2PackageConnection"]

_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=True,
    normalize_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)


class _Stream:
    """What the wrapper keeps of one stream: a partial message, and DATA waiting for window."""

    __slots__ = ("ended_local", "ended_remote", "message", "message_need", "pending", "pending_end", "rejected")

    def __init__(self) -> None:
        self.message: bytearray | None = None
        self.message_need = 0
        self.rejected = False
        self.pending: deque[memoryview] | None = None
        self.pending_end: list[tuple[bytes, bytes]] | None = None
        self.ended_local = False
        self.ended_remote = False


class H2PackageConnection:
    """A server-side HTTP/2 connection on ``h2.connection.H2Connection`` (see the module docstring)."""

    def __init__(
        self,
        *,
        role: Role,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_output: Callable[[], None] | None = None,
    ) -> None:
        if role is not Role.SERVER:
            raise ValueError("the h2 package baseline plays the server role only")
        self.role = role
        self.limits = limits = limits or Limits()
        self._clock = clock
        self._on_output = on_output
        self._out: list[bytes | bytearray | memoryview] = []
        self.writing_paused = False
        self.closed = False
        self.terminated: ConnectionTerminated | None = None
        """Why we ended the connection, once we have (as on the own core)."""
        self.preface_received = False
        """The client's preface (magic and first SETTINGS) has arrived: read by the adapter's
        handshake timeout, as on the own core."""
        self._streams: dict[int, _Stream] = {}
        self._headers_memo: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._reset_tokens = float(limits.reset_burst)
        self._reset_time = clock()
        self._settings_tokens = float(limits.settings_burst)
        self._settings_time = self._reset_time
        self._empty_frames = 0
        self._queued_control = 0
        self._queued_messages = 0
        self._goaway_sent = False
        h2 = self._h2 = H2Connection(config=_CONFIG)
        h2.incoming_buffer = _GuardedFrameBuffer(limits)
        h2.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                SettingCodes.INITIAL_WINDOW_SIZE: limits.initial_window_size,
                SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
                SettingCodes.ENABLE_PUSH: 0,
            },
        )
        h2.decoder.max_header_list_size = limits.max_header_list_size
        h2.initiate_connection()
        if limits.connection_window_size > 65_535:
            h2.increment_flow_control_window(limits.connection_window_size - 65_535)
        self._collect()

    # -- output --------------------------------------------------------------------------------

    def _collect(self) -> None:
        data = self._h2.data_to_send()
        if data:
            if not self._out and self._on_output is not None:
                self._on_output()
            self._out.append(data)

    def take_output(self) -> list[bytes | bytearray | memoryview]:
        out, self._out = self._out, []
        return out

    def data_to_send(self) -> bytes:
        return b"".join(self.take_output())

    @property
    def wants_to_read(self) -> bool:
        return not self.closed  # a peer that does not read is still read, as on the own core

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._queued_control = 0
        self._queued_messages = 0
        self._drain_all()
        self._collect()

    @property
    def last_peer_stream(self) -> int:
        """The highest stream id the peer opened (the adapter's idle timeout reads it)."""
        return int(self._h2.highest_inbound_stream_id)

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        if self.closed:
            return events
        try:
            for event in self._h2.receive_data(data):
                self._on_event(event, events)
                if self.closed:
                    break
        except ProtocolError as exc:
            code = int(getattr(exc, "error_code", ErrorCodes.PROTOCOL_ERROR))
            self.closed = True
            self.terminated = ConnectionTerminated(
                code, self._h2.highest_inbound_stream_id, False, f"h2: {type(exc).__name__}: {str(exc)[:200]}"
            )
            events.append(self.terminated)
        except _Calm as exc:
            self._terminate(ErrorCodes.ENHANCE_YOUR_CALM, str(exc), events)
        self._collect()
        return events

    def _terminate(self, code: int, reason: str, events: list[Event]) -> None:
        self.closed = True
        self._goaway_sent = True
        self._h2.close_connection(code, reason.encode()[:256])
        self.terminated = ConnectionTerminated(code, self._h2.highest_inbound_stream_id, False, reason)
        events.append(self.terminated)

    def _on_event(self, event: h2e.Event, events: list[Event]) -> None:
        if isinstance(event, h2e.DataReceived):
            self._on_data(event, events)
        elif isinstance(event, h2e.RequestReceived):
            self._empty_frames = 0
            self._streams[event.stream_id] = _Stream()
            events.append(
                HeadersReceived(event.stream_id, list(event.headers or ()), event.stream_ended is not None, False)
            )
        elif isinstance(event, h2e.StreamEnded):
            stream = self._streams.get(event.stream_id)
            incomplete = stream is not None and stream.message is not None
            if stream is not None:
                stream.message = None
                stream.ended_remote = True
                if stream.ended_local:
                    self._forget(event.stream_id)
            events.append(StreamEnded(event.stream_id, incomplete))
        elif isinstance(event, h2e.WindowUpdated):
            if event.stream_id:
                stream = self._streams.get(event.stream_id)
                if stream is not None and stream.pending:
                    self._drain(event.stream_id, stream)
            else:
                self._drain_all()
        elif isinstance(event, h2e.StreamReset):
            self._spend_reset_token()
            if not event.remote_reset:
                self._count_control()
            if self._forget(event.stream_id):
                events.append(
                    StreamReset(
                        event.stream_id,
                        int(event.error_code or 0),
                        event.remote_reset,
                        f"reset (error code {event.error_code})",
                    )
                )
        elif isinstance(event, h2e.RemoteSettingsChanged):
            self.preface_received = True
            now = self._clock()
            limits = self.limits
            self._settings_tokens = (
                min(
                    float(limits.settings_burst),
                    self._settings_tokens + (now - self._settings_time) * limits.settings_rate,
                )
                - 1
            )
            self._settings_time = now
            if self._settings_tokens < 0:
                raise _Calm(
                    f"more than {limits.settings_burst} SETTINGS frames at {limits.settings_rate}/s "
                    "(a SETTINGS flood; Limits.settings_burst, Limits.settings_rate)"
                )
            self._count_control()
            if (
                SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings
                or SettingCodes.MAX_FRAME_SIZE in event.changed_settings
            ):
                self._drain_all()
        elif isinstance(event, h2e.PingReceived):
            self._count_control()
        elif isinstance(event, h2e.TrailersReceived):
            events.append(
                HeadersReceived(event.stream_id, list(event.headers or ()), event.stream_ended is not None, True)
            )
        elif isinstance(event, h2e.ConnectionTerminated):
            code = int(event.error_code or 0)
            events.append(
                ConnectionTerminated(
                    code,
                    event.last_stream_id or 0,
                    True,
                    f"GOAWAY from the peer: {(event.additional_data or b'')[:200]!r}",
                )
            )
            if code != ErrorCodes.NO_ERROR:
                self.closed = True

    def _count_control(self) -> None:
        if self.writing_paused:
            self._queued_control += 1
            if self._queued_control > self.limits.max_queued_control_frames:
                raise _Calm(
                    f"more than {self.limits.max_queued_control_frames} control frames owed to a peer "
                    "that does not read (Limits.max_queued_control_frames)"
                )

    def _spend_reset_token(self) -> None:
        now = self._clock()
        limits = self.limits
        self._reset_tokens = (
            min(float(limits.reset_burst), self._reset_tokens + (now - self._reset_time) * limits.reset_rate) - 1
        )
        self._reset_time = now
        if self._reset_tokens < 0:
            raise _Calm(
                f"more than {limits.reset_burst} stream resets at {limits.reset_rate}/s "
                "(rapid reset; Limits.reset_burst, Limits.reset_rate)"
            )

    def _on_data(self, event: h2e.DataReceived, events: list[Event]) -> None:
        data = event.data or b""
        size = event.flow_controlled_length or 0
        stream_id = event.stream_id
        if data or event.stream_ended is not None:
            self._empty_frames = 0
        else:
            self._empty_frames += 1
            if self._empty_frames > self.limits.max_consecutive_empty_frames:
                raise _Calm(
                    f"more than {self.limits.max_consecutive_empty_frames} empty DATA frames in a row "
                    "(Limits.max_consecutive_empty_frames)"
                )
        stream = self._streams.get(stream_id)
        delivered = self._on_messages(stream_id, stream, data, events) if stream is not None and data else 0
        if size > delivered:
            self._give_back(stream_id, size - delivered)

    def _on_messages(self, stream_id: int, stream: _Stream, data: bytes, events: list[Event]) -> int:
        """Deliver the whole messages in ``data``, keep a partial one; the bytes delivered."""
        if stream.rejected:
            return 0
        delivered, offset, end = 0, 0, len(data)
        limit = self.limits.max_message_size
        if stream.message is not None:
            buffer = stream.message
            if not stream.message_need:
                take = min(5 - len(buffer), end)
                buffer += data[:take]
                offset = take
                if len(buffer) < 5:
                    return 0
                compressed, length = parse_grpc_prefix(buffer, 0)
                if compressed or length > limit:
                    self._reject(stream_id, stream, compressed, length, events)
                    return 0
                stream.message_need = 5 + length
            take = min(stream.message_need - len(buffer), end - offset)
            buffer += data[offset : offset + take]
            offset += take
            if len(buffer) < stream.message_need:
                return 0
            stream.message, stream.message_need = None, 0
            events.append(MessageReceived(stream_id, bytes(buffer[5:]), take))
            delivered += take
        while end - offset >= 5:
            compressed, length = parse_grpc_prefix(data, offset)
            if compressed or length > limit:
                self._reject(stream_id, stream, compressed, length, events)
                return delivered
            total = 5 + length
            if end - offset < total:
                break
            events.append(MessageReceived(stream_id, data[offset + 5 : offset + total], total))
            delivered += total
            offset += total
        if offset < end:
            stream.message = bytearray(data[offset:])
            if end - offset >= 5:
                stream.message_need = 5 + parse_grpc_prefix(data, offset)[1]
        return delivered

    def _reject(self, stream_id: int, stream: _Stream, compressed: int, length: int, events: list[Event]) -> None:
        if compressed:
            status = GrpcStatus.UNIMPLEMENTED
            reason = f"stream {stream_id}: a compressed message; pilotfish accepts uncompressed messages only"
        else:
            status = GrpcStatus.RESOURCE_EXHAUSTED
            reason = (
                f"stream {stream_id}: a message of {length} bytes is over the limit of "
                f"{self.limits.max_message_size} (Limits.max_message_size)"
            )
        stream.rejected = True
        stream.message, stream.message_need = None, 0
        events.append(MessageRejected(stream_id, status, reason))

    def _give_back(self, stream_id: int, size: int) -> None:
        with contextlib.suppress(H2Error):
            self._h2.acknowledge_received_data(size, stream_id)

    def acknowledge(self, stream_id: int, size: int) -> None:
        if size > 0 and not self.closed:
            self._give_back(stream_id, size)
            self._collect()

    # -- sending -------------------------------------------------------------------------------

    def _forget(self, stream_id: int) -> bool:
        return self._streams.pop(stream_id, None) is not None

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The header list of a literal-only block (pilotfish's are built once and reused)."""
        headers = self._headers_memo.get(block)
        if headers is None:
            headers = [(bytes(n), bytes(v)) for n, v in hpack.Decoder().decode(block, raw=True)]
            if len(self._headers_memo) < 64:
                self._headers_memo[block] = headers
        return headers

    def send_header_block(
        self, stream_id: int, block: bytes, *, end_stream: bool = False, abandon_pending: bool = False
    ) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended_local or self.closed:
            return
        headers = self._decode(block)
        if abandon_pending:
            stream.pending = None
        if end_stream:
            stream.ended_local = True
            if stream.pending:
                stream.pending_end = headers
                return
        self._send_headers(stream_id, stream, headers, end_stream)
        self._collect()

    def _send_headers(
        self, stream_id: int, stream: _Stream, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        try:
            self._h2.send_headers(stream_id, headers, end_stream=end_stream)
        except H2Error:
            self._forget(stream_id)
            return
        if end_stream:
            self._ended_locally(stream_id, stream)

    def _ended_locally(self, stream_id: int, stream: _Stream) -> None:
        if not stream.ended_remote:
            # RFC 9113 section 8.1: the response is complete, the request need not be.
            with contextlib.suppress(H2Error):
                self._h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)
        self._forget(stream_id)

    def send_message(self, stream_id: int, *parts: bytes) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended_local or self.closed:
            return
        if self.writing_paused:
            self._queued_messages += 1
            if self._queued_messages > self.limits.max_queued_messages:
                self._terminate(
                    ErrorCodes.ENHANCE_YOUR_CALM,
                    f"more than {self.limits.max_queued_messages} messages queued for a peer that does "
                    "not read (Limits.max_queued_messages)",
                    [],
                )
                self._collect()
                return
        length = sum(len(p) for p in parts)
        message = memoryview(b"".join((length.to_bytes(5, "big"), *parts)))  # flag 0 + 4-byte length
        if stream.pending is None:
            stream.pending = deque()
        stream.pending.append(message)
        self._drain(stream_id, stream)
        self._collect()

    def _drain_all(self) -> None:
        for stream_id, stream in list(self._streams.items()):
            if stream.pending:
                self._drain(stream_id, stream)

    def _drain(self, stream_id: int, stream: _Stream) -> None:
        pending = stream.pending
        if pending is None or self.writing_paused:
            return
        h2 = self._h2
        try:
            while pending:
                budget = min(h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)
                if budget <= 0:
                    return
                chunk = pending[0]
                if len(chunk) <= budget:
                    pending.popleft()
                    h2.send_data(stream_id, chunk)
                else:
                    pending[0] = chunk[budget:]
                    h2.send_data(stream_id, chunk[:budget])
        except H2Error:
            self._forget(stream_id)
            return
        stream.pending = None
        if stream.pending_end is not None:
            headers, stream.pending_end = stream.pending_end, None
            self._send_headers(stream_id, stream, headers, True)

    def reset_stream(self, stream_id: int, code: int = ErrorCodes.CANCEL) -> None:
        if self._forget(stream_id) and not self.closed:
            with contextlib.suppress(H2Error):
                self._h2.reset_stream(stream_id, code)
            self._collect()

    def close(self, code: int = ErrorCodes.NO_ERROR, reason: str = "") -> None:
        if self._goaway_sent and code == ErrorCodes.NO_ERROR:
            return
        self._goaway_sent = True
        with contextlib.suppress(H2Error):
            self._h2.close_connection(code, reason.encode()[:256])
        if code != ErrorCodes.NO_ERROR:
            self.closed = True
        self._collect()

    def discard(self) -> None:
        """The socket is gone: drop what is held for the peer at once (as the own core does)."""
        self.closed = True
        self._out = []
        for stream in self._streams.values():
            stream.pending = None
        self._streams.clear()

    @property
    def open_streams(self) -> int:
        return len(self._streams)


class _GuardedFrameBuffer(FrameBuffer):
    """The package's frame buffer, with the limits of :class:`Limits` it has no rule for, checked
    on each frame as it is parsed (before the package acts on it): SETTINGS entries, header block
    size and CONTINUATION frames, HPACK table size updates per block; and a SETTINGS ACK with a
    payload as the FRAME_SIZE_ERROR RFC 9113 section 6.5 names (the package says PROTOCOL_ERROR)."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(server=True)
        self._limits = limits
        self._block_size = 0
        self._block_frames = 0

    def __next__(self) -> Frame:
        data = self._data
        if len(data) >= 9 and data[3] == 0x4 and data[4] & 0x1 and (data[0] or data[1] or data[2]):
            raise FrameDataMissingError("SETTINGS ACK with a payload")  # FRAME_SIZE_ERROR
        return super().__next__()

    def _update_header_buffer(self, f: Frame | None) -> Frame | None:
        limits = self._limits
        if isinstance(f, SettingsFrame):
            if f.body_len // 6 > limits.max_settings_entries:
                raise DenialOfServiceError(
                    f"SETTINGS with {f.body_len // 6} entries, over "
                    f"{limits.max_settings_entries} (Limits.max_settings_entries)"
                )
        elif isinstance(f, HeadersFrame):
            self._block_size, self._block_frames = len(f.data), 0
            self._check_block()
        elif isinstance(f, ContinuationFrame) and self._headers_buffer:
            self._block_frames += 1
            self._block_size += len(f.data)
            if self._block_frames > limits.max_continuation_frames:
                raise DenialOfServiceError(
                    f"more than {limits.max_continuation_frames} CONTINUATION frames in "
                    "one header block (Limits.max_continuation_frames)"
                )
            self._check_block()
        whole = super()._update_header_buffer(f)
        if isinstance(whole, HeadersFrame):
            self._count_table_updates(whole.data)
        return whole

    def _check_block(self) -> None:
        if self._block_size > self._limits.max_header_block_size:
            raise DenialOfServiceError(
                f"header block over {self._limits.max_header_block_size} bytes (Limits.max_header_block_size)"
            )

    def _count_table_updates(self, block: bytes) -> None:
        """The dynamic table size updates (001xxxxx) that open ``block``, as the own core counts them."""
        count, offset, end = 0, 0, len(block)
        while offset < end and block[offset] & 0xE0 == 0x20:
            count += 1
            if count > self._limits.max_table_size_updates:
                raise DenialOfServiceError(
                    f"more than {self._limits.max_table_size_updates} HPACK table size "
                    "updates in one header block (Limits.max_table_size_updates)"
                )
            first = block[offset] & 0x1F
            offset += 1
            if first == 0x1F:
                while offset < end and block[offset] & 0x80:
                    offset += 1
                offset += 1


class _Calm(Exception):
    """A limit this wrapper keeps was crossed: GOAWAY ENHANCE_YOUR_CALM."""
