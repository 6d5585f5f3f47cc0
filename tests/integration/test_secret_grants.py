"""SDS secrets reach only the proxies they are granted to (``--grant-secret``), over mTLS.

``pilotfish serve`` runs in-process with two secrets, each granted to one certificate identity;
grpcio ADS and SDS clients present certificates for those identities (SPIFFE URI SANs, issued by a
trustme CA). A secret asked for by a proxy it is not granted to is never sent: on an ADS stream,
answers go out in the order of the requests, so the SDS answers read before the answer to a CDS
request written last are all there is to an SDS request written before it (a secret that does
not exist, or is not granted, is answered with an SDS response without it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
import yaml
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from inprocess import serving as serve_in_process
from test_tls import CDS, TIMEOUT, Running, credentials, snapshot_doc, spiffe_cert, write_pair

from pilotfish.app import ServeSettings
from pilotfish.app.settings import PolicySettings, TlsSettings
from pilotfish.cache import SnapshotCache
from pilotfish.policy.authorize import parse_rule
from pilotfish.policy.grants import SecretGrants, parse_grant
from pilotfish.sources import load_snapshot
from pilotfish.xds import RestXds, XdsPolicy, XdsServer, start_rest_server, start_xds_server
from pilotfish.xds.server import MAX_DENIED_RECORDED

SDS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
EDGE = "spiffe://pilotfish.test/ns/edge/sa/edge"
API = "spiffe://pilotfish.test/ns/api/sa/api"


def secret(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "tls_certificate": {
            "certificate_chain": {"inline_string": f"chain of {name}"},
            "private_key": {"inline_string": f"private key of {name}"},
        },
    }


@asynccontextmanager
async def serving(tmp_path: Path, ca: trustme.CA, *grants: str, **settings: Any) -> AsyncIterator[Running]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(
        yaml.safe_dump(
            {**snapshot_doc("web"), "secrets": [secret("edge-cert"), secret("api-cert"), secret("ops-cert")]}
        )
    )
    cert, key = write_pair(tmp_path, ca.issue_cert("127.0.0.1"))
    client_ca = tmp_path / "client-ca.pem"
    ca.cert_pem.write_to_path(str(client_ca))
    async with serve_in_process(
        tmp_path,
        ServeSettings(
            snapshot=snapshot,
            tls=TlsSettings(cert=cert, key=key, client_ca=client_ca),
            policy=PolicySettings(secret_grants=tuple(map(parse_grant, grants)), **settings),
        ),
    ) as running:
        yield Running(running.xds, running.registry, running.events, cert, key)


@asynccontextmanager
async def ads_stream(address: str, creds: grpc.ChannelCredentials) -> AsyncIterator[Any]:
    async with grpc.aio.secure_channel(address, creds) as channel:
        yield ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()


def request(
    type_url: str, names: Sequence[str] = (), node: str | None = None, response: Any = None
) -> discovery_pb2.DiscoveryRequest:
    message = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names)
    if node is not None:
        message.node.id = node
    if response is not None:  # an ACK of it
        message.version_info, message.response_nonce = response.version_info, response.nonce
    return message


async def read(call: Any) -> discovery_pb2.DiscoveryResponse:
    response: discovery_pb2.DiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
    return response


async def secrets_until_cds(call: Any) -> list[str]:
    """The names of the secrets in the SDS answers read before the next CDS answer."""
    names: list[str] = []
    while (response := await read(call)).type_url != CDS:
        names += secret_names(response)
    return names


def secret_names(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    assert response.type_url == SDS, response.type_url
    return sorted(secret_pb2.Secret.FromString(any_.value).name for any_ in response.resources)


async def test_a_secret_goes_only_to_the_identity_it_is_granted_to(tmp_path: Path) -> None:
    ca = trustme.CA()
    async with serving(tmp_path, ca, f"edge-cert=identity:{EDGE}", f"api-cert=identity:{API}") as server:
        edge, api = credentials(ca, spiffe_cert(ca, EDGE)), credentials(ca, spiffe_cert(ca, API))
        async with ads_stream(server.xds, edge) as call:
            # Both names asked for: only the granted one comes.
            await call.write(request(SDS, ["api-cert", "edge-cert"], node="edge-1"))
            first = await read(call)
            assert secret_names(first) == ["edge-cert"]
            denied = await server.wait_for("secret_denied", secret="api-cert")
            assert denied["identity"] == EDGE and denied["node"] == "edge-1"
            # The ACK, then the ungranted secret alone, a wildcard, then CDS: CDS is the next answer.
            await call.write(request(SDS, ["api-cert", "edge-cert"], response=first))
            await call.write(request(SDS, ["api-cert"], response=first))
            await call.write(request(SDS, ["*", "ops-cert"], response=first))
            await call.write(request(CDS))
            assert await secrets_until_cds(call) == [], "an ungranted secret (or a wildcard) was answered"
            assert await server.wait_for("secret_denied", secret="*")
            assert await server.wait_for("secret_denied", secret="ops-cert")
            # Recorded once per stream and name, however often it is asked for.
            assert sorted(e["secret"] for e in server.events() if e["event"] == "secret_denied") == [
                "*",
                "api-cert",
                "ops-cert",
            ]

        # The identity it is granted to gets it, on the per-type SDS service too.
        async with grpc.aio.secure_channel(server.xds, api) as channel:
            call = sds_pb2_grpc.SecretDiscoveryServiceStub(channel).StreamSecrets()
            await call.write(request(SDS, ["api-cert", "edge-cert"], node="api-1"))
            assert secret_names(await read(call)) == ["api-cert"]
        assert (await server.wait_for("secret_denied", node="api-1"))["secret"] == "edge-cert"


async def test_node_grants_match_the_claimed_node_id(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = trustme.CA()
    (tmp_path / "unbound").mkdir()
    async with serving(tmp_path / "unbound", ca, "edge-cert=node:edge-*"):
        pass
    assert "without --authorize-node any peer" in caplog.text and "edge-cert=node:edge-*" in caplog.text
    caplog.clear()
    rules = (parse_rule(f"{EDGE}=edge-*"), parse_rule(f"{EDGE}=edge/7"))
    async with serving(tmp_path, ca, "edge-cert=node:edge-*", authorize_nodes=rules) as server:
        edge = credentials(ca, spiffe_cert(ca, EDGE))
        async with ads_stream(server.xds, edge) as call:
            await call.write(request(SDS, ["edge-cert", "api-cert"], node="edge-7"))
            assert secret_names(await read(call)) == ["edge-cert"]
        async with ads_stream(server.xds, edge) as call:  # '*' does not cross '/'
            await call.write(request(SDS, ["edge-cert"], node="edge/7"))
            await call.write(request(CDS))
            assert await secrets_until_cds(call) == []
        assert await server.wait_for("secret_denied", node="edge/7", secret="edge-cert")
    assert "without --authorize-node" not in caplog.text


async def test_without_grants_no_secret_is_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = trustme.CA()
    async with serving(tmp_path, ca) as server:
        assert "no proxy will receive them: api-cert, edge-cert, ops-cert" in caplog.text
        async with ads_stream(server.xds, credentials(ca, spiffe_cert(ca, EDGE))) as call:
            await call.write(request(SDS, ["edge-cert"], node="edge-1"))
            await call.write(request(CDS))
            assert await secrets_until_cds(call) == []
        assert await server.wait_for("secret_denied", secret="edge-cert", identity=EDGE)


async def test_denials_recorded_per_stream_are_bounded(tmp_path: Path) -> None:
    ca = trustme.CA()
    async with serving(tmp_path, ca, f"edge-cert=identity:{EDGE}") as server:
        async with ads_stream(server.xds, credentials(ca, spiffe_cert(ca, EDGE))) as call:
            made_up = [f"key-{i:04}" for i in range(MAX_DENIED_RECORDED + 50)]
            await call.write(request(SDS, [*made_up[:100], "edge-cert"], node="edge-1"))
            assert secret_names(await read(call)) == ["edge-cert"]
            await call.write(request(SDS, [*made_up[100:], "edge-cert"]))  # a changed subscription, no nonce
            await call.write(request(CDS))
            assert await secrets_until_cds(call) == []
        await server.wait_for("stream_closed", node="edge-1")
        denied = [e["secret"] for e in server.events() if e["event"] == "secret_denied"]
        assert len(denied) == len(set(denied)) == MAX_DENIED_RECORDED and set(denied) <= set(made_up)


async def test_a_grant_change_takes_effect_at_the_next_request(tmp_path: Path) -> None:
    """Grants are checked at every SDS request: one added is served at the next request of the
    same stream; one removed stops later versions (what was sent stays sent: SotW cannot take it
    back). Plaintext, node grants: the server is driven directly."""
    snapshot = tmp_path / "snap.yaml"

    def write(version: str) -> None:
        snapshot.write_text(yaml.safe_dump({"version": version, "secrets": [secret("edge-cert")]}))

    write("1")
    cache = SnapshotCache()
    cache.set_snapshot(load_snapshot(snapshot))
    xds = XdsServer(cache)
    server, port = await start_xds_server(xds, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
            await call.write(request(SDS, ["edge-cert"], node="edge-1"))
            first = await read(call)
            assert secret_names(first) == []  # no grants: it does not exist for this proxy
            xds.policy.grants.value = SecretGrants([parse_grant("edge-cert=node:edge-1")])
            await call.write(request(SDS, ["edge-cert"], response=first))
            second = await read(call)
            assert secret_names(second) == ["edge-cert"] and second.version_info == "1"
            xds.policy.grants.value = SecretGrants()
            await call.write(request(SDS, ["edge-cert"], response=second))
            write("2")
            cache.set_snapshot(load_snapshot(snapshot))
            third = await read(call)
            assert third.version_info == "2" and secret_names(third) == []
    finally:
        await server.stop(0.5)


async def test_one_change_of_the_shared_policy_reaches_open_streams_and_rest_polls(tmp_path: Path) -> None:
    """gRPC and REST xDS share one XdsPolicy: one ``set_grants`` (what ``serve`` does when the
    grants file changes) sends an open SotW stream the secret it now may have, without another
    request, and answers the next REST poll with it too."""
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"version": "1", "secrets": [secret("edge-cert")]}))
    cache = SnapshotCache()
    cache.set_snapshot(load_snapshot(snapshot))
    policy = XdsPolicy()
    server, port = await start_xds_server(XdsServer(cache, policy), "127.0.0.1:0")
    runner, rest_address = await start_rest_server(RestXds(cache, policy), "127.0.0.1:0")
    body = {"node": {"id": "edge-1"}, "resource_names": ["edge-cert"]}

    async def rest_secrets(session: aiohttp.ClientSession) -> list[str]:
        async with session.post(f"http://{rest_address}/v3/discovery:secrets", json=body) as answer:
            assert answer.status == 200, await answer.text()
            return sorted(resource["name"] for resource in (await answer.json()).get("resources", []))

    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
        ):
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
            await call.write(request(SDS, ["edge-cert"], node="edge-1"))
            first = await read(call)
            assert secret_names(first) == []  # no grants: it does not exist for this proxy
            await call.write(request(SDS, ["edge-cert"], response=first))  # the ACK
            assert await rest_secrets(session) == []
            policy.set_grants(SecretGrants([parse_grant("edge-cert=node:edge-1")]))
            assert secret_names(await read(call)) == ["edge-cert"]  # no request in between
            assert await rest_secrets(session) == ["edge-cert"]
    finally:
        await runner.cleanup()
        await server.stop(0.5)


async def test_a_delta_stream_gets_only_granted_secrets(tmp_path: Path) -> None:
    """The same rule on incremental xDS: a denied name is neither sent nor told removed."""
    ca = trustme.CA()
    async with serving(tmp_path, ca, f"edge-cert=identity:{EDGE}") as server:
        edge = credentials(ca, spiffe_cert(ca, EDGE))
        async with grpc.aio.secure_channel(server.xds, edge) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
            first = discovery_pb2.DeltaDiscoveryRequest(
                type_url=SDS, resource_names_subscribe=["api-cert", "edge-cert"]
            )
            first.node.id = "edge-1"
            await call.write(first)
            got: discovery_pb2.DeltaDiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
            assert [r.name for r in got.resources] == ["edge-cert"] and list(got.removed_resources) == []
            assert secret_pb2.Secret.FromString(got.resources[0].resource.value).name == "edge-cert"
            assert (await server.wait_for("secret_denied", secret="api-cert"))["node"] == "edge-1"
            # A wildcard, then CDS: the CDS answer comes next, nothing about secrets before it.
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    type_url=SDS, resource_names_subscribe=["*"], response_nonce=got.nonce
                )
            )
            await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=CDS))
            nxt: discovery_pb2.DeltaDiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
            assert nxt.type_url == CDS, f"an ungranted secret or a wildcard was answered: {nxt}"
            assert await server.wait_for("secret_denied", secret="*")


def write_grants(path: Path, *grants: str) -> None:
    """The grants file, replaced atomically (rename over), as a deploy tool writes it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump({"grants": list(grants)}))
    os.replace(tmp, path)


