"""The registry HTTP API in-process: registrations reach xDS; bad requests change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess import Running
from inprocess import serving as serve_in_process

from pilotfish.api.registry import RegistryApi
from pilotfish.app import ServeSettings
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.events import read_events
from pilotfish.reconcile import Reconciler
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import ServiceSpec
from pilotfish.sources.registry import Registry

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TIMEOUT = 10.0


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, snapshot: Path | None = None) -> AsyncIterator[Running]:
    async with serve_in_process(tmp_path, ServeSettings(snapshot=snapshot)) as running:
        yield running


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with serving(tmp_path) as server:
        yield server


class EdsWatcher:
    """An ADS stream subscribed to one service's endpoints, ACKing what it gets."""

    def __init__(self, call: Any, service: str) -> None:
        self.call, self.service = call, service

    async def next_ports(self) -> list[int]:
        response = await asyncio.wait_for(self.call.read(), TIMEOUT)
        await self.call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=EDS,
                resource_names=[self.service],
                version_info=response.version_info,
                response_nonce=response.nonce,
            )
        )
        ports: list[int] = []
        for item in response.resources:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            item.Unpack(assignment)
            ports += [
                lb.endpoint.address.socket_address.port_value
                for group in assignment.endpoints
                for lb in group.lb_endpoints
            ]
        return sorted(ports)

    async def until(self, expected: list[int]) -> list[list[int]]:
        """Read responses until the endpoints are ``expected``; return every set seen."""
        seen: list[list[int]] = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1] != expected:
                seen.append(await self.next_ports())
        return seen


@contextlib.asynccontextmanager
async def eds_watch(xds: str, service: str) -> AsyncIterator[EdsWatcher]:
    async with grpc.aio.insecure_channel(xds) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=[service], node={"id": "t"}))
        yield EdsWatcher(call, service)
        await call.done_writing()


async def test_registered_instances_reach_xds_and_leave_on_deregister(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        put = await http.put(running.url("/v1/services/web"), json={"listen": "127.0.0.1:10000"})
        assert put.status == 200, await put.text()
        for port in (9001, 9002):
            created = await http.post(
                running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": port, "weight": 2}
            )
            assert created.status == 201
            assert (await created.json())["id"] == f"127.0.0.1:{port}"
        async with eds_watch(running.xds, "web") as eds:
            await eds.until([9001, 9002])
            gone = await http.delete(running.url("/v1/services/web/instances/127.0.0.1:9001"))
            assert gone.status == 204
            assert (await eds.until([9002])) == [[9002]]  # straight there, nothing between
        listing = await (await http.get(running.url("/v1/services"))).json()
        assert [i["port"] for i in listing["services"]["web"]["instances"]] == [9002]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"address": "127.0.0.1"}, "port", "required"),
        ({"address": "127.0.0.1", "port": 70000}, "port", "65535"),
        ({"address": "127.0.0.1", "port": "80"}, "port", "whole number"),
        ({"address": "not_a_host", "port": 80}, "address", "IP address or a host name"),
        ({"address": "127.0.0.1", "port": 80, "ttl": -1}, "ttl", "seconds"),
        ({"address": "127.0.0.1", "port": 80, "colour": "red"}, "", "colour"),
    ],
)
async def test_bad_registrations_name_the_field_and_lose_nothing(
    running: Running, body: dict[str, Any], field: str, words: str
) -> None:
    async with aiohttp.ClientSession() as http:
        ok = await http.post(running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9001})
        assert ok.status == 201
        bad = await http.post(running.url("/v1/services/web/instances"), json=body)
        assert bad.status == 400
        error = await bad.json()
        assert any(p["field"] == field and words in p["message"] for p in error["problems"]), error
        still = await (await http.get(running.url("/v1/services/web"))).json()
        assert [i["id"] for i in still["instances"]] == ["127.0.0.1:9001"]


