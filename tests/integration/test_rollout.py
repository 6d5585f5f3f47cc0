"""Progressive delivery through ``pilotfish serve --rollout``, in-process, with grpcio ADS clients
playing the proxies: each asks for clusters and endpoints and ACKs (or NACKs) what it is sent,
so the test decides every gate's outcome and sees what each proxy was sent, and when.

The snapshot file has EDS clusters; a change to a cluster is a change to a rollout type (CDS),
a change to an endpoint is not (EDS: it reaches the baseline and the candidate alike).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.rpc import status_pb2
from inprocess import TIMEOUT, Running, serving

from pilotfish.app import ServeSettings
from pilotfish.app.settings import EtcdSettings, RolloutFlags, XdsSettings
from pilotfish.events import read_events
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.xds.lrs import SEND_ALL_FEATURE, LrsSettings

pytestmark = pytest.mark.timeout(90)

CDS, EDS = CLUSTER.url, ENDPOINT.url


def document(clusters: dict[str, int], *, timeout: str = "1s") -> dict[str, Any]:
    """EDS clusters (name -> the port of its one endpoint), each with ``timeout``."""
    return {
        "clusters": [
            {
                "name": name,
                "type": "EDS",
                "connect_timeout": timeout,
                "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
            }
            for name in clusters
        ],
        "endpoints": [
            {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                        ]
                    }
                ],
            }
            for name, port in clusters.items()
        ],
    }


@dataclass
class Proxy:
    """One SotW ADS stream that asks for every cluster and for the endpoints of ``a`` and ``b``;
    ACKs every response unless ``refuse(response)`` says to NACK it."""

    node: str
    call: Any
    refuse: Callable[[discovery_pb2.DiscoveryResponse], bool] = lambda _: False
    versions: dict[str, str] = field(default_factory=dict)
    """Type URL -> the version it last accepted."""
    seen: dict[str, list[str]] = field(default_factory=dict)
    """Type URL -> every version it was sent, in order."""
    clusters: dict[str, str] = field(default_factory=dict)
    """Cluster name -> its connect timeout, as last accepted."""

    async def run(self) -> None:
        while True:
            response: discovery_pb2.DiscoveryResponse = await self.call.read()
            if response is grpc.aio.EOF:
                return
            url = response.type_url
            self.seen.setdefault(url, []).append(response.version_info)
            if self.refuse(response):
                await self.call.write(self._answer(url, self.versions.get(url, ""), response.nonce, error="no"))
                continue
            self.versions[url] = response.version_info
            if url == CDS:
                found = {}
                for item in response.resources:
                    cluster = cluster_pb2.Cluster()
                    item.Unpack(cluster)
                    found[cluster.name] = f"{cluster.connect_timeout.seconds}s"
                self.clusters = found
            await self.call.write(self._answer(url, response.version_info, response.nonce))

    def _answer(self, url: str, version: str, nonce: str, *, error: str = "") -> discovery_pb2.DiscoveryRequest:
        request = discovery_pb2.DiscoveryRequest(type_url=url, version_info=version, response_nonce=nonce)
        if url == EDS:
            request.resource_names.extend(["a", "b"])
        if error:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=f"{self.node} says {error}"))
        return request


@asynccontextmanager
async def proxy(running: Running, node: str, **kwargs: Any) -> AsyncIterator[Proxy]:
    async with grpc.aio.insecure_channel(running.xds) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster = node, "edge"
        await call.write(first)
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["a", "b"]))
        p = Proxy(node, call, **kwargs)
        task = asyncio.create_task(p.run())
        try:
            yield p
        finally:
            call.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def until(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Poll ``check`` (a function, or one returning an awaitable) until its result is true."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def events(running: Running, kind: str, *, after: int = 0) -> list[dict[str, Any]]:
    """The events of ``kind`` in the log (from the ``after``-th: the log is appended to across runs)."""
    return [e for e in read_events(running.events)[0][after:] if e["event"] == kind]


async def scrape(running: Running) -> dict[str, float]:
    """The admin API's ``/metrics``: sample (with its labels) -> value."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{running.admin}/metrics") as response:
        text = await response.text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def rollout(**flags: Any) -> RolloutFlags:
    defaults: dict[str, Any] = {"waves": "canary=c-*,100%", "ack_timeout": 10.0, "bake": 0.5, "health": False}
    return RolloutFlags(**(defaults | flags))


