"""What the status page reads, over real HTTP against ``pilotfish serve`` in-process with grpcio
ADS clients: the page itself, ``/v1/fleet`` (counts, worst first, filter, bounds), ``/v1/events``
(the bounded ring of recent events, and the bounds of its query) and what ``/v1/snapshots`` says
was refused. The page's behaviour in a browser is tests/e2e/test_status_page.py's.
"""

from __future__ import annotations

import importlib.resources
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from inprocess import Running
from test_admin_api import ack, ads, get, nack, read, serving, until
from test_tls import snapshot_doc

from pilotfish.api.admin import FLEET_ROWS, MAX_FILTER
from pilotfish.events import RECENT_EVENTS

pytestmark = pytest.mark.timeout(60)


async def test_the_page_is_the_package_file_with_a_policy_that_runs_only_its_own_script(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, "web") as (running, _),
        aiohttp.ClientSession() as session,
        session.get(f"http://{running.admin}/") as response,
    ):
        assert response.status == 200 and response.headers["Content-Type"] == "text/html; charset=utf-8"
        page = await response.read()
        assert page == importlib.resources.files("pilotfish.api").joinpath("status_page.html").read_bytes()
        policy = response.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src 'sha256-" in policy
        assert "connect-src 'self'" in policy and "unsafe-inline" not in policy
        assert response.headers["X-Content-Type-Options"] == "nosniff"


async def _fleet(running: Running, query: str = "") -> dict[str, Any]:
    status, body = await get(running, f"/v1/fleet{query}")
    assert status == 200, body
    return body  # type: ignore[no-any-return]


async def test_fleet_counts_every_proxy_and_lists_the_worst_first(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _), AsyncExitStack() as stack:
        calls = {
            node: await stack.enter_async_context(ads(running, node))
            for node in ("a-synced", "b-stale", "c-nacked", "d-synced")
        }
        first = {node: await read(call) for node, call in calls.items()}
        for node in ("a-synced", "d-synced"):
            await calls[node].write(ack(first[node]))
        await calls["c-nacked"].write(nack(first["c-nacked"], "", "cluster web: <b>no</b>"))

        async def settled() -> dict[str, Any] | None:
            fleet = await _fleet(running)
            return fleet if fleet["states"] == {"NACKED": 1, "STALE": 1, "NOT_SENT": 0, "SYNCED": 2} else None

        fleet = await until("two SYNCED, one STALE, one NACKED", settled)
        assert fleet["connected"] == fleet["matched"] == 4
        assert [p["node"] for p in fleet["proxies"]] == ["c-nacked", "b-stale", "a-synced", "d-synced"]
        (latest,) = fleet["nacks"]
        assert (latest["node"], latest["type"], latest["message"], latest["state"]) == (
            "c-nacked",
            "CDS",
            "cluster web: <b>no</b>",
            "NACKED",
        )

        # The filter (node id, cluster or group, any case) and the cap; the counts stay the whole fleet's.
        only = await _fleet(running, "?q=SYNCED")
        assert [p["node"] for p in only["proxies"]] == ["a-synced", "d-synced"] and only["matched"] == 2
        assert only["states"] == fleet["states"]
        capped = await _fleet(running, "?limit=1")
        assert [p["node"] for p in capped["proxies"]] == ["c-nacked"] and capped["matched"] == 4
        assert (await _fleet(running, "?q=edge&limit=0"))["proxies"] == []  # every node's cluster is "edge"


async def test_fleet_refuses_what_crosses_its_bounds(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _):
        for query, says in (
            (f"limit={FLEET_ROWS + 1}", f"limit must be a whole number from 0 to {FLEET_ROWS}"),
            ("limit=-1", "limit must be"),
            ("limit=many", "not 'many'"),
            ("q=" + "x" * (MAX_FILTER + 1), f"at most {MAX_FILTER} characters"),
        ):
            status, body = await get(running, f"/v1/fleet?{query}")
            assert status == 400 and says in body["error"], (query, body)
        assert (await get(running, f"/v1/fleet?limit={FLEET_ROWS}&q={'x' * MAX_FILTER}"))[0] == 200


