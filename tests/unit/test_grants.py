"""SDS grants (``--grant-secret``): parsing, matching, and the options they need."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pilotfish.cli import main
from pilotfish.server.grants import SecretGrant, SecretGrants, Subject, parse_grant

EDGE = "spiffe://mesh/ns/prod/sa/edge"


def test_a_grant_is_a_secret_pattern_and_an_identity_or_node_pattern() -> None:
    assert parse_grant("edge-*-cert=identity:spiffe://mesh/ns/*/sa/edge") == SecretGrant(
        "edge-*-cert", Subject.IDENTITY, "spiffe://mesh/ns/*/sa/edge")
    assert parse_grant("edge-cert=node:edge-*") == SecretGrant("edge-cert", Subject.NODE, "edge-*")
    # The split is at the first '=identity:' or '=node:': a secret name or an identity may hold '='.
    assert parse_grant("a=b=node:n=1") == SecretGrant("a=b", Subject.NODE, "n=1")
    for bad in ("edge-cert", "edge-cert=edge-*", "edge-cert=cluster:edge", "=node:edge", "edge-cert=node:",
                "edge-cert=identity:"):
        with pytest.raises(ValueError, match="SECRET=identity:PATTERN"):
            parse_grant(bad)


def test_a_secret_is_allowed_only_by_a_grant_naming_it_and_the_proxy() -> None:
    grants = SecretGrants(map(parse_grant, (
        f"edge-cert=identity:{EDGE}",
        "edge-*-key=identity:spiffe://mesh/ns/*/sa/edge",
        "api-cert=node:api-*",
    )))
    assert grants.allows("edge-cert", identity=EDGE, node_id="anything")
    assert grants.allows("edge-1-key", identity=EDGE, node_id="")
    assert grants.allows("api-cert", identity="", node_id="api-7")
    refused = [
        ("edge-cert", "spiffe://mesh/ns/prod/sa/api", "edge-1"),  # another identity
        ("edge-cert", "", EDGE),  # a node id is not an identity
        ("api-cert", EDGE, "edge-1"),  # granted to other node ids
        ("edge-1/x-key", EDGE, ""),  # '*' stops at '/', in secret names too
        ("edge-1-key", "spiffe://mesh/ns/a/b/sa/edge", ""),  # ... and in identities
        ("api-cert", "", "api-7/x"),  # ... and node ids
        ("web-cert", EDGE, "api-1"),  # no grant names it
        ("edge-cert2", EDGE, ""),  # a pattern matches the whole name
    ]
    for secret, identity, node in refused:
        assert not grants.allows(secret, identity=identity, node_id=node), (secret, identity, node)
    granted, denied = grants.for_proxy(identity=EDGE, node_id="api-1").split(["web-cert", "edge-cert", "api-cert"])
    assert (granted, denied) == (["api-cert", "edge-cert"], ["web-cert"])


def test_nothing_proven_or_claimed_matches_even_a_bare_star() -> None:
    grants = SecretGrants([parse_grant("*=identity:*"), parse_grant("*=node:*")])
    assert grants.allows("edge-cert", identity="edge.mesh", node_id="")
    assert grants.allows("edge-cert", identity="", node_id="edge-1")
    # No certificate and no node id: nothing to match, whatever the pattern.
    assert not grants.allows("edge-cert", identity="", node_id="")


def test_no_grants_allow_nothing_and_name_the_uncovered_secrets() -> None:
    assert not SecretGrants().allows("edge-cert", identity=EDGE, node_id="edge-1")
    grants = SecretGrants([parse_grant("edge-*=node:edge-1")])
    assert grants.ungranted(["web-cert", "edge-cert", "api-cert"]) == ["api-cert", "web-cert"]
    assert [str(g) for g in grants.of(Subject.NODE)] == ["edge-*=node:edge-1"]
    assert grants.of(Subject.IDENTITY) == []


def test_cli_refuses_identity_grants_without_mtls_and_malformed_grants(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    assert main(["serve", "--snapshot", str(snapshot), "--grant-secret", f"edge-cert=identity:{EDGE}"]) == 2
    assert "needs mTLS" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--snapshot", str(snapshot), "--grant-secret", "edge-cert=edge-1"])
    assert exited.value.code == 2
    assert "SECRET=identity:PATTERN" in capsys.readouterr().err
