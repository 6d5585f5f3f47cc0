"""The subscription intern tables: shared sets for the common case, bounded against a peer that
cycles through ever new name lists."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.protocol import next_subscription
from pilotfish.protocol import subscription as interning
from pilotfish.resources.wire import request_names_span

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def wire_of(names: list[str]) -> bytes:
    request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names, version_info="1",
                                             response_nonce="3")
    span = request_names_span(request.SerializeToString(), EDS, "3")
    assert span is not None
    return span


def test_a_peer_cycling_name_lists_keeps_the_tables_bounded_and_the_common_set_shared() -> None:
    common = [f"svc-{i}" for i in range(100)]
    common_wire = wire_of(common)
    shared = next_subscription(common, wildcard_capable=False, ever_named=True, wire=common_wire)
    limit = 2 * interning._INTERNED_BYTES + 2 * 3 * interning._INTERNED_MAX * 1024
    for i in range(20_000):
        names = [f"peer-{i}-{j}" for j in range(20)]
        cycled = next_subscription(names, wildcard_capable=False, ever_named=True, wire=wire_of(names))
        assert cycled.names == frozenset(names) and not cycled.wildcard
        if i % 500 == 0:  # the fleet keeps asking for its set: still the very same object
            assert next_subscription(common, wildcard_capable=False, ever_named=True, wire=common_wire) is shared
            assert next_subscription(common, wildcard_capable=False, ever_named=True) is shared
    entries, size = interning.interned_size()
    assert entries <= 2 * 3 * interning._INTERNED_MAX
    assert size <= limit


def test_long_names_count_by_their_size_not_their_number() -> None:
    for i in range(400):
        names = [f"{i}-{j}-" + "x" * 20_000 for j in range(10)]  # 200 KB per list: 80 MB in all
        subscription = next_subscription(names, wildcard_capable=False, ever_named=True)
        assert subscription.names == frozenset(names)
        assert interning.interned_size()[1] <= 2 * interning._INTERNED_BYTES
        # interned all the same: the next stream asking for it shares it
        assert next_subscription(names, wildcard_capable=False, ever_named=True) is subscription


def test_a_set_too_large_to_intern_is_still_the_right_subscription() -> None:
    huge = [f"name-{i}-" + "y" * 200 for i in range(interning._INTERNED_BYTES // 4 // 300 + 1)]
    before = interning.interned_size()
    first = next_subscription(huge, wildcard_capable=False, ever_named=True)
    second = next_subscription(huge, wildcard_capable=False, ever_named=True)
    assert first == second and first.names == frozenset(huge)
    assert first is not second  # not kept: each stream holds its own
    assert interning.interned_size()[1] <= max(before[1], 0) + interning._INTERNED_BYTES
