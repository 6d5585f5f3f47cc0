"""The rollout over the admin API (``/v1/rollout`` and its commands) and ``pilotfish rollout``: a real
:class:`~pilotfish.rollout.delivery.Delivery` over a real cache, status and event log, served by
:class:`~pilotfish.api.admin.AdminApi` on a real listener (port 0). The proxies are the status's
records (a stream opened, a response sent and ACKed), as the xDS server writes them; one test runs
``serve --rollout`` itself, to see the admin API is given its delivery.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from inprocess import serving as serve_in_process
from test_tls import snapshot_doc

from cluster_snapshots import clusters
from pilotfish.api.admin import MAX_COMMAND_BODY, MAX_REASON, AdminApi
from pilotfish.api.tokens import AdminTokenFile, hash_token
from pilotfish.app import ServeSettings
from pilotfish.app.settings import RolloutFlags
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.commands.operate import AdminClient, rollout_command
from pilotfish.events import EventLog, check_event_log, read_events
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER
from pilotfish.rollout.delivery import HELD_SHOWN, Delivery, candidate_group
from pilotfish.rollout.machine import RolloutSettings
from pilotfish.rollout.waves import parse_waves
from pilotfish.status import NodeInfo, SyncStatus
from pilotfish.transport.site import serve_app

pytestmark = pytest.mark.timeout(60)

CDS = CLUSTER.url
CANARY, EDGE = "c-1", "edge-1"  # waves 'canary=c-*,100%': c-1 is the canary, edge-1 the rest
READER, OPS = "reader-token", "ops-token"


@dataclass
class Fleet:
    """The server's objects and where its admin API listens."""

    admin: str
    status: SyncStatus
    cache: SnapshotCache
    delivery: Delivery | None
    events: EventLog
    log: Path

    def recorded(self, kind: str) -> list[dict[str, Any]]:
        self.events.flush()
        return [event for event in read_events(self.log)[0] if event["event"] == kind]

    def change(self, *names: str) -> None:
        """The reconciler publishes a build of these clusters."""
        assert self.delivery is not None
        self.delivery.publish({DEFAULT_GROUP: clusters(*names)})

    def ack_candidate(self, node: str) -> None:
        """``node`` is sent the candidate's clusters and ACKs them."""
        snapshot = self.cache.snapshot(candidate_group(DEFAULT_GROUP))
        assert snapshot is not None
        version = snapshot.version(CDS)
        assert version is not None
        self.status.sent(node, CDS, version)
        self.status.acked(node, CDS, version)


@asynccontextmanager
async def fleet(
    tmp_path: Path, *, rollout: bool = True, tokens: bool = False, bake: float = 600.0
) -> AsyncIterator[Fleet]:
    """An admin API over a delivery (waves ``canary=c-*,100%``, no health gate) with the proxies
    c-1 and edge-1 connected, and the first change published (the baseline)."""
    log = tmp_path / "events.jsonl"
    events = EventLog(log)
    cache, status = SnapshotCache(), SyncStatus()
    settings = RolloutSettings(waves=parse_waves("canary=c-*,100%"), bake=bake, health=None)
    delivery = Delivery(cache, settings, status=status, events=events) if rollout else None
    token_file = None
    if tokens:
        path = tmp_path / "tokens.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "tokens": {
                        "reader": {"sha256": hash_token(READER), "read": True},
                        "ops": {"sha256": hash_token(OPS), "admin": True},
                    }
                }
            )
        )
        token_file = AdminTokenFile(path, events=events)
    api = AdminApi(status, cache, Reconciler(cache), tokens=token_file, events=events, rollout=delivery)
    runner, address = await serve_app(api.app(), "127.0.0.1:0")
    try:
        running = Fleet(address, status, cache, delivery, events, log)
        for node in (CANARY, EDGE):
            status.stream_opened(node, NodeInfo(cluster="edge", user_agent="envoy"))
        if delivery is not None:
            running.change("web")
        yield running
    finally:
        await runner.cleanup()
        events.close()
    assert not check_event_log(log)


async def call(
    running: Fleet, path: str, *, method: str = "GET", token: str | None = None, **kwargs: Any
) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"http://{running.admin}{path}", headers=headers, **kwargs) as response,
    ):
        return response.status, await response.json()


