"""``POST /v1/plan`` and ``pilotfish plan`` against ``pilotfish serve`` in-process: a plan says what a
proposed snapshot file would do (the diff per group and type, every problem, the guard, the
rollout's decision, the proxies) and publishes nothing; its body is bounded as it arrives, and one
plan is made at a time.

The rollout tests use grpcio ADS clients as proxies (:mod:`test_rollout`'s), on waves
``canary=c-*,100%``: c-1 is the canary, p-1 the rest.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from inprocess import Running, serving
from test_rollout import CDS, EDS, document, events, proxy, rollout, until

from pilotfish.api.admin import MAX_PLAN_BODY
from pilotfish.api.tokens import hash_token
from pilotfish.app import ServeSettings
from pilotfish.app.settings import AdminSettings
from pilotfish.commands.operate import MAX_PLAN_BYTES, AdminClient, plan_command

pytestmark = pytest.mark.timeout(90)

READER = "reader-token"


@asynccontextmanager
async def served(
    tmp_path: Path, clusters: dict[str, int], settings: ServeSettings | None = None
) -> AsyncIterator[tuple[Running, Path]]:
    """Serve ``tmp_path/snapshot.yaml``, written with ``clusters`` (EDS clusters, name -> port)."""
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(yaml.safe_dump(document(clusters)))
    async with serving(tmp_path, replace(settings or ServeSettings(), snapshot=snapshot)) as running:
        await until("the snapshot served", lambda: events(running, "snapshot_loaded"))
        yield running, snapshot


async def plan(running: Running, body: bytes | str, *, name: str = "new.yaml", **headers: str) -> tuple[int, Any]:
    data = body.encode() if isinstance(body, str) else body
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{running.admin}/v1/plan", params={"name": name}, data=data, headers=headers) as answer,
    ):
        return answer.status, await answer.json()


async def snapshots(running: Running) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"http://{running.admin}/v1/snapshots") as answer:
        found: dict[str, Any] = await answer.json()
        return found


def served_state(shown: dict[str, Any]) -> tuple[Any, ...]:
    """What /v1/snapshots says is served, and what was refused or held."""
    return (
        {group: entry["label"] for group, entry in shown["groups"].items()},
        shown["held"],
        shown["refused"]["count"],
    )


async def cli(command: Callable[..., int], *args: Any, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(command, *args, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


def broken(clusters: dict[str, int]) -> str:
    """``clusters`` with a connect timeout Envoy refuses, each."""
    return yaml.safe_dump(document(clusters, timeout="-1s"))


async def test_an_invalid_file_lists_every_problem_and_nothing_is_published(tmp_path: Path) -> None:
    async with served(tmp_path, {"a": 9001}) as (running, _):
        before = served_state(await snapshots(running))
        loaded = len(events(running, "snapshot_loaded"))
        code, answer = await plan(running, broken({"a": 9001, "b": 9002}))
        assert code == 200 and answer["verdict"] == "refuse" and answer["published"] is False
        wheres = [problem["where"] for problem in answer["problems"]]
        assert any(w.startswith("clusters[0]") for w in wheres) and any(w.startswith("clusters[1]") for w in wheres)
        assert answer["groups"] == {} and answer["guard"] is None and answer["rollout"] is None
        assert answer["sources"] == "new.yaml"

        code, unparsable = await plan(running, "clusters: [{name: a, bogus: 1}]\n")
        assert code == 200 and unparsable["verdict"] == "refuse"
        [problem] = unparsable["problems"]
        assert problem["where"] == "clusters[0] (name 'a').bogus", problem
        assert problem["message"].startswith("unknown field of envoy.config.cluster.v3.Cluster"), problem

        new = tmp_path / "new.yaml"
        new.write_text(broken({"a": 9001}))
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 1 and f"validation  1 problem(s) in {new}:" in out
        assert "clusters[0] (name 'a').connect_timeout: must be greater than 0s" in out
        assert "verdict     would be REFUSED" in out

        assert served_state(await snapshots(running)) == before
        assert len(events(running, "snapshot_loaded")) == loaded and not events(running, "snapshot_error")


async def test_a_plan_shows_the_diff_per_type_and_the_cli_exits_0(tmp_path: Path) -> None:
    async with served(tmp_path, {"a": 9001, "b": 9002}) as (running, snapshot):
        before = served_state(await snapshots(running))
        proposed = document({"a": 9001, "c": 9003}, timeout="2s")
        code, answer = await plan(running, json.dumps(proposed), name="new.json")  # JSON, by its name
        assert code == 200 and answer["verdict"] == "publish" and answer["published"] is True
        group = answer["groups"]["default"]
        assert group["changed"] is True and group["proxies"] == 0 and group["before"] == before[0]["default"]
        cds = group["types"]["CDS"]
        assert (cds["added"], cds["removed"], [c["name"] for c in cds["changed"]]) == (["c"], ["b"], ["a"])
        assert cds["changed"][0]["changes"] == [{"path": "connect_timeout", "old": "1s", "new": "2s"}]
        assert set(group["types"]) == {"CDS", "EDS"}
        assert answer["guard"] == {
            "enabled": True,
            "hold": False,
            "reasons": [],
            "counts": {
                "clusters": {"before": 2, "after": 2, "removed": 1},
                "endpoints": {"before": 2, "after": 2, "removed": 1},
            },
        }

        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump(proposed))
        code, out, err = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 0, err
        for line in ("CDS: 1 added, 1 removed, 1 changed", "+ c", "- b", "~ a", 'connect_timeout: "1s" -> "2s"'):
            assert line in out, out
        assert "verdict     would be published" in out
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new, as_json=True)
        assert code == 0 and json.loads(out)["verdict"] == "publish"

        # The file as served: no change, exit 0.
        code, out, _ = await cli(plan_command, AdminClient(running.admin), snapshot)
        assert code == 0 and "no change" in out
        assert served_state(await snapshots(running)) == before


async def test_a_plan_that_removes_too_much_says_the_guard_would_hold_it(tmp_path: Path) -> None:
    async with served(tmp_path, {f"c{i}": 9000 + i for i in range(12)}) as (running, _):
        before = served_state(await snapshots(running))
        code, answer = await plan(running, yaml.safe_dump(document({"c0": 9000})))
        assert code == 200 and answer["verdict"] == "hold" and answer["published"] is False
        assert answer["guard"]["hold"] is True
        assert any("removes 11 of 12 clusters" in reason for reason in answer["guard"]["reasons"])
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump(document({"c0": 9000})))
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 1 and "guard       would HOLD it: it removes 11 of 12 clusters" in out
        assert "HELD by the blast-radius guard" in out
        assert served_state(await snapshots(running)) == before  # nothing is held for real


async def test_under_a_rollout_a_cluster_change_names_the_waves_and_an_endpoint_change_is_all_at_once(
    tmp_path: Path,
) -> None:
    settings = ServeSettings(rollout=rollout(bake=60.0))
    async with (
        served(tmp_path, {"a": 9001}, settings) as (running, _),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        versions = {p.node: dict(p.versions) for p in (canary, p1)}
        before = served_state(await snapshots(running))

        code, answer = await plan(running, yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        assert code == 200 and answer["verdict"] == "publish"
        assert answer["groups"]["default"]["proxies"] == 2
        shown = answer["rollout"]
        assert shown["decision"] == "roll out" and shown["types"] == ["CDS"] and shown["supersedes"] is None
        assert shown["waves"] == [{"name": "canary", "proxies": 1}, {"name": "100%", "proxies": 1}]
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 0 and "rollout     in waves (CDS changes): canary (1 proxy), 100% (1 proxy)" in out

        code, answer = await plan(running, yaml.safe_dump(document({"a": 9005})))
        assert code == 200 and answer["verdict"] == "publish"
        assert answer["rollout"]["decision"] == "both" and answer["rollout"]["types"] == []
        assert list(answer["groups"]["default"]["types"]) == ["EDS"]
        new.write_text(yaml.safe_dump(document({"a": 9005})))
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 0 and "rollout     all at once" in out

        # Nothing was published or offered: the proxies were sent nothing new.
        await asyncio.sleep(0.3)
        assert {p.node: dict(p.versions) for p in (canary, p1)} == versions
        assert not events(running, "rollout_started") and served_state(await snapshots(running)) == before


async def test_a_candidate_the_rollout_held_would_not_be_served(tmp_path: Path) -> None:
    def bad(response: Any) -> bool:
        return bool(response.type_url == CDS and b"bad" in response.SerializeToString())

    async with (
        served(tmp_path, {"a": 9001}, ServeSettings(rollout=rollout(bake=0.2))) as (running, snapshot),
        proxy(running, "c-1", refuse=bad) as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        held = yaml.safe_dump(document({"a": 9001, "bad": 9002}))
        snapshot.write_text(held)
        await until("the rollback", lambda: events(running, "rollout_rolled_back"))
        snapshot.write_text(yaml.safe_dump(document({"a": 9001})))  # the sources go back to the baseline
        await until("the baseline again", lambda: len(events(running, "snapshot_loaded")) >= 3)

        code, answer = await plan(running, held)
        assert code == 200 and answer["verdict"] == "not served" and answer["published"] is False
        assert answer["rollout"]["decision"] == "held"
        assert "c-1 NACKed CDS" in answer["rollout"]["held"]
        new = tmp_path / "new.yaml"
        new.write_text(held)
        code, out, _ = await cli(plan_command, AdminClient(running.admin), new)
        assert code == 1 and "NOT SERVED: this change was rolled back and is held" in out
        assert EDS in canary.versions


async def test_a_plan_needs_a_read_token_and_the_cli_exits_2_without_and_3_unreachable(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"tokens": {"reader": {"sha256": hash_token(READER), "read": True}}}))
    settings = ServeSettings(admin=AdminSettings(tokens=tokens))
    async with served(tmp_path, {"a": 9001}, settings) as (running, snapshot):
        code, answer = await plan(running, snapshot.read_text())
        assert code == 401
        code, answer = await plan(running, snapshot.read_text(), Authorization=f"Bearer {READER}")
        assert code == 200 and answer["verdict"] == "no change"
        code, _, err = await cli(plan_command, AdminClient(running.admin), snapshot)
        assert code == 2 and "token" in err
        code, out, _ = await cli(plan_command, AdminClient(running.admin, token=READER), snapshot)
        assert code == 0 and "no change" in out
        address = running.admin
    code, _, err = await cli(plan_command, AdminClient(address, timeout=2.0), snapshot, timeout=2.0)
    assert code == 3 and "is `pilotfish serve --admin" in err
    code, _, err = await cli(plan_command, AdminClient(address), tmp_path / "absent.yaml")
    assert code == 2 and "cannot read" in err


async def raw_request(running: Running, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = running.admin.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head)
    await writer.drain()
    return reader, writer


async def test_a_body_over_the_bound_is_refused_as_it_arrives_and_one_plan_is_made_at_a_time(
    tmp_path: Path,
) -> None:
    assert MAX_PLAN_BYTES == MAX_PLAN_BODY
    async with served(tmp_path, {"a": 9001}) as (running, snapshot):
        # A declared length over the bound: refused before a byte of the body is sent.
        reader, writer = await raw_request(
            running, b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_PLAN_BODY + 1)
        )
        status = await asyncio.wait_for(reader.readline(), 10)
        assert b" 413 " in status
        writer.close()

        # Chunked, no length: refused once one byte more than the bound arrived, the rest never sent.
        reader, writer = await raw_request(
            running, b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"#" * (1 << 20)
        for _ in range(MAX_PLAN_BODY // len(chunk)):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"1\r\n#\r\n")  # (no last chunk: the body never ends)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        assert b" 413 " in status
        writer.close()

        # While one plan's body is still arriving, another is refused with 429 (and may come back).
        reader, writer = await raw_request(
            running, b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nclusters: []\n"
        )
        await asyncio.sleep(0.2)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://{running.admin}/v1/plan", data=snapshot.read_bytes()) as busy,
        ):
            assert busy.status == 429 and busy.headers["Retry-After"] == "1"
            assert "one at a time" in (await busy.json())["error"]
        writer.close()  # (the plan ends as its body does)
        for _ in range(50):
            code, answer = await plan(running, snapshot.read_text())
            if code != 429:
                break
            await asyncio.sleep(0.1)
        assert code == 200 and answer["verdict"] == "no change"
