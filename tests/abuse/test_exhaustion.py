"""Resource exhaustion by one unauthenticated client: each attack bounded.

Every test starts its own ``pilotfish serve`` (so the memory and CPU it measures are the attack's
alone), with a good client (grpcio) subscribed beside it. The attacker works from raw sockets on
127.0.0.1; half-way through, the test changes the snapshot. Then :meth:`Target.conclude` asks: did
the good client get the change, did the server's peak memory stay within
:data:`~.target.RSS_BOUND` of where it was, did it write no traceback, and did the offending
connection get what the issue specifies (GOAWAY, ENHANCE_YOUR_CALM where fitting, RST_STREAM or a
gRPC status, or was it closed or limited)? A client that never reads is "limited" when the server
stops reading from it (its sends stall) or closes it; the memory bound is what matters there.

Sizes are those of the issue's reproductions, cut where a fixed server would have stopped the
attacker long before, so that each test runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import StartTarget
from .target import CDS, EDS, GoodClient, Target, discovery_request
from .wire import (
    END_HEADERS,
    END_STREAM,
    FrameType,
    H2Code,
    RawClient,
    frame,
    grpc_message,
    headers_frame,
    literal_block,
    parse_frames,
    request_headers,
    rst_stream,
    settings_frame,
    table_size_update,
    wait,
    window_update,
)

MIB = 1024 * 1024
MAX_WINDOW = 2**31 - 1
RESOURCE_EXHAUSTED = 8
INVALID_ARGUMENT = 3


def goaway_with(client: RawClient, codes: set[int], what: str, *, barrier: bool = True) -> list[str]:
    """Problems unless the server sent GOAWAY with one of ``codes`` and closed the connection.

    A server that closes with the attacker's bytes still unread makes the kernel send a reset,
    which may overtake its GOAWAY: a connection reset without a GOAWAY counts as closed too (a
    clean close without one does not: the peer would not know why). Without ``barrier`` (inside a
    header block, where a PING is itself an error) the server gets a few seconds to answer."""
    if barrier:
        client.barrier(timeout=5.0)
    else:
        client.wait_for(lambda got: got.goaway is not None or got.closed is not None, timeout=3.0)
    goaway = client.got.goaway
    names = " or ".join(sorted(H2Code.name(c) for c in codes))
    if goaway is not None and goaway.code not in codes:
        return [f"{what}: expected GOAWAY {names}, got {goaway}; " + client.got.describe()]
    if goaway is None and client.got.closed is None:
        return [f"{what}: expected GOAWAY {names} and the connection closed; " + client.got.describe()]
    closed = client.wait_for(lambda got: got.closed, timeout=5.0)
    if closed is None:
        return [f"{what}: {goaway} was sent, but the connection stayed open"]
    if goaway is None and "Reset" not in closed:
        return [f"{what}: the connection was closed ({closed}) without a GOAWAY {names}"]
    return []


def call_refused(client: RawClient, stream_id: int, statuses: set[int], what: str, timeout: float = 10.0) -> list[str]:
    """Problems unless the call on ``stream_id`` ended with one of the gRPC ``statuses`` (trailers)."""
    client.wait_for(
        lambda got: stream_id in got.ended or stream_id in got.resets or got.closed is not None, timeout=timeout
    )
    status = client.got.grpc_status(stream_id)
    if status in statuses:
        return []
    return [
        f"{what}: expected the call to end with gRPC status {sorted(statuses)}, it got {status}; "
        + client.got.describe()
    ]


def cpu_bound(target: Target, seconds: float, what: str) -> list[str]:
    used = target.cpu_used()
    if used > seconds:
        return [f"{what}: the server spent {used:.1f} CPU-s on it (bound {seconds:g} s): the event loop was blocked"]
    return []


def open_streams(client: RawClient, first: int, count: int) -> int:
    """Open ``count`` streams (valid gRPC request headers, client side open); the next free id."""
    client.send(b"".join(headers_frame(sid) for sid in range(first, first + 2 * count, 2)))
    return first + 2 * count


# -- floods of frames ------------------------------------------------------------------------------


CLOSED_WITHIN = 1.0
"""Seconds a connection the server ended may keep its socket, whatever the peer does meanwhile."""
RAPID_RESET_STREAMS = 10_000
RAPID_RESET_TAKEN = {False: 2_500, True: 800}
"""Streams of a rapid-reset connection's 10,000 the server may take before its GOAWAY: the reset
budget (Limits.reset_burst, 1,000) and what its rate (33/s) gives back meanwhile, with room for a
busy machine. A refused stream costs two (the refusal and the peer's reset of it): 500 of them."""


def goaway_received(client: RawClient, code: int, what: str, *, timeout: float = 10.0) -> list[str]:
    """Problems unless the client read GOAWAY ``code`` and then the end of the connection, within
    :data:`CLOSED_WITHIN` of the GOAWAY (stricter than :func:`goaway_with`: a reset that
    overtook the GOAWAY is a problem, since the peer then never learns why it was cut off)."""
    got = client.wait_for(lambda got: got if got.closed is not None else None, timeout=timeout) or client.got
    if got.goaway is None or got.goaway.code != code:
        return [f"{what}: expected GOAWAY {H2Code.name(code)}, got {got.goaway}; " + got.describe()]
    if got.closed_time is None or got.goaway_time is None:
        return [f"{what}: {got.goaway} was sent, but the connection stayed open {timeout:g} s"]
    if got.closed_time - got.goaway_time > CLOSED_WITHIN:
        return [
            f"{what}: the connection closed {got.closed_time - got.goaway_time:.2f} s after its {got.goaway} "
            f"(bound {CLOSED_WITHIN:g} s)"
        ]
    return []


def rapid_reset(
    client: RawClient,
    first: int,
    streams: int = RAPID_RESET_STREAMS,
    *,
    per_write: int = 500,
    then: Callable[[], None] = lambda: None,
) -> int:
    """HEADERS then RST_STREAM CANCEL on stream after stream from ``first``, ``per_write`` pairs
    per write, up to ``streams`` or until the server ends the connection (``then`` after the
    fourth write); the pairs sent."""
    block = literal_block(request_headers())
    sid, pairs, writes = first, 0, 0
    while pairs < streams and client.got.goaway is None and client.got.closed is None:
        chunk = b"".join(
            frame(FrameType.HEADERS, END_HEADERS, s, block) + rst_stream(s, H2Code.CANCEL)
            for s in range(sid, sid + 2 * per_write, 2)
        )
        if not client.send(chunk):
            break
        sid += 2 * per_write
        pairs += per_write
        writes += 1
        if writes == 4:
            then()
    return pairs


def test_rapid_reset(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    pairs = rapid_reset(client, 1, 40_000, per_write=1000, then=target.change_snapshot)
    problems = goaway_received(client, H2Code.ENHANCE_YOUR_CALM, f"{pairs:,} HEADERS+RST_STREAM pairs")
    target.conclude(request.node.name, problems, pairs_sent=pairs)


@pytest.mark.parametrize("refused", [False, True], ids=["streams-opened", "streams-refused"])
def test_rapid_reset_on_four_connections_at_once(target: Target, request: pytest.FixtureRequest, refused: bool) -> None:
    """Each RST_STREAM arrives in the same read as the HEADERS that opened its stream; with
    ``refused``, 100 streams are held open first (the server's SETTINGS_MAX_CONCURRENT_STREAMS),
    so the server refuses every stream that follows. Either way every connection ends with GOAWAY
    ENHANCE_YOUR_CALM long before its 10,000 streams."""
    clients = [target.attacker().start_reader() for _ in range(4)]
    held = 100 if refused else 0
    firsts = [open_streams(client, 1, held) for client in clients]
    with ThreadPoolExecutor(len(clients)) as pool:
        attacks = [pool.submit(rapid_reset, client, first) for client, first in zip(clients, firsts, strict=True)]
        target.change_snapshot()
        sent = [attack.result() for attack in attacks]
    problems, taken = [], []
    for n, client in enumerate(clients):
        what = f"connection {n} ({sent[n]:,} HEADERS+RST_STREAM pairs sent{', streams refused' if refused else ''})"
        problems += goaway_received(client, H2Code.ENHANCE_YOUR_CALM, what)
        goaway = client.got.goaway
        taken.append((goaway.last_stream + 1) // 2 - held if goaway is not None else 0)  # its last stream id
        if taken[-1] > RAPID_RESET_TAKEN[refused]:
            problems.append(
                f"{what}: the server took {taken[-1]:,} streams before its GOAWAY "
                f"(bound {RAPID_RESET_TAKEN[refused]:,})"
            )
    target.conclude(request.node.name, problems, pairs_sent=sent, streams_taken=taken)


EMPTY_DATA_FRAMES = 100_000


def answered_streams(client: RawClient, count: int) -> None:
    """Open ``count`` ADS streams, each with one CDS request (the server answers each with the
    whole CDS, a few KB)."""
    body = grpc_message(discovery_request(CDS))
    client.send(b"".join(headers_frame(s) + frame(FrameType.DATA, 0, s, body) for s in range(1, 2 * count, 2)))


def empty_data_flood(client: RawClient) -> int:
    """:data:`EMPTY_DATA_FRAMES` DATA frames without payload or END_STREAM on stream 1, 10,000
    per write, until the server stops taking them; the frames sent."""
    chunk = frame(FrameType.DATA, 0, 1) * 10_000
    sent = 0
    while sent < EMPTY_DATA_FRAMES and client.send(chunk):
        sent += 10_000
    return sent


def test_empty_data_flood_after_the_stream_is_answered(target: Target, request: pytest.FixtureRequest) -> None:
    """A small receive buffer, and answers still on their way when the flood arrives: the GOAWAY
    must reach the client before the socket closes (a socket closed with the flood unread is
    reset, and the reset throws away what is still queued behind the answers: the GOAWAY)."""
    client = target.attacker(rcvbuf=4096, settings=[(0x4, MAX_WINDOW)]).start_reader()
    client.send(window_update(0, MAX_WINDOW - 65_535))  # windows wide open: every answer is on its way at once
    answered_streams(client, 100)
    client.wait_for(lambda got: got.data.get(1), timeout=10.0)
    target.change_snapshot()
    sent = empty_data_flood(client)  # and on, whatever the server says meanwhile
    problems = goaway_received(client, H2Code.ENHANCE_YOUR_CALM, f"{sent:,} empty DATA frames")
    target.conclude(request.node.name, problems, frames_sent=sent)


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive buffer (FIONREAD), without reading them."""
    unread: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    return unread


def _established(sock: socket.socket) -> bool:
    """Whether ``sock``'s TCP state is still ESTABLISHED (the first byte of TCP_INFO), without reading."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == 1


@pytest.mark.parametrize("full", [False, True], ids=["room-for-the-goaway", "receive-buffer-full"])
def test_empty_data_flood_from_a_client_that_never_reads(
    target: Target, request: pytest.FixtureRequest, full: bool
) -> None:
    """The client never reads: the server must still end the connection with GOAWAY
    ENHANCE_YOUR_CALM (found in the client's receive buffer afterwards) and close its socket
    within a second. With ``full``, a small receive buffer is full of answers the client asked
    for: the GOAWAY can never reach it, and the socket must be closed within a second all the same."""
    if full:
        client = target.attacker(send_timeout=1.0, rcvbuf=4096, settings=[(0x4, MAX_WINDOW)])
        client.send(window_update(0, MAX_WINDOW - 65_535))
        answered_streams(client, 100)
    else:
        client = target.attacker(send_timeout=1.0)
        answered_streams(client, 1)
    if not wait(lambda: _unread(client.sock) > 1000, timeout=10.0):
        pytest.fail("the server did not answer the ADS requests")
    target.change_snapshot()
    started = time.monotonic()
    sent = empty_data_flood(client)
    closed = wait(lambda: not _established(client.sock), timeout=5.0, interval=0.01)
    elapsed = time.monotonic() - started
    problems = []
    if not closed:
        problems.append(f"{sent:,} empty DATA frames: the socket was still open {elapsed:.1f} s after the flood began")
    elif elapsed > CLOSED_WITHIN:
        problems.append(
            f"{sent:,} empty DATA frames: the socket closed {elapsed:.2f} s after the flood began "
            f"(bound {CLOSED_WITHIN:g} s)"
        )
    if not full:
        goaways = [payload for kind, _, _, payload in parse_frames(read_all(client.sock)) if kind == FrameType.GOAWAY]
        codes = [struct.unpack_from(">I", payload, 4)[0] for payload in goaways if len(payload) >= 8]
        if codes != [H2Code.ENHANCE_YOUR_CALM]:
            problems.append(
                f"{sent:,} empty DATA frames: expected one GOAWAY ENHANCE_YOUR_CALM among what the "
                f"server sent, found GOAWAY codes {[H2Code.name(c) for c in codes]}"
            )
    target.conclude(request.node.name, problems, frames_sent=sent, seconds_to_close=round(elapsed, 3))


def read_all(sock: socket.socket) -> bytes:
    """What ``sock`` holds, up to its end (EOF or reset)."""
    data = bytearray()
    sock.settimeout(2.0)
    with contextlib.suppress(OSError):
        while chunk := sock.recv(1 << 20):
            data += chunk
    return bytes(data)


def test_continuation_flood(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    client.send(frame(FrameType.HEADERS, 0, 1, literal_block(request_headers())))
    # 1 MiB of valid header literals, cut into CONTINUATION frames; sent again and again.
    pattern = literal_block([(b"x-filler", b"f" * 1000)] * 1040)
    megabyte = b"".join(
        frame(FrameType.CONTINUATION, 0, 1, pattern[i : i + 16_384]) for i in range(0, len(pattern), 16_384)
    )
    sent = 0
    for n in range(96):
        if n == 8:
            target.change_snapshot()
        if client.got.closed is not None or not client.send(megabyte):
            break
        sent += 1
    problems = goaway_with(
        client,
        {H2Code.ENHANCE_YOUR_CALM, H2Code.PROTOCOL_ERROR, H2Code.COMPRESSION_ERROR},
        f"{sent} MiB of CONTINUATION without END_HEADERS",
        barrier=False,
    )
    target.conclude(request.node.name, problems, mib_sent=sent)


def test_hpack_table_size_update_flood(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    headers = literal_block(request_headers())
    updates = table_size_update(0) * (16_384 - len(headers))  # one frame: 16,000 updates, then a request
    blocks = 0
    for sid in range(1, 201, 2):  # 100 such blocks
        if sid == 21:
            target.change_snapshot()
        if client.got.closed is not None:
            break
        if not client.send(frame(FrameType.HEADERS, END_HEADERS | END_STREAM, sid, updates + headers)):
            break
        blocks += 1
    problems = goaway_with(
        client,
        {H2Code.COMPRESSION_ERROR, H2Code.ENHANCE_YOUR_CALM, H2Code.PROTOCOL_ERROR},
        f"{blocks} header blocks of {len(updates):,} table size updates each",
    )
    problems += cpu_bound(target, 1.0, "table size updates")
    target.conclude(request.node.name, problems, blocks=blocks)


def test_settings_with_thousands_of_entries(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    open_streams(client, 1, 100)  # each INITIAL_WINDOW_SIZE entry touches every open stream
    target.change_snapshot()
    entries = [(0x4, 65_535 + n % 2) for n in range(16_380 // 6)]  # 2,730 entries: a full frame
    frames = 0
    for _ in range(10):
        if client.got.closed is not None or not client.send(settings_frame(entries)):
            break
        frames += 1
    problems = goaway_with(client, {H2Code.ENHANCE_YOUR_CALM}, f"{frames} SETTINGS frames of {len(entries):,} entries")
    target.conclude(request.node.name, problems, frames=frames)


def flood_without_reading(target: Target, unit: bytes, megabytes: int) -> RawClient:
    """Send ``unit`` frames (MiB after MiB, up to ``megabytes``) from a client that never reads,
    with a small receive buffer: what the server answers piles up on its side."""
    client = target.attacker(rcvbuf=4096, send_timeout=1.0)
    chunk = unit * (MIB // len(unit))
    for n in range(megabytes):
        if n == 1:
            target.change_snapshot()
        if not client.send(chunk):
            break
    return client


def limited(client: RawClient) -> str:
    return client.send_failed or "the server took every byte"


def closed_after_flood(client: RawClient, what: str) -> list[str]:
    """Problems unless the server has closed the socket of a client that never reads within
    :data:`CLOSED_WITHIN` of the end of its flood (its last send, or the send that stalled or
    failed): the server must go on reading such a peer (so as to see the flood that ends the
    connection) and must not wait on it to take the GOAWAY."""
    ended = time.monotonic()
    closed = wait(lambda: not _established(client.sock), timeout=CLOSED_WITHIN + 4.0, interval=0.01)
    elapsed = time.monotonic() - ended
    if not closed:
        return [f"{what}: the connection was still open {elapsed:.1f} s after the flood ({limited(client)})"]
    if elapsed > CLOSED_WITHIN:
        return [f"{what}: the connection closed {elapsed:.2f} s after the flood (bound {CLOSED_WITHIN:g} s)"]
    return []


def answered(client: RawClient, kind: int, what: str, *, flags: int = 0) -> list[str]:
    """Read the first 64 KiB the server sent to a client that had not read (the test's proof that
    the server did take the flood): a problem unless frames of ``kind`` (with ``flags``) are there,
    or the server ended the connection over it (a GOAWAY among them, or the connection reset while
    the client was still sending: the server closed it with the flood unread, which it does only
    once it has read enough of it to end the connection)."""
    if "reset" in (client.send_failed or "").lower():
        return []
    data = bytearray()
    client.sock.settimeout(2.0)
    try:
        while len(data) < 65_536:
            chunk = client.sock.recv(65_536 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    offset = count = 0
    while len(data) - offset >= 9:
        length = int.from_bytes(data[offset : offset + 3], "big")
        if (data[offset + 3] == kind and data[offset + 4] & flags == flags) or data[offset + 3] == FrameType.GOAWAY:
            count += 1
        offset += 9 + length
    if not count:
        return [f"{what}: the server answered none of it in the first {len(data):,} bytes it sent"]
    return []


def test_settings_flood_from_a_client_that_never_reads(target: Target, request: pytest.FixtureRequest) -> None:
    client = flood_without_reading(target, settings_frame([]), 24)
    problems = closed_after_flood(client, "SETTINGS flood")
    problems += answered(client, FrameType.SETTINGS, "SETTINGS flood", flags=0x1)
    target.conclude(request.node.name, problems, mib_sent=round(client.sent / MIB, 1), outcome=limited(client))


def test_ping_flood_from_a_client_that_never_reads(target: Target, request: pytest.FixtureRequest) -> None:
    client = flood_without_reading(target, frame(FrameType.PING, 0, 0, b"pingping"), 24)
    problems = closed_after_flood(client, "PING flood")
    problems += answered(client, FrameType.PING, "PING flood", flags=0x1)
    # Tighter than the other attacks: 12 MiB of PINGs once cost +51 MiB held after the flood (a
    # 17-byte object per ACK for the socket's write queue); the ACKs now share buffers.
    target.conclude(
        request.node.name, problems, rss_bound=24 * MIB, mib_sent=round(client.sent / MIB, 1), outcome=limited(client)
    )


def test_requests_from_a_client_that_never_reads(target: Target, request: pytest.FixtureRequest) -> None:
    # Windows opened wide, so flow control does not hold the answers back: the send buffer must.
    client = target.attacker(rcvbuf=4096, send_timeout=1.0, settings=[(0x4, MAX_WINDOW)])
    client.send(window_update(0, MAX_WINDOW - 65_535))
    body = grpc_message(discovery_request(CDS))
    sid, calls = 1, 0
    for batch in range(40):  # 40 x 1,000 calls, each one request and the whole CDS answer
        if batch == 1:
            target.change_snapshot()
        chunk = b"".join(
            headers_frame(s) + frame(FrameType.DATA, END_STREAM, s, body) for s in range(sid, sid + 2000, 2)
        )
        if not client.send(chunk):
            break
        sid += 2000
        calls += 1000
    problems = closed_after_flood(client, "requests from a client that never reads")
    problems += answered(client, FrameType.DATA, "requests from a client that never reads")
    target.conclude(request.node.name, problems, calls_sent=calls, outcome=limited(client))


# -- large and slow messages -----------------------------------------------------------------------


def big_request(size: int) -> bytes:
    """A valid CDS request of about ``size`` bytes (the bulk in version_info)."""
    return discovery_request(CDS, version_info="v" * size)


def test_large_message_then_one_byte_data_frames(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    message = grpc_message(big_request(8 * MIB + 2000))
    head, tail = message[:-2000], message[-2000:]
    client.send(headers_frame(1))
    client.send_data(1, head[: 4 * MIB], end_stream=False)
    target.change_snapshot()
    client.send_data(1, head[4 * MIB :], end_stream=False)
    for n, byte in enumerate(tail):
        if not client.send_data(1, bytes([byte]), end_stream=n == len(tail) - 1, timeout=5.0):
            break
    problems = call_refused(client, 1, {RESOURCE_EXHAUSTED}, "a message of 8 MiB (grpc-core's limit: 4 MiB)")
    problems += cpu_bound(target, 1.5, "8 MiB then 2,000 one-byte DATA frames")
    target.conclude(request.node.name, problems)


def test_message_under_4_mib_completed_byte_by_byte(target: Target, request: pytest.FixtureRequest) -> None:
    # Under any sane size limit, so only linear reassembly keeps this cheap.
    client = target.attacker().start_reader()
    message = grpc_message(big_request(4 * MIB - 64 * 1024))
    head, tail = message[:-8000], message[-8000:]
    client.send(headers_frame(1))
    client.send_data(1, head, end_stream=False)
    target.change_snapshot()
    for n, byte in enumerate(tail):
        if not client.send_data(1, bytes([byte]), end_stream=n == len(tail) - 1, timeout=5.0):
            break
    client.wait_for(lambda got: 1 in got.data or 1 in got.ended or 1 in got.resets or got.closed, timeout=10.0)
    problems = (
        []
        if 1 in client.got.data or 1 in client.got.ended
        else ["a 4 MiB message completed by 8,000 one-byte DATA frames was not answered; " + client.got.describe()]
    )
    problems += cpu_bound(target, 1.0, "4 MiB then 8,000 one-byte DATA frames")
    target.conclude(request.node.name, problems)


def test_message_over_4_mib(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    client.send(headers_frame(1))
    target.change_snapshot()
    client.send_data(1, grpc_message(big_request(4 * MIB + 1)))
    problems = call_refused(client, 1, {RESOURCE_EXHAUSTED}, "a message over 4 MiB")
    target.conclude(request.node.name, problems)


def names_field(names: list[bytes]) -> bytes:
    """``resource_names`` (field 3) entries of a DiscoveryRequest, encoded by hand (fast)."""
    out = bytearray()
    for name in names:
        out += b"\x1a" + bytes([len(name)]) + name  # names under 128 bytes: a one-byte length
    return bytes(out)


def test_two_million_resource_names(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    body = discovery_request(EDS) + names_field([b"r%x" % n for n in range(2_000_000)])
    client.send(headers_frame(1))
    target.change_snapshot()
    client.send_data(1, grpc_message(body), timeout=10.0)
    problems = call_refused(client, 1, {RESOURCE_EXHAUSTED, INVALID_ARGUMENT}, "2,000,000 resource names")
    client.barrier()
    target.conclude(request.node.name, problems, message_mib=round(len(body) / MIB, 1))


def test_17_mb_type_url(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    body = discovery_request("type.googleapis.com/" + "x" * 17_000_000)
    client.send(headers_frame(1))
    target.change_snapshot()
    client.send_data(1, grpc_message(body), end_stream=False, timeout=10.0)
    problems = call_refused(client, 1, {RESOURCE_EXHAUSTED, INVALID_ARGUMENT}, "a 17 MB type_url")
    if client.got.largest_frame > 16_384:
        problems.append(f"a frame of {client.got.largest_frame:,} bytes was sent (MAX_FRAME_SIZE 16,384)")
    target.conclude(request.node.name, problems)


def test_600_node_ids_of_64_kib(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    log_before = target.event_log_size()
    for n in range(600):
        if n == 50:
            target.change_snapshot()
        node_id = f"{n:04d}" + "n" * (64 * 1024 - 4)
        client.send(headers_frame(2 * n + 1))
        if not client.send_data(2 * n + 1, grpc_message(discovery_request(CDS, node_id=node_id)), timeout=5.0):
            break
    client.barrier()
    problems = []
    logged = target.event_log_size() - log_before
    if logged > 8 * MIB:
        problems.append(f"the event log grew by {logged / MIB:.0f} MiB for 600 requests (node ids written whole)")
    target.conclude(request.node.name, problems, event_log_mib=round(logged / MIB, 1))


def test_distinct_subscription_sets(target: Target, request: pytest.FixtureRequest) -> None:
    client = target.attacker().start_reader()
    target.change_snapshot()  # first: a new snapshot would start with empty memos
    wait(lambda: target.good is not None and f"v{target.version}" in target.good.versions, timeout=10)
    for n in range(40):  # 40 calls, each subscribing to its own 20,000 names
        names = [b"cluster-%02d-%05d-" % (n, i) + b"x" * 24 for i in range(20_000)]
        client.send(headers_frame(2 * n + 1))
        if not client.send_data(2 * n + 1, grpc_message(discovery_request(EDS) + names_field(names)), timeout=5.0):
            break
    client.barrier()
    target.conclude(request.node.name, [])


# -- connections -----------------------------------------------------------------------------------


def test_2000_silent_connections(start_target: StartTarget, request: pytest.FixtureRequest) -> None:
    target = start_target(nofile=1024)
    silent: list[socket.socket] = []
    try:
        for _ in range(2000):  # from another source address: a per-address cap must not hit the proxies
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", target.port))
            silent.append(sock)
        # Until the server holds as many as its limit lets it (or 5 s, for a server that caps them).
        held = wait(lambda: target.open_descriptors() >= 1022, timeout=5.0)
        target.change_snapshot()
        started = time.monotonic()
        newcomer = GoodClient(target.address, node_id="new-proxy")
        target.extra_clients.append(newcomer)
        problems = []
        if not wait(lambda: newcomer.versions or newcomer.error, timeout=5.0) or not newcomer.versions:
            problems.append(
                f"a proxy connecting after 2,000 silent connections was not served within 5 s "
                f"(error: {newcomer.error}); the server holds {target.open_descriptors()} descriptors"
            )
        target.conclude(
            request.node.name,
            problems,
            served_timeout=5.0,
            descriptors=target.open_descriptors(),
            saturated=bool(held),
            newcomer_s=round(time.monotonic() - started, 2),
        )
    finally:
        for sock in silent:
            sock.close()
