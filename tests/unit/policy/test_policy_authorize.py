"""``--authorize-node`` rules with captures: one rule binds each identity to its own node ids.

The captures' meaning is checked against a regular expression built from the same rule (named
groups in IDENTITY, the captured text escaped into NODE): the expression is the definition, the
matcher is what runs, in linear time, on values a peer chooses.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.commands.cli import main
from pilotfish.policy.authorize import NodeAuthorizer, NodeRule, compile_pattern, glob_match, parse_rule

FLEET = "spiffe://mesh/ns/{ns}/sa/{sa}={sa}"


def test_one_capture_rule_lets_each_identity_claim_only_its_own_node_id() -> None:
    authorizer = NodeAuthorizer([parse_rule(FLEET)])
    assert authorizer.refusal("spiffe://mesh/ns/edge/sa/edge-a", "edge-a") is None
    assert authorizer.refusal("spiffe://mesh/ns/edge/sa/edge-b", "edge-b") is None
    reason = authorizer.refusal("spiffe://mesh/ns/edge/sa/edge-a", "edge-b")
    assert reason is not None and "may not claim it" in reason and "'edge-a'" in reason  # what it may claim
    for node in ("edge-a-1", "edge-", "edge-a/x", ""):
        assert authorizer.refusal("spiffe://mesh/ns/edge/sa/edge-a", node) is not None, node
    # A capture takes a whole non-empty run without '/': no segment more, none less, none empty.
    for identity in ("spiffe://mesh/ns/edge/sa/", "spiffe://mesh/ns//sa/edge-a", "spiffe://mesh/ns/edge/sa/a/b"):
        reason = authorizer.refusal(identity, "edge-a")
        assert reason is not None and "no --authorize-node rule" in reason, identity


def test_captures_sit_beside_text_and_stars_and_are_matched_literally() -> None:
    authorizer = NodeAuthorizer(
        [parse_rule("spiffe://mesh/ns/{ns}/sa/{sa}={ns}.{sa}-*"), parse_rule("{host}.mesh.example={host}/{host}")]
    )
    assert authorizer.refusal("spiffe://mesh/ns/prod/sa/web", "prod.web-7") is None
    assert authorizer.refusal("spiffe://mesh/ns/prod/sa/web", "prod.web-") is None  # '*' may take nothing
    assert authorizer.refusal("spiffe://mesh/ns/prod/sa/web", "dev.web-7") is not None
    assert authorizer.refusal("spiffe://mesh/ns/prod/sa/web", "prod.api-7") is not None
    assert authorizer.refusal("edge.mesh.example", "edge/edge") is None
    assert authorizer.refusal("edge.mesh.example", "edge/edgy") is not None
    assert authorizer.refusal(".mesh.example", "/") is not None  # the capture is never empty
    # What a certificate names is text: a '*' in it is no wildcard in the node id.
    assert authorizer.refusal("*.mesh.example", "*/*") is None
    assert authorizer.refusal("*.mesh.example", "a/b") is not None
    # Rules without captures keep their meaning beside them.
    plain = NodeAuthorizer([parse_rule("spiffe://mesh/ns/*/sa/edge=edge-*"), parse_rule(FLEET)])
    assert plain.refusal("spiffe://mesh/ns/x/sa/edge", "edge-9") is None
    assert plain.refusal("spiffe://mesh/ns/x/sa/edge", "edge") is None  # by the capture rule


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ("spiffe://mesh/ns/{sa}/sa/{sa}={sa}", ["{sa}", "twice"]),
        ("spiffe://mesh/ns/{ns}/sa/{sa}={name}", ["{name}", "not defined", "{ns}, {sa}"]),
        ("spiffe://mesh/ns/*/sa/edge={sa}", ["{sa}", "not defined", "none"]),
        ("spiffe://mesh/ns/{ns}-{sa}={sa}", ["two captures", "ambiguous"]),
        ("spiffe://mesh/ns/{ns}*={ns}", ["a capture and *"]),
        ("spiffe://mesh/ns/{1st}={1st}", ["'{1st}' is not a capture"]),
        ("spiffe://mesh/ns/{ns={ns}", ["braces are reserved"]),
    ],
)
def test_a_malformed_capture_is_refused_at_start_naming_the_flag_and_capture(
    rule: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as caught:
        parse_rule(rule)
    for word in words:
        assert word in str(caught.value)
    with pytest.raises(ValueError):
        NodeRule(*rule.rsplit("=", 1))  # the settings' own type refuses it too (serve from Python)
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    with pytest.raises(SystemExit) as exited:  # a usage error: nothing is started
        main(["serve", "--snapshot", str(snapshot), "--xds", "127.0.0.1:0", "--admin", "off", "--authorize-node", rule])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "argument --authorize-node" in error and all(word in error for word in words), error


def _reference(rule: NodeRule, identity: str, node_id: str) -> bool:
    """The definition: IDENTITY as an expression with named groups, NODE with what they took."""

    def expression(pattern: str, captured: dict[str, str] | None) -> str:
        out = []
        for piece in re.split(r"(\{[A-Za-z_][A-Za-z0-9_]*\}|\*)", pattern):
            if piece == "*":
                out.append("[^/]*")
            elif piece.startswith("{") and piece.endswith("}") and len(piece) > 2:
                name = piece[1:-1]
                out.append(f"(?P<{name}>[^/]+)" if captured is None else re.escape(captured[name]))
            else:
                out.append(re.escape(piece))
        return "".join(out)

    matched = re.fullmatch(expression(rule.identity, None), identity)
    return matched is not None and re.fullmatch(expression(rule.node, matched.groupdict()), node_id) is not None


_RULES = [
    parse_rule(text)
    for text in (
        FLEET,
        "spiffe://mesh/ns/{ns}/sa/{sa}={ns}.{sa}-*",
        "a{x}b/*={x}*{x}",
        "{h}.m={h}/*/{h}",
        "*a*/{s}={s}a*",
    )
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(_RULES),
    st.text("ab/.-*", max_size=12),
    st.text("ab/.-*", max_size=12),
    st.sampled_from(["", "spiffe://mesh/ns/", "spiffe://mesh/ns/x/sa/"]),
)
def test_captures_agree_with_their_definition(rule: NodeRule, identity: str, node_id: str, prefix: str) -> None:
    identity = prefix + identity
    allowed = NodeAuthorizer([rule]).refusal(identity, node_id) is None
    assert allowed == _reference(rule, identity, node_id), (rule, identity, node_id)


@pytest.mark.timeout(60)
def test_a_hostile_node_id_and_identity_of_100000_characters_are_matched_at_once() -> None:
    # As regular expressions, these patterns backtrack for a time that grows as a power of the
    # length; the matcher takes a few passes over each value.
    rules = [
        parse_rule("spiffe://mesh/ns/{ns}/sa/{sa}={sa}*a*a*a*a*a*a*a*a*c*{ns}"),
        parse_rule("spiffe://mesh/ns/*a*a*a*a*a*a*a*a*c/sa/{sa}={sa}"),
    ]
    authorizer = NodeAuthorizer(rules)
    long_identity = "spiffe://mesh/ns/" + "a" * 50_000 + "/sa/" + "a" * 50_000
    long_node = "a" * 100_000
    cases = [
        (long_identity, long_node),  # the identity matches rule 1; the node id almost matches
        ("spiffe://mesh/ns/x/sa/" + "a" * 100_000, "a" * 100_000 + "x"),
        ("spiffe://mesh/ns/" + "a" * 100_000 + "/sa/e", "e"),  # rule 2's IDENTITY almost matches
        ("spiffe://mesh/ns/x/sa/e", "/" * 100_000),  # many segments
    ]
    for identity, node in cases:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            reason = authorizer.refusal(identity, node)
            best = min(best, time.perf_counter() - started)
            assert reason is not None
        print(
            f"refusing a {len(node):,}-character node id for a {len(identity):,}-character identity: "
            f"{best * 1e6:.0f} us"
        )
        assert best < 0.05  # quadratic matching would take seconds; exponential, forever
    # And the matcher still says yes where it should, as fast.
    assert authorizer.refusal(long_identity, "a" * 50_008 + "c" + "a" * 50_000) is None


@settings(max_examples=500, deadline=None)
@given(st.text("ab/*", max_size=8), st.text("ab/", max_size=10))
def test_glob_match_agrees_with_the_pattern_expression(pattern: str, value: str) -> None:
    assert glob_match(pattern, value) == (compile_pattern(pattern).fullmatch(value) is not None)


def test_node_rules_bind_identities_to_node_ids() -> None:
    authorizer = NodeAuthorizer(
        [parse_rule("spiffe://mesh/ns/*/sa/edge=edge-*"), parse_rule("ingress.mesh.example=ingress")]
    )
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
