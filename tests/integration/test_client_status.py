"""CSDS through the real transport: a grpcio client reads pilotfish's ClientStatusDiscoveryService
on the xDS port (``--csds-on-xds``) and on the admin gRPC port (the admin API's TLS and tokens),
while grpcio ADS clients play proxies that ACK and NACK; what it reads matches ``/v1/proxies``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
import yaml
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, string_pb2
from inprocess import TIMEOUT, Running
from inprocess import serving as serve_in_process
from test_admin_api import ack, ads, cds_of, nack, read, run, until
from test_tls import CDS, snapshot_doc, write_pair

from pilotfish.api.tokens import hash_token
from pilotfish.app import ServeSettings
from pilotfish.app.settings import AdminSettings, TlsSettings, XdsSettings
from pilotfish.commands.operate import client_context, csds_command
from pilotfish.events import read_events
from pilotfish.status import SyncStatus
from pilotfish.transport.aio import GrpcServer
from pilotfish.xds.csds import ClientStatus, CsdsLimits

pytestmark = pytest.mark.timeout(60)

Status = config_dump_shared_pb2.ClientResourceStatus
READER = "reader-token-0123456789abcdef"
WRITER = "writer-token-0123456789abcdef"


@asynccontextmanager
async def serving(tmp_path: Path, settings: ServeSettings) -> AsyncIterator[Running]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(snapshot_doc("web")))
    settings = ServeSettings(
        snapshot=snapshot,
        xds=settings.xds,
        tls=settings.tls,
        admin=settings.admin,
    )
    async with serve_in_process(tmp_path, settings) as running:
        yield running


def admin_grpc(running: Running) -> str:
    (line,) = [e for e in read_events(running.events)[0] if e["event"] == "server_started"]
    address: str = line["admin_grpc"]
    return address


def by_id(exact: str) -> csds_pb2.ClientStatusRequest:
    matcher = node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(exact=exact))
    return csds_pb2.ClientStatusRequest(node_matchers=[matcher])


def cds(response: csds_pb2.ClientStatusResponse, node: str) -> Any:
    (config,) = [c for c in response.config if c.node.id == node]
    (xds,) = [x for x in config.generic_xds_configs if x.type_url == CDS]
    return xds


async def test_csds_on_the_xds_port_says_what_v1_proxies_says_acked_and_nacked(tmp_path: Path) -> None:
    settings = ServeSettings(xds=XdsSettings(csds=True))
    async with (
        serving(tmp_path, settings) as running,
        ads(running, "acking") as acking,
        ads(running, "nacking") as nacking,
        grpc.aio.insecure_channel(running.xds) as channel,
    ):
        first = await read(acking)
        await acking.write(ack(first))
        rejected = await read(nacking)
        await nacking.write(nack(rejected, "", "cluster 'web': no healthy upstream in this test"))
        await until("the ACK", lambda: _state(running, "acking", "SYNCED"))
        listed = await until("the NACK", lambda: _state(running, "nacking", "NACKED"))
        stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)

        every = await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=TIMEOUT)
        assert sorted(c.node.id for c in every.config) == ["acking", "nacking"]
        acked = cds(every, "acking")
        assert (acked.name, acked.client_status, acked.version_info) == ("web", Status.ACKED, first.version_info)
        nacked = cds(every, "nacking")
        assert nacked.client_status == Status.NACKED
        assert nacked.error_state.details == listed["nack"]["message"]
        assert "no healthy upstream in this test" in nacked.error_state.details
        assert nacked.error_state.version_info == listed["nack"]["version"] == rejected.version_info

        code, out, err = await run(csds_command, running.xds, tls=None, token=None, node=None)
        assert code == 1 and "nacking NACKED Cluster: cluster 'web': no healthy upstream in this test" in err
        rows = {tuple(line.split()[:5]) for line in out.splitlines()}
        assert ("acking", "Cluster", "1", first.version_info, "ACKED") in rows  # one resource, its version
        assert ("nacking", "Cluster", "1", "-", "NACKED") in rows  # (it runs no version yet)
        code, out, _ = await run(csds_command, running.xds, tls=None, token=None, node="ack*")
        assert code == 0 and "nacking" not in out and "acking" in out

        stream = stub.StreamClientStatus()
        await stream.write(by_id("nacking"))
        one = await stream.read()
        assert [c.node.id for c in one.config] == ["nacking"]
        await stream.done_writing()
        stream.cancel()

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            bad = node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher())
            await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(node_matchers=[bad]), timeout=TIMEOUT)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "node_matchers[0].node_id sets no pattern" in (refused.value.details() or "")


async def _state(running: Running, node: str, state: str) -> dict[str, Any] | None:
    types = await cds_of(running, node)
    return types if types.get("state") == state else None


async def test_csds_is_not_on_the_xds_port_unless_asked_for(tmp_path: Path) -> None:
    async with serving(tmp_path, ServeSettings()) as running, grpc.aio.insecure_channel(running.xds) as channel:
        stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=TIMEOUT)
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_a_stream_asking_too_fast_is_ended_with_resource_exhausted(tmp_path: Path) -> None:
    settings = ServeSettings(xds=XdsSettings(csds=True))
    async with serving(tmp_path, settings) as running, grpc.aio.insecure_channel(running.xds) as channel:
        stream = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel).StreamClientStatus()
        await stream.write(csds_pb2.ClientStatusRequest())
        assert list((await stream.read()).config) == []
        await stream.write(csds_pb2.ClientStatusRequest())  # at once: within the stream's minimum gap
        assert await stream.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most every 0.1s" in await stream.details()


async def test_the_admin_grpc_port_takes_the_admin_apis_tls_and_read_tokens(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = write_pair(tmp_path, ca.issue_cert("127.0.0.1"))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    tokens = tmp_path / "tokens.yaml"
    entries = {
        "reader": {"sha256": hash_token(READER), "read": True},
        "writer": {"sha256": hash_token(WRITER), "write": ["web"]},
    }
    tokens.write_text(yaml.safe_dump({"tokens": entries}))
    settings = ServeSettings(
        tls=TlsSettings(cert=cert, key=key),
        admin=AdminSettings(tokens=tokens, grpc_address="127.0.0.1:0"),
    )
    async with serving(tmp_path, settings) as running:
        address = admin_grpc(running)
        credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())
        async with grpc.aio.secure_channel(address, credentials) as channel:
            stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
            answer = await stub.FetchClientStatus(
                csds_pb2.ClientStatusRequest(), metadata=(("authorization", f"Bearer {READER}"),), timeout=TIMEOUT
            )
            assert list(answer.config) == []
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", "Bearer not-a-token"),), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", f"Bearer {WRITER}"),), grpc.StatusCode.PERMISSION_DENIED),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), metadata=metadata, timeout=TIMEOUT)
                assert refused.value.code() is code, metadata
        async with grpc.aio.insecure_channel(address) as plain:
            stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(plain)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.FetchClientStatus(
                    csds_pb2.ClientStatusRequest(), metadata=(("authorization", f"Bearer {READER}"),), timeout=TIMEOUT
                )
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE  # plaintext is not answered
        tls = client_context(ca=ca_file, cert=None, key=None)
        code, out, _ = await run(csds_command, address, tls=tls, token=READER, node=None)
        assert (code, out) == (0, "no proxy is connected\n")
        code, _, err = await run(csds_command, address, tls=tls, token=None, node=None)
        assert code == 2 and "needs a token" in err


async def test_csds_calls_past_the_bound_are_refused_and_a_closed_one_frees_its_place() -> None:
    service = ClientStatus(SyncStatus(), limits=CsdsLimits(max_streams=2))
    server = GrpcServer(service.methods())
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
            held = [stub.StreamClientStatus() for _ in range(2)]
            for stream in held:
                await stream.write(csds_pb2.ClientStatusRequest())
                await stream.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=TIMEOUT)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            await held[0].done_writing()
            assert await held[0].code() is grpc.StatusCode.OK
            answer = await stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=TIMEOUT)
            assert list(answer.config) == []
            held[1].cancel()
    finally:
        await server.stop(0)
