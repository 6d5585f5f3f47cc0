"""A DNS server of the test's own, on a UDP port of 127.0.0.1, for Envoy to resolve names with.

:class:`NameServer` answers the A queries of the names it holds (``names``: name -> IPv4
addresses, changed by the test as it goes) with those addresses (TTL 0: nothing is cached), a
query of any other type for such a name with no answer (NOERROR), and every other name with
NXDOMAIN: the answer a deleted record gets. Point Envoy at it with :func:`envoy_resolves_with`
(the bootstrap's default resolver: c-ares, with only this server). It serves in a thread of the
test process, stopped by :meth:`NameServer.close` (it looks for the stop every 0.1 s).

Only what a stub resolver sends is read (RFC 1035 4.1: a header, one question; the rest, such as an
EDNS OPT record, is ignored); anything else is dropped.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NameServer", "envoy_resolves_with"]

_A, _IN = 1, 1
_NXDOMAIN = 3


def _question(packet: bytes) -> tuple[int, int, bytes, str, int] | None:
    """(id, flags, the question's bytes, its name in lower case, its type), or None."""
    if len(packet) < 12:
        return None
    ident, flags, questions = struct.unpack("!HHH", packet[:6])
    if flags & 0x8000 or questions != 1:  # (a response, or not one question)
        return None
    labels, at = [], 12
    while at < len(packet) and packet[at]:
        length = packet[at]
        if length > 63 or at + 1 + length > len(packet):
            return None
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii", "replace"))
        at += 1 + length
    if at + 5 > len(packet):
        return None
    qtype, _ = struct.unpack("!HH", packet[at + 1 : at + 5])
    return ident, flags, packet[12 : at + 5], ".".join(labels).lower(), qtype


def answer(packet: bytes, names: dict[str, list[str]]) -> bytes | None:
    """The response to one query (None: not a query this server answers)."""
    asked = _question(packet)
    if asked is None:
        return None
    ident, flags, question, name, qtype = asked
    addresses = names.get(name.rstrip("."))
    records = [] if addresses is None or qtype != _A else addresses
    rcode = _NXDOMAIN if addresses is None else 0
    # QR, the query's opcode and RD, RA; one question; the answers
    header = struct.pack("!HHHHHH", ident, 0x8080 | (flags & 0x7900) | rcode, 1, len(records), 0, 0)
    body = b"".join(struct.pack("!HHHIH", 0xC00C, _A, _IN, 0, 4) + socket.inet_aton(a) for a in records)
    return header + question + body


@dataclass
class NameServer:
    """See the module docstring; ``port`` is its UDP port on 127.0.0.1."""

    names: dict[str, list[str]] = field(default_factory=dict)
    port: int = 0
    queries: int = 0
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, names: dict[str, list[str]]) -> NameServer:
        server = cls(dict(names))
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(0.1)  # (to see the stop)
        server._sock, server.port = sock, sock.getsockname()[1]
        server._thread = threading.Thread(target=server._serve, name="name-server", daemon=True)
        server._thread.start()
        return server

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                packet, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            response = answer(packet, self.names)
            if response is not None:
                self.queries += 1
                with contextlib.suppress(OSError):
                    sock.sendto(response, peer)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()


def envoy_resolves_with(server: NameServer) -> Callable[[dict[str, Any]], None]:
    """A bootstrap edit: Envoy's default DNS resolver (every cluster's that names none) is c-ares
    asking ``server`` alone."""

    def edit(bootstrap: dict[str, Any]) -> None:
        bootstrap["typed_dns_resolver_config"] = {
            "name": "envoy.network.dns_resolver.cares",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                "resolvers": [{"socket_address": {"address": "127.0.0.1", "port_value": server.port}}],
                "dns_resolver_options": {"no_default_search_domain": True},
            },
        }

    return edit
