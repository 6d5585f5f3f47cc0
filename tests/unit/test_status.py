"""Per-proxy sync status: kept while a proxy is connected, forgotten a while after it left; the
state of each type, and how far a group's current version has reached."""

from __future__ import annotations

import gc
import hashlib
import sys
import tracemalloc
import types

import pytest
from envoy.config.core.v3 import base_pb2

from pilotfish.api.admin import proxy_json
from pilotfish.commands.cli import main
from pilotfish.status import (
    DEPARTED_BYTES,
    DEPARTED_BYTES_MAX,
    DEPARTED_NACK,
    DepartedProxy,
    NodeInfo,
    ProxyStatus,
    StatusLimits,
    SyncState,
    SyncStatus,
    TypeStatus,
    nack_summary,
)
from pilotfish.xds.server import node_info

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def state_of(status: TypeStatus) -> SyncState:
    """A type's state, read anew (mypy would keep what an earlier assert narrowed it to)."""
    return status.state


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
    assert state_of(cds) is SyncState.SYNCED and cds.acked_at == wall.now
    wall.now += 5
    status.acked("edge-1", CDS, "v1")  # a repeated ACK (after an unchanged resend) does not move acked_at
    assert cds.acked_at == wall.now - 5
    status.sent("edge-1", CDS, "v2")
    status.nacked("edge-1", CDS, "v2", "...connect_timeout: value must be greater than 0s")
    assert state_of(cds) is SyncState.NACKED and cds.acked_version == "v1" and cds.nacked_at == wall.now
    status.sent("edge-1", CDS, "v3")  # a fix is on its way: not NACKED any more, not yet SYNCED
    assert state_of(cds) is SyncState.STALE
    status.acked("edge-1", CDS, "v3")
    assert state_of(cds) is SyncState.SYNCED and cds.nack_error is None
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


# -- what a departed proxy leaves behind ---------------------------------------------------------

LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
VERSIONS = {url: hashlib.sha256(url.encode()).hexdigest() for url in (CDS, EDS, LDS, RDS)}
"""The snapshot's versions: one string per type, which the server hands every proxy."""
REASON = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout: value must be greater than 0s)"


def envoy_node(node_id: str) -> base_pb2.Node:
    """A node as Envoy 1.40 sends it: metadata, a locality, its build version and ~60 KB of extensions."""
    node = base_pb2.Node(id=node_id, cluster="edge-pool", user_agent_name="envoy")
    node.user_agent_build_version.version.major_number, node.user_agent_build_version.version.minor_number = 1, 40
    node.locality.zone = "zone-a"
    node.metadata.update({f"istio.io/label-{k}": f"{node_id}-{k}-" + "v" * 200 for k in range(50)})
    for k in range(400):
        node.extensions.add(
            name=f"envoy.filters.http.extension_{k:03d}",
            category="envoy.filters.http",
            type_urls=[f"envoy.extensions.filters.http.extension_{k:03d}.v3.Config"],
        )
    return node


def _depart(status: SyncStatus, n: int, *, nacked: int = 0, hostile: bool = False) -> str:
    """Proxy ``n`` connects as Envoy does, is sent and ACKs every type (its ACKs carry versions of
    its own, as decoded from its requests), NACKs ``nacked`` of them with Envoy's long message, and
    leaves; ``hostile``: every string it chooses is long."""
    node = envoy_node(f"sidecar~10.1.{n // 250}.{n % 250}~web-{n:06d}.prod~prod.svc.cluster.local")
    if hostile:
        node.cluster, node.user_agent_name = f"c{n}-" * 30_000, f"u{n}-" * 30_000
    address = f"ipv4:127.0.0.1:{20_000 + n}" + ("-" * 10_000 if hostile else "")
    status.stream_opened(node.id, node_info(node, address=address, group="default", protocol="sotw"))
    for url, version in VERSIONS.items():
        status.sent(node.id, url, version)
        status.acked(node.id, url, f"{n}-" * 500 if hostile else "".join(version))  # a string of its own
    for url in list(VERSIONS)[:nacked]:
        status.nacked(node.id, url, VERSIONS[url], f"dump of the rejected resource of proxy {n} " * 3000 + REASON)
    status.stream_closed(node.id)
    return str(node.id)