@asynccontextmanager
async def served(
    tmp_path: Path, flags: RolloutFlags, clusters: dict[str, int] | None
) -> AsyncIterator[tuple[Running, Path]]:
    """Serve ``tmp_path/snapshot.yaml`` (written with ``clusters``; None: as the test left it)."""
    snapshot = tmp_path / "snapshot.yaml"
    if clusters is not None:
        snapshot.write_text(yaml.safe_dump(document(clusters)))
    async with serving(tmp_path, ServeSettings(snapshot=snapshot, rollout=flags)) as running:
        yield running, snapshot


async def test_a_good_change_reaches_the_canary_first_then_everyone(tmp_path: Path) -> None:
    async with (
        served(tmp_path, rollout(bake=1.5), {"a": 9001}) as (running, snapshot),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
        proxy(running, "p-2") as p2,
    ):
        fleet = (canary, p1, p2)
        await until("every proxy on the baseline", lambda: all(p.clusters == {"a": "1s"} for p in fleet))
        baseline = canary.versions[CDS]

        snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        await until("the canary has the candidate", lambda: canary.clusters == {"a": "2s"})
        await until("the canary's wave passed its ACK gate", lambda: events(running, "rollout_wave_acked"))
        # The canary ACKed; its wave bakes before the next starts: nobody else has it yet.
        assert [p.clusters for p in (p1, p2)] == [{"a": "1s"}, {"a": "1s"}]
        assert p1.seen[CDS] == [baseline]

        await until("everyone has the candidate", lambda: all(p.clusters == {"a": "2s"} for p in fleet))
        await until("the rollout completed", lambda: events(running, "rollout_completed"))
        (started,) = events(running, "rollout_started")
        assert started["baseline"] != started["candidate"] and started["types"] == ["CDS"]
        waves = [(e["wave"], e["proxies"]) for e in events(running, "rollout_wave_started")]
        assert waves == [("canary", 1), ("100%", 2)]
        passed = [e["wave"] for e in events(running, "rollout_wave_passed")]
        assert passed == ["canary", "100%"]
        metrics = await scrape(running)
        assert metrics['pilotfish_rollouts_total{outcome="completed"}'] == 1
        assert metrics['pilotfish_rollouts_total{outcome="rolled_back"}'] == 0
        assert metrics["pilotfish_rollout_wave_seconds_count"] == 2
        assert metrics["pilotfish_rollout_wave_seconds_sum"] >= 2 * 1.5  # each wave baked 1.5 s at least
        assert metrics["pilotfish_rollout_running"] == 0 and metrics["pilotfish_rollout_wave"] == -1


