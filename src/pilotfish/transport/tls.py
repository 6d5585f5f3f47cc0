"""TLS for pilotfish's listeners: server contexts built from files, reloaded when the files change.

An xDS port serves secrets (SDS private keys) and the whole mesh's configuration, so it must not
speak in clear over an untrusted network, and with ``client_ca`` it serves only proxies holding a
certificate from that CA (mTLS). The registry API can use the same certificate.

Reloading without dropping anything: a listener is created once with one :class:`ssl.SSLContext`
(the *front* context), whose ``sni_callback`` runs on every ClientHello, SNI or not (OpenSSL's
servername callback). The callback points the handshake's ``SSLObject`` at the *current*
context, a complete one built from the files. When a file's content changes (polled: a digest of
each file, a few KiB read per poll), a fresh context is built off to the side; only if
the certificate, key and CA load and match does it become current. New handshakes then use it;
established connections keep the session they have, so no stream is dropped. A bad file (a
certificate written before its key, a typo) is reported and the previous context keeps serving.
This works on asyncio's own loop and on uvloop: both hand the callback the handshake's SSLObject.

Identity: with ``client_ca`` the peer's certificate is verified (chain and validity; no name is
expected of a client), and :func:`peer_identity` names it: its first SPIFFE URI SAN, else its
first DNS SAN. A connection that verified no certificate has the identity ``""``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotfish.errors import ConfigError, Problem

__all__ = ["ReloadingServerContext", "TlsFiles", "peer_identity"]

_log = logging.getLogger("pilotfish.tls")

ALPN_H2 = "h2"


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """Where a TLS listener's certificate, key and (for mTLS) client CA are read from."""

    cert: Path
    """PEM certificate chain the server presents (leaf first)."""
    key: Path
    """PEM private key of the leaf certificate."""
    client_ca: Path | None = None
    """PEM CA bundle client certificates must chain to; None: no client certificate is asked for."""
    alpn: tuple[str, ...] = ()
    """ALPN protocols offered (``("h2",)`` for gRPC); empty: no ALPN."""

    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)


def _bad(path: Path, message: str) -> ConfigError:
    return ConfigError(str(path), [Problem("", message)])


def build_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context from ``files`` (TLS 1.2 or newer). Raises :class:`ConfigError` naming the
    file at fault and what to do."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    if files.alpn:
        context.set_alpn_protocols(list(files.alpn))
    try:
        context.load_cert_chain(files.cert, files.key)
    except FileNotFoundError as exc:
        raise _bad(
            Path(exc.filename or files.cert), "no such file (the TLS certificate or key); give an existing PEM file"
        ) from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise _bad(
            files.cert,
            f"cannot load it with the key {files.key} ({exc}); both must be PEM, the key "
            "unencrypted and matching the certificate's public key",
        ) from None
    if files.client_ca is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except FileNotFoundError:
            raise _bad(files.client_ca, "no such file (the client CA); give an existing PEM CA bundle") from None
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise _bad(
                files.client_ca, f"cannot load it as the client CA bundle ({exc}); it must hold PEM CA certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _signature(paths: tuple[Path, ...]) -> tuple[bytes, ...]:
    """A digest of each file's content (b"" when it cannot be read). Content, not mtime: a file
    rewritten in place within one tick of the kernel's coarse clock keeps its mtime and size."""
    out = []
    for path in paths:
        try:
            out.append(hashlib.blake2b(path.read_bytes(), digest_size=16).digest())
        except OSError:
            out.append(b"")
    return tuple(out)


class ReloadingServerContext:
    """The context to give a listener (:attr:`context`), following its files (:meth:`run`)."""

    def __init__(self, files: TlsFiles, *, on_event: Callable[..., None] | None = None, name: str = "TLS") -> None:
        self.files = files
        self.name = name
        """Which listener this is, for log lines and events (``xds``, ``registry``)."""
        self._on_event = on_event
        self._signature = _signature(files.paths())
        self.current = build_context(files)  # raises ConfigError at start-up: nothing to fall back on
        """The context new handshakes use."""
        self.reloads = 0
        self.context = build_context(files)
        """The front context, given to the listener once; it hands each handshake to :attr:`current`."""
        self.context.sni_callback = self._pick

    def _pick(self, ssl_object: Any, server_name: str | None, front: ssl.SSLContext) -> int | None:
        current = self.current
        if current is not front:
            ssl_object.context = current
        return None

    def reload_if_changed(self) -> bool:
        """Build a new context if a file changed; True when it became current."""
        signature = _signature(self.files.paths())
        if signature == self._signature:
            return False
        try:
            context = build_context(self.files)
        except ConfigError as exc:
            # Not retried until a file changes again (a certificate written before its key is
            # loaded once the key is written).
            _log.error("%s: %s; still serving the previous certificate", self.name, exc.describe())
            if self._on_event is not None:
                self._on_event("tls_reload_failed", listener=self.name, reason=exc.describe())
            self._signature = signature
            return False
        self._signature = signature
        self.current = context
        self.reloads += 1
        _log.warning("%s: loaded the new certificate from %s", self.name, self.files.cert)
        if self._on_event is not None:
            self._on_event("tls_reloaded", listener=self.name, cert=str(self.files.cert))
        return True

    async def run(self, *, every: float = 1.0) -> None:
        """Poll the files every ``every`` seconds, forever."""
        while True:
            await asyncio.sleep(every)
            try:
                self.reload_if_changed()
            except Exception:  # our bug: say so, keep serving the current context, keep polling
                _log.exception("%s: checking the TLS files for changes failed", self.name)


def peer_identity(peercert: Mapping[str, Any] | None) -> str:
    """The identity in a verified peer certificate (``getpeercert()``'s dict): its first SPIFFE URI
    SAN, else its first DNS SAN, else ``""``."""
    if not peercert:
        return ""
    sans = peercert.get("subjectAltName", ())
    for kind, value in sans:
        if kind == "URI" and isinstance(value, str) and value.startswith("spiffe://"):
            return value
    for kind, value in sans:
        if kind == "DNS" and isinstance(value, str):
            return value
    return ""