def _reachable(root: object) -> dict[int, object]:
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType):
            continue
        seen[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
    return seen


def _own_bytes(status: SyncStatus, node_id: str, other: str) -> int:
    """The deep size of ``node_id``'s record, without what it shares with ``other``'s (type URLs,
    the snapshot's versions, a cluster name they both have): what one more departed proxy costs."""
    mine, theirs = _reachable(status.get(node_id)), _reachable(status.get(other))
    return sum(sys.getsizeof(obj) for key, obj in mine.items() if key not in theirs)


@pytest.mark.parametrize("nacked", [0, 1, 2])
def test_a_departed_envoy_is_remembered_in_at_most_1_kb(nacked: int) -> None:
    status = SyncStatus()
    first, second = _depart(status, 1, nacked=nacked), _depart(status, 2, nacked=nacked)
    assert isinstance(status.get(first), DepartedProxy)
    size = _own_bytes(status, first, second)
    assert size <= DEPARTED_BYTES == 1024, f"a departed proxy keeps {size} bytes"


def test_a_departed_peer_that_makes_everything_long_is_remembered_in_at_most_2_kb() -> None:
    status = SyncStatus()
    first, second = _depart(status, 1, nacked=4, hostile=True), _depart(status, 2, nacked=4, hostile=True)
    size = _own_bytes(status, first, second)
    assert size <= DEPARTED_BYTES_MAX == 2048, f"a departed proxy keeps {size} bytes"


def test_thousands_of_departed_envoys_cost_at_most_1_kb_each_all_told() -> None:
    """Counting everything the status allocates for them (its maps' entries too), per proxy."""
    status = SyncStatus()
    _depart(status, 0, nacked=1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(1, 2001):
            _depart(status, n, nacked=1 if n % 10 == 0 else 0)  # one in ten left a NACK behind
        gc.collect()
        per_proxy = (tracemalloc.get_traced_memory()[0] - before) / 2000
    finally:
        tracemalloc.stop()
    assert len(status) == 2001
    assert per_proxy <= 1024, f"{per_proxy:.0f} bytes per departed proxy"


def test_a_departed_proxy_shows_what_it_showed_when_it_left() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    node = envoy_node("edge-1")
    status.stream_opened("edge-1", node_info(node, address="ipv4:127.0.0.1:40000", group="edge", protocol="delta"))
    for url, version in VERSIONS.items():
        status.sent("edge-1", url, version)
        wall.now += 1
        status.acked("edge-1", url, version)
    status.sent("edge-1", LDS, "l2")
    status.nacked("edge-1", LDS, VERSIONS[LDS], "dump " * 10_000 + REASON)
    status.sent("edge-1", RDS, "r2")  # sent, neither ACKed nor NACKed: STALE
    wall.now += 5
    live = status.get("edge-1")
    assert isinstance(live, ProxyStatus)
    shown = proxy_json(live, wall.now)
    status.stream_closed("edge-1")
    wall.now += 30
    departed = status.get("edge-1")
    assert isinstance(departed, DepartedProxy) and departed.left_at == wall.now - 30
    after = proxy_json(departed, wall.now - 30)
    assert (after.pop("streams"), after.pop("connected"), after.pop("left_at")) == (0, False, wall.now - 30)
    assert (shown.pop("streams"), shown.pop("connected")) == (1, True)
    message = shown["types"]["LDS"]["nack"].pop("message")
    kept = after["types"]["LDS"]["nack"].pop("message")
    assert len(kept) <= DEPARTED_NACK + 40 and kept.startswith("dump dump") and kept.endswith("greater than 0s)")
    assert len(message) > 4000
    for summary in (shown["types"]["LDS"]["nack"].pop("summary"), after["types"]["LDS"]["nack"].pop("summary")):
        assert len(summary) <= 340 and summary.startswith("dump dump") and summary.endswith("greater than 0s)")
    assert after == shown  # every other field as it was: node, versions, states, times
    # It comes back: its history is there to write to again.
    status.stream_opened("edge-1")
    status.acked("edge-1", LDS, "l2")
    again = status.get("edge-1")
    assert isinstance(again, ProxyStatus) and again.types[LDS].state is SyncState.SYNCED
    assert again.types[CDS].acked_version == VERSIONS[CDS] and again.info.group == "edge"


def test_a_write_for_a_proxy_with_no_stream_is_kept_and_compacted() -> None:
    """Not what the server does (it writes while a stream is open), but it must not be lost."""
    status = SyncStatus()
    status.sent("ghost", CDS, "v1")
    status.acked("ghost", CDS, "v1")
    ghost = status.get("ghost")
    assert isinstance(ghost, DepartedProxy) and ghost.types[CDS].state is SyncState.SYNCED


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"forget_after": -1.0}, "forget_after must be 0 or more"),
        ({"forget_after": float("nan")}, "forget_after must be 0 or more"),
        ({"max_disconnected": -1}, "max_disconnected must be 0 or more"),
    ],
)
def test_status_limits_refuse_what_cannot_be_meant(limits: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StatusLimits(**limits)  # type: ignore[arg-type]


def test_with_no_disconnected_proxies_allowed_a_proxy_is_forgotten_as_it_leaves() -> None:
    status = SyncStatus(limits=StatusLimits(max_disconnected=0))
    status.stream_opened("a")
    status.stream_closed("a")
    assert status.get("a") is None and len(status) == 0


# -- the flags that set them ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--status-forget-after", "0", "is not a duration above 0"),
        ("--status-forget-after", "nan", "is not a duration: give a number and a unit"),
        ("--status-forget-after", "soon", "is not a duration: give a number and a unit"),
        ("--status-max-disconnected", "-1", "is not a whole number (0 or more)"),
        ("--status-max-disconnected", "1e3", "is not a whole number (0 or more)"),
        ("--recent-events", "0", "is not a positive whole number"),
        ("--recent-events", "1000000", "is more than 100,000 events"),
    ],
)
def test_serve_refuses_a_bad_memory_limit_naming_the_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--snapshot", "x.yaml", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: {value!r} {says}" in capsys.readouterr().err