async def test_a_nack_from_the_canary_rolls_it_back_and_nobody_else_gets_it(tmp_path: Path) -> None:
    def bad(response: discovery_pb2.DiscoveryResponse) -> bool:
        return response.type_url == CDS and b"bad" in response.SerializeToString()

    async with (
        served(tmp_path, rollout(bake=0.2), {"a": 9001}) as (running, snapshot),
        proxy(running, "c-1", refuse=bad) as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both on the baseline", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        baseline = canary.versions[CDS]

        snapshot.write_text(yaml.safe_dump(document({"a": 9001, "bad": 9002})))
        (rolled,) = await until("the rollback", lambda: events(running, "rollout_rolled_back"))
        (failed,) = events(running, "rollout_failed")
        assert failed["wave"] == "canary" and "c-1 NACKed CDS: c-1 says no" in failed["reason"], failed
        assert rolled["proxies"] == 1
        metrics = await scrape(running)
        assert metrics['pilotfish_rollouts_total{outcome="rolled_back"}'] == 1
        assert metrics["pilotfish_rollout_held"] == 1
        # The canary is sent the baseline again; the other proxy was never sent the candidate.
        await until("the canary back on the baseline", lambda: canary.seen[CDS][-1] == baseline)
        assert canary.clusters == {"a": "1s"}
        assert set(p1.seen[CDS]) == {baseline}

        # A proxy that connects later gets the baseline too: the candidate is held.
        async with proxy(running, "c-2") as late:
            await until("the late canary served", lambda: late.clusters)
            assert late.clusters == {"a": "1s"} and late.versions[CDS] == baseline

        # A different change starts a new rollout, from the baseline.
        snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="3s")))
        await until("the new candidate everywhere", lambda: canary.clusters == p1.clusters == {"a": "3s"})
        await until("the rollout completed", lambda: events(running, "rollout_completed"))
        assert len(events(running, "rollout_started")) == 2


