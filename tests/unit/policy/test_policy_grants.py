"""SDS grants (``--grant-secret``, ``--grants-file``): parsing, matching, the options they need,
and the grants file followed as it changes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from pilotfish.commands.cli import main
from pilotfish.errors import ConfigError
from pilotfish.events import EventLog
from pilotfish.policy.grants import MAX_GRANTS, GrantsFile, SecretGrant, SecretGrants, Subject, parse_grant

EDGE = "spiffe://mesh/ns/prod/sa/edge"


def test_a_grant_is_a_secret_pattern_and_an_identity_or_node_pattern() -> None:
    assert parse_grant("edge-*-cert=identity:spiffe://mesh/ns/*/sa/edge") == SecretGrant(
        "edge-*-cert", Subject.IDENTITY, "spiffe://mesh/ns/*/sa/edge"
    )
    assert parse_grant("edge-cert=node:edge-*") == SecretGrant("edge-cert", Subject.NODE, "edge-*")
    # The split is at the first '=identity:' or '=node:': a secret name or an identity may hold '='.
    assert parse_grant("a=b=node:n=1") == SecretGrant("a=b", Subject.NODE, "n=1")
    for bad in (
        "edge-cert",
        "edge-cert=edge-*",
        "edge-cert=cluster:edge",
        "=node:edge",
        "edge-cert=node:",
        "edge-cert=identity:",
    ):
        with pytest.raises(ValueError, match="SECRET=identity:PATTERN"):
            parse_grant(bad)


def test_a_secret_is_allowed_only_by_a_grant_naming_it_and_the_proxy() -> None:
    grants = SecretGrants(
        map(
            parse_grant,
            (
                f"edge-cert=identity:{EDGE}",
                "edge-*-key=identity:spiffe://mesh/ns/*/sa/edge",
                "api-cert=node:api-*",
            ),
        )
    )
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
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    assert main(["serve", "--snapshot", str(snapshot), "--grant-secret", f"edge-cert=identity:{EDGE}"]) == 2
    assert "needs mTLS" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--snapshot", str(snapshot), "--grant-secret", "edge-cert=edge-1"])
    assert exited.value.code == 2
    assert "SECRET=identity:PATTERN" in capsys.readouterr().err


# -- the grants file -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def test_a_grants_file_holds_grants_in_the_flags_grammar(tmp_path: Path) -> None:
    as_yaml = tmp_path / "grants.yaml"
    as_yaml.write_text(f"grants:\n  - edge-cert=identity:{EDGE}\n  - 'ingress-*=node:ingress-*'\n")
    assert GrantsFile(as_yaml, mtls=True).value == (
        parse_grant(f"edge-cert=identity:{EDGE}"),
        parse_grant("ingress-*=node:ingress-*"),
    )
    as_json = tmp_path / "grants.json"
    as_json.write_text(json.dumps({"grants": []}))
    assert GrantsFile(as_json, mtls=False).value == ()  # an empty list grants nothing


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("grants:\n  - edge-cert=edge-1\n", "grants[0]", "SECRET=identity:PATTERN"),
        ("grants:\n  - a=node:x\n  - 7\n", "grants[1]", "not int"),
        (f"grants:\n  - edge-cert=identity:{EDGE}\n", "grants[0]", "need mTLS"),  # (mtls=False below)
        ("grants: edge-cert=node:x\n", "grants", "a list"),
        ("grant:\n  - a=node:x\n", "grant", "unknown setting"),
        ("- a=node:x\n", "", "must be a mapping"),
        ("", "", "write 'grants: []'"),
        ("grants: [\n", "line 2", "invalid YAML"),
        ("grants:\n" + "  - a=node:x\n" * (MAX_GRANTS + 1), "grants", f"at most {MAX_GRANTS}"),
    ],
)
def test_a_bad_grants_file_at_start_is_an_error_naming_the_file_and_entry(
    tmp_path: Path, text: str, where: str, words: str
) -> None:
    path = tmp_path / "grants.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        GrantsFile(path, mtls=False)
    described = caught.value.describe()
    assert described.startswith(f"{path}: ") and f"  {where}" in described and words in described, described


def test_an_edited_grants_file_applies_and_a_bad_edit_keeps_the_last_good_grants(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock, log = tmp_path / "grants.yaml", Clock(), tmp_path / "events.jsonl"
    path.write_text("grants:\n  - edge-cert=node:edge-1\n")
    events = EventLog(log)
    grants = GrantsFile(path, mtls=False, events=events, clock=clock)
    changes: list[tuple[SecretGrant, ...]] = []
    grants.on_change = changes.append

    path.write_text("grants:\n  - edge-cert=node:edge-*\n")
    assert grants.current() == (parse_grant("edge-cert=node:edge-1"),)  # looked at once a second
    clock.time += 1.0
    assert grants.current() == (parse_grant("edge-cert=node:edge-*"),)
    assert changes == [grants.value]

    path.write_text("grants:\n  - edge-cert=node:edge-*\n  - api-cert=api-1\n")  # a bad edit
    for _ in range(3):
        clock.time += 1.0
        assert grants.current() == (parse_grant("edge-cert=node:edge-*"),)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, caplog.text  # once per version of the file
    assert str(path) in errors[0].getMessage() and "grants[1]" in errors[0].getMessage()
    assert "the last good grants stay in force" in errors[0].getMessage()
    assert grants.problem is not None and changes == [grants.value]

    path.write_text("grants: []\n")  # fixed
    clock.time += 1.0
    assert grants.current() == () and grants.problem is None and changes[-1] == ()
    events.close()
    recorded = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in recorded] == ["grants_loaded", "grants_error", "grants_loaded"]
    assert recorded[1]["file"] == str(path) and "grants[1]" in recorded[1]["reason"]
    assert [e.get("grants") for e in recorded] == [1, None, 0]


def test_serve_stops_at_start_on_a_bad_grants_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot, grants = tmp_path / "snap.yaml", tmp_path / "grants.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    grants.write_text("grants:\n  - edge-cert=edge-1\n")
    assert (
        main(
            [
                "serve",
                "--snapshot",
                str(snapshot),
                "--xds",
                "127.0.0.1:0",
                "--admin",
                "off",
                "--event-loop",
                "asyncio",
                "--grants-file",
                str(grants),
            ]
        )
        == 1
    )
    error = capsys.readouterr().err
    assert f"{grants}: 1 problem(s)" in error and "grants[0]" in error, error
