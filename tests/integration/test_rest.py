"""REST xDS over real HTTP (aiohttp client) against ``pilotfish serve --rest`` in-process.

A poll is a JSON DiscoveryRequest POSTed to ``/v3/discovery:<type>``; the answer is a JSON
DiscoveryResponse (200), nothing (304: current), or a JSON error naming what is wrong (400, 403,
404, 405, 413) or why nothing can be served yet (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format
from inprocess import TIMEOUT, Running
from inprocess import serving as serve_in_process
from test_tls import spiffe_cert, write_pair

from pilotfish.app import ServeSettings
from pilotfish.app.settings import EtcdSettings, PolicySettings, RestSettings, TlsSettings, XdsSettings
from pilotfish.events import read_events
from pilotfish.policy.authorize import parse_rule
from pilotfish.policy.grants import parse_grant
from pilotfish.policy.groups import parse_node_group
from pilotfish.protocol import XdsLimits
from pilotfish.resources.anytypes import ensure_types_in
from pilotfish.resources.bootstrap import rest_config_source
from pilotfish.xds.rest import DEFAULT_MAX_BODY, PATHS

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SDS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
EDGE = "spiffe://pilotfish.test/ns/edge/sa/edge"


def document(*, version: str = "1", web_port: int = 9001) -> dict[str, Any]:
    """Two EDS clusters, their endpoints, a listener using RDS, its route, two secrets."""
    rest = {
        "api_config_source": {
            "api_type": "REST",
            "transport_api_version": "V3",
            "cluster_names": ["xds_cluster"],
            "refresh_delay": "1s",
        },
        "resource_api_version": "V3",
    }

    def address(port: int) -> dict[str, Any]:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    def secret(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "tls_certificate": {
                "certificate_chain": {"inline_string": f"chain of {name}"},
                "private_key": {"inline_string": f"key of {name}"},
            },
        }

    ports = {"web": web_port, "api": 9002}
    return {
        "version": version,
        "clusters": [
            {"name": name, "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": {"eds_config": rest}}
            for name in ports
        ],
        "endpoints": [
            {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address(port)}}]}]}
            for name, port in ports.items()
        ],
        "listeners": [
            {
                "name": "ingress",
                "address": address(10000),
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": HCM,
                                    "stat_prefix": "ingress",
                                    "rds": {"route_config_name": "local_route", "config_source": rest},
                                    "http_filters": [
                                        {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}
                                    ],
                                },
                            }
                        ]
                    }
                ],
            }
        ],
        "routes": [
            {
                "name": "local_route",
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "web"}}],
                    }
                ],
            }
        ],
        "secrets": [secret("edge-cert"), secret("ops-cert")],
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, settings: ServeSettings | None = None, *, doc: dict[str, Any] | None = None
) -> AsyncIterator[Running]:
    snapshot = tmp_path / "snapshot.yaml"
    write(snapshot, doc or document())
    settings = settings or ServeSettings()
    settings = replace(settings, snapshot=snapshot, rest=replace(settings.rest, address="127.0.0.1:0"))
    async with serve_in_process(tmp_path, settings) as running:
        yield running


def poll(node: str = "edge-1", names: list[str] | None = None, version: str = "", **extra: Any) -> dict[str, Any]:
    """A poll as Envoy sends it (proto field names; Envoy's node carries more, ignored here)."""
    return {"version_info": version, "node": {"id": node, "cluster": "edge"}, "resource_names": names or [], **extra}


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base

    async def post(self, path: str, body: Any, *, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(
            self.base + path, data=io.BytesIO(data), headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.read()

    async def discover(self, kind: str, body: dict[str, Any]) -> discovery_pb2.DiscoveryResponse:
        status, text = await self.post(f"/v3/discovery:{kind}", body)
        assert status == 200, (status, text)
        message = json.loads(text)
        ensure_types_in(message)  # so the test's parser knows every @type in it
        return json_format.ParseDict(message, discovery_pb2.DiscoveryResponse())


@contextlib.asynccontextmanager
async def client(running: Running, *, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Client]:
    assert running.rest is not None
    scheme = "https" if ssl_context is not None else "http"
    connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        yield Client(session, f"{scheme}://{running.rest}")


def events(running: Running) -> list[dict[str, Any]]:
    return read_events(running.events)[0]


def names_of(response: discovery_pb2.DiscoveryResponse, field: str = "name") -> list[str]:
    out = []
    for item in response.resources:
        data = json_format.MessageToDict(item, preserving_proto_field_name=True)
        out.append(data[field])
    return sorted(out)


async def test_clusters_and_listeners_come_whole_and_a_current_poll_gets_304(tmp_path: Path) -> None:
    async with serving(tmp_path) as running, client(running) as rest:
        clusters = await rest.discover("clusters", poll())
        assert clusters.version_info == "1" and clusters.type_url == CDS
        assert names_of(clusters) == ["api", "web"]
        assert all(item.type_url == CDS for item in clusters.resources)
        listeners = await rest.discover("listeners", poll())
        assert names_of(listeners) == ["ingress"] and listeners.type_url == LDS
        # The listener's typed_config (an Any inside the resource) is JSON with its @type.
        status, text = await rest.post("/v3/discovery:listeners", poll())
        assert HCM in text.decode()

        for kind in ("clusters", "listeners"):
            status, text = await rest.post(f"/v3/discovery:{kind}", poll(version="1"))
            assert (status, text) == (304, b""), kind
        # Another version stated: the whole set again.
        assert names_of(await rest.discover("clusters", poll(version="0"))) == ["api", "web"]

    answers = [(e["type"], e["answer"]) for e in events(running) if e["event"] == "rest_request"]
    assert answers == [(CDS, 200), (LDS, 200), (LDS, 200), (CDS, 304), (LDS, 304), (CDS, 200)]
    sent = [e for e in events(running) if e["event"] == "sent"]
    assert sent[0] | {"ts": 0} == {
        "ts": 0,
        "event": "sent",
        "node": "edge-1",
        "type": CDS,
        "version": "1",
        "rest": True,
        "resources": 2,
    }


async def test_endpoints_routes_and_secrets_are_the_named_ones(tmp_path: Path) -> None:
    settings = ServeSettings(policy=PolicySettings(secret_grants=(parse_grant("*-cert=node:edge-*"),)))
    async with serving(tmp_path, settings) as running, client(running) as rest:
        endpoints = await rest.discover("endpoints", poll(names=["web"]))
        assert names_of(endpoints, "cluster_name") == ["web"] and endpoints.type_url == EDS
        assert names_of(await rest.discover("endpoints", poll(names=["web", "api", "nope"])), "cluster_name") == [
            "api",
            "web",
        ]
        assert len((await rest.discover("endpoints", poll(names=["nope"]))).resources) == 0
        routes = await rest.discover("routes", poll(names=["local_route"]))
        assert names_of(routes) == ["local_route"] and routes.type_url == RDS
        # No names: nothing (only CDS and LDS have a wildcard).
        assert len((await rest.discover("routes", poll())).resources) == 0
        secrets = await rest.discover("secrets", poll(names=["edge-cert"]))
        assert names_of(secrets) == ["edge-cert"] and secrets.type_url == SDS
        assert (await rest.post("/v3/discovery:endpoints", poll(names=["web"], version="1")))[0] == 304


async def test_runtime_layers_are_polled_by_name(tmp_path: Path) -> None:
    doc = document() | {"runtime": [{"name": "flags", "layer": {"a.b": 1}}, {"name": "other", "layer": {}}]}
    async with serving(tmp_path, doc=doc) as running, client(running) as rest:
        layers = await rest.discover("runtime", poll(names=["flags"]))
        assert names_of(layers) == ["flags"] and layers.type_url.endswith("envoy.service.runtime.v3.Runtime")
        assert len((await rest.discover("runtime", poll())).resources) == 0, "no wildcard"


async def test_a_named_poll_is_current_while_its_resources_are_unchanged(tmp_path: Path) -> None:
    """Only what changed is sent: after web's endpoints change, a poll for api at the old version
    gets 304, one for web gets web's new endpoints."""
    doc = document()
    async with serving(tmp_path, doc=doc) as running, client(running) as rest:
        write(tmp_path / "snapshot.yaml", document(version="2", web_port=9003))
        async with asyncio.timeout(TIMEOUT):  # the endpoints change; the clusters stay at "1"
            while (await rest.post("/v3/discovery:endpoints", poll(names=["web"], version="1")))[0] == 304:
                await asyncio.sleep(0.02)
        assert (await rest.post("/v3/discovery:clusters", poll(version="1")))[0] == 304, "versions are per type"
        status, _ = await rest.post("/v3/discovery:endpoints", poll(names=["api"], version="1"))
        assert status == 304
        web = await rest.discover("endpoints", poll(names=["web"], version="1"))
        assert web.version_info == "2"
        assert "9003" in json_format.MessageToJson(web)
        # Both named: one of them changed, so both come.
        both = await rest.discover("endpoints", poll(names=["api", "web"], version="1"))
        assert names_of(both, "cluster_name") == ["api", "web"]


async def test_secrets_go_only_to_the_pollers_granted_them(tmp_path: Path) -> None:
    settings = ServeSettings(policy=PolicySettings(secret_grants=(parse_grant("edge-cert=node:edge-*"),)))
    async with serving(tmp_path, settings) as running, client(running) as rest:
        granted = await rest.discover("secrets", poll(node="edge-1", names=["edge-cert", "ops-cert"]))
        assert names_of(granted) == ["edge-cert"], "ops-cert is granted to no one"
        assert len((await rest.discover("secrets", poll(node="api-1", names=["edge-cert"]))).resources) == 0
        assert len((await rest.discover("secrets", poll(node="edge-1", names=["*"]))).resources) == 0
    denied = {(e["node"], e["secret"]) for e in events(running) if e["event"] == "secret_denied"}
    assert denied == {("edge-1", "ops-cert"), ("api-1", "edge-cert"), ("edge-1", "*")}


async def test_an_edited_grants_file_applies_to_the_next_poll(tmp_path: Path) -> None:
    grants = tmp_path / "grants.yaml"
    write(grants, {"grants": ["edge-cert=node:edge-*"]})
    settings = ServeSettings(policy=PolicySettings(grants_file=grants))
    async with serving(tmp_path, settings) as running, client(running) as rest:
        assert names_of(await rest.discover("secrets", poll(node="edge-1", names=["ops-cert"]))) == []
        write(grants, {"grants": ["edge-cert=node:edge-*", "ops-cert=node:edge-1"]})
        async with asyncio.timeout(TIMEOUT):  # the file is looked at every second
            while not any(e["event"] == "grants_loaded" for e in events(running)):
                await asyncio.sleep(0.02)
        assert names_of(await rest.discover("secrets", poll(node="edge-1", names=["ops-cert"]))) == ["ops-cert"]


async def test_secrets_over_mtls_go_by_certificate_identity_and_node_claims_are_checked(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = write_pair(tmp_path, ca.issue_cert("127.0.0.1"))
    client_ca = tmp_path / "client-ca.pem"
    ca.cert_pem.write_to_path(str(client_ca))
    edge_pem, edge_key = spiffe_cert(ca, EDGE)
    (tmp_path / "edge.pem").write_bytes(edge_pem)
    (tmp_path / "edge.key").write_bytes(edge_key)
    context = ssl.create_default_context(cafile=str(client_ca))
    context.load_cert_chain(tmp_path / "edge.pem", tmp_path / "edge.key")
    settings = ServeSettings(
        tls=TlsSettings(cert=cert, key=key, client_ca=client_ca),
        policy=PolicySettings(
            authorize_nodes=(parse_rule(f"{EDGE}=edge-*"),), secret_grants=(parse_grant(f"edge-cert=identity:{EDGE}"),)
        ),
    )
    async with serving(tmp_path, settings) as running, client(running, ssl_context=context) as rest:
        secrets = await rest.discover("secrets", poll(node="edge-1", names=["edge-cert", "ops-cert"]))
        assert names_of(secrets) == ["edge-cert"]
        for _ in range(3):  # a poller asks again every refresh delay
            status, text = await rest.post("/v3/discovery:clusters", poll(node="api-1"))
            assert status == 403 and json.loads(text)["field"] == "node.id"
        # Without a client certificate the handshake fails: nothing is served.
        bare = ssl.create_default_context(cafile=str(client_ca))
        async with client(running, ssl_context=bare) as anonymous:
            with pytest.raises(aiohttp.ClientError):
                await anonymous.post("/v3/discovery:clusters", poll(node="edge-1"))
    refused = [e for e in events(running) if e["event"] == "node_refused"]
    assert [(e["identity"], e["node"], e["rest"]) for e in refused] == [(EDGE, "api-1", True)], "once"


async def test_bad_polls_are_refused_with_the_field_at_fault(tmp_path: Path) -> None:
    limits = XdsLimits(max_resource_names=10, max_node_id_chars=64)
    async with serving(tmp_path, ServeSettings(xds=XdsSettings(limits=limits))) as running, client(running) as rest:
        status, text = await rest.post("/v3/discovery:nothing", poll())
        assert status == 404 and json.loads(text)["paths"] == list(PATHS)
        async with rest.session.get(rest.base + "/v3/discovery:clusters") as response:
            assert response.status == 405 and response.headers["Allow"] == "POST"

        status, text = await rest.post("/v3/discovery:clusters", None, raw=b"{not json")
        assert status == 400 and "not a JSON DiscoveryRequest" in json.loads(text)["error"]
        status, text = await rest.post("/v3/discovery:clusters", ["not", "an", "object"])
        assert status == 400 and "JSON object" in json.loads(text)["error"]
        status, text = await rest.post("/v3/discovery:clusters", {"resource_names": 5})
        assert status == 400 and json.loads(text)["field"] == "resource_names"
        status, text = await rest.post("/v3/discovery:clusters", {"node": {"id": 7}})
        assert status == 400 and json.loads(text)["field"] == "node.id"
        status, text = await rest.post("/v3/discovery:clusters", poll(type_url=EDS))
        assert status == 400 and json.loads(text)["field"] == "type_url"
        status, text = await rest.post("/v3/discovery:clusters", poll(node="x" * 65))
        assert status == 400 and json.loads(text)["field"] == "node.id"
        deep = b'{"node": {"metadata": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_000 + b"}}"
        status, text = await rest.post("/v3/discovery:clusters", None, raw=deep)
        assert status == 400 and "depth" in json.loads(text)["error"]

        status, text = await rest.post("/v3/discovery:endpoints", poll(names=[f"c{i}" for i in range(11)]))
        assert status == 413 and json.loads(text)["field"] == "resource_names"
        assert "max_resource_names" in json.loads(text)["error"]
        big = poll(names=["web"], padding="x" * DEFAULT_MAX_BODY)
        status, text = await rest.post("/v3/discovery:endpoints", big)
        assert status == 413 and f"{DEFAULT_MAX_BODY:,} bytes" in json.loads(text)["error"]

        # Refusals changed nothing: a good poll is still answered.
        assert (await rest.post("/v3/discovery:clusters", poll()))[0] == 200
    refused = [e for e in events(running) if e["event"] == "rest_refused"]
    assert refused and refused[0]["status"] == 404, "refusals are recorded (at most one per 10 s)"


async def test_nothing_is_served_before_the_first_snapshot(tmp_path: Path) -> None:
    """etcd never answers: no snapshot is published, and polls get 503 with the reason (Envoy
    keeps what it has and polls again)."""
    settings = ServeSettings(
        etcd=EtcdSettings(address="127.0.0.1:1"), waiting_log_every=60, rest=RestSettings(address="127.0.0.1:0")
    )
    async with serve_in_process(tmp_path, settings) as running, client(running) as rest:
        status, text = await rest.post("/v3/discovery:clusters", poll())
        assert status == 503 and "waiting for its sources" in json.loads(text)["error"]
    assert [e["answer"] for e in events(running) if e["event"] == "rest_request"] == [503]


SERVICES = {
    "services": {
        "web": {
            "listen": "127.0.0.1:10000",
            "zone_local": True,
            "endpoints": [
                {"address": "127.0.0.1", "port": 9001, "zone": "east"},
                {"address": "127.0.0.1", "port": 9002, "zone": "west"},
            ],
        }
    }
}


async def _ads_clusters(xds: str, node: dict[str, Any]) -> list[cluster_pb2.Cluster]:
    async with grpc.aio.insecure_channel(xds) as channel, asyncio.timeout(TIMEOUT):
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node=node))
        response = await call.read()
        call.cancel()
    clusters = []
    for item in response.resources:
        cluster = cluster_pb2.Cluster()
        item.Unpack(cluster)
        clusters.append(cluster)
    return clusters


@pytest.mark.parametrize(
    ("rules", "ports"),
    [((), [9001, 9002]), (("east:rest@east=cluster:edge",), [9001])],
    ids=["built-in rest group", "a rest group in a zone"],
)
async def test_services_reach_pollers_with_eds_and_rds_over_rest_and_streams_over_ads(
    tmp_path: Path, rules: tuple[str, ...], ports: list[int]
) -> None:
    """Clusters and listeners built from ``services:`` point a REST poller's EDS and RDS at the
    REST config source of its bootstrap (refresh delay: --rest-refresh-ms), and a gRPC stream
    of the very same node at ADS. A poller joins the rest group its node matches (here: one in
    zone east, so of the zone-local service it gets east's endpoint only), else ``rest``."""
    settings = ServeSettings(
        rest=RestSettings(refresh=0.3),
        policy=PolicySettings(node_groups=tuple(parse_node_group(rule) for rule in rules)),
    )
    expected = json_format.ParseDict(rest_config_source(refresh=0.3), config_source_pb2.ConfigSource())
    async with serving(tmp_path, settings, doc=SERVICES) as running, client(running) as rest:
        clusters = await rest.discover("clusters", poll())
        cluster = cluster_pb2.Cluster()
        clusters.resources[0].Unpack(cluster)
        assert cluster.name == "web" and cluster.eds_cluster_config.eds_config == expected
        listeners = await rest.discover("listeners", poll())
        listener, manager = listener_pb2.Listener(), hcm_pb2.HttpConnectionManager()
        listeners.resources[0].Unpack(listener)
        listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
        assert manager.rds.route_config_name == "web" and manager.rds.config_source == expected
        # Endpoints and routes are what every group gets.
        endpoints = await rest.discover("endpoints", poll(names=["web"]))
        assignment = endpoint_pb2.ClusterLoadAssignment()
        endpoints.resources[0].Unpack(assignment)
        assert (
            sorted(
                lb.endpoint.address.socket_address.port_value
                for locality in assignment.endpoints
                for lb in locality.lb_endpoints
            )
            == ports
        )
        assert names_of(await rest.discover("routes", poll(names=["web"]))) == ["web"]

        (over_ads,) = await _ads_clusters(running.xds, {"id": "edge-1", "cluster": "edge"})
        assert over_ads.eds_cluster_config.eds_config.HasField("ads")
