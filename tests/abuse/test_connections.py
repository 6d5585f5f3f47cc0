"""Connection exhaustion: caps on connections, the handshake timeout, the idle timeout.

Each test starts its own ``pilotfish serve`` with the option under test shortened or lowered on
its command line (``--handshake-timeout-ms``, ``--idle-timeout-ms``, ``--max-connections``,
``--max-connections-per-address``), with a good client (grpcio, from 127.0.0.1) subscribed beside
it. The attackers connect from other loopback addresses (127.0.0.2 and up), so that the per-address
cap is what they meet. Each test asserts what the offending connections get (closed without an
HTTP/2 byte when refused; GOAWAY PROTOCOL_ERROR after the handshake timeout; GOAWAY NO_ERROR when
idle), that well-behaved connections are untouched and newcomers served, and that the server logs
a bounded number of lines however many connections it refused or closed
(:meth:`Target.conclude` adds: the good client got the change made meanwhile, memory bounded, no
traceback).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

import pytest

from loopback import connect_from

from .conftest import StartTarget
from .target import CDS, GoodClient, Target, discovery_request
from .wire import (
    PREFACE,
    FrameType,
    H2Code,
    RawClient,
    grpc_message,
    headers_frame,
    parse_frames,
    request_headers,
    wait,
)

LOG_LINES = 3
"""Log lines one kind of refusal or time-out may cause during a test (one per 10 s, and the count
of those left out), however many connections it concerns."""


def read_until_closed(sock: socket.socket, deadline: float) -> tuple[bytes, str | None]:
    """What the server sent, and how the connection ended (None: still open at ``deadline``)."""
    received = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return bytes(received), None
        try:
            chunk = sock.recv(65536)
        except OSError as exc:
            return bytes(received), type(exc).__name__
        if not chunk:
            return bytes(received), "EOF"
        received += chunk


def refused(port: int, source: str) -> str:
    """``""`` when a connection from ``source`` is refused (closed before any byte), else what
    happened instead."""
    try:
        sock = connect_from(port, source, timeout=5.0)
    except ConnectionResetError:
        return ""  # reset as soon as accepted: the connect call saw it
    with contextlib.suppress(OSError):  # already reset: refused
        sock.sendall(PREFACE)
    try:
        received, ended = read_until_closed(sock, time.monotonic() + 5.0)
    finally:
        sock.close()
    if ended is None or received:
        return f"not refused: it got {len(received)} bytes and was {'closed: ' + ended if ended else 'kept open'}"
    return ""


def accepted(port: int, source: str) -> bool:
    """Whether a connection from ``source`` is served (the server's SETTINGS arrive)."""
    sock = connect_from(port, source, timeout=5.0)
    try:
        received, _ = read_until_closed(sock, time.monotonic() + 0.5)
        return any(kind == FrameType.SETTINGS for kind, _, _, _ in parse_frames(received))
    finally:
        sock.close()


def goaways(received: bytes) -> list[tuple[int, int]]:
    """(error code, last stream id) of each GOAWAY in ``received``."""
    return [
        (int.from_bytes(p[4:8], "big"), int.from_bytes(p[:4], "big") & 0x7FFF_FFFF)
        for kind, _, _, p in parse_frames(received)
        if kind == FrameType.GOAWAY and len(p) >= 8
    ]


def log_bounded(target: Target, containing: str, what: str) -> list[str]:
    lines = target.stderr_lines(containing)
    if len(lines) > LOG_LINES:
        return [f"{what}: {len(lines)} log lines (at most {LOG_LINES} expected):\n" + "\n".join(lines[:5])]
    return []


def open_ads_stream(client: RawClient, stream_id: int = 1) -> None:
    """An ADS stream that asked for clusters and stays open (as a proxy's does)."""
    client.send(headers_frame(stream_id))
    client.send_data(stream_id, grpc_message(discovery_request(CDS)), end_stream=False)


# -- the handshake (preface) timeout ---------------------------------------------------------------


def test_connections_without_a_preface_are_closed_after_the_handshake_timeout(
    start_target: StartTarget, request: pytest.FixtureRequest
) -> None:
    target = start_target(serve_args=["--handshake-timeout-ms", "300"])
    descriptors = target.open_descriptors()
    # Silent; half the magic; the magic only; the magic and half a SETTINGS frame header.
    starts = [b"", PREFACE[:10], PREFACE, PREFACE + b"\x00\x00\x00\x04"]
    sockets = []
    for i in range(120):
        sock = connect_from(target.port, "127.0.0.2", timeout=5.0)
        if starts[i % 4]:
            sock.sendall(starts[i % 4])
        sockets.append((starts[i % 4], sock))
    problems = []
    deadline = time.monotonic() + 15.0
    try:
        for start, sock in sockets:
            received, ended = read_until_closed(sock, deadline)
            codes = [code for code, _ in goaways(received)]
            if ended is None:
                problems.append(
                    f"a connection that sent {start!r} was still open 15 s after a handshake timeout of 0.3 s"
                )
                break
            if codes != [H2Code.PROTOCOL_ERROR]:
                problems.append(
                    f"a connection that sent {start!r} was closed ({ended}) with GOAWAYs {codes}, not "
                    "one GOAWAY PROTOCOL_ERROR"
                )
                break
        target.change_snapshot()
        if not wait(lambda: target.open_descriptors() <= descriptors + 2, timeout=10.0):
            problems.append(f"the server holds {target.open_descriptors()} descriptors, {descriptors} before")
        # A client that completes its preface in time is served: the good client (in harm), and this one.
        late = target.attacker(source="127.0.0.2").start_reader()
        if not late.barrier(timeout=5.0):
            problems.append("a client that sent its preface was not answered: " + late.got.describe())
        problems += log_bounded(target, "no HTTP/2 connection preface", "120 connections without a preface")
    finally:
        for _, sock in sockets:
            sock.close()
    target.conclude(request.node.name, problems)


# -- the idle timeout -------------------------------------------------------------------------------


def test_a_connection_without_streams_is_closed_with_goaway_after_the_idle_timeout(
    start_target: StartTarget, request: pytest.FixtureRequest
) -> None:
    target = start_target(serve_args=["--idle-timeout-ms", "500"])
    busy = target.attacker(source="127.0.0.2").start_reader()  # an ADS stream open, silent after it
    open_ads_stream(busy)
    problems = []
    if not busy.wait_for(lambda got: got.data.get(1), timeout=5.0):
        problems.append("the ADS stream got no response: " + busy.got.describe())
    # One call, then nothing: the stream is over and the connection idle.
    done = target.attacker(source="127.0.0.3").start_reader()
    done.send(headers_frame(1, request_headers(b"/no.such.Service/Method"), end_stream=True))
    never = target.attacker(source="127.0.0.4").start_reader()  # a preface, and never a stream
    for client, last in ((done, 1), (never, 0)):
        if not client.wait_for(lambda got: got.closed, timeout=10.0):
            problems.append(
                f"an idle connection (last stream {last}) was not closed within 10 s of an idle timeout "
                f"of 0.5 s: {client.got.describe()}"
            )
        elif client.got.goaway is None or (client.got.goaway.code, client.got.goaway.last_stream) != (
            H2Code.NO_ERROR,
            last,
        ):
            problems.append(
                f"an idle connection was closed without GOAWAY NO_ERROR (last stream {last}): {client.got.describe()}"
            )
    target.change_snapshot()
    # The connection with an open stream has been there longer than the idle timeout, and is kept.
    if busy.got.goaway is not None or not busy.barrier(timeout=5.0):
        problems.append("a connection with an open (silent) ADS stream was closed as idle: " + busy.got.describe())
    problems += log_bounded(target, "no streams for", "idle connections")
    assert target.good is not None
    target.conclude(request.node.name, problems)
    assert target.good.error is None, f"the good client's stream ended: {target.good.error}"


# -- connection caps --------------------------------------------------------------------------------


def test_an_address_over_its_connection_cap_is_refused_while_another_is_served(
    start_target: StartTarget, request: pytest.FixtureRequest
) -> None:
    target = start_target(serve_args=["--max-connections-per-address", "5"])
    held = [target.attacker(source="127.0.0.2").start_reader() for _ in range(5)]
    problems = [
        f"connection {i} of 5 from 127.0.0.2 was not served: {c.got.describe()}"
        for i, c in enumerate(held)
        if not c.barrier(timeout=5.0)
    ]
    for attempt in range(200):  # the sixth, and a reconnect flood after it
        why = refused(target.port, "127.0.0.2")
        if why:
            problems.append(f"connection {6 + attempt} from 127.0.0.2 (cap 5): {why}")
            break
    target.change_snapshot()
    newcomer = GoodClient(target.address, node_id="new-proxy")  # from 127.0.0.1, as the good client
    target.extra_clients.append(newcomer)
    if not newcomer.wait_for_version(f"v{target.version}", 10.0):
        problems.append(f"a proxy from 127.0.0.1 was not served while 127.0.0.2 was over its cap: {newcomer.error}")
    if any(c.got.goaway is not None or not c.barrier(timeout=5.0) for c in held):
        problems.append("the connections within the cap were disturbed by the refusals")
    held.pop().close()  # one leaves: its place is free again
    if not wait(lambda: accepted(target.port, "127.0.0.2"), timeout=5.0):
        problems.append("127.0.0.2 was still refused after one of its 5 connections closed")
    problems += log_bounded(target, "refused a connection", "200 refused connections")
    target.conclude(request.node.name, problems)


def test_connections_over_the_total_cap_are_refused_and_the_proxies_within_it_served(
    start_target: StartTarget, request: pytest.FixtureRequest
) -> None:
    # 6 in all (the per-address cap is then 3 by default: half of it): the good client, 3 + 2 raw.
    target = start_target(serve_args=["--max-connections", "6"])
    held = [target.attacker(source="127.0.0.2").start_reader() for _ in range(3)]
    why = refused(target.port, "127.0.0.2")
    problems = [f"a fourth connection from 127.0.0.2 (default per-address cap: half of 6): {why}"] if why else []
    held += [target.attacker(source="127.0.0.3").start_reader() for _ in range(2)]
    problems += [
        f"connection {i} within the cap was not served: {c.got.describe()}"
        for i, c in enumerate(held)
        if not c.barrier(timeout=5.0)
    ]
    for attempt, source in enumerate(["127.0.0.4", "127.0.0.5", "127.0.0.1"] * 30):
        why = refused(target.port, source)
        if why:
            problems.append(f"connection attempt {attempt} from {source} with 6 of 6 open: {why}")
            break
    target.change_snapshot()  # the good client, within the cap, must get it
    held[-1].close()
    if not wait(lambda: accepted(target.port, "127.0.0.4"), timeout=5.0):
        problems.append("a new address was still refused after a connection closed (5 of 6 open)")
    problems += log_bounded(target, "refused a connection", "91 refused connections")
    target.conclude(request.node.name, problems)


def test_at_1024_descriptors_a_silent_flood_from_one_address_leaves_room_for_proxies(
    start_target: StartTarget, request: pytest.FixtureRequest
) -> None:
    # A hard limit of 1,024 (serve cannot raise it): the default caps are 896 in all, 448 per address.
    target = start_target(nofile=1024, nofile_hard=1024)
    silent: list[socket.socket] = []
    try:
        for _ in range(2000):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", target.port))
            silent.append(sock)
        held = wait(lambda: target.open_descriptors() >= 448, timeout=5.0)
        target.change_snapshot()
        newcomer = GoodClient(target.address, node_id="new-proxy")
        target.extra_clients.append(newcomer)
        problems = []
        if not newcomer.wait_for_version(f"v{target.version}", 5.0):
            problems.append(
                f"a proxy from 127.0.0.1 was not served within 5 s of 2,000 silent connections from "
                f"127.0.0.2 (error: {newcomer.error}); the server holds {target.open_descriptors()} "
                "descriptors of 1,024"
            )
        if target.open_descriptors() > 600:
            problems.append(
                f"the server holds {target.open_descriptors()} descriptors: more than 448 silent "
                "connections from one address were kept"
            )
        problems += log_bounded(target, "refused a connection", "1,552 refused connections")
        target.conclude(
            request.node.name, problems, served_timeout=5.0, descriptors=target.open_descriptors(), saturated=bool(held)
        )
    finally:
        for sock in silent:
            sock.close()