async def run(command: Callable[..., int], *args: Any, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(command, *args, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


async def test_the_status_while_idle_and_while_a_wave_waits_then_bakes(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        assert running.delivery is not None
        code, idle = await call(running, "/v1/rollout")
        assert code == 200
        baseline = idle["baseline"]
        assert (idle["phase"], idle["candidate"], idle["wave"], idle["wave_index"]) == ("idle", None, None, None)
        assert (idle["proxies"], idle["on_candidate"], idle["held"], idle["held_count"]) == (2, 0, [], 0)
        assert idle["waves"] == ["canary", "100%"] and idle["types"] == ["CDS", "ECDS", "LDS", "RDS", "RTDS", "SDS"]
        assert (idle["bake"], idle["bake_ends"], idle["health"], idle["paused"]) == (600.0, None, None, None)

        running.change("web", "api")  # a new candidate: the canary wave is served it
        code, acking = await call(running, "/v1/rollout")
        assert code == 200 and acking["baseline"] == baseline and acking["candidate"] not in (None, baseline)
        assert (acking["phase"], acking["wave"], acking["wave_index"]) == ("acking", "canary", 0)
        assert (acking["waiting"], acking["waiting_proxies"]) == (1, [CANARY])
        assert acking["deadline"] == pytest.approx(acking["wave_started"] + acking["ack_timeout"])
        assert acking["wave_started"] <= acking["now"]

        running.ack_candidate(CANARY)
        code, baking = await call(running, "/v1/rollout")
        assert (baking["phase"], baking["waiting"], baking["waiting_proxies"]) == ("baking", 0, [])
        assert baking["bake_ends"] == pytest.approx(baking["now"] + 600.0, abs=5)

        # The status page reads it in /v1/snapshots.
        code, snapshots = await call(running, "/v1/snapshots")
        assert code == 200
        shown = snapshots["rollout"]
        assert (shown["phase"], shown["wave"], shown["candidate"]) == ("baking", "canary", baking["candidate"])


async def test_promote_goes_wave_by_wave_to_completion(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        running.change("web", "api")
        candidate = (await call(running, "/v1/rollout"))[1]["candidate"]
        code, answer = await call(running, "/v1/rollout/promote", method="POST")
        assert code == 200 and answer["command"] == "promote" and answer["candidate"] == candidate
        after = answer["rollout"]
        assert (after["phase"], after["wave"], after["wave_index"], after["waiting_proxies"]) == (
            "acking",
            "100%",
            1,
            [EDGE],
        )
        assert (await call(running, "/v1/rollout"))[1]["wave"] == "100%"
        code, answer = await call(running, "/v1/rollout/promote", method="POST")
        done = answer["rollout"]
        assert code == 200 and (done["phase"], done["candidate"], done["baseline"]) == ("idle", None, candidate)
        (promoted, _) = running.recorded("rollout_promoted")
        assert (promoted["candidate"], promoted["wave"], promoted["phase"], promoted["by"]) == (
            candidate,
            "canary",
            "acking",
            "admin API",
        )
        assert [e["candidate"] for e in running.recorded("rollout_completed")] == [candidate]

        # Nothing runs now: refused, saying why.
        code, refused = await call(running, "/v1/rollout/promote", method="POST")
        assert code == 409 and refused == {"error": "promote: no rollout in progress; a new change starts one"}


async def test_pause_and_resume_and_what_is_refused_twice(tmp_path: Path) -> None:
    async with fleet(tmp_path, bake=0.0) as running:
        assert running.delivery is not None
        running.change("web", "api")
        code, answer = await call(running, "/v1/rollout/pause", method="POST")
        assert code == 200 and answer["rollout"]["paused"] == "operator"
        code, again = await call(running, "/v1/rollout/pause", method="POST")
        assert code == 409 and "already paused (operator); resume it to go on" in again["error"]
        running.ack_candidate(CANARY)  # the bake (0 s) is over: paused, the next wave does not start
        running.delivery.tick()
        paused = (await call(running, "/v1/rollout"))[1]
        assert (paused["phase"], paused["wave"], paused["paused"]) == ("baking", "canary", "operator")
        assert paused["deadline"] is None
        code, answer = await call(running, "/v1/rollout/resume", method="POST")
        assert code == 200 and answer["rollout"]["paused"] is None and answer["rollout"]["wave"] == "100%"
        code, again = await call(running, "/v1/rollout/resume", method="POST")
        assert code == 409 and again == {"error": "resume: the rollout is not paused"}
        (event,) = running.recorded("rollout_paused")
        assert (event["reason"], event["by"]) == ("paused by the operator", "admin API")
        (event,) = running.recorded("rollout_resumed")
        assert (event["wave"], event["by"]) == ("canary", "admin API")


async def test_abort_rolls_back_and_holds_with_the_reason(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        running.change("web", "api")
        running.ack_candidate(CANARY)
        before = (await call(running, "/v1/rollout"))[1]
        code, answer = await call(running, "/v1/rollout/abort", method="POST", json={"reason": "  latency\n up  "})
        assert code == 200 and answer["candidate"] == before["candidate"]
        after = answer["rollout"]
        assert (after["phase"], after["candidate"], after["baseline"], after["held_count"]) == (
            "idle",
            None,
            before["baseline"],
            1,
        )
        (held,) = after["held"]
        assert held["candidate"] == before["candidate"]
        assert held["reason"] == "wave canary: aborted by the operator: latency up"
        (aborted,) = running.recorded("rollout_aborted")
        assert (aborted["reason"], aborted["by"]) == ("aborted by the operator: latency up", "admin API")
        assert running.recorded("rollout_rolled_back")[0]["candidate"] == before["candidate"]

        # The reason by query, for another candidate; refused when nothing runs.
        running.change("web", "api", "db")
        code, answer = await call(running, "/v1/rollout/abort?reason=db+is+down", method="POST")
        assert code == 200 and answer["rollout"]["held"][0]["reason"].endswith("aborted by the operator: db is down")
        assert answer["rollout"]["held_count"] == 2
        code, refused = await call(running, "/v1/rollout/abort", method="POST")
        assert code == 409 and refused["error"].startswith("abort: no rollout in progress (held: ")

        # The page's JSON: the newest held first.
        shown = (await call(running, "/v1/snapshots"))[1]["rollout"]
        assert shown["held"][0]["reason"].endswith("db is down") and shown["phase"] == "idle"


async def test_what_a_command_may_carry_is_bounded(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        running.change("web", "api")
        for kwargs, status, says in (
            ({"json": {"reason": "x" * (MAX_REASON + 1)}}, 400, f"at most {MAX_REASON} characters"),
            ({"json": {"reason": 7}}, 400, "must be a string, not int"),
            ({"json": {"why": "x"}}, 400, 'at most "reason"'),
            ({"json": ["x"]}, 400, 'at most "reason"'),
            ({"data": b"{not json"}, 400, "must be JSON"),
            ({"json": {"reason": "a"}, "params": {"reason": "b"}}, 400, "not both"),
            ({"data": b"x" * (MAX_COMMAND_BODY + 1)}, 413, f"at most {MAX_COMMAND_BODY} bytes"),
        ):
            code, body = await call(running, "/v1/rollout/abort", method="POST", **kwargs)
            assert (code, says in body["error"]) == (status, True), (kwargs, body)
        code, body = await call(running, "/v1/rollout/pause", method="POST", json={"reason": "x"})
        assert code == 400 and "only abort takes a reason" in body["error"]
        assert (await call(running, "/v1/rollout"))[1]["phase"] == "acking"  # nothing was done
        assert running.recorded("rollout_aborted") == running.recorded("rollout_paused") == []


async def test_the_held_list_is_bounded(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        for n in range(HELD_SHOWN + 2):
            running.change("web", f"api-{n}")
            assert (await call(running, "/v1/rollout/abort", method="POST"))[0] == 200
        shown = (await call(running, "/v1/rollout"))[1]
        assert len(shown["held"]) == HELD_SHOWN and shown["held_count"] == HELD_SHOWN + 2


async def test_without_a_rollout_the_routes_say_how_to_turn_one_on(tmp_path: Path) -> None:
    async with fleet(tmp_path, rollout=False) as running:
        for method, path in [("GET", "/v1/rollout"), *(("POST", f"/v1/rollout/{c}") for c in ("promote", "abort"))]:
            code, body = await call(running, path, method=method)
            assert code == 404 and "--rollout WAVES" in body["error"], (path, body)
        assert (await call(running, "/v1/snapshots"))[1]["rollout"] is None
        code, out, err = await run(rollout_command, AdminClient(running.admin), "status")
        assert (code, out) == (1, "") and "start it with --rollout WAVES" in err


async def test_reads_need_a_read_token_and_commands_an_admin_token(tmp_path: Path) -> None:
    async with fleet(tmp_path, tokens=True) as running:
        running.change("web", "api")
        code, body = await call(running, "/v1/rollout")
        assert code == 401 and "needs a token" in body["error"]
        assert (await call(running, "/v1/rollout", token=READER))[0] == 200
        assert (await call(running, "/v1/rollout/pause", method="POST"))[0] == 401
        code, body = await call(running, "/v1/rollout/pause", method="POST", token=READER)
        assert code == 403 and "token 'reader' may not pause the rollout (admin: true)" in body["error"]
        code, body = await call(running, "/v1/rollout/abort", method="POST", token="guessed")
        assert code == 401 and "not one the admin API knows" in body["error"]
        shown = (await call(running, "/v1/rollout", token=READER))[1]
        assert (shown["phase"], shown["paused"]) == ("acking", None)  # nothing was done
        code, body = await call(running, "/v1/rollout/pause", method="POST", token=OPS)
        assert code == 200 and body["rollout"]["paused"] == "operator"
        assert running.recorded("rollout_paused")[0]["by"] == "admin API (token ops)"
        code, out, err = await run(rollout_command, AdminClient(running.admin, token=READER), "resume")
        assert code == 2 and "may not resume the rollout (admin: true)" in err and out == ""
        code, out, err = await run(rollout_command, AdminClient(running.admin), "status")
        assert code == 2 and "needs a token" in err
        code, out, err = await run(rollout_command, AdminClient(running.admin, token=OPS), "abort", reason="paging")
        assert code == 0 and out.startswith("aborted the rollout of "), err
        assert running.recorded("rollout_aborted")[0]["by"] == "admin API (token ops)"


async def test_the_rollout_command_prints_it_and_commands_it(tmp_path: Path) -> None:
    async with fleet(tmp_path) as running:
        admin = AdminClient(running.admin)
        code, out, err = await run(rollout_command, admin, "status")
        baseline = (await call(running, "/v1/rollout"))[1]["baseline"]
        assert code == 0, err
        assert out.splitlines()[0] == f"rollout  none in progress: every proxy is served the baseline {baseline[:12]}"
        running.change("web", "api")
        candidate = (await call(running, "/v1/rollout"))[1]["candidate"]
        code, out, _ = await run(rollout_command, admin, "status")
        lines = out.splitlines()
        assert lines[0] == f"rollout  {candidate[:12]} over baseline {baseline[:12]}"
        assert lines[1].startswith("phase    acking, wave canary (1 of 2: canary, 100%)")
        assert lines[2].startswith("waiting  1 proxy to ACK the candidate (ACK timeout in ") and lines[2].endswith(
            ": c-1"
        )
        code, out, _ = await run(rollout_command, admin, "pause")
        assert (code, out) == (
            0,
            f"paused the rollout of {candidate[:12]} at wave canary (acking): no further wave starts until "
            "`pilotfish rollout resume`\n",
        )
        code, out, _ = await run(rollout_command, admin, "status")
        assert "paused   by the operator: no further wave starts" in out
        code, out, err = await run(rollout_command, admin, "pause")
        assert (code, out) == (1, "") and err == (
            "pilotfish rollout pause: pause: the rollout is already paused (operator); resume it to go on\n"
        )
        code, out, _ = await run(rollout_command, admin, "promote")
        assert (code, out) == (0, f"promoted the rollout of {candidate[:12]}: now wave 100% (acking)\n")
        code, out, _ = await run(rollout_command, admin, "promote")
        assert (code, out) == (
            0,
            f"promoted the rollout of {candidate[:12]}: it completed, {candidate[:12]} is every proxy's baseline\n",
        )
        code, out, _ = await run(rollout_command, admin, "status", as_json=True)
        assert code == 0 and json.loads(out)["baseline"] == candidate
    code, _, err = await run(rollout_command, admin, "status")  # the API is gone
    assert code == 3 and f"http://{running.admin}/v1/rollout" in err


async def test_serve_with_rollout_gives_the_admin_api_its_delivery(tmp_path: Path) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(snapshot_doc("web")))
    settings = ServeSettings(snapshot=snapshot, rollout=RolloutFlags(waves="canary=c-*,100%", health=False))
    async with serve_in_process(tmp_path, settings) as running, aiohttp.ClientSession() as session:
        async with session.get(f"http://{running.admin}/v1/rollout") as response:
            body = await response.json()
            assert response.status == 200 and body["phase"] == "idle" and body["baseline"], body
        async with session.post(f"http://{running.admin}/v1/rollout/promote") as response:
            assert response.status == 409 and "no rollout in progress" in (await response.json())["error"]
