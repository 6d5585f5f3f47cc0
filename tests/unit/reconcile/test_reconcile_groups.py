"""The reconciler serves every node group: each group's snapshot published, an unchanged one left
the very same object, and the blast-radius guard holding every group when one would lose all its
listeners (proxyless gRPC and REST groups beside the Envoys on ADS)."""

from __future__ import annotations

from typing import cast

from conftest import ADS_SOURCE, bootstrap_source, eds_source
from envoy.config.cluster.v3 import cluster_pb2

from pilotfish.build.desired import DesiredState, View
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.policy.groups import GRPC_GROUP, REST_GROUP
from pilotfish.reconcile import BuildOptions, Reconciler
from pilotfish.resources import CLUSTER, LISTENER
from pilotfish.resources.builders import ClientKind
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import parse_services
from pilotfish.snapshot import Snapshot

ENVOYS, GRPC, REST = View(), View(kind=ClientKind.GRPC), View(kind=ClientKind.REST)


def _state(section: dict[str, object], **resources: list[dict[str, object]]) -> DesiredState:
    specs, endpoints, problems = parse_services(section)
    assert problems == []
    raw = parse_document(dict(resources), "test").resources if resources else {}
    return DesiredState(services=specs, endpoints=endpoints, resources=raw)


WEB = {"listen": "127.0.0.1:10000", "grpc": True, "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}


def test_the_reconciler_publishes_each_group_and_leaves_an_unchanged_one_alone() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, build=BuildOptions(groups={DEFAULT_GROUP: ENVOYS, GRPC_GROUP: GRPC}), guard=None)
    rec.update("file", _state({"web": WEB, "rpc": {"grpc": True}}))
    rec.build_now()
    envoy, grpc = cache.snapshot(DEFAULT_GROUP), cache.snapshot(GRPC_GROUP)
    assert envoy is not None and grpc is not None
    assert sorted(grpc.get(LISTENER.url).resources) == ["rpc", "web"]  # type: ignore[union-attr]
    # Only an Envoy listener changes: the gRPC group's snapshot stays the very same object.
    rec.update("file", _state({"web": {**WEB, "listen": "127.0.0.1:10001"}, "rpc": {"grpc": True}}))
    rec.build_now()
    assert cache.snapshot(DEFAULT_GROUP) is not envoy and cache.snapshot(GRPC_GROUP) is grpc


def test_the_guard_holds_every_group_when_one_would_lose_all_its_listeners() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, build=BuildOptions(groups={DEFAULT_GROUP: ENVOYS, GRPC_GROUP: GRPC}))
    rec.update("file", _state({"web": WEB, "rpc": {"grpc": True}}))
    rec.build_now()
    before = cache.snapshot(GRPC_GROUP), cache.snapshot(DEFAULT_GROUP)
    rec.update("file", _state({"web": {**WEB, "grpc": False}, "rpc": {}}))  # no API listener left
    assert rec.build_now() is None
    assert rec.held is not None and rec.held.reasons == ("node group grpc: it removes every listener (2)",)
    assert (cache.snapshot(GRPC_GROUP), cache.snapshot(DEFAULT_GROUP)) == before
    rec.confirm()
    assert not cache.snapshot(GRPC_GROUP).get(LISTENER.url).resources  # type: ignore[union-attr]


SERVICES = {
    "web": {"listen": "127.0.0.1:10000", "grpc": True, "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]},
    "db": {"listen": "127.0.0.1:10001", "protocol": "tcp", "endpoints": ["127.0.0.1:5432"]},
}


def _merged(section: dict[str, object] = SERVICES) -> DesiredState:
    specs, endpoints, problems = parse_services(section)
    assert problems == []
    return DesiredState(services=specs, endpoints=endpoints)


def _cluster(snapshot: Snapshot, name: str) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster.FromString(snapshot.types[CLUSTER.url].resources[name].value)


def test_the_reconciler_builds_the_rest_group_with_the_servers_refresh_delay_and_guards_it() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, build=BuildOptions(groups={DEFAULT_GROUP: ENVOYS, REST_GROUP: REST}, rest_refresh=0.5))
    rec.update("file", _merged())
    rec.build_now()
    rest, envoy = cache.snapshot(REST_GROUP), cache.snapshot(DEFAULT_GROUP)
    assert rest is not None and envoy is not None
    assert eds_source(_cluster(rest, "web")) == bootstrap_source(0.5)
    assert eds_source(_cluster(envoy, "web")) == ADS_SOURCE
    # The blast-radius guard holds a change that would take the pollers' listeners away.
    unlistened: dict[str, object] = {
        name: {**cast(dict[str, object], spec), "listen": None} for name, spec in SERVICES.items()
    }
    rec.update("file", _merged(unlistened))
    assert rec.build_now() is None
    assert rec.held is not None and "it removes every listener (2)" in rec.held.reasons
    assert cache.snapshot(REST_GROUP) is rest