async def test_malformed_json_and_unknown_ids(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        bad = await http.post(
            running.url("/v1/services/web/instances"), data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert bad.status == 400 and "not valid JSON" in (await bad.json())["error"]
        missing = await http.put(running.url("/v1/services/web/instances/127.0.0.1:1/heartbeat"))
        assert missing.status == 404 and "register it again" in (await missing.json())["error"]
        bad_service = await http.put(running.url("/v1/services/web"), json={"protocol": "udp"})
        assert bad_service.status == 400
        assert (await bad_service.json())["problems"][0]["field"] == "protocol"


async def test_an_instance_without_heartbeats_expires_after_its_ttl(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        await http.post(running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9001})
        await http.post(
            running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9002, "ttl": 0.6}
        )
        async with eds_watch(running.xds, "web") as eds:
            await eds.until([9001, 9002])
            # Heartbeats keep it for longer than its TTL...
            for _ in range(4):
                await asyncio.sleep(0.3)
                beat = await http.put(running.url("/v1/services/web/instances/127.0.0.1:9002/heartbeat"))
                assert beat.status == 200
            listing = await (await http.get(running.url("/v1/services/web"))).json()
            assert len(listing["instances"]) == 2
            # ...and without them it goes.
            assert (await eds.until([9001])) == [[9001]]
        expired = events_named(running.events, "registry_expired")
        assert [e["instance"] for e in expired] == ["127.0.0.1:9002"]


# -- a request that would break the merged state is refused, and breaks nothing -------------------


def events_named(log: Path, name: str) -> list[dict[str, Any]]:
    return [event for event in read_events(log)[0] if event["event"] == name]


async def test_a_listen_address_in_use_is_refused_and_later_changes_are_served(tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text("services:\n  web:\n    listen: 127.0.0.1:10000\n    endpoints: ['127.0.0.1:9001']\n")
    async with serving(tmp_path, snapshot) as running, aiohttp.ClientSession() as http:
        # The address a service of the snapshot file listens on.
        clash = await http.put(running.url("/v1/services/web2"), json={"listen": "127.0.0.1:10000"})
        assert clash.status == 409
        error = await clash.json()
        assert [p["field"] for p in error["problems"]] == ["services.web2.listen"], error
        assert "already used by services.web" in error["error"] and f"defined by {snapshot}" in error["error"]
        assert (await http.get(running.url("/v1/services/web2"))).status == 404  # nothing was changed
        # The address a service defined through the registry itself listens on.
        api = await http.put(running.url("/v1/services/api"), json={"listen": "127.0.0.1:10001"})
        assert api.status == 200
        clash = await http.put(running.url("/v1/services/api2"), json={"listen": "127.0.0.1:10001"})
        assert clash.status == 409
        assert "services.api: defined by the registry" in (await clash.json())["error"]
        # A definition differing from the file's, and instances for it, are refused too...
        redefined = await http.put(running.url("/v1/services/web"), json={"listen": "127.0.0.1:10002"})
        assert redefined.status == 409 and "defined by both file and registry" in (await redefined.json())["error"]
        # ...while every valid change after the refused ones is served.
        async with eds_watch(running.xds, "web") as eds:
            await eds.until([9001])
            created = await http.post(
                running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9002}
            )
            assert created.status == 201
            assert (await eds.until([9001, 9002]))[-1] == [9001, 9002]
        assert events_named(running.events, "snapshot_error") == []


async def test_a_redefinition_that_moves_a_listener_onto_another_is_refused_and_kept(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        for name, port in (("a", 10010), ("b", 10011)):
            assert (
                await http.put(running.url(f"/v1/services/{name}"), json={"listen": f"127.0.0.1:{port}"})
            ).status == 200
        moved = await http.put(running.url("/v1/services/b"), json={"listen": "127.0.0.1:10010"})
        assert moved.status == 409
        kept = await (await http.get(running.url("/v1/services/b"))).json()
        assert kept["listen"] == "127.0.0.1:10011"


async def test_a_definition_with_routes_is_checked_against_every_service_and_shown_as_written(
    running: Running,
) -> None:
    routes = [{"prefix": "/slow", "to": "slow", "timeout": 1.5}, {"to": {"pool": 3, "canary": 1}}]
    async with aiohttp.ClientSession() as http:
        early = await http.put(running.url("/v1/services/edge"), json={"listen": "127.0.0.1:10020", "routes": routes})
        assert early.status == 409
        fields = [p["field"] for p in (await early.json())["problems"]]
        assert fields == ["services.edge.routes[0].to", "services.edge.routes[1].to", "services.edge.routes[1].to"]
        for name in ("slow", "pool", "canary"):
            assert (await http.put(running.url(f"/v1/services/{name}"), json={})).status == 200
        # An instance may be a host name: Envoy resolves it.
        named = await http.post(running.url("/v1/services/slow/instances"), json={"address": "localhost", "port": 9003})
        assert named.status == 201
        put = await http.put(running.url("/v1/services/edge"), json={"listen": "127.0.0.1:10020", "routes": routes})
        assert put.status == 200, await put.text()
        shown = await (await http.get(running.url("/v1/services/edge"))).json()
        assert shown["routes"] == routes


# -- bodies that are too big, too deep or not JSON get a 4xx, never a 500 ----------------------------


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"listen": "' + b"x" * (2 << 20) + b'"}', 413, "larger than"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "too deeply"),
        (b'{"a":' * 40 + b"1" + b"}" * 40, 400, "too deeply"),
        (b'{"listen": "127.0.0.1:10000", "connect_timeout": NaN}', 400, "NaN"),
        (b'{"retries": ' + b"7" * 5000 + b"}", 400, "not valid JSON"),
        (b"\xff\xfe\x00", 400, "not valid JSON"),
    ],
    ids=["2MiB", "nested-100000", "nested-40", "NaN", "5000-digits", "not-utf8"],
)
async def test_bad_bodies_get_a_4xx_and_the_server_goes_on(
    running: Running, caplog: pytest.LogCaptureFixture, body: bytes, status: int, words: str
) -> None:
    async with aiohttp.ClientSession() as http:
        bad = await http.put(
            running.url("/v1/services/web"), data=io.BytesIO(body), headers={"Content-Type": "application/json"}
        )
        assert bad.status == status
        assert words in (await bad.json())["error"]
        assert (await http.put(running.url("/v1/services/web"), json={"listen": "127.0.0.1:10000"})).status == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