async def _events(running: Running, query: str = "") -> dict[str, Any]:
    status, body = await get(running, f"/v1/events{query}")
    assert status == 200, body
    return body  # type: ignore[no-any-return]


async def test_recent_events_are_kept_in_a_bounded_ring_and_read_from_a_sequence_number(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _):
        start = await _events(running)
        names = [event["event"] for event in start["events"]]
        assert "snapshot_loaded" in names and "server_started" in names
        assert [e["seq"] for e in start["events"]] == list(range(1, start["last"] + 1))
        assert start["size"] == RECENT_EVENTS and start["kept"] == start["last"]

        async with ads(running, "edge-1") as call:
            await call.write(nack(await read(call), "", "cluster web: refused"))

            async def the_nack() -> list[dict[str, Any]]:
                return [
                    e for e in (await _events(running, f"?after={start['last']}"))["events"] if e["event"] == "nack"
                ]

            (event,) = await until("the NACK among the recent events", the_nack)
            assert event["node"] == "edge-1" and event["error"] == "cluster web: refused"
            assert event["seq"] > start["last"] and event["ts"] > 0
            newer = await _events(running, f"?after={start['last']}")
            # The routine conversation (requests, responses) stays out of the ring.
            assert {e["event"] for e in newer["events"]} <= {"stream_open", "nack"}
            assert (await _events(running, f"?after={newer['last']}"))["events"] == []
            (latest,) = (await _events(running, "?limit=1"))["events"]
            assert latest["seq"] == newer["last"]

        # Many more events than the ring holds: it keeps the latest RECENT_EVENTS, in order.
        async with aiohttp.ClientSession() as http:
            for n in range(RECENT_EVENTS + 50):
                async with http.put(
                    running.url(f"/v1/services/svc-{n % 5}"), json={"listen": f"127.0.0.1:{20000 + n}"}
                ) as response:
                    assert response.status in (200, 201), await response.text()
        flooded = await _events(running, f"?limit={RECENT_EVENTS}")
        assert flooded["kept"] == RECENT_EVENTS == len(flooded["events"])
        seqs = [e["seq"] for e in flooded["events"]]
        assert seqs == list(range(flooded["last"] - RECENT_EVENTS + 1, flooded["last"] + 1))
        assert flooded["events"][-1]["event"] in ("registry_service_defined", "snapshot_loaded")


async def test_events_refuse_what_crosses_their_bounds(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _):
        for query, says in (
            (f"limit={RECENT_EVENTS + 1}", f"limit must be a whole number from 1 to {RECENT_EVENTS}"),
            ("limit=0", "limit must be"),
            ("after=-1", "after must be a whole number at least 0"),
            ("after=" + "9" * 5000, "after must be"),
        ):
            status, body = await get(running, f"/v1/events?{query}")
            assert status == 400 and says in body["error"], (query, body)
            assert len(body["error"]) < 200


async def test_what_was_refused_is_shown_until_a_good_change(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, snapshot):
        assert (await get(running, "/v1/snapshots"))[1]["refused"] == {"count": 0, "build": None, "sources": {}}
        snapshot.write_text("clusters: [unclosed\n")

        async def refused() -> dict[str, Any] | None:
            shown = (await get(running, "/v1/snapshots"))[1]["refused"]
            return shown if shown["sources"] else None

        shown = await until("the unreadable file to be shown as refused", refused)
        assert str(snapshot) in shown["sources"]["file"]["reason"] and shown["sources"]["file"]["at"] > 0
        bad = snapshot_doc("web", "api")
        bad["clusters"][1]["connect_timeout"] = "0s"  # Envoy's rules refuse it (validation is on)
        snapshot.write_text(yaml.safe_dump(bad))

        async def build_refused() -> dict[str, Any] | None:
            shown = (await get(running, "/v1/snapshots"))[1]["refused"]
            return shown if shown["build"] and not shown["sources"] else None

        shown = await until("the invalid cluster to be shown as refused", build_refused)
        assert shown["count"] == 1 and "connect_timeout" in shown["build"]["reason"]
        snapshot.write_text(yaml.safe_dump(snapshot_doc("web", "api")))

        async def cleared() -> bool:
            return (await get(running, "/v1/snapshots"))[1]["refused"]["build"] is None

        await until("a good change to clear it", cleared)
