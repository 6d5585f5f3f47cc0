"""The registry HTTP API (pilotfish.api.registry) on its in-memory store, over real HTTP on
loopback: a write is checked against the state pilotfish serves before it is made (a clash is 409
and changes nothing), a bad body is refused by a bound and named (400 not JSON or nested too
deeply, 413 too large), and what is accepted reaches the reconciler. The whole server in-process,
with xDS clients: tests/integration/test_registry_api.py."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pilotfish.api.registry import RegistryApi
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER
from pilotfish.resources.services import ServiceSpec
from pilotfish.sources.registry import Registry

FILE = DesiredState(services={"web": ServiceSpec(name="web", listen=("127.0.0.1", 10000))})
Client = TestClient[web.Request, web.Application]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Client, Reconciler, Registry]]:
    reconciler = Reconciler(SnapshotCache(), guard=None)
    reconciler.update("file", FILE)
    registry = Registry(clock=time.monotonic)
    api = RegistryApi(registry, reconciler, max_body=4096, max_depth=8)
    async with TestClient(TestServer(api.app(), host="127.0.0.1")) as client:
        yield client, reconciler, registry


async def test_a_write_clashing_with_what_is_served_is_409_and_changes_nothing(
    served: tuple[Client, Reconciler, Registry],
) -> None:
    client, _, registry = served
    response = await client.put("/v1/services/api", json={"listen": "127.0.0.1:10000"})
    assert response.status == 409
    body = await response.json()
    assert "nothing was changed" in body["error"] and "127.0.0.1:10000" in body["error"], body
    assert not registry.knows("api")
    assert (await client.get("/v1/services/api")).status == 404


async def test_what_is_accepted_reaches_the_reconciler_and_an_unknown_instance_is_404(
    served: tuple[Client, Reconciler, Registry],
) -> None:
    client, reconciler, registry = served
    assert (await client.put("/v1/services/api", json={"listen": "127.0.0.1:10001"})).status == 200
    response = await client.post("/v1/services/api/instances", json={"address": "127.0.0.1", "port": 9001})
    assert response.status == 201, await response.text()
    instance = (await response.json())["id"]
    snapshot = reconciler.build_now()
    assert snapshot is not None
    assert sorted(snapshot.types[CLUSTER.url].resources) == ["api", "web"]
    heartbeat = await client.put(f"/v1/services/api/instances/{instance}/heartbeat")
    assert heartbeat.status == 200
    unknown = await client.put("/v1/services/api/instances/nope/heartbeat")
    assert unknown.status == 404 and "nope" in (await unknown.json())["error"]
    assert (await client.delete(f"/v1/services/api/instances/{instance}")).status == 204
    assert registry.describe("api")["api"]["instances"] == []


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "the body is not valid JSON"),
        (b'{"port": NaN}', 400, "the body is not valid JSON"),
        (json.dumps({"a": [[[[[[[[[1]]]]]]]]]}).encode(), 400, "nests arrays or objects too deeply (at most 8 levels)"),
        (b"[" * 100_000 + b"]" * 100_000, 413, "is larger than 4096 bytes"),
    ],
)
async def test_a_bad_body_is_refused_by_its_bound_and_named(
    served: tuple[Client, Reconciler, Registry], body: bytes, status: int, says: str
) -> None:
    client, _, registry = served
    response = await client.put("/v1/services/api", data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    assert says in (await response.json())["error"]
    assert not registry.knows("api")


async def test_the_figures_the_metrics_show_count_registrations_expiries_and_every_refusal_by_status() -> None:
    now = [1000.0]
    reconciler = Reconciler(SnapshotCache(), guard=None)
    reconciler.update("file", FILE)
    registry = Registry(clock=lambda: now[0])
    api = RegistryApi(registry, reconciler, max_body=4096)
    async with TestClient(TestServer(api.app(), host="127.0.0.1")) as client:
        assert (await client.put("/v1/services/api", json={"listen": "127.0.0.1:10001"})).status == 200
        for port in (9001, 9002, 9001):  # the third registers 9001 again: counted, one instance still
            body = {"address": "127.0.0.1", "port": port, "ttl": 5}
            assert (await client.post("/v1/services/api/instances", json=body)).status == 201
        assert (await client.put("/v1/services/api", json={"listen": "127.0.0.1:10000"})).status == 409  # web's
        assert (await client.post("/v1/services/api/instances", data=b"{not json")).status == 400
        assert (await client.put("/v1/services/api/instances/127.0.0.1:1/heartbeat")).status == 404
        assert (await client.get("/v1/no-such-route")).status == 404
        figures = api.figures()
        assert (figures.services, figures.instances, figures.registrations) == (1, 2, 3)
        assert figures.refused == {400: 1, 404: 2, 409: 1}
        assert figures.expired == 0 and not figures.preserving

        assert (await client.put("/v1/services/api/instances/127.0.0.1:9001/heartbeat")).status == 200
        now[0] += 4
        assert (await client.put("/v1/services/api/instances/127.0.0.1:9001/heartbeat")).status == 200
        now[0] += 2  # 9002 lapsed alone (churn: below self-preservation's minimum), 9001 did not
        api.expire_once()
        figures = api.figures()
        assert (figures.instances, figures.expired) == (1, 1)
