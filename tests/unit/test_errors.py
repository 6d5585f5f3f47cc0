"""Errors by who must act (pilotfish.errors): a configuration error names its source and every
problem, each with where it is; a peer's value repeated in a message is shortened, keeping the start
and the end (where Envoy puts the reason of a NACK)."""

from __future__ import annotations

import pytest

from pilotfish.errors import ConfigError, PeerError, PilotfishError, Problem, shorten


def test_a_config_error_names_its_source_and_every_problem_with_where_it_is() -> None:
    error = ConfigError(
        "snapshot.yaml",
        [
            Problem("clusters[0] (name 'web').connect_timeout", "must be greater than 0s"),
            Problem("", "the file is empty; write clusters: [] for none"),
        ],
    )
    assert (
        str(error)
        == error.describe()
        == (
            "snapshot.yaml: 2 problem(s)\n"
            "  clusters[0] (name 'web').connect_timeout: must be greater than 0s\n"
            "  the file is empty; write clusters: [] for none"
        )
    )
    assert error.source == "snapshot.yaml" and len(error.problems) == 2
    assert isinstance(error, PilotfishError) and issubclass(PeerError, PilotfishError)
    with pytest.raises(ConfigError, match="1 problem"):
        raise ConfigError("api", [Problem("services.web", "unknown field")])


def test_shorten_keeps_the_tail_asked_for_and_never_more_than_the_limit() -> None:
    reason = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout)"
    nack = "dump " * 100_000 + reason
    kept = shorten(nack, 300, tail=len(reason))
    assert kept.endswith("..." + reason) and "(500,074 characters)" in kept
    assert kept.startswith("dump dump") and len(kept) < 300 + 40
    assert shorten(nack, 10, tail=50).endswith("..." + nack[-10:])  # the tail is at most the limit
    assert shorten("x" * 100, 10, tail=0) == "xxxxxxxxxx... (100 characters) ..."
    assert shorten("exactly ten", 11) == "exactly ten"


def test_shorten_keeps_start_end_and_says_how_long() -> None:
    assert shorten("short") == "short"
    url = "type.googleapis.com/" + "x" * 17_000_000
    short = shorten(url)
    assert len(short) < 250 and short.startswith("type.googleapis.com/xx") and "17,000,020 characters" in short
