"""The Load Reporting Service on pilotfish's own gRPC server, spoken to by a grpcio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from inprocess import serving
from prometheus_client.parser import text_string_to_metric_families

from pilotfish.app import ServeSettings
from pilotfish.app.settings import XdsSettings
from pilotfish.commands.cli import main
from pilotfish.transport.aio import GrpcServer
from pilotfish.xds.lrs import SEND_ALL_FEATURE, LoadReporting, LrsSettings

TIMEOUT = 10.0


@dataclass
class Received:
    """The sink: every report as it reached it."""

    reports: list[tuple[str, lrs_pb2.LoadStatsRequest]] = field(default_factory=list)

    def report(self, node_id: str, group: str, request: lrs_pb2.LoadStatsRequest) -> None:
        self.reports.append((node_id, request))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Lrs:
    service: LoadReporting
    sink: Received
    clock: Clock
    stub: lrs_pb2_grpc.LoadReportingServiceStub


@pytest.fixture
async def lrs() -> AsyncIterator[Lrs]:
    sink, clock = Received(), Clock()
    service = LoadReporting(
        sink,
        settings=LrsSettings(interval=2.0),
        clock=clock,
        authorize=lambda identity, node: None if not node.startswith("forbidden") else f"{node!r} may not report",
        clusters_for=lambda node: ["web", "api"],
    )
    server = GrpcServer(service.methods())
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Lrs(service, sink, clock, lrs_pb2_grpc.LoadReportingServiceStub(channel))
    finally:
        await channel.close()
        await server.stop(0)


def report(
    node: str | None,
    *,
    cluster: str = "web",
    ok: int = 0,
    errors: int = 0,
    features: tuple[str, ...] = (SEND_ALL_FEATURE,),
) -> lrs_pb2.LoadStatsRequest:
    request = lrs_pb2.LoadStatsRequest()
    if node is not None:
        request.node.CopyFrom(base_pb2.Node(id=node, client_features=list(features)))
    if ok or errors:
        stats = request.cluster_stats.add(cluster_name=cluster)
        stats.upstream_locality_stats.append(
            load_report_pb2.UpstreamLocalityStats(
                total_successful_requests=ok, total_error_requests=errors, total_issued_requests=ok + errors
            )
        )
    return request


async def wait_for(condition: Callable[[], object], what: str) -> None:
    try:
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"waited {TIMEOUT:g} s for {what}") from None


async def test_a_client_is_told_what_to_report_and_how_often_and_its_reports_reach_the_sink(lrs: Lrs) -> None:
    call = lrs.stub.StreamLoadStats()
    await call.write(report("edge-1"))
    answer = await asyncio.wait_for(call.read(), TIMEOUT)
    assert answer.send_all_clusters and not answer.clusters
    assert answer.load_reporting_interval.ToNanoseconds() == 2_000_000_000

    lrs.clock.now += 2.0
    await call.write(report(None, ok=40, errors=2))  # later reports need not repeat the node
    await wait_for(lambda: lrs.sink.reports, "the first report")
    node, got = lrs.sink.reports[0]
    assert node == "edge-1"
    locality = got.cluster_stats[0].upstream_locality_stats[0]
    assert (got.cluster_stats[0].cluster_name, locality.total_successful_requests, locality.total_error_requests) == (
        "web",
        40,
        2,
    )
    assert lrs.service.open_streams == 1 and lrs.service.reports == 1
    await call.done_writing()
    assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.OK
    await wait_for(lambda: lrs.service.open_streams == 0, "the stream to be counted closed")


async def test_a_client_that_cannot_be_told_all_is_given_its_group_s_clusters(lrs: Lrs) -> None:
    call = lrs.stub.StreamLoadStats()
    await call.write(report("grpc-1", features=()))
    answer = await asyncio.wait_for(call.read(), TIMEOUT)
    assert not answer.send_all_clusters and list(answer.clusters) == ["web", "api"]
    call.cancel()


async def test_reports_faster_than_the_interval_allows_are_dropped_unparsed(lrs: Lrs) -> None:
    call = lrs.stub.StreamLoadStats()
    await call.write(report("edge-1"))
    await asyncio.wait_for(call.read(), TIMEOUT)
    for _ in range(200):  # a flood, all within a quarter of the interval of the first request
        await call.write(report(None, ok=1))
    lrs.clock.now += 0.5  # a quarter of the 2 s interval: the next one is taken
    await call.write(report(None, ok=7))
    await wait_for(lambda: lrs.sink.reports, "the report after the flood")
    assert [r.cluster_stats[0].upstream_locality_stats[0].total_successful_requests for _, r in lrs.sink.reports] == [7]
    assert lrs.service.dropped == 200
    call.cancel()


@pytest.mark.parametrize(
    ("first", "code", "says"),
    [
        (report(None, ok=1), grpc.StatusCode.INVALID_ARGUMENT, "must carry node.id"),
        (report("forbidden-1"), grpc.StatusCode.PERMISSION_DENIED, "may not report"),
        (report("x" * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "a shorter node id"),
    ],
)
async def test_a_stream_that_does_not_say_who_reports_or_may_not_is_refused(
    lrs: Lrs, first: lrs_pb2.LoadStatsRequest, code: grpc.StatusCode, says: str
) -> None:
    call = lrs.stub.StreamLoadStats()
    await call.write(first)
    assert await asyncio.wait_for(call.code(), TIMEOUT) == code
    assert says in await call.details()
    assert lrs.sink.reports == []
    await wait_for(lambda: lrs.service.open_streams == 0, "the refused stream to be counted closed")


async def test_a_stream_cannot_report_for_another_node(lrs: Lrs) -> None:
    call = lrs.stub.StreamLoadStats()
    await call.write(report("edge-1"))
    await asyncio.wait_for(call.read(), TIMEOUT)
    lrs.clock.now += 2.0
    await call.write(report("edge-2", ok=5))
    assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.INVALID_ARGUMENT
    assert "reports for one node" in await call.details()
    assert lrs.sink.reports == []


async def test_bytes_that_are_not_a_report_end_the_stream() -> None:
    service = LoadReporting(Received())
    server = GrpcServer(service.methods())
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats")()
            await call.write(b"\xff\xff\xff")
            assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a LoadStatsRequest" in await call.details()
    finally:
        await server.stop(0)


async def test_serve_takes_load_reports_on_its_xds_port_and_counts_them_in_its_metrics(tmp_path: Path) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text("services:\n  web:\n    endpoints: [127.0.0.1:9001]\n  api:\n    endpoints: [127.0.0.1:9002]\n")
    settings = ServeSettings(snapshot=snapshot, xds=XdsSettings(lrs=LrsSettings(interval=0.2)))
    async with serving(tmp_path, settings) as running, grpc.aio.insecure_channel(running.xds) as channel:
        call = lrs_pb2_grpc.LoadReportingServiceStub(channel).StreamLoadStats()
        await call.write(report("grpc-1", features=()))  # told its group's clusters, by name
        answer = await asyncio.wait_for(call.read(), TIMEOUT)
        assert sorted(answer.clusters) == ["api", "web"]
        assert answer.load_reporting_interval.ToNanoseconds() == 200_000_000

        async def scraped() -> dict[str, float]:
            async with aiohttp.ClientSession() as session, session.get(f"http://{running.admin}/metrics") as r:
                text = await r.text()
            return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if "lrs" in f.name}

        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while (counts := await scraped()).get("pilotfish_lrs_reports", 0) < 1:
            assert asyncio.get_running_loop().time() < deadline, f"no report was counted: {counts}"
            await call.write(report(None, ok=10, errors=1))
            await asyncio.sleep(0.1)
        assert counts["pilotfish_lrs_streams"] == 1
        call.cancel()


def test_a_reporting_interval_out_of_range_is_refused_naming_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text("services:\n  web:\n    endpoints: [127.0.0.1:9001]\n")
    assert main(["serve", "--snapshot", str(snapshot), "--lrs-interval", "50ms"]) == 2
    assert "--lrs-interval asks proxies to report load every 100ms to 1h" in capsys.readouterr().err
