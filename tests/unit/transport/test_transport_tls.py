"""TLS settings: the identity a certificate names, files that cannot be served, the Envoy side."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from pilotfish.errors import ConfigError
from pilotfish.transport.tls import ReloadingServerContext, TlsFiles, build_context, peer_identity


def test_identity_is_the_spiffe_uri_else_the_first_dns_name() -> None:
    both = {
        "subjectAltName": (
            ("DNS", "edge.example"),
            ("URI", "https://not-spiffe"),
            ("URI", "spiffe://example/ns/a/sa/edge"),
        )
    }
    assert peer_identity(both) == "spiffe://example/ns/a/sa/edge"
    assert peer_identity({"subjectAltName": (("IP Address", "10.0.0.1"), ("DNS", "edge.example"))}) == "edge.example"
    assert peer_identity({"subject": ((("commonName", "edge"),),)}) == ""  # a CN is not an identity
    assert peer_identity(None) == peer_identity({}) == ""


def pair(tmp_path: Path, ca: trustme.CA) -> tuple[Path, Path]:
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(leaf.cert_chain_pems[0].bytes())
    key.write_bytes(leaf.private_key_pem.bytes())
    return cert, key


def test_unusable_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = pair(tmp_path, ca)
    with pytest.raises(ConfigError, match="no such file") as missing:
        build_context(TlsFiles(cert=tmp_path / "absent.pem", key=key))
    assert str(tmp_path / "absent.pem") in missing.value.describe()
    other_key = tmp_path / "other.key"
    other_key.write_bytes(ca.issue_cert("127.0.0.1").private_key_pem.bytes())
    with pytest.raises(ConfigError, match="matching the certificate") as mismatch:
        build_context(TlsFiles(cert=cert, key=other_key))
    assert str(cert) in mismatch.value.describe()
    not_a_ca = tmp_path / "ca.pem"
    not_a_ca.write_text("not PEM\n")
    with pytest.raises(ConfigError, match="client CA bundle") as bad_ca:
        build_context(TlsFiles(cert=cert, key=key, client_ca=not_a_ca))
    assert str(not_a_ca) in bad_ca.value.describe()


def test_a_changed_pair_is_loaded_only_once_it_matches(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = pair(tmp_path, ca)
    reported: list[str] = []
    tls = ReloadingServerContext(
        TlsFiles(cert=cert, key=key, alpn=("h2",)), on_event=lambda event, **fields: reported.append(event)
    )
    first = tls.current
    assert not tls.reload_if_changed()  # nothing changed
    new = ca.issue_cert("127.0.0.1")
    key.write_bytes(new.private_key_pem.bytes())  # the key first: it does not match the certificate yet
    assert not tls.reload_if_changed() and tls.current is first
    cert.write_bytes(new.cert_chain_pems[0].bytes())
    assert tls.reload_if_changed() and tls.current is not first
    assert reported == ["tls_reload_failed", "tls_reloaded"]