# -- our own bugs: a JSON 500, a logged traceback, the change taken back ---------------------------


class RegistryWithABug(Registry):
    """A real registry whose state view fails once asked to: stands in for a bug of ours."""

    fail = False

    def state(self) -> DesiredState:
        if self.fail:
            raise RuntimeError("a bug")
        return super().state()


async def test_an_internal_error_is_a_json_500_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    registry = RegistryWithABug(clock=time.monotonic)
    api = RegistryApi(registry, Reconciler(SnapshotCache()))
    async with api_server(api) as base, aiohttp.ClientSession() as http:
        registry.fail = True
        failed = await http.post(f"{base}/v1/services/web/instances", json={"address": "127.0.0.1", "port": 9001})
        assert failed.status == 500
        assert "RuntimeError" in (await failed.json())["error"]
        registry.fail = False
        assert (await http.get(f"{base}/v1/services/web")).status == 404  # the registration was taken back
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    assert logged and "POST /v1/services/web/instances" in logged[0].getMessage()


@contextlib.asynccontextmanager
async def api_server(api: RegistryApi) -> AsyncIterator[str]:
    runner = web.AppRunner(api.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


# -- self-preservation ----------------------------------------------------------------------------


async def wait_for_event(log: Path, name: str, **fields: Any) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        while True:
            for event in events_named(log, name):
                if all(event.get(k) == v for k, v in fields.items()):
                    return event
            await asyncio.sleep(0.02)


async def test_when_every_instance_stops_heartbeating_expiry_pauses_until_turned_off(running: Running) -> None:
    ports = list(range(9001, 9011))
    async with aiohttp.ClientSession() as http:
        for port in ports:
            created = await http.post(
                running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": port, "ttl": 0.5}
            )
            assert created.status == 201
        entered = await wait_for_event(running.events, "registry_self_preservation", state="entered")
        assert entered["everywhere"] and entered["ttl_instances"] == 10
        # At most half can go first, each looking like churn (they lapse milliseconds apart);
        # the rest are kept: a partition is likelier than a dead fleet.
        listing = await (await http.get(running.url("/v1/services/web"))).json()
        kept = sorted(i["port"] for i in listing["instances"])
        assert len(kept) >= 5 and entered["lost_in_window"] > 5
        async with asyncio.timeout(TIMEOUT):  # the kept ones lapse too, and stay
            while (status := await (await http.get(running.url("/v1/self-preservation"))).json())["kept"][
                "lapsed"
            ] < len(kept):
                await asyncio.sleep(0.02)
        assert status["active"] and status["kept"]["lapsed"] == len(kept)
        listing = await (await http.get(running.url("/v1/services/web"))).json()
        assert sorted(i["port"] for i in listing["instances"]) == kept
        async with eds_watch(running.xds, "web") as eds:
            await eds.until(kept)  # still served
        # The operator knows better: the lapsed instances go. (Publishing their removal is then up
        # to the blast-radius guard, which holds a snapshot that empties a service.)
        off = await http.put(running.url("/v1/self-preservation"), json={"enabled": False})
        assert off.status == 200 and not (await off.json())["enabled"]
        await wait_for_event(running.events, "registry_self_preservation", state="exited")
        assert (await http.get(running.url("/v1/services/web"))).status == 404
        assert (
            sorted(int(e["instance"].rsplit(":", 1)[1]) for e in events_named(running.events, "registry_expired"))
            == ports
        )


# -- property: any sequence of requests gets 2xx/4xx answers and leaves a state that builds --------

FILE_DOCUMENT = {
    "services": {"shared": {"listen": "127.0.0.1:10003", "endpoints": ["127.0.0.1:9100"]}},
    "clusters": [
        {
            "name": "legacy",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "legacy",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9200}}}}
                        ]
                    }
                ],
            },
        }
    ],
    "listeners": [
        {
            "name": "edge",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10002}},
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "tcp",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                "stat_prefix": "edge",
                                "cluster": "legacy",
                            },
                        }
                    ]
                }
            ],
        }
    ],
}
ETCD_STATE = DesiredState(services={"api": ServiceSpec(name="api", listen=("127.0.0.1", 10001))})