async def test_endpoint_changes_reach_the_baseline_and_the_candidate_at_once(tmp_path: Path) -> None:
    async with (
        served(tmp_path, rollout(bake=60.0), {"a": 9001}) as (running, snapshot),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        await until("the canary's wave baking", lambda: events(running, "rollout_wave_acked"))
        eds_before = {p.node: p.versions[EDS] for p in (canary, p1)}

        # Only an endpoint moves: both snapshots get it, while the canary's wave still bakes.
        snapshot.write_text(yaml.safe_dump(document({"a": 9005}, timeout="2s")))
        await until(
            "both sent the new endpoints", lambda: all(p.versions[EDS] != eds_before[p.node] for p in (canary, p1))
        )
        assert canary.clusters == {"a": "2s"} and p1.clusters == {"a": "1s"}
        assert not events(running, "rollout_superseded") and len(events(running, "rollout_started")) == 1


async def test_a_restart_keeps_the_held_candidate_away_and_the_baseline_served(tmp_path: Path) -> None:
    def bad(response: discovery_pb2.DiscoveryResponse) -> bool:
        return response.type_url == CDS and b"bad" in response.SerializeToString()

    async with (
        served(tmp_path, rollout(), {"a": 9001}) as (running, snapshot),
        proxy(running, "c-1", refuse=bad) as canary,
    ):
        await until("the canary on the baseline", lambda: canary.clusters == {"a": "1s"})
        baseline = canary.versions[CDS]
        snapshot.write_text(yaml.safe_dump(document({"a": 9001, "bad": 9002})))
        await until("the rollback", lambda: events(running, "rollout_rolled_back"))
        await until("the canary back on the baseline", lambda: canary.seen[CDS][-1] == baseline)
    assert (tmp_path / "pilotfish-rollout.json").exists()
    before = len(read_events(tmp_path / "events.jsonl")[0])

    # Started again on the same file, which still says the held candidate: everyone gets the baseline.
    async with (
        served(tmp_path, rollout(), None) as (running, _),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters and p1.clusters)
        assert canary.clusters == p1.clusters == {"a": "1s"}
        assert canary.versions[CDS] == p1.versions[CDS] == baseline
        held = await until("the held candidate reported", lambda: events(running, "rollout_held", after=before))
        assert "c-1 NACKed CDS" in held[0]["reason"]
        assert not events(running, "rollout_baseline_set", after=before)


async def test_a_restart_mid_rollout_goes_on_with_the_candidate_in_its_wave(tmp_path: Path) -> None:
    async with (
        served(tmp_path, rollout(bake=3600.0), {"a": 9001}) as (running, snapshot),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        await until("the canary's wave baking", lambda: events(running, "rollout_wave_acked"))
    before = len(read_events(tmp_path / "events.jsonl")[0])

    async with (
        served(tmp_path, rollout(bake=3600.0), None) as (running, _),
        proxy(running, "c-1") as canary,
        proxy(running, "p-1") as p1,
    ):
        await until("both served", lambda: canary.clusters and p1.clusters)
        assert canary.clusters == {"a": "2s"} and p1.clusters == {"a": "1s"}
        assert not events(running, "rollout_started", after=before)
        assert not events(running, "rollout_baseline_set", after=before)


# -- replicas on etcd -------------------------------------------------------------------------------


def leader_of(*replicas: Running) -> Running | None:
    for running in replicas:
        elected = events(running, "leader_elected")
        lost = events(running, "leader_lost")
        if len(elected) > len(lost):
            return running
    return None


async def rollout_status(running: Running, field: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(f"http://{running.admin}/v1/rollout") as r:
        return (await r.json())[field]


async def command(running: Running, name: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(f"http://{running.admin}/v1/rollout/{name}") as r:
        return r.status, await r.json()


@pytest.mark.e2e
async def test_on_etcd_the_elected_replica_decides_every_replica_serves_it_and_the_next_goes_on(
    tmp_path: Path, etcd: str
) -> None:
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(yaml.safe_dump(document({"a": 9001})))
    settings = ServeSettings(
        snapshot=snapshot, etcd=EtcdSettings(address=etcd, election_ttl=2.0), rollout=rollout(bake=0.5)
    )
    refusing = {"on": False}

    def bad(response: discovery_pb2.DiscoveryResponse) -> bool:
        return refusing["on"] and response.type_url == CDS

    stacks = {name: AsyncExitStack() for name in ("one", "two")}
    replicas = {}
    for name, stack in stacks.items():
        (tmp_path / name).mkdir()
        replicas[name] = await stack.enter_async_context(serving(tmp_path / name, settings))
    try:
        leader = await until("a replica elected", lambda: leader_of(*replicas.values()))
        follower = next(r for r in replicas.values() if r is not leader)
        async with proxy(follower, "c-1", refuse=bad) as canary:
            async with proxy(leader, "p-1") as p1:
                await until("both served the baseline", lambda: canary.clusters == p1.clusters == {"a": "1s"})
                baseline = canary.versions[CDS]
                await until("the leader knows the canary", lambda: rollout_status(leader, "proxies_elsewhere"))

                # A good change: the canary (on the follower) first; its ACK reaches the leader; then p-1.
                snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
                await until("the canary has the candidate", lambda: canary.clusters == {"a": "2s"})
                await until("the rollout completed", lambda: events(leader, "rollout_completed"))
                await until("p-1 has it", lambda: p1.clusters == {"a": "2s"})
                assert [e["proxies"] for e in events(leader, "rollout_wave_started")] == [1, 1]
                assert not events(follower, "rollout_started")  # the follower decides nothing
                good = canary.versions[CDS]

                # A NACK on the follower rolls the candidate back everywhere.
                refusing["on"] = True
                snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="3s")))
                failed = await until("the rollback", lambda: events(leader, "rollout_failed"))
                assert "c-1 NACKed CDS" in failed[0]["reason"]
                await until("the canary back where it was", lambda: canary.seen[CDS][-1] == good)
                assert set(p1.seen[CDS]) == {baseline, good}
                refusing["on"] = False

                # The next change: the operator pauses it at the canary; then the leader stops.
                snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="4s")))
                await until("the canary has the next candidate", lambda: canary.clusters == {"a": "4s"})
                assert (await command(leader, "pause"))[0] == 200
                await until("the follower to know it", lambda: rollout_status(follower, "paused"))
            await stacks["one" if leader is replicas["one"] else "two"].aclose()

            # The survivor takes the decisions over: the canary keeps the candidate, p-1 (back on
            # the survivor) is served the baseline, and the paused rollout goes on when resumed.
            await until("the survivor to decide", lambda: rollout_status(follower, "deciding"), timeout=20)
            async with proxy(follower, "p-1") as p1:
                await until("p-1 served again", lambda: p1.clusters)
                assert p1.clusters == {"a": "2s"} and canary.clusters == {"a": "4s"}
                assert set(canary.seen[CDS][-1:]) != {good}
                status, body = await command(follower, "resume")
                assert status == 200, body
                await until("the rollout completed on the survivor", lambda: events(follower, "rollout_completed"))
                await until("p-1 has the candidate", lambda: p1.clusters == {"a": "4s"})
    finally:
        for stack in stacks.values():
            await stack.aclose()


