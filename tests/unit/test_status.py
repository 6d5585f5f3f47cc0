"""Per-proxy sync status: kept while a proxy is connected, forgotten a while after it left; the
state of each type, and how far a group's current version has reached."""

from __future__ import annotations

from pilotfish.status import NodeInfo, StatusLimits, SyncState, SyncStatus

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


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


# -- what the admin API reads: states, progress, counters ----------------------------------------


class Wall:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_types_state_follows_what_was_sent_acked_and_nacked() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    status.stream_opened("edge-1", NodeInfo(cluster="edge", user_agent="envoy", user_agent_version="1.40.0"))
    assert status.get("edge-1").types.get(CDS) is None  # type: ignore[union-attr]
    status.sent("edge-1", CDS, "v1")
    cds = status.get("edge-1").types[CDS]  # type: ignore[union-attr]
    assert cds.state is SyncState.STALE and cds.sent_at == wall.now
    wall.now += 2
    status.acked("edge-1", CDS, "v1")
    assert cds.state is SyncState.SYNCED and cds.acked_at == wall.now
    wall.now += 5
    status.acked("edge-1", CDS, "v1")  # a repeated ACK (after an unchanged resend) does not move acked_at
    assert cds.acked_at == wall.now - 5
    status.sent("edge-1", CDS, "v2")
    status.nacked("edge-1", CDS, "v2", "...connect_timeout: value must be greater than 0s")
    assert cds.state is SyncState.NACKED and cds.acked_version == "v1" and cds.nacked_at == wall.now
    status.sent("edge-1", CDS, "v3")  # a fix is on its way: not NACKED any more, not yet SYNCED
    assert cds.state is SyncState.STALE
    status.acked("edge-1", CDS, "v3")
    assert cds.state is SyncState.SYNCED and cds.nack_error is None
    assert (status.counters[CDS].responses, status.counters[CDS].acks, status.counters[CDS].nacks) == (3, 3, 1)


def test_what_a_node_says_and_a_nack_message_are_kept_bounded() -> None:
    status = SyncStatus()
    status.stream_opened("edge-1", NodeInfo(cluster="c" * 100_000, user_agent="envoy"))
    status.sent("edge-1", CDS, "v1")
    status.nacked("edge-1", CDS, "v1", "dump " * 100_000 + "the reason")
    proxy = status.get("edge-1")
    assert proxy is not None and len(proxy.info.cluster) < 400
    message = proxy.types[CDS].nack_error
    assert message is not None and len(message) < 4200 and message.endswith("the reason")


def test_progress_counts_the_proxies_of_each_group_that_acked_its_current_version() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    status.published("default", label="v7", versions={CDS: "c7", EDS: "e1"})
    published = wall.now
    for i in range(3):
        status.stream_opened(f"edge-{i}", NodeInfo(group="default"))
        status.sent(f"edge-{i}", CDS, "c7")
    status.stream_opened("grpc-1", NodeInfo(group="grpc"))  # another group: not counted here
    status.sent("grpc-1", CDS, "c7")
    status.acked("grpc-1", CDS, "c7")
    wall.now += 1.5
    status.acked("edge-0", CDS, "c7")
    wall.now += 1
    status.acked("edge-1", CDS, "c7")
    status.nacked("edge-2", CDS, "c7", "bad")
    (cds,) = [p for p in status.progress() if p.type_url == CDS]
    assert (cds.group, cds.version, cds.proxies, cds.acked, cds.nacked) == ("default", "c7", 3, 2, 1)
    assert not cds.complete and cds.seconds_to_last_ack is None
    status.sent("edge-2", CDS, "c7")
    wall.now += 1
    status.acked("edge-2", CDS, "c7")
    (cds,) = [p for p in status.progress() if p.type_url == CDS]
    assert cds.complete and cds.seconds_to_last_ack == 3.5 and cds.published_at == published
    status.stream_closed("edge-2")  # gone: no longer counted
    (cds,) = [p for p in status.progress() if p.type_url == CDS]
    assert (cds.proxies, cds.acked) == (2, 2)
    # A new snapshot that leaves CDS as it was keeps the time CDS's version was first published.
    wall.now += 10
    status.published("default", label="v8", versions={CDS: "c7", EDS: "e2"})
    assert status.groups["default"].types[CDS] == ("c7", published)
    assert status.groups["default"].types[EDS] == ("e2", wall.now)


def test_a_delta_proxy_that_acked_all_it_was_sent_counts_as_current() -> None:
    status = SyncStatus()
    status.stream_opened("delta-1", NodeInfo(protocol="delta"))
    status.stream_opened("sotw-1", NodeInfo(protocol="sotw"))
    for node in ("delta-1", "sotw-1"):
        status.sent(node, EDS, "e1")
        status.acked(node, EDS, "e1")
    # e2 changed only endpoints neither subscribes to: the delta stream is sent nothing.
    status.published("default", label="v2", versions={EDS: "e2"})
    (eds,) = status.progress()
    assert (eds.proxies, eds.acked, eds.current, eds.complete) == (2, 0, 1, False)
    assert status.connected() == {"default": 2}


def test_connected_since_is_when_the_first_of_its_streams_opened() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    status.stream_opened("edge-1")
    since = wall.now
    wall.now += 30
    status.stream_opened("edge-1")  # a second stream (hot restart)
    proxy = status.get("edge-1")
    assert proxy is not None and proxy.connected_since == since and proxy.streams == 2
