"""``pilotfish wait``'s verdict, ``pilotfish status``'s table, ``pilotfish rollout``'s and ``pilotfish
plan``'s text, from admin API answers; the token the commands send."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pilotfish.commands.operate import (
    TOKEN_VARIABLE,
    admin_token,
    fleet_verdict,
    laggards,
    plan_text,
    rollout_text,
    status_table,
    unhealthy,
)


def proxy(node: str, *, protocol: str = "sotw", group: str = "default", **types: dict[str, Any]) -> dict[str, Any]:
    return {
        "node": node,
        "cluster": "edge",
        "group": group,
        "user_agent": "envoy",
        "user_agent_version": "1.40.0",
        "protocol": protocol,
        "connected": True,
        "types": types,
    }


def synced(version: str) -> dict[str, Any]:
    return {"state": "SYNCED", "sent_version": version, "acked_version": version}


def snapshots(label: str = "v7", *, pending: bool = False, **versions: str) -> dict[str, Any]:
    return {
        "groups": {"default": {"label": label, "types": {t: {"version": v} for t, v in versions.items()}}},
        "pending": pending,
        "held": None,
    }


def test_done_when_every_proxy_acked_its_groups_current_versions() -> None:
    verdict = laggards(
        [proxy("a", CDS=synced("c2"), EDS=synced("e2")), proxy("b", CDS=synced("c2"))], snapshots(CDS="c2", EDS="e2")
    )
    assert verdict.done and verdict.proxies == 2 and not verdict.problems


def test_a_proxy_behind_stale_or_nacked_is_named_with_the_reason() -> None:
    nacked = {
        "state": "NACKED",
        "sent_version": "c2",
        "acked_version": "c1",
        "nack": {"version": "c2", "message": "dump of the cluster " * 50 + "value must be greater than 0s"},
    }
    stale = {"state": "STALE", "sent_version": "c2", "acked_version": "c1", "stale_for": 4.2}
    verdict = laggards(
        [proxy("a", CDS=nacked), proxy("b", CDS=stale), proxy("c", CDS=synced("c1"))], snapshots(CDS="c2")
    )
    assert not verdict.done and verdict.rejected
    # A long message keeps its start (where Envoy names the resource) and its end (the reason).
    assert verdict.problems[0].startswith("a: CDS NACKED c2: dump of the cluster")
    assert verdict.problems[0].endswith("value must be greater than 0s") and len(verdict.problems[0]) < 400
    assert verdict.problems[1] == "b: CDS STALE c2 for 4.2s"
    assert verdict.problems[2] == "c: CDS at c1, not c2"


def test_a_delta_proxy_that_acked_all_it_was_sent_is_current() -> None:
    # Incremental xDS sends nothing when none of a proxy's resources changed.
    assert laggards([proxy("a", protocol="delta", EDS=synced("e1"))], snapshots(EDS="e2")).done


def test_a_version_not_yet_served_a_pending_build_and_too_few_proxies_keep_waiting() -> None:
    ready = [proxy("a", CDS=synced("c2"))]
    verdict = laggards(ready, snapshots("v7", CDS="c2"), version="v8")
    assert not verdict.done and not verdict.rejected and "served v7, not v8" in verdict.problems[0]
    assert not laggards(ready, snapshots(CDS="c2", pending=True)).done
    assert laggards(ready, snapshots(CDS="c2", pending=True), version="v7").done  # v7 is served: done
    verdict = laggards(ready, snapshots(CDS="c2"), min_proxies=2)
    assert not verdict.done and verdict.problems == ("1 of at least 2 proxies connected",)
    assert not laggards([], snapshots(CDS="c2"), min_proxies=1).done
    assert laggards([], snapshots(CDS="c2")).done


def test_not_sent_types_do_not_count() -> None:
    assert laggards(
        [proxy("a", CDS=synced("c2"), SDS={"state": "NOT_SENT", "sent_version": None, "acked_version": None})],
        snapshots(CDS="c2", SDS="s1"),
    ).done


def test_the_table_has_a_row_per_proxy_and_a_line_per_nack() -> None:
    nacked = {
        "state": "NACKED",
        "sent_version": "3",
        "acked_version": "2",
        "nack": {"version": "3", "message": "ClusterValidationError.ConnectTimeout"},
    }
    table = status_table([proxy("edge-1", CDS=nacked, EDS=synced("2")), proxy("edge-2", CDS=synced("3"))])
    header, first, second, blank, nack = table.splitlines()
    assert header.split() == ["NAME", "CLUSTER", "GROUP", "CDS", "EDS", "LDS", "RDS", "SDS", "AGENT"]
    assert first.split() == [
        "edge-1",
        "edge",
        "default",
        "NACKED",
        "3",
        "SYNCED",
        "2",
        "-",
        "-",
        "-",
        "envoy",
        "1.40.0",
    ]
    assert second.split()[3:6] == ["SYNCED", "3", "-"]
    assert blank == "" and nack == "edge-1 rejected CDS 3: ClusterValidationError.ConnectTimeout"


def progress(version: str, proxies: int, current: int, nacked: int = 0) -> dict[str, Any]:
    return {"version": version, "proxies": proxies, "current": current, "acked": current, "nacked": nacked}


def fleet(
    label: str = "v7", *, connected: dict[str, int] | None = None, pending: bool = False, **types: dict[str, Any]
) -> dict[str, Any]:
    return {
        "groups": {"default": {"label": label, "types": types}},
        "connected": connected or {"default": 2},
        "pending": pending,
        "held": None,
    }


def test_the_fleet_verdict_reads_the_counts_of_v1_snapshots() -> None:
    assert fleet_verdict(fleet(CDS=progress("c2", 2, 2), EDS=progress("e2", 2, 2))).done
    behind = fleet_verdict(fleet(CDS=progress("c2", 2, 1)))
    assert not behind.done and not behind.rejected
    assert behind.problems == ("node group 'default': CDS c2: 1 of 2 proxies have it, 0 rejected it",)
    assert fleet_verdict(fleet(CDS=progress("c2", 2, 1, nacked=1))).rejected
    assert not fleet_verdict(fleet(CDS=progress("c2", 2, 2), pending=True)).done
    assert not fleet_verdict(fleet("v7", CDS=progress("c2", 2, 2)), version="v8").done
    assert fleet_verdict(fleet("v8", CDS=progress("c2", 2, 2), pending=True), version="v8").done
    assert not fleet_verdict(fleet(CDS=progress("c2", 2, 2)), min_proxies=3).done
    orphans = fleet_verdict(fleet(connected={"default": 1, "mesh": 1}, CDS=progress("c2", 1, 1)))
    assert orphans.problems == ("node group 'mesh': nothing is published for it",)


def test_the_token_comes_from_the_file_then_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("  file-token \nsecond line\n")
    assert admin_token(file, {TOKEN_VARIABLE: "env-token"}) == "file-token"
    assert admin_token(None, {TOKEN_VARIABLE: " env-token\n"}) == "env-token"
    assert admin_token(None, {TOKEN_VARIABLE: ""}) is None
    assert admin_token(None, {}) is None
    file.write_text("\n")
    with pytest.raises(ValueError, match=r"--token-file .*token: the file is empty"):
        admin_token(file, {})
    with pytest.raises(OSError):
        admin_token(tmp_path / "missing", {})


def rollout(**fields: Any) -> dict[str, Any]:
    """A ``/v1/rollout`` answer: a rollout of c2 over b1 in its second wave of four, at time 1000."""
    status: dict[str, Any] = {
        "now": 1000.0,
        "phase": "acking",
        "baseline": "b1b1b1b1b1b1b1b1",
        "candidate": "c2c2c2c2c2c2c2c2",
        "wave": "5%",
        "wave_index": 1,
        "wave_started": 950.0,
        "paused": None,
        "deadline": 980.0 + 30,
        "waiting": 0,
        "waiting_proxies": [],
        "bake_ends": None,
        "health": None,
        "held": [],
        "held_count": 0,
        "proxies": 120,
        "on_candidate": 7,
        "waves": ["canary", "5%", "25%", "100%"],
        "types": ["CDS", "LDS", "RDS", "SDS"],
    }
    status.update(fields)
    return status


def test_the_rollout_text_says_what_waits_for_what() -> None:
    waiting = [f"edge-{n}" for n in range(10)]
    text = rollout_text(rollout(waiting=14, waiting_proxies=waiting, paused="operator"))
    assert text.splitlines() == [
        "rollout  c2c2c2c2c2c2 over baseline b1b1b1b1b1b1",
        "phase    acking, wave 5% (2 of 4: canary, 5%, 25%, 100%), for 50s",
        "paused   by the operator: no further wave starts; `pilotfish rollout resume` goes on",
        f"waiting  14 proxies to ACK the candidate (ACK timeout in 10s): {', '.join(waiting)} and 4 more",
        "proxies  7 of 120 on the candidate",
    ]
    health = {
        "verdict": "pass",
        "reason": "",
        "requests": 1500,
        "errors": 3,
        "error_ratio": 0.002,
        "baseline_requests": 30000,
        "baseline_error_ratio": 0.001,
    }
    baking = rollout_text(rollout(phase="baking", deadline=1012.0, bake_ends=1012.0, health=health))
    assert "baking   the bake ends in 12s\n" in baking
    assert "health   error ratio 0.20 % of 1,500 requests; baseline 0.10 % of 30,000\n" in baking
    over = rollout_text(rollout(phase="baking", deadline=None, bake_ends=990.0, paused="12 requests of at least 100"))
    assert "paused   12 requests of at least 100; `pilotfish rollout promote` goes on, `abort` rolls back" in over
    assert "baking   the bake ended 10s ago: the next wave waits for the pause" in over


def test_the_rollout_text_when_idle_lists_the_newest_held_candidates() -> None:
    held = [
        {"candidate": f"h{n}" * 8, "reason": f"wave canary: edge-{n} NACKed CDS:  {'x' * 400}", "at": 1000.0 - 60 * n}
        for n in range(10)
    ]
    lines = rollout_text(rollout(phase="idle", candidate=None, wave=None, held=held, held_count=12)).splitlines()
    assert lines[:4] == [
        "rollout  none in progress: every proxy is served the baseline b1b1b1b1b1b1",
        "waves    canary, 5%, 25%, 100% (types CDS, LDS, RDS, SDS)",
        "proxies  120 connected",
        "held     12 candidates, never served again (the newest first):",
    ]
    assert lines[4].startswith("  h0h0h0h0h0h0  0s ago  wave canary: edge-0 NACKed CDS: xxx") and lines[4].endswith(
        "..."
    )
    assert len(lines[4]) < 330 and lines[6].startswith("  h2h2h2h2h2h2  2 min ago  ")
    assert lines[9:] == ["  ... and 7 older (--json lists the newest 10)"]
    first = rollout_text(rollout(phase="idle", candidate=None, baseline=None, wave=None))
    assert first.splitlines()[0] == "rollout  none yet: nothing is published"


def test_a_change_rolled_back_by_the_rollout_is_rejected_though_everyone_has_the_baseline() -> None:
    everyone = fleet(CDS=progress("c1", 2, 2))  # every proxy has what it is served: the baseline again
    assert fleet_verdict({**everyone, "rollout": {"latest_held": None}}).done
    held = fleet_verdict({**everyone, "rollout": {"latest_held": "wave canary: c-1 NACKed CDS: no"}})
    assert held.rejected and not held.done
    assert held.problems == ("the change was rolled back and is held: wave canary: c-1 NACKed CDS: no",)


# -- pilotfish plan ------------------------------------------------------------------------------------


def a_plan(**changes: Any) -> dict[str, Any]:
    """A plan as POST /v1/plan answers it: one group whose CDS changes."""
    cds = {
        "added": ["new"],
        "removed": ["gone"],
        "changed": [
            {
                "name": "web",
                "changes": [
                    {"path": "connect_timeout", "old": "1s", "new": "2s"},
                    {"path": "circuit_breakers", "old": None, "new": {"thresholds": [{"max_connections": 9}]}},
                ],
                "changes_left_out": 3,
            }
        ],
        "counts": {"added": 201, "removed": 1, "changed": 1},
        "left_out": {"added": 200, "removed": 0, "changed": 0},
    }
    plan: dict[str, Any] = {
        "verdict": "publish",
        "published": True,
        "offline": False,
        "sources": "new.yaml",
        "problems": [],
        "waiting_for": [],
        "groups": {
            "default": {
                "changed": True,
                "before": "aaaabbbbccccdddd",
                "after": "1111222233334444",
                "proxies": 3,
                "types": {"CDS": cds},
            },
            "canary": {"changed": False, "before": "x", "after": "x", "proxies": 1, "types": {}},
        },
        "guard": {
            "enabled": True,
            "hold": False,
            "reasons": [],
            "counts": {"clusters": {"before": 3, "after": 3, "removed": 1}},
        },
        "rollout": {
            "decision": "roll out",
            "types": ["CDS"],
            "supersedes": None,
            "waves": [{"name": "canary", "proxies": 1}, {"name": "100%", "proxies": 2}],
            "paused": False,
        },
    }
    plan.update(changes)
    return plan


def test_a_plan_prints_each_group_and_type_with_its_changes_then_the_verdicts() -> None:
    lines = plan_text(a_plan()).splitlines()
    assert lines[:11] == [
        "node group default (3 proxies connected): aaaabbbbcccc -> 111122223333",
        "  CDS: 201 added, 1 removed, 1 changed",
        "    + new",
        "    - gone",
        "    ~ web",
        '        connect_timeout: "1s" -> "2s"',
        '        circuit_breakers: (none) -> {"thresholds": [{"max_connections": 9}]}',
        "        ... and 3 more changes",
        "    ... and 200 more added (not listed)",
        "node group canary (1 proxy connected): no change",
        "validation  ok",
    ]
    assert lines[11:] == [
        "guard       would not hold it (removes 1 of 3 clusters)",
        "rollout     in waves (CDS changes): canary (1 proxy), 100% (2 proxies)",
        "verdict     would be published",
    ]


def test_a_plan_says_why_it_would_not_be_published() -> None:
    refused = plan_text(
        a_plan(
            verdict="refuse", groups={}, guard=None, rollout=None, problems=[{"where": "clusters[0]", "message": "bad"}]
        )
    )
    assert refused.splitlines() == [
        "validation  1 problem(s) in new.yaml:",
        "  clusters[0]: bad",
        "verdict     would be REFUSED (the last good snapshot keeps serving)",
    ]
    held = plan_text(
        a_plan(
            verdict="hold",
            guard={"enabled": True, "hold": True, "reasons": ["it removes every cluster (3)"], "counts": {}},
        )
    )
    assert "guard       would HOLD it: it removes every cluster (3) (`pilotfish confirm` would publish it)" in held
    assert "HELD by the blast-radius guard" in held
    unchanged = plan_text(a_plan(verdict="no change"))
    assert unchanged.splitlines() == [
        "validation  ok",
        "verdict     no change: the server would serve what it serves now",
    ]
    waiting = plan_text(a_plan(verdict="wait", waiting_for=["etcd at 127.0.0.1:2379"]))
    assert "waiting     for etcd at 127.0.0.1:2379: nothing is published before they report" in waiting


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        (None, "rollout     none (serve runs no --rollout): every proxy would get it at once"),
        ({"decision": "both", "types": []}, "rollout     all at once: only types that do not roll out change"),
        ({"decision": "initial"}, "rollout     all at once: the first change"),
        ({"decision": "unchanged"}, "rollout     the candidate already rolling out"),
        (
            {"decision": "baseline", "supersedes": "3f2a9c1d0e4b5a6c"},
            "the rollout of 3f2a9c1d0e4b in progress would be superseded",
        ),
        (
            {"decision": "held", "held": "wave canary: c-1 NACKed CDS"},
            "NOT SERVED: this change was rolled back and is held (wave canary: c-1 NACKed CDS)",
        ),
        (
            {
                "decision": "roll out",
                "types": ["CDS", "LDS"],
                "supersedes": "77",
                "paused": True,
                "waves": [{"name": "100%", "proxies": 0}],
            },
            "in waves (CDS, LDS changes): 100% (0 proxies); the rollout of 77 in progress would be superseded; "
            "its first wave would stay paused",
        ),
    ],
)
def test_each_rollout_decision_is_said_in_a_line(rollout: dict[str, Any] | None, says: str) -> None:
    assert says in plan_text(a_plan(rollout=rollout))


def test_an_offline_plan_says_what_it_leaves_out() -> None:
    text = plan_text(a_plan(offline=True, guard=None, rollout=None), file="new.yaml", against="old.yaml")
    assert text.startswith(
        "offline plan: new.yaml against old.yaml: the diff and the validation only (no guard, rollout or proxies"
    )
    labels = [line.split()[0] for line in text.splitlines() if not line.startswith(" ")]
    assert "guard" not in labels and "rollout" not in labels and labels[-2:] == ["validation", "verdict"]


def test_status_fails_on_a_nack_and_on_stale_past_the_grace_only() -> None:
    def stale(seconds: float) -> dict[str, Any]:
        return {"state": "STALE", "sent_version": "c2", "acked_version": "c1", "stale_for": seconds}

    nacked = {"state": "NACKED", "sent_version": "c2", "acked_version": "c1", "nack": {"version": "c2", "message": "m"}}
    fleet = [proxy("a", CDS=synced("c2")), proxy("b", CDS=stale(10.0)), proxy("c", EDS=stale(45.0), CDS=nacked)]
    assert unhealthy(fleet, stale_grace=30.0) == ["c: CDS NACKED c2", "c: EDS STALE c2 for 45s"]
    assert unhealthy(fleet, stale_grace=60.0) == ["c: CDS NACKED c2"]
    assert unhealthy(fleet[:2], stale_grace=0.0) == ["b: CDS STALE c2 for 10s"]
    assert unhealthy(fleet[:1], stale_grace=0.0) == []
