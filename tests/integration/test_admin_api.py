"""The admin API over real HTTP, against ``pilotfish serve`` in-process with grpcio ADS clients;
``pilotfish status``, ``wait`` and ``confirm`` against it (run on a thread: they block).

A grpcio client plays the proxy: it asks for clusters, and ACKs or NACKs what it gets, so the
test decides each state the API must show.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2
from inprocess import TIMEOUT, Running
from inprocess import serving as serve_in_process
from test_tls import CDS, snapshot_doc, write_pair

from pilotfish.app import ServeSettings
from pilotfish.app.settings import EtcdSettings, RestSettings, TlsSettings
from pilotfish.commands.operate import AdminClient, client_context, confirm_command, status_command, wait_command
from pilotfish.events import check_event_log
from pilotfish.reconcile import GuardSettings

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def serving(tmp_path: Path, *names: str, **settings: Any) -> AsyncIterator[tuple[Running, Path]]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(snapshot_doc(*names)))
    async with serve_in_process(tmp_path, ServeSettings(snapshot=snapshot, **settings)) as running:
        yield running, snapshot


async def get(running: Running, path: str, *, method: str = "GET") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(method, f"http://{running.admin}{path}") as r:
        return r.status, await r.json()


async def until(what: str, check: Callable[[], Any]) -> Any:
    """Poll the (async) ``check`` until it returns something true; fail after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def ads(running: Running, node: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(running.xds) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster, first.node.user_agent_name = node, "edge", "grpc-test"
        first.node.user_agent_version = "9.9"
        await call.write(first)
        yield call
        call.cancel()


async def read(call: Any) -> discovery_pb2.DiscoveryResponse:
    response: discovery_pb2.DiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
    return response


def ack(response: discovery_pb2.DiscoveryResponse) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(
        type_url=CDS, version_info=response.version_info, response_nonce=response.nonce
    )


def nack(response: discovery_pb2.DiscoveryResponse, accepted: str, message: str) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(
        type_url=CDS,
        version_info=accepted,
        response_nonce=response.nonce,
        error_detail=status_pb2.Status(code=3, message=message),
    )


async def cds_of(running: Running, node: str) -> dict[str, Any]:
    status, body = await get(running, f"/v1/proxies?node={node}")
    assert status == 200
    return body["proxies"][0]["types"]["CDS"] if body["proxies"] else {}


async def run(command: Callable[..., int], *args: Any, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(command, *args, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


async def test_health_and_readiness(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _):
        assert await get(running, "/healthz") == (200, {"status": "serving"})
        assert await get(running, "/readyz") == (200, {"ready": True})


async def test_not_ready_says_what_it_waits_for(tmp_path: Path) -> None:
    settings = ServeSettings(etcd=EtcdSettings(address="127.0.0.1:1"), waiting_log_every=60)
    async with serve_in_process(tmp_path, settings) as running:
        status, body = await get(running, "/readyz")
        assert status == 503 and body["ready"] is False
        assert body["waiting_for"][0].startswith("etcd at 127.0.0.1:1"), body
        assert (await get(running, "/healthz"))[0] == 200


async def test_a_proxys_states_as_it_acks_and_nacks_and_what_wait_and_status_say(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, snapshot), ads(running, "edge-1") as call:
        first = await read(call)
        stale = await until("edge-1 to be listed", lambda: cds_of(running, "edge-1"))
        assert stale["state"] == "STALE" and stale["sent_version"] == first.version_info
        status, body = await get(running, "/v1/proxies")
        (proxy,) = body["proxies"]
        assert (
            proxy["node"],
            proxy["cluster"],
            proxy["user_agent"],
            proxy["user_agent_version"],
            proxy["group"],
            proxy["protocol"],
            proxy["streams"],
        ) == ("edge-1", "edge", "grpc-test", "9.9", "default", "sotw", 1)
        assert proxy["address"].startswith("ipv4:127.0.0.1:") and proxy["connected_since"] > 0
        code, _, err = await run(
            wait_command, AdminClient(running.admin), version=None, timeout=0.3, min_proxies=1, every=0.05
        )
        assert code == 1 and f"edge-1: CDS STALE {first.version_info[:12]}" in err

        await call.write(ack(first))
        synced = await until("the ACK", lambda: _in_state(running, "edge-1", "SYNCED"))
        assert synced["acked_version"] == first.version_info
        status, snapshots = await get(running, "/v1/snapshots")
        cds = snapshots["groups"]["default"]["types"]["CDS"]
        assert cds["summary"] == f"{first.version_info}: 1 of 1" and cds["seconds_to_last_ack"] >= 0
        assert snapshots["counters"]["CDS"] == {"responses": 1, "acks": 1, "nacks": 0}
        code, out, _ = await run(
            wait_command, AdminClient(running.admin), version=None, timeout=5, min_proxies=1, every=0.05
        )
        assert code == 0 and out == f"1 proxy has {snapshots['groups']['default']['label']}\n"

        # A new version the proxy rejects.
        snapshot.write_text(yaml.safe_dump(snapshot_doc("web", "api")))
        second = await read(call)
        await call.write(nack(second, first.version_info, "cluster api: value must be greater than 0s"))
        nacked = await until("the NACK", lambda: _in_state(running, "edge-1", "NACKED"))
        assert nacked["nack"]["version"] == second.version_info and nacked["acked_version"] == first.version_info
        assert "greater than 0s" in nacked["nack"]["message"]
        code, _, err = await run(
            wait_command, AdminClient(running.admin), version=None, timeout=30, min_proxies=0, every=0.05
        )
        assert code == 1 and "a proxy rejected the configuration" in err
        assert f"edge-1: CDS NACKED {second.version_info}: cluster api: value must be greater than 0s" in err
        code, out, _ = await run(
            status_command, AdminClient(running.admin), node="edge-*", cluster=None, state="NACKED"
        )
        assert code == 1 and out.splitlines()[1].startswith("edge-1") and "NACKED" in out  # (1: a proxy NACKED)
        assert "edge-1 rejected CDS" in out
        code, out, _ = await run(status_command, AdminClient(running.admin), node="other-*", cluster=None, state=None)
        assert code == 0 and out == "no proxy is connected that matches\n"
        status, snapshots = await get(running, "/v1/snapshots")
        cds = snapshots["groups"]["default"]["types"]["CDS"]
        assert (cds["acked"], cds["nacked"], cds["proxies"], cds["seconds_to_last_ack"]) == (0, 1, 1, None)

        # What it is being served, as Envoy JSON.
        status, config = await get(running, "/v1/config?node=edge-1")
        assert status == 200 and config["types"]["CDS"]["version"] == second.version_info
        names = sorted(cluster["name"] for cluster in config["types"]["CDS"]["resources"])
        assert names == ["api", "web"] and config["types"]["CDS"]["resources"][0]["connect_timeout"] == "1s"


async def _in_state(running: Running, node: str, state: str) -> dict[str, Any] | None:
    cds = await cds_of(running, node)
    return cds if cds.get("state") == state else None


async def test_bad_admin_requests_are_answered_with_the_reason(tmp_path: Path) -> None:
    async with serving(tmp_path, "web") as (running, _):
        status, body = await get(running, "/v1/proxies?state=happy")
        assert status == 400 and "SYNCED" in body["error"]
        assert (await get(running, "/v1/config"))[0] == 400
        status, body = await get(running, "/v1/config?node=nobody")
        assert status == 404 and "nobody" in body["error"]


async def test_secrets_are_shown_by_name_only(tmp_path: Path) -> None:
    snapshot = tmp_path / "snap.yaml"
    secret = {
        "name": "edge-cert",
        "tls_certificate": {
            "certificate_chain": {"inline_string": "chain"},
            "private_key": {"inline_string": "THE KEY"},
        },
    }
    snapshot.write_text(yaml.safe_dump({**snapshot_doc("web"), "secrets": [secret]}))
    async with serve_in_process(tmp_path, ServeSettings(snapshot=snapshot)) as running, ads(running, "edge-1") as call:
        await read(call)
        await until("edge-1 to be listed", lambda: cds_of(running, "edge-1"))
        status, config = await get(running, "/v1/config?node=edge-1")
        assert status == 200 and config["types"]["SDS"]["resources"] == [{"name": "edge-cert", "redacted": True}]
        assert "THE KEY" not in str(config)


async def test_a_held_snapshot_is_shown_and_confirmed_through_the_api(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = [f"svc-{i}" for i in range(10)]
    settings = {"guard": GuardSettings(max_removed_share=0.5, min_count=10)}
    async with serving(tmp_path, *names, **settings) as (running, snapshot):
        assert await get(running, "/v1/held") == (200, {"held": None})
        code, _, err = await run(confirm_command, AdminClient(running.admin))
        assert code == 1 and "nothing to confirm" in err
        before = (await get(running, "/v1/snapshots"))[1]["groups"]["default"]["label"]
        snapshot.write_text(yaml.safe_dump(snapshot_doc("svc-0")))  # removes 9 of 10 clusters: held

        async def held() -> Any:
            return (await get(running, "/v1/held"))[1]["held"]

        shown = await until("the guard to hold the snapshot", held)
        assert any("cluster" in reason for reason in shown["reasons"]), shown
        assert f"to publish it anyway: pilotfish confirm --admin {running.admin}, or kill -USR1" in caplog.text
        assert (await get(running, "/v1/snapshots"))[1]["held"]["version"] == shown["version"]
        code, out, _ = await run(confirm_command, AdminClient(running.admin))
        assert code == 0 and out.startswith(f"published {shown['version']}")
        status, snapshots = await get(running, "/v1/snapshots")
        assert status == 200
        assert snapshots["groups"]["default"]["label"] == shown["version"] != before
        assert snapshots["held"] is None
        assert await get(running, "/v1/held/confirm", method="POST") == (
            404,
            {"error": "no snapshot is held: nothing to confirm"},
        )
    confirmed = [line for line in running.events.read_text().splitlines() if '"snapshot_confirmed"' in line]
    assert len(confirmed) == 1 and '"by":"admin API"' in confirmed[0]
    assert not check_event_log(running.events)


async def test_rest_pollers_are_in_the_same_status_as_streams(tmp_path: Path) -> None:
    """A REST poll is recorded where the admin API reads (it used to get a status of its own)."""
    async with (
        serving(tmp_path, "web", rest=RestSettings(address="127.0.0.1:0")) as (running, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"version_info": "", "node": {"id": "poller-1", "cluster": "edge", "user_agent_name": "envoy"}}
        async with session.post(f"http://{running.rest}/v3/discovery:clusters", json=body) as response:
            assert response.status == 200
            version = (await response.json())["version_info"]
        status, listed = await get(running, "/v1/proxies?all=true&node=poller-*")
        assert status == 200
        (proxy,) = listed["proxies"]
        assert (proxy["protocol"], proxy["group"], proxy["connected"]) == ("rest", "rest", False)
        assert proxy["types"]["CDS"]["sent_version"] == version
        assert (await get(running, "/v1/proxies"))[1]["proxies"] == []  # between polls: not connected


async def test_with_tls_the_admin_api_is_https_only_and_asks_for_a_client_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = write_pair(tmp_path, ca.issue_cert("127.0.0.1"))
    ca_file, client_cert, client_key = tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key"
    ca.cert_pem.write_to_path(str(ca_file))
    client = ca.issue_cert("operator@example.com")
    client_cert.write_bytes(client.cert_chain_pems[0].bytes())
    client_key.write_bytes(client.private_key_pem.bytes())
    settings = {"tls": TlsSettings(cert=cert, key=key, admin_client_ca=ca_file)}
    async with serving(tmp_path, "web", **settings) as (running, _):
        tls = client_context(ca=ca_file, cert=client_cert, key=client_key)
        code, out, err = await run(
            status_command, AdminClient(running.admin, tls=tls), node=None, cluster=None, state=None
        )
        assert (code, out) == (0, "no proxy is connected\n"), err
        no_certificate = client_context(ca=ca_file, cert=None, key=None)
        code, _, err = await run(
            status_command, AdminClient(running.admin, tls=no_certificate), node=None, cluster=None, state=None
        )
        assert code == 3 and f"https://{running.admin}/v1/proxies" in err
        code, _, err = await run(status_command, AdminClient(running.admin), node=None, cluster=None, state=None)
        assert code == 3 and f"http://{running.admin}/v1/proxies" in err  # plain HTTP is not answered
    with pytest.raises(ValueError, match="give --tls-ca"):
        client_context(ca=None, cert=client_cert, key=client_key)
