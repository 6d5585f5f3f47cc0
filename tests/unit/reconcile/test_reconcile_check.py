"""Reconciler.check: would a source's change break the merged state? Nothing is published."""

from __future__ import annotations

from typing import Any

from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import Endpoint, ServiceSpec

TCP_PROXY = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"


def service(name: str, port: int | None = None, **settings: Any) -> ServiceSpec:
    return ServiceSpec(name=name, listen=None if port is None else ("127.0.0.1", port), **settings)


def defines(*specs: ServiceSpec, endpoints: dict[str, tuple[Endpoint, ...]] | None = None) -> DesiredState:
    return DesiredState(services={s.name: s for s in specs}, endpoints=endpoints or {})


def reconciler(**states: DesiredState) -> Reconciler:
    made = Reconciler(SnapshotCache())
    for source, state in states.items():
        made.update(source, state)
    return made


def test_a_listen_address_another_source_uses_is_named_with_its_source() -> None:
    checker = reconciler(file=defines(service("web", 10000)))
    problems = checker.check("registry", defines(service("web2", 10000)))
    assert [p.where for p in problems] == ["services.web2.listen"]
    assert "already used by services.web" in problems[0].message
    assert "services.web: defined by file" in problems[0].message
    assert "services.web2: defined by registry" in problems[0].message


def test_checking_publishes_nothing_and_changes_no_state() -> None:
    checker = reconciler(file=defines(service("web", 10000)))
    checker.build_now()
    published = checker.cache.snapshot()
    assert checker.check("registry", defines(service("api", 10001))) == []
    assert checker.check("registry", defines(service("web2", 10000))) != []
    assert checker.cache.snapshot() is published and checker.stats.published == 1
    assert checker.build_now() is None  # the state it builds is still the file's alone


def test_a_service_defined_differently_by_two_sources_is_a_problem_of_the_change() -> None:
    checker = reconciler(etcd=defines(service("web", 10000)))
    problems = checker.check("registry", defines(service("web", 10000, retries=5)))
    assert [p.where for p in problems] == ["services.web"]
    assert "defined by both etcd and registry" in problems[0].message
    assert checker.check("registry", defines(service("web", 10000))) == []  # the same definition is fine


def test_when_other_sources_already_clash_only_new_problems_count() -> None:
    # The file and etcd disagree about "web": the merged state is broken, not by the registry.
    checker = reconciler(file=defines(service("web", 10000)), etcd=defines(service("web", 10000, retries=1)))
    assert checker.check("registry", defines(service("api", 10001))) == []
    assert checker.check("registry", defines(endpoints={"web": (Endpoint("127.0.0.1", 9001),)})) == []
    problems = checker.check("registry", defines(service("api", 10000)))
    # One new problem: the listen clash (reported on whichever service comes second by name),
    # not the file/etcd disagreement that was there before.
    assert len(problems) == 1 and problems[0].where.endswith(".listen"), problems
    assert "services.api" in str(problems[0]) and "services.web" in str(problems[0])
    assert "defined by both" not in str(problems[0])


def test_instances_for_a_cluster_name_a_raw_resource_uses_are_refused() -> None:
    document = parse_document(
        {
            "clusters": [{"name": "legacy", "type": "STATIC", "connect_timeout": "1s"}],
        },
        "snapshot.yaml",
    )
    checker = reconciler(file=DesiredState.of_document(document))
    problems = checker.check("registry", defines(endpoints={"legacy": (Endpoint("127.0.0.1", 9001),)}))
    assert [p.where for p in problems] == ["services.legacy"]
    assert "clashes with clusters[0]" in problems[0].message
    assert "clusters[0]: clusters[0] of file" in problems[0].message


def test_a_listen_address_of_a_raw_listener_names_the_listener_and_its_source() -> None:
    document = parse_document(
        {
            "listeners": [
                {
                    "name": "edge",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "tcp",
                                    "typed_config": {
                                        "@type": TCP_PROXY,
                                        "stat_prefix": "edge",
                                        "cluster": "web",
                                    },
                                }
                            ]
                        }
                    ],
                }
            ]
        },
        "snapshot.yaml",
    )
    checker = reconciler(file=DesiredState.of_document(document), registry=defines(service("web")))
    problems = checker.check("registry", defines(service("web", 10000)))
    assert len(problems) == 1
    assert "listeners[0] (name 'edge')" in problems[0].message
    assert "listeners[0] of file" in problems[0].message
