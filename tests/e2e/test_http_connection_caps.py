"""Connection caps on the HTTP ports (registry API, REST xDS, admin API) of a real ``pilotfish
serve``: a connection over a cap is closed at once, before any byte; the connections under it
keep being answered (keep-alive requests on them); another address is served; once a connection
closes, its place is free again.

Each port gets its caps lowered on the command line (``--registry-max-connections-per-address``,
``--rest-max-connections``, ``--admin-max-connections-per-address``). The connections come from
loopback addresses of their own (127.0.0.2 and up), so that one port's test does not count
against another's.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopback import connect_from

from .processes import ControlPlane, ProcessGroup, free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SNAPSHOT = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
TIMEOUT = 10.0
CAP = 3


def ask(sock: socket.socket, path: str) -> bytes:
    """Send ``GET path`` (HTTP/1.1, keep-alive) and return the response's status line; b"" when
    the connection was closed or reset instead."""
    with contextlib.suppress(OSError):
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: pilotfish\r\n\r\n".encode())
    received = b""
    deadline = time.monotonic() + TIMEOUT
    while b"\r\n\r\n" not in received:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise AssertionError(f"no answer and no close within {TIMEOUT} s")
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return b""
        if not chunk:
            return b""
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(rest) < length:  # read the body, so the next request's answer starts clean
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head.split(b"\r\n", 1)[0]


def refused(port: int, source: str, path: str) -> bool:
    """Whether a new connection from ``source`` is closed without an answer."""
    try:
        sock = connect_from(port, source, timeout=TIMEOUT)
    except ConnectionResetError:
        return True  # reset as soon as accepted: the connect call saw it
    with sock:
        return ask(sock, path) == b""


@contextlib.contextmanager
def held(port: int, sources: list[str], path: str) -> Iterator[list[socket.socket]]:
    """Connections from ``sources``, each answered once; closed at the end."""
    socks = []
    try:
        for source in sources:
            sock = connect_from(port, source, timeout=TIMEOUT)
            socks.append(sock)
            assert ask(sock, path).startswith(b"HTTP/1.1 "), source
        yield socks
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def rest_port() -> int:
    return free_port()


@pytest.fixture
def control_plane(processes: ProcessGroup, rest_port: int) -> ControlPlane:
    rest = rest_port
    cp = ControlPlane(
        processes,
        SNAPSHOT,
        free_port(),
        registry_port=free_port(),
        options=(
            "--rest",
            f"127.0.0.1:{rest}",
            "--registry-max-connections-per-address",
            str(CAP),
            "--rest-max-connections",
            str(CAP),
            "--admin-max-connections-per-address",
            str(CAP),
        ),
    )
    cp.start()
    return cp


def _stderr(cp: ControlPlane) -> str:
    return cp.process.stderr_path.read_text(errors="replace")


@pytest.mark.parametrize("port_name", ["registry", "admin"])
def test_a_connection_over_the_per_address_cap_is_refused_and_those_under_it_are_answered(
    control_plane: ControlPlane, port_name: str
) -> None:
    port = control_plane.registry_port if port_name == "registry" else control_plane.admin_port
    assert port is not None
    source = "127.0.0.2" if port_name == "registry" else "127.0.0.3"
    with held(port, [source] * CAP, "/healthz") as socks:
        assert refused(port, source, "/healthz")
        for sock in socks:  # those under the cap keep being answered
            assert ask(sock, "/healthz") == b"HTTP/1.1 200 OK"
        assert not refused(port, "127.0.0.9", "/healthz")  # another address is served
        flag = f"--{port_name}-max-connections-per-address"
        wait_until(
            lambda: (
                f"refused a connection from {source}: {CAP} connections from this address are open, "
                f"the limit ({flag})" in _stderr(control_plane)
            ),
            timeout=TIMEOUT,
            what="the refusal in the log",
            details=lambda: _stderr(control_plane),
        )
        socks[0].close()
        # Its place is free once the server has seen it close.
        wait_until(
            lambda: not refused(port, source, "/healthz"),
            timeout=TIMEOUT,
            what="a new connection to be served once one closed",
        )
        for sock in socks[1:]:
            assert ask(sock, "/healthz") == b"HTTP/1.1 200 OK"


def test_a_connection_over_the_total_cap_of_rest_xds_is_refused_and_those_under_it_are_answered(
    control_plane: ControlPlane, rest_port: int
) -> None:
    port = rest_port
    path = "/v3/discovery:clusters"  # a GET: 405, an answer all the same
    sources = [f"127.0.0.{10 + i}" for i in range(CAP)]
    with held(port, sources, path) as socks:
        assert refused(port, "127.0.0.20", path)
        for sock in socks:
            assert ask(sock, path).startswith(b"HTTP/1.1 405")
        wait_until(
            lambda: "the limit (--rest-max-connections)" in _stderr(control_plane),
            timeout=TIMEOUT,
            what="the refusal in the log",
            details=lambda: _stderr(control_plane),
        )
        socks[0].close()
        wait_until(
            lambda: not refused(port, "127.0.0.20", path),
            timeout=TIMEOUT,
            what="a new connection to be served once one closed",
        )
    assert "Traceback" not in _stderr(control_plane)
