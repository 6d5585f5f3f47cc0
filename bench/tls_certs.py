"""Throwaway TLS material for the benchmarks: a test CA (trustme), a server certificate for
``localhost``/127.0.0.1 and a client certificate, as PEM files; and how a fan-out run uses them
(``pilotfish serve`` options, the fleet's :class:`~bench.fleet.FleetTls`).

Nothing here is for production: the CA's key lives in memory and is thrown away, and every
simulated proxy presents the same client certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.fleet import FleetTls

__all__ = ["TLS_MODES", "Certs", "make_certs"]

TLS_MODES = ("off", "tls", "mtls")
"""How the proxies reach the server: plaintext, TLS, or mTLS (a client certificate too)."""


@dataclass(frozen=True, slots=True)
class Certs:
    """A test CA and what it issued, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_args(self, mode: str) -> tuple[str, ...]:
        """``pilotfish serve`` options for ``mode`` (one of :data:`TLS_MODES`)."""
        if mode == "off":
            return ()
        args = ("--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key))
        return (*args, "--client-ca", str(self.ca)) if mode == "mtls" else args

    def fleet(self, mode: str) -> FleetTls | None:
        """How the fleet connects in ``mode`` (None: plaintext)."""
        if mode == "off":
            return None
        if mode == "mtls":
            return FleetTls(ca=str(self.ca), cert=str(self.client_cert), key=str(self.client_key))
        return FleetTls(ca=str(self.ca))


def make_certs(directory: Path) -> Certs:
    """A throwaway CA, a server certificate for ``localhost``/127.0.0.1 and a client certificate
    (DNS SAN ``proxy.bench.test``), written into ``directory``."""
    import trustme  # a test dependency, like grpcio for the naive server

    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("proxy.bench.test")
    certs = Certs(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    ca.cert_pem.write_to_path(str(certs.ca))
    server.private_key_pem.write_to_path(str(certs.server_key))
    client.private_key_pem.write_to_path(str(certs.client_key))
    certs.server_cert.write_bytes(b"".join(pem.bytes() for pem in server.cert_chain_pems))
    certs.client_cert.write_bytes(b"".join(pem.bytes() for pem in client.cert_chain_pems))
    return certs