async def test_an_edited_grants_file_applies_to_open_streams_and_a_bad_edit_keeps_the_last_good(tmp_path: Path) -> None:
    """``--grants-file``: a grant added to the file reaches the proxy already waiting for the
    secret, on its open SotW and delta streams, without a restart or a new request; a bad edit is
    reported and changes nothing; a grant removed stops the secret for new streams."""
    ca = trustme.CA()
    grants = tmp_path / "grants.yaml"
    write_grants(grants, f"edge-cert=identity:{EDGE}")
    async with serving(tmp_path, ca, grants_file=grants) as server:
        api = credentials(ca, spiffe_cert(ca, API))
        async with ads_stream(server.xds, api) as sotw, grpc.aio.secure_channel(server.xds, api) as channel:
            await sotw.write(request(SDS, ["api-cert"], node="api-1"))
            first = await read(sotw)
            assert secret_names(first) == []  # not granted (yet): answered without it
            await sotw.write(request(SDS, ["api-cert"], response=first))  # the ACK: now it waits
            delta = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
            subscribe = discovery_pb2.DeltaDiscoveryRequest(type_url=SDS, resource_names_subscribe=["api-cert"])
            subscribe.node.id = "api-2"
            await delta.write(subscribe)
            await server.wait_for("secret_denied", node="api-2", secret="api-cert")

            write_grants(grants, f"edge-cert=identity:{EDGE}", f"api-cert=identity:{API}")
            granted = await read(sotw)  # no request in between: the new grants reopened the watch
            assert secret_names(granted) == ["api-cert"] and granted.version_info == first.version_info
            got: discovery_pb2.DeltaDiscoveryResponse = await asyncio.wait_for(delta.read(), TIMEOUT)
            assert [r.name for r in got.resources] == ["api-cert"]
            loaded = await server.wait_for("grants_loaded", file=str(grants))
            assert loaded["grants"] == 2

            # A bad edit: reported naming the file and the entry; the last good grants stay.
            write_grants(grants, f"edge-cert=identity:{EDGE}", "api-cert=api-1")
            error = await server.wait_for("grants_error", file=str(grants))
            assert "grants[1]" in error["reason"] and "SECRET=identity:PATTERN" in error["reason"]
        async with ads_stream(server.xds, api) as call:
            await call.write(request(SDS, ["api-cert"], node="api-3"))
            assert secret_names(await read(call)) == ["api-cert"]

        # Removed from the file: a new stream of that identity is not granted it.
        write_grants(grants, f"edge-cert=identity:{EDGE}")
        async with asyncio.timeout(TIMEOUT):
            while len([e for e in server.events() if e["event"] == "grants_loaded"]) < 2:
                await asyncio.sleep(0.02)
        async with ads_stream(server.xds, api) as call:
            await call.write(request(SDS, ["api-cert"], node="api-4"))
            await call.write(request(CDS))
            assert await secrets_until_cds(call) == []
        assert await server.wait_for("secret_denied", node="api-4", secret="api-cert")
