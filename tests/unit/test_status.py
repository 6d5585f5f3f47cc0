"""Per-proxy sync status: kept while a proxy is connected, forgotten a while after it left."""

from __future__ import annotations

from pilotfish.status import StatusLimits, SyncStatus

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_proxy_that_reconnects_within_the_grace_period_keeps_its_history() -> None:
    clock = Clock()
    status = SyncStatus(limits=StatusLimits(forget_after=600), clock=clock)
    status.stream_opened("envoy-1")
    status.sent("envoy-1", CDS, "v1")
    status.nacked("envoy-1", CDS, "v1", "bad cluster")
    status.stream_closed("envoy-1")
    clock.now += 599
    proxy = status.get("envoy-1")
    assert proxy is not None and proxy.streams == 0 and proxy.types[CDS].nack_error == "bad cluster"
    status.stream_opened("envoy-1")
    clock.now += 10_000  # connected: never forgotten, however long
    status.stream_opened("other")
    proxy = status.get("envoy-1")
    assert proxy is not None and proxy.streams == 1 and proxy.disconnected_at is None
    assert proxy.types[CDS].nacked_version == "v1"


def test_proxies_that_left_are_forgotten_after_the_grace_period() -> None:
    clock = Clock()
    status = SyncStatus(limits=StatusLimits(forget_after=600), clock=clock)
    for i in range(600):  # 600 distinct node ids connect, are served, and go
        node = f"pod-{i}"
        status.stream_opened(node)
        status.sent(node, CDS, "v1")
        status.acked(node, CDS, "v1")
        status.stream_closed(node)
        clock.now += 0.5
    status.stream_opened("stays")
    assert len(status) == 601
    clock.now += 400  # pod-i left 700 - i/2 s ago: those up to pod-200 more than 600 s ago
    remembered = {p.node_id for p in status.proxies()}
    assert remembered == {"stays"} | {f"pod-{i}" for i in range(201, 600)}
    clock.now += 600
    assert [p.node_id for p in status.proxies()] == ["stays"]


def test_at_most_max_disconnected_proxies_are_remembered_the_longest_gone_go_first() -> None:
    clock = Clock()
    status = SyncStatus(limits=StatusLimits(max_disconnected=100), clock=clock)
    status.stream_opened("connected")
    for i in range(1000):
        status.stream_opened(f"pod-{i}")
        status.stream_opened(f"pod-{i}")  # two streams (hot restart): gone when both close
        status.stream_closed(f"pod-{i}")
        assert status.get(f"pod-{i}") is not None
        status.stream_closed(f"pod-{i}")
        clock.now += 1
        assert len(status) <= 101
    names = {p.node_id for p in status.proxies()}
    assert names == {"connected"} | {f"pod-{i}" for i in range(900, 1000)}


def test_a_stream_closed_twice_or_unknown_changes_nothing() -> None:
    clock = Clock()
    status = SyncStatus(clock=clock)
    status.stream_closed("never-seen")
    assert len(status) == 0
    status.stream_opened("a")
    status.stream_closed("a")
    status.stream_closed("a")
    proxy = status.get("a")
    assert proxy is not None and proxy.streams == 0
