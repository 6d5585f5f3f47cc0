"""xDS and the registry API over TLS and mTLS, in-process, spoken to by grpcio and aiohttp clients.

Certificates come from test CAs (trustme); a client certificate with a SPIFFE URI SAN (which
trustme cannot issue) is signed with the CA's key by ``cryptography``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from pilotfish.app import ServeSettings, serve
from pilotfish.app.settings import EventSettings, PolicySettings, RegistrySettings, TlsSettings, XdsSettings
from pilotfish.events import read_events
from pilotfish.policy.authorize import NodeRule, parse_rule

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
TIMEOUT = 10.0
SPIFFE_ID = "spiffe://pilotfish.test/ns/edge/sa/edge"


def snapshot_doc(*names: str) -> dict[str, Any]:
    def cluster(name: str) -> dict[str, Any]:
        endpoint = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9001}}}
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": endpoint}]}]},
        }

    return {"clusters": [cluster(name) for name in names]}


def spiffe_cert(ca: trustme.CA, uri: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a client whose only SAN is the URI ``uri``, issued by ``ca``."""
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # trustme's CA key is EC or RSA
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_pair(directory: Path, leaf: trustme.LeafCert) -> tuple[Path, Path]:
    """The leaf's chain and key as files, replaced atomically (rename over), as deploy tools do."""
    cert, key = directory / "server.pem", directory / "server.key"
    for path, data in ((key, leaf.private_key_pem.bytes()), (cert, leaf.cert_chain_pems[0].bytes())):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return cert, key


@dataclass
class Running:
    xds: str
    registry: str
    log: Path
    cert: Path
    key: Path

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.log)[0]

    async def wait_for(self, event: str, **fields: Any) -> dict[str, Any]:
        async with asyncio.timeout(TIMEOUT):
            while True:
                for item in self.events():
                    if item["event"] == event and all(item.get(k) == v for k, v in fields.items()):
                        return item
                await asyncio.sleep(0.02)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path,
    ca: trustme.CA,
    *,
    client_ca: trustme.CA | None = None,
    registry_client_ca: trustme.CA | None = None,
    authorize_nodes: tuple[NodeRule, ...] = (),
) -> AsyncIterator[Running]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(snapshot_doc("web")))
    cert, key = write_pair(tmp_path, ca.issue_cert("127.0.0.1", "localhost"))
    files: dict[str, Path] = {}
    for name, authority in (("client-ca.pem", client_ca), ("registry-ca.pem", registry_client_ca)):
        if authority is not None:
            files[name] = tmp_path / name
            authority.cert_pem.write_to_path(str(files[name]))
    log = tmp_path / "events.jsonl"
    settings = ServeSettings(
        snapshot=snapshot,
        xds=XdsSettings(address="127.0.0.1:0"),
        registry=RegistrySettings(address="127.0.0.1:0"),
        events=EventSettings(log=log),
        tls=TlsSettings(
            cert=cert,
            key=key,
            client_ca=files.get("client-ca.pem"),
            registry_client_ca=files.get("registry-ca.pem"),
            reload_every=0.05,
        ),
        policy=PolicySettings(authorize_nodes=authorize_nodes),
    )
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(settings, started=started))
    try:
        port = await asyncio.wait_for(started, TIMEOUT)
        running = Running(f"127.0.0.1:{port}", "", log, cert, key)
        running.registry = (await running.wait_for("server_started"))["registry"]
        yield running
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def credentials(trusted: trustme.CA, client: tuple[bytes, bytes] | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=trusted.cert_pem.bytes())
    cert, key = client
    return grpc.ssl_channel_credentials(
        root_certificates=trusted.cert_pem.bytes(), private_key=key, certificate_chain=cert
    )


def leaf_pems(leaf: trustme.LeafCert) -> tuple[bytes, bytes]:
    return leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()


@contextlib.asynccontextmanager
async def ads(address: str, creds: grpc.ChannelCredentials | None, node: str) -> AsyncIterator[Any]:
    """An ADS call that has sent its first CDS request (``creds`` None: plaintext)."""
    channel = grpc.aio.insecure_channel(address) if creds is None else grpc.aio.secure_channel(address, creds)
    async with channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        request = discovery_pb2.DiscoveryRequest(type_url=CDS)
        request.node.id = node
        await call.write(request)
        yield call


async def first_response(
    address: str, creds: grpc.ChannelCredentials | None, node: str = "proxy-1"
) -> discovery_pb2.DiscoveryResponse:
    async with ads(address, creds, node) as call:
        response: discovery_pb2.DiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
        return response