# Envoy 1.40's message for a cluster that breaks its proto rules: the cluster dumped, then why.
ENVOY_CDS_NACK = """goo.gle/debugonly\x20\x20
name: "api"
type: EDS
eds_cluster_config {
  eds_config {
    ads {
    }
    resource_api_version: V3
  }
  service_name: "not-this-name"
}
connect_timeout {
}
: Proto constraint validation failed (ClusterValidationError.ConnectTimeout: value must be greater than 0s)
."""


def test_a_nack_summary_names_the_dumped_resource_and_keeps_the_reason() -> None:
    assert nack_summary(ENVOY_CDS_NACK) == (
        "'api': Proto constraint validation failed "
        "(ClusterValidationError.ConnectTimeout: value must be greater than 0s)"
    )
    assignment = 'cluster_name: "web"\nendpoints {\n  lb_endpoints {\n  }\n}\n: Proto constraint validation failed (x)'
    assert nack_summary(assignment) == "'web': Proto constraint validation failed (x)"
    # A nested message's name (indented) is not taken for the resource's.
    assert nack_summary('filter_chains {\n  name: "inner"\n}\n: bad') == "bad"


def test_a_long_nack_is_shortened_in_the_middle_keeping_the_name_and_the_reason() -> None:
    message = "Error adding/updating listener(s) ingress: " + "filler " * 200 + "the reason at the end"
    summary = nack_summary(message, 300)
    assert len(summary) <= 340 and "\n" not in summary
    assert summary.startswith("Error adding/updating listener(s) ingress: ")
    assert summary.endswith("the reason at the end")
    short = "Error adding/updating listener(s) ingress: invalid regex"
    assert nack_summary(short) == short
