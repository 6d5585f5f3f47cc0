"""docs/architecture.md, publishing rule 1: nothing is published before every source has reported
(:mod:`pilotfish.reconcile.readiness`, alone and in the loop)."""

from __future__ import annotations

from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.reconcile.readiness import Readiness
from pilotfish.resources import CLUSTER
from pilotfish.resources.services import Endpoint, ServiceSpec


def services(*names: str, listen: bool = True) -> DesiredState:
    specs = {n: ServiceSpec(name=n, listen=("127.0.0.1", 10000 + i) if listen else None) for i, n in enumerate(names)}
    return DesiredState(services=specs, endpoints={n: (Endpoint("127.0.0.1", 9000),) for n in names})


def names(cache: SnapshotCache, url: str) -> set[str]:
    snapshot = cache.snapshot()
    assert snapshot is not None
    found = snapshot.get(url)
    return set(found.resources) if found else set()


def test_every_expected_source_is_awaited_until_it_reports() -> None:
    readiness = Readiness(["file", "etcd"])
    assert readiness.expected_sources() == ["etcd", "file"] and readiness.waiting_for() == ["etcd", "file"]
    readiness.reported("file")
    readiness.reported("registry")  # not expected: reporting changes nothing awaited
    assert readiness.waiting_for() == ["etcd"]
    readiness.reported("etcd")
    assert readiness.waiting_for() == []


def test_a_source_awaited_after_another_is_named_only_once_that_one_reported() -> None:
    readiness = Readiness(["etcd"], after={"etcd-subsets": "etcd"})
    assert readiness.expected_sources() == ["etcd", "etcd-subsets"]
    assert readiness.waiting_for() == ["etcd"], "while etcd is away, etcd is what is awaited"
    readiness.reported("etcd")
    assert readiness.waiting_for() == ["etcd-subsets"]
    readiness.reported("etcd-subsets")
    assert readiness.waiting_for() == []


def test_a_refused_input_is_counted_and_kept_until_the_source_reports_again() -> None:
    readiness = Readiness(["file"], wall_clock=lambda: 123.0)
    readiness.refused("file", "snap.yaml: 1 problem(s)")
    readiness.refused("file", "snap.yaml: 2 problem(s)")
    assert readiness.failing_sources == {"file"} and readiness.source_errors == {"file": 2}
    assert readiness.source_problems == {"file": ("snap.yaml: 2 problem(s)", 123.0)}
    assert readiness.waiting_for() == ["file"], "a refused input does not count as reported"
    readiness.reported("file")
    assert not readiness.failing_sources and not readiness.source_problems and readiness.source_errors == {"file": 2}


def test_nothing_is_published_until_every_expected_source_has_reported() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, expect=("etcd", "file"))
    rec.update("file", services("web"))
    assert rec.waiting_for() == ["etcd"]
    assert rec.build_now() is None and cache.snapshot() is None, "etcd's part is not known yet"
    rec.update("etcd", services("api", listen=False))
    assert rec.waiting_for() == []
    assert rec.build_now() is not None
    assert names(cache, CLUSTER.url) == {"web", "api"}


def test_an_empty_first_report_counts_as_reported() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, expect=("etcd",))
    rec.update("etcd", DesiredState())
    assert rec.build_now() is not None and names(cache, CLUSTER.url) == set()
