"""The subscription intern tables: shared sets for the common case, holding nothing a peer that
cycles through ever new name lists has let go of."""

from __future__ import annotations

import weakref

from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.protocol import next_subscription
from pilotfish.protocol import subscription as interning
from pilotfish.resources.wire import request_names_span

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def wire_of(names: list[str]) -> bytes:
    request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names, version_info="1", response_nonce="3")
    span = request_names_span(request.SerializeToString(), EDS, "3")
    assert span is not None
    return span


def test_a_peer_cycling_name_lists_keeps_the_tables_bounded_and_the_common_set_shared() -> None:
    common = [f"svc-{i}" for i in range(100)]
    common_wire = wire_of(common)
    before = interning.interned_size()  # (other tests' streams may hold some)
    shared = next_subscription(common, wildcard_capable=False, ever_named=True, wire=common_wire)
    for i in range(20_000):
        names = [f"peer-{i}-{j}" for j in range(20)]
        cycled = next_subscription(names, wildcard_capable=False, ever_named=True, wire=wire_of(names))
        assert cycled.names == frozenset(names) and not cycled.wildcard
        if i % 500 == 0:  # the fleet keeps asking for its set: still the very same object
            assert next_subscription(common, wildcard_capable=False, ever_named=True, wire=common_wire) is shared
            assert next_subscription(common, wildcard_capable=False, ever_named=True) is shared
    del cycled
    entries, size = interning.interned_size()
    # What is left is what is held: the common set (list, encoded list, subscription).
    assert entries <= before[0] + 3, entries
    assert size <= before[1] + 3 * 100 * 120


def test_long_names_count_by_their_size_not_their_number() -> None:
    before = interning.interned_size()[1]
    for i in range(400):
        names = [f"{i}-{j}-" + "x" * 20_000 for j in range(10)]  # 200 KB per list: 80 MB in all
        subscription = next_subscription(names, wildcard_capable=False, ever_named=True)
        assert subscription.names == frozenset(names)
        # interned: the next stream asking for it shares it
        assert next_subscription(names, wildcard_capable=False, ever_named=True) is subscription
        # and the lists let go of are not kept (only the one held: its list and subscription)
        assert interning.interned_size()[1] <= before + 2 * (200_100 + 10 * 100)


def test_a_large_set_is_shared_while_held_and_gone_after() -> None:
    huge = [f"name-{i}-" + "y" * 200 for i in range(40_000)]  # 8 MB of names
    wire = wire_of(huge)
    before = interning.interned_size()
    first = next_subscription(huge, wildcard_capable=False, ever_named=True, wire=wire)
    second = next_subscription(huge, wildcard_capable=False, ever_named=True, wire=wire)
    assert second is first and first.names == frozenset(huge)
    assert interning.checked_wire(bytes(bytearray(wire))) is wire
    held = weakref.ref(first.names)
    del first, second
    assert held() is None, "the set outlived every subscription holding it"
    assert interning.checked_wire(wire) is None
    assert interning.interned_size()[1] <= before[1]


def test_delta_streams_share_a_set_while_one_holds_it() -> None:
    names = [f"svc-{i}" for i in range(50)]
    first = interning.intern_names(frozenset(names))
    assert interning.intern_names(frozenset(reversed(names))) is first
    held = weakref.ref(first)
    del first
    assert held() is None, "the tables held a set no stream holds"
