"""``GET /metrics`` on the admin port: it parses with prometheus-client's own text parser, and its
counters move as a proxy is pushed to, ACKs, NACKs, and as the guard holds a snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_admin_api import ack, ads, nack, read, serving, until
from test_tls import snapshot_doc

from pilotfish.reconcile import GuardSettings


async def scrape(running: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{running.admin}/metrics") as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_as_proxies_are_pushed_to_ack_and_nack(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, snapshot):
        before = await scrape(running)
        assert value(before, "pilotfish_snapshots_published_total") == 1
        assert value(before, "pilotfish_source_ready", source="file") == 1
        assert value(before, "pilotfish_snapshot_build_seconds_count") >= 1
        assert value(before, "pilotfish_proxies_connected", group="default") == 0
        async with ads(running, "edge-1") as call:
            first = await read(call)
            await call.write(ack(first))

            async def acked() -> Any:
                samples = await scrape(running)
                return samples if value(samples, "pilotfish_xds_acks_total", type="CDS") == 1 else None

            samples = await until("the ACK to be counted", acked)
            assert value(samples, "pilotfish_xds_responses_total", type="CDS") == 1
            assert value(samples, "pilotfish_proxies_connected", group="default") == 1
            assert value(samples, "pilotfish_xds_streams") == 1
            assert value(samples, "pilotfish_publish_to_ack_seconds_count") == 1
            assert value(samples, "pilotfish_publish_to_ack_seconds_bucket", le="+Inf") == 1

            snapshot.write_text(yaml.safe_dump(snapshot_doc("web", "api")))
            second = await read(call)
            await call.write(nack(second, first.version_info, "rejected"))

            async def nacked() -> Any:
                samples = await scrape(running)
                return samples if value(samples, "pilotfish_xds_nacks_total", type="CDS") == 1 else None

            samples = await until("the NACK to be counted", nacked)
            assert value(samples, "pilotfish_xds_responses_total", type="CDS") == 2
            assert value(samples, "pilotfish_snapshots_published_total") == 2
            assert value(samples, "pilotfish_source_changes_total") >= 2


async def test_a_held_snapshot_and_a_refused_change_show(tmp_path: Path) -> None:
    names = [f"svc-{i}" for i in range(10)]
    async with serving(tmp_path, *names, guard=GuardSettings(max_removed_share=0.5, min_count=10)) as (
        running,
        snapshot,
    ):
        snapshot.write_text(yaml.safe_dump(snapshot_doc("svc-0")))  # removes 9 of 10 clusters: held

        async def held() -> Any:
            samples = await scrape(running)
            return samples if value(samples, "pilotfish_snapshot_held") == 1 else None

        samples = await until("the guard to hold the snapshot", held)
        assert value(samples, "pilotfish_snapshots_held_total") == 1
        snapshot.write_text("services: {web: {endpoints: [nonsense]}}\n")  # refused: the last good serves

        async def refused() -> Any:
            samples = await scrape(running)
            return samples if value(samples, "pilotfish_source_errors_total", source="file") >= 1 else None

        samples = await until("the refused file to be counted", refused)
        assert value(samples, "pilotfish_source_failing", source="file") == 1
        snapshot.write_text(yaml.safe_dump(snapshot_doc(*names)))  # good again (and the hold is undone)

        async def recovered() -> Any:
            samples = await scrape(running)
            good = value(samples, "pilotfish_source_failing", source="file") == 0
            return samples if good and value(samples, "pilotfish_snapshot_held") == 0 else None

        # The file is good again at once; the hold is dropped by the build after the debounce.
        await until("the file to be good again and the hold dropped", recovered)
