"""The subsetting backend tables the loop builds with (:mod:`pilotfish.reconcile.tables`)."""

from __future__ import annotations

from pilotfish.build.desired import DesiredState, Merged, merge_states
from pilotfish.build.subsetting import Index, IndexTable
from pilotfish.reconcile.tables import SubsetTables
from pilotfish.resources.services import Endpoint, ServiceSpec

WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000), subset_size=2)


def merged(*ports: int) -> Merged:
    return merge_states(
        {"file": DesiredState(services={"web": WEB}, endpoints={"web": tuple(Endpoint("127.0.0.1", p) for p in ports)})}
    )


def test_alone_new_backends_are_allocated_and_kept_once_published() -> None:
    tables = SubsetTables()
    built = tables.for_build(merged(9001, 9002, 9003))
    assert sorted(built["web"].indices.values()) == [0, 1, 2]
    assert tables.tables == {} and tables.changed == 0, "nothing is in force before it is published"
    tables.published(built)
    assert tables.tables == built and tables.changed == 1
    tables.published(built)
    assert tables.changed == 1, "the same tables again: no change"


def test_shared_tables_are_never_allocated_here_only_set_from_outside() -> None:
    tables = SubsetTables(shared=True)
    assert tables.for_build(merged(9001, 9002)) == {"web": IndexTable()}, "no index until etcd has one"
    tables.published({"web": IndexTable({"127.0.0.1:9001": Index(0)})})
    assert tables.tables == {} and tables.changed == 0
    etcd = {"web": IndexTable({"127.0.0.1:9001": Index(0), "127.0.0.1:9002": Index(1)})}
    assert tables.set_shared(etcd) and tables.changed == 1
    assert not tables.set_shared(dict(etcd)) and tables.changed == 1
    assert tables.for_build(merged(9001, 9002)) == etcd