async def refused(address: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await first_response(address, creds)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    return caught.value


async def test_tls_serves_a_client_that_trusts_the_ca(tmp_path: Path, ca: trustme.CA) -> None:
    async with serving(tmp_path, ca) as server:
        response = await first_response(server.xds, credentials(ca))
        assert response.type_url == CDS and len(response.resources) == 1
        assert (await server.wait_for("server_started"))["tls"] == "tls"


async def test_tls_refuses_a_plaintext_client_and_one_that_does_not_trust_the_ca(
    tmp_path: Path, ca: trustme.CA
) -> None:
    async with serving(tmp_path, ca) as server:
        await refused(server.xds, None)
        await refused(server.xds, credentials(trustme.CA()))


async def test_mtls_serves_a_client_certificate_and_records_its_identity(tmp_path: Path, ca: trustme.CA) -> None:
    async with serving(tmp_path, ca, client_ca=ca) as server:
        response = await first_response(server.xds, credentials(ca, spiffe_cert(ca, SPIFFE_ID)), "edge-1")
        assert len(response.resources) == 1
        opened = await server.wait_for("stream_open", node="edge-1")
        assert opened["identity"] == SPIFFE_ID
        # No URI SAN: the first DNS SAN names the proxy.
        await first_response(server.xds, credentials(ca, leaf_pems(ca.issue_cert("edge-2.pilotfish.test"))), "edge-2")
        assert (await server.wait_for("stream_open", node="edge-2"))["identity"] == "edge-2.pilotfish.test"
        assert (await server.wait_for("server_started"))["tls"] == "mtls"


async def test_mtls_refuses_a_client_without_a_certificate(tmp_path: Path, ca: trustme.CA) -> None:
    async with serving(tmp_path, ca, client_ca=ca) as server:
        await refused(server.xds, credentials(ca))
        assert not [e for e in server.events() if e["event"] == "stream_open"]


async def test_mtls_refuses_a_certificate_from_another_ca(tmp_path: Path, ca: trustme.CA) -> None:
    other = trustme.CA()
    async with serving(tmp_path, ca, client_ca=ca) as server:
        await refused(server.xds, credentials(ca, spiffe_cert(other, SPIFFE_ID)))
        assert not [e for e in server.events() if e["event"] == "stream_open"]


async def test_a_new_certificate_is_used_for_new_connections_and_open_streams_stay(
    tmp_path: Path, ca: trustme.CA
) -> None:
    new_ca = trustme.CA()
    async with serving(tmp_path, ca) as server:
        async with ads(server.xds, credentials(ca), "before") as call:
            first = await asyncio.wait_for(call.read(), TIMEOUT)
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=CDS, version_info=first.version_info, response_nonce=first.nonce
                )
            )  # ACK
            write_pair(tmp_path, new_ca.issue_cert("127.0.0.1"))
            await server.wait_for("tls_reloaded", listener="xds")
            # New handshakes present the new certificate: a client trusting only the old CA fails.
            await first_response(server.xds, credentials(new_ca), "after")
            await refused(server.xds, credentials(ca))
            # The stream opened before the rotation is still served: it gets the next change.
            (tmp_path / "snap.yaml").write_text(yaml.safe_dump(snapshot_doc("web", "api")))
            response = await asyncio.wait_for(call.read(), TIMEOUT)
            assert len(response.resources) == 2
        assert not [
            e
            for e in server.events()
            if e["event"] == "stream_closed" and e["node"] == "before" and "closed by client" not in e["reason"]
        ]


async def test_a_bad_certificate_file_is_reported_and_the_previous_one_kept(tmp_path: Path, ca: trustme.CA) -> None:
    async with serving(tmp_path, ca) as server:
        # A key that does not match the certificate (the new key written, the certificate not yet).
        server.key.write_bytes(trustme.CA().issue_cert("127.0.0.1").private_key_pem.bytes())
        failed = await server.wait_for("tls_reload_failed", listener="xds")
        assert str(server.cert) in failed["reason"]
        await first_response(server.xds, credentials(ca))


async def test_registry_api_over_https_and_mtls(tmp_path: Path, ca: trustme.CA) -> None:
    registry_ca = trustme.CA()
    async with serving(tmp_path, ca, registry_client_ca=registry_ca) as server:
        url = f"https://{server.registry}/healthz"
        trusting = ssl.create_default_context(cafile=None)
        ca.configure_trust(trusting)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):  # no client certificate
                async with session.get(url, ssl=trusting) as response:
                    await response.read()
            registry_ca.issue_cert("deployer.pilotfish.test").configure_cert(trusting)
            async with session.get(url, ssl=trusting) as response:
                assert response.status == 200
            with pytest.raises(aiohttp.ClientError):  # plaintext HTTP on the HTTPS port
                async with session.get(f"http://{server.registry}/healthz") as response:
                    await response.read()
        # The xDS port did not get the registry's client CA: proxies need no certificate there.
        await first_response(server.xds, credentials(ca))


async def test_a_certificate_may_claim_only_the_node_ids_a_rule_grants_it(tmp_path: Path, ca: trustme.CA) -> None:
    rules = (parse_rule("spiffe://pilotfish.test/ns/*/sa/edge=edge-*"),)
    async with serving(tmp_path, ca, client_ca=ca, authorize_nodes=rules) as server:
        edge = credentials(ca, spiffe_cert(ca, SPIFFE_ID))
        assert len((await first_response(server.xds, edge, "edge-7")).resources) == 1
        for creds, node, why in (
            (edge, "api-1", "may not claim it"),  # the right identity, a node id it is not granted
            (credentials(ca, spiffe_cert(ca, "spiffe://pilotfish.test/ns/edge/sa/api")), "edge-8", "no --authorize"),
            (credentials(ca, leaf_pems(ca.issue_cert("edge-9.pilotfish.test"))), "edge-9", "no --authorize"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await first_response(server.xds, creds, node)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert why in (caught.value.details() or "")
            refused_event = await server.wait_for("node_refused", reason=caught.value.details())
            assert refused_event["identity"] and node in refused_event["reason"]
        opened = [e["node"] for e in server.events() if e["event"] == "stream_open"]
        assert opened == ["edge-7"]


async def test_a_new_client_ca_is_used_for_new_connections(tmp_path: Path, ca: trustme.CA) -> None:
    new_ca = trustme.CA()
    async with serving(tmp_path, ca, client_ca=ca) as server:
        old_client, new_client = spiffe_cert(ca, SPIFFE_ID), spiffe_cert(new_ca, SPIFFE_ID)
        await first_response(server.xds, credentials(ca, old_client))
        await refused(server.xds, credentials(ca, new_client))
        new_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
        await server.wait_for("tls_reloaded", listener="xds")
        await first_response(server.xds, credentials(ca, new_client))
        await refused(server.xds, credentials(ca, old_client))
