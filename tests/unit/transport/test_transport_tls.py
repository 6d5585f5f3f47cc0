"""TLS settings: the identity a certificate names, files that cannot be served, the Envoy side."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme
import yaml

from pilotfish.commands.cli import main
from pilotfish.errors import ConfigError
from pilotfish.policy.authorize import NodeAuthorizer, parse_rule
from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap
from pilotfish.transport.tls import ReloadingServerContext, TlsFiles, build_context, peer_identity


def test_identity_is_the_spiffe_uri_else_the_first_dns_name() -> None:
    both = {"subjectAltName": (("DNS", "edge.example"), ("URI", "https://not-spiffe"),
                               ("URI", "spiffe://example/ns/a/sa/edge"))}
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
    tls = ReloadingServerContext(TlsFiles(cert=cert, key=key, alpn=("h2",)),
                                 on_event=lambda event, **fields: reported.append(event))
    first = tls.current
    assert not tls.reload_if_changed()  # nothing changed
    new = ca.issue_cert("127.0.0.1")
    key.write_bytes(new.private_key_pem.bytes())  # the key first: it does not match the certificate yet
    assert not tls.reload_if_changed() and tls.current is first
    cert.write_bytes(new.cert_chain_pems[0].bytes())
    assert tls.reload_if_changed() and tls.current is not first
    assert reported == ["tls_reload_failed", "tls_reloaded"]


def test_bootstrap_checks_the_server_name_and_sends_sni_for_host_names() -> None:
    by_ip = bootstrap(BootstrapSettings(node_id="n", xds="127.0.0.1:18000", tls_ca="/ca.pem"))
    socket = by_ip["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]
    assert "sni" not in socket  # SNI carries no IP addresses
    common = socket["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"] and "tls_certificates" not in common
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}]
    by_name = bootstrap(BootstrapSettings(node_id="n", xds="127.0.0.1:18000", tls_ca="/ca.pem",
                                          tls_server_name="xds.example", tls_cert="/c.pem", tls_key="/k.pem"))
    socket = by_name["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]
    assert socket["sni"] == "xds.example"
    assert socket["common_tls_context"]["tls_certificates"] == [
        {"certificate_chain": {"filename": "/c.pem"}, "private_key": {"filename": "/k.pem"}}]
    plain = bootstrap(BootstrapSettings(node_id="n"))
    assert "transport_socket" not in plain["static_resources"]["clusters"][0]


def test_cli_refuses_incomplete_tls_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    assert main(["serve", "--snapshot", str(snapshot), "--tls-cert", "c.pem"]) == 2
    assert "--tls-key" in capsys.readouterr().err
    assert main(["serve", "--snapshot", str(snapshot), "--client-ca", "ca.pem"]) == 2
    assert "--tls-cert" in capsys.readouterr().err
    assert main(["bootstrap", "--node-id", "n", "--tls-cert", "c.pem", "--tls-key", "k.pem"]) == 2
    assert "--tls-ca" in capsys.readouterr().err
    absent = str(tmp_path / "absent.pem")
    assert main(["serve", "--snapshot", str(snapshot), "--xds", "127.0.0.1:0", "--event-loop", "asyncio",
                 "--tls-cert", absent, "--tls-key", absent]) == 1
    assert f"{absent}: 1 problem(s)\n  no such file" in capsys.readouterr().err


def test_node_rules_bind_identities_to_node_ids() -> None:
    authorizer = NodeAuthorizer([parse_rule("spiffe://mesh/ns/*/sa/edge=edge-*"),
                                 parse_rule("ingress.mesh.example=ingress")])
    assert authorizer.refusal("spiffe://mesh/ns/prod/sa/edge", "edge-1") is None
    assert authorizer.refusal("ingress.mesh.example", "ingress") is None
    refused = {
        ("spiffe://mesh/ns/prod/sa/edge", "ingress"): "may not claim it",
        ("spiffe://mesh/ns/prod/extra/sa/edge", "edge-1"): "no --authorize-node rule",  # '*' stops at '/'
        ("spiffe://mesh/ns/prod/sa/edge", "edge-1/x"): "may not claim it",
        ("ingress.mesh.example", "ingress-2"): "may not claim it",
        ("", "edge-1"): "no verified client certificate",
    }
    for (identity, node), why in refused.items():
        reason = authorizer.refusal(identity, node)
        assert reason is not None and why in reason, (identity, node, reason)
    assert len(authorizer.refusal("", "n" * 100_000) or "") < 400  # a peer's long node id is not echoed whole
    for bad in ("no-equals", "=node", "identity="):
        with pytest.raises(ValueError, match="IDENTITY=NODE"):
            parse_rule(bad)