@asynccontextmanager
async def reporting(running: Running, node: str, load: Callable[[], tuple[int, int]]) -> AsyncIterator[None]:
    """``node``'s load reporting stream to ``running``: every 0.1 s a report of cluster ``a``'s
    requests, ``load()`` saying how many succeeded and how many failed since the last one."""
    async with grpc.aio.insecure_channel(running.xds) as channel:
        call = lrs_pb2_grpc.LoadReportingServiceStub(channel).StreamLoadStats()
        await call.write(lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id=node, client_features=[SEND_ALL_FEATURE])))

        async def report() -> None:
            while True:
                await asyncio.sleep(0.1)
                ok, errors = load()
                request = lrs_pb2.LoadStatsRequest()
                stats = request.cluster_stats.add(cluster_name="a")
                stats.upstream_locality_stats.add(
                    total_successful_requests=ok, total_error_requests=errors, total_issued_requests=ok + errors
                )
                await call.write(request)

        task = asyncio.create_task(report())
        try:
            yield
        finally:
            task.cancel()
            call.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.e2e
async def test_on_etcd_load_reported_to_a_replica_that_does_not_decide_counts_in_the_gate(
    tmp_path: Path, etcd: str
) -> None:
    """The canary's ADS stream is on the deciding replica, its load reporting stream on the other
    (Envoy picks a replica per stream): the errors it reports there after the change fail the
    wave on the deciding one, which has no report of its own from the canary."""
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(yaml.safe_dump(document({"a": 9001})))
    flags = rollout(bake=30.0, health=True, min_requests=20)
    settings = ServeSettings(
        snapshot=snapshot,
        etcd=EtcdSettings(address=etcd, election_ttl=2.0),
        rollout=flags,
        xds=XdsSettings(lrs=LrsSettings(interval=0.1)),
    )
    async with AsyncExitStack() as stack:
        replicas = []
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            replicas.append(await stack.enter_async_context(serving(tmp_path / name, settings)))
        leader = await until("a replica elected", lambda: leader_of(*replicas))
        follower = next(r for r in replicas if r is not leader)
        canary = await stack.enter_async_context(proxy(leader, "c-1"))
        p1 = await stack.enter_async_context(proxy(leader, "p-1"))
        await until("both served the baseline", lambda: canary.clusters == p1.clusters == {"a": "1s"})
        baseline = p1.versions[CDS]
        # The canary's requests fail once it runs the candidate (connect timeout 2s); p-1's never do.
        await stack.enter_async_context(
            reporting(follower, "c-1", lambda: (10, 10) if canary.clusters == {"a": "2s"} else (20, 0))
        )
        await stack.enter_async_context(reporting(leader, "p-1", lambda: (20, 0)))
        snapshot.write_text(yaml.safe_dump(document({"a": 9001}, timeout="2s")))
        await until("the canary has the candidate", lambda: canary.clusters == {"a": "2s"})
        failed = await until("the wave failed on the load", lambda: events(leader, "rollout_failed"), timeout=30)
        assert "wave canary: error ratio 50" in failed[0]["reason"], failed[0]["reason"]
        await until("the canary rolled back", lambda: canary.clusters == {"a": "1s"})
        assert set(p1.seen[CDS]) == {baseline}, "p-1 never got the candidate"
        assert not events(follower, "rollout_failed")  # (the follower decides nothing)