NAMES = st.sampled_from(["web", "web2", "api", "shared", "legacy", "edge", "x.y", "bad name", "é"])
LISTEN = st.sampled_from(
    [
        "127.0.0.1:10000",
        "127.0.0.1:10001",
        "127.0.0.1:10002",
        "127.0.0.1:10003",
        "127.0.0.1:10004",
        "[::1]:10000",
        "nowhere",
        7,
        None,
    ]
)
SERVICE_BODIES: st.SearchStrategy[object] = st.fixed_dictionaries(
    {},
    optional={
        "listen": LISTEN,
        "protocol": st.sampled_from(["http", "tcp", "udp"]),
        "connect_timeout": st.sampled_from([1, "250ms", 0, -1, "x", 1e300, "nans", True]),
        "timeout": st.sampled_from([0, "15s", -3]),
        "retries": st.sampled_from([0, 3, 11, True, 2.5]),
        "upstream_protocol": st.sampled_from(["http1", "http2", "h3"]),
        "health_check": st.sampled_from([True, {"path": "/h"}, {"path": "h"}, {"interval": "1s", "timeout": 0}, 5]),
        "endpoints": st.just(["127.0.0.1:1"]),
        "colour": st.just("red"),
    },
) | st.sampled_from([None, [], "x", 3, {"listen": {"deep": [1]}}])
INSTANCE_BODIES: st.SearchStrategy[object] = st.fixed_dictionaries(
    {},
    optional={
        "address": st.sampled_from(["127.0.0.1", "10.0.0.2", "::1", "host", ""]),
        "port": st.sampled_from([9001, 9002, 0, 70000, "80"]),
        "weight": st.sampled_from([1, 128, 0, 1.5]),
        "metadata": st.sampled_from([{}, {"zone": "a"}, {"k": 1}, []]),
        "ttl": st.sampled_from([None, 5, 30, 0, -1, "x"]),
    },
) | st.sampled_from([None, [], "127.0.0.1:9001"])
IDS = st.sampled_from(["127.0.0.1:9001", "127.0.0.1:9002", "10.0.0.2:9001", "nope"])
RAW_BODIES = st.binary(max_size=64) | st.sampled_from([b"[" * 5000, b'{"listen": NaN}', b"\xff", b""])

Request = tuple[str, str, Any]
"""(method, path, body): a JSON-able body, raw bytes, or None; ("TICK", "", seconds) advances time."""
REQUESTS: st.SearchStrategy[Request] = st.one_of(
    st.tuples(st.just("PUT"), NAMES.map("/v1/services/{}".format), SERVICE_BODIES),
    st.tuples(st.just("DELETE"), NAMES.map("/v1/services/{}".format), st.none()),
    st.tuples(st.just("POST"), NAMES.map("/v1/services/{}/instances".format), INSTANCE_BODIES),
    st.tuples(st.just("PUT"), st.builds("/v1/services/{}/instances/{}/heartbeat".format, NAMES, IDS), st.none()),
    st.tuples(st.just("DELETE"), st.builds("/v1/services/{}/instances/{}".format, NAMES, IDS), st.none()),
    st.tuples(
        st.sampled_from(["PUT", "POST"]),
        st.sampled_from(["/v1/services/web", "/v1/services/web/instances", "/v1/self-preservation"]),
        RAW_BODIES,
    ),
    st.tuples(st.just("TICK"), st.just(""), st.sampled_from([1.0, 6.0, 40.0])),
)


class FakeTime:
    def __init__(self) -> None:
        self.time = 1000.0

    def __call__(self) -> float:
        return self.time


async def play(requests: list[Request]) -> None:
    reconciler = Reconciler(SnapshotCache())
    reconciler.update("file", DesiredState.of_document(parse_document(FILE_DOCUMENT, "snapshot.yaml")))
    reconciler.update("etcd", ETCD_STATE)
    reconciler.build_now()
    clock = FakeTime()
    api = RegistryApi(Registry(clock=clock), reconciler)
    async with api_server(api) as base, aiohttp.ClientSession() as http:
        for method, path, body in requests:
            if method == "TICK":
                clock.time += body
                api.expire_once()
            else:
                sent = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with http.request(method, base + path, **sent) as response:
                    assert response.status < 500, (method, path, body, await response.text())
                    assert response.status < 300 or "error" in await response.json()
            reconciler.build_now()  # raises ConfigError if the merged state does not build
            assert reconciler.last_error is None


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(REQUESTS, max_size=25))
def test_random_request_sequences_get_no_5xx_and_always_build(requests: list[Request]) -> None:
    asyncio.run(play(requests))
