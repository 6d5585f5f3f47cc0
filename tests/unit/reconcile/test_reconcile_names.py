"""Host names of DNS services looked up by pilotfish (:mod:`pilotfish.reconcile.names`), through the
reconciler, with a fake resolver: the last good addresses of a name that stops resolving are
served in its place (the cluster stays STRICT_DNS), reported once; the name is served again once
it resolves. Nothing sleeps: each round of lookups is awaited, each build made at once."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pilotfish.build.desired import DesiredState, merge_states
from pilotfish.cache import SnapshotCache
from pilotfish.events import EventLog, RecentEvents
from pilotfish.reconcile import BuildOptions, NameSettings, Reconciler, SystemResolver
from pilotfish.reconcile.names import Kept, with_last_good
from pilotfish.resources import CLUSTER
from pilotfish.resources.services import UNRESOLVED_NAME, Endpoint, ServiceSpec, parse_endpoint

API = ServiceSpec(name="api", listen=("127.0.0.1", 10000))


class FakeResolver:
    """Answers what ``answers`` says now: addresses, or an OSError to raise; counts the lookups."""

    def __init__(self, answers: dict[str, tuple[str, ...] | OSError]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def addresses(self, name: str) -> tuple[str, ...]:
        self.asked.append(name)
        answer = self.answers[name]
        if isinstance(answer, OSError):
            raise answer
        return answer


class Silent:
    """A resolver that never answers."""

    async def addresses(self, name: str) -> tuple[str, ...]:
        await asyncio.Event().wait()
        return ()


NXDOMAIN = socket.gaierror(socket.EAI_NONAME, "Name or service not known")


def fleet(resolver: Any, **settings: Any) -> tuple[Reconciler, SnapshotCache, RecentEvents]:
    cache = SnapshotCache()
    recent = RecentEvents(size=100)
    reconciler = Reconciler(
        cache,
        events=EventLog(None, recent=recent),
        build=BuildOptions(names=NameSettings(**settings), resolver=resolver),
    )
    return reconciler, cache, recent


def served(cache: SnapshotCache, name: str = "api") -> tuple[str, list[tuple[str, int, dict[str, Any]]]]:
    """The cluster's type, and its hosts with their pilotfish metadata."""
    snapshot = cache.snapshot()
    assert snapshot is not None
    cluster: Any = snapshot.types[CLUSTER.url].resources[name].message
    hosts = [
        (
            lb.endpoint.address.socket_address.address,
            lb.endpoint.address.socket_address.port_value,
            dict(lb.metadata.filter_metadata["pilotfish"]),
        )
        for group in cluster.load_assignment.endpoints
        for lb in group.lb_endpoints
    ]
    return cluster.DiscoveryType.Name(cluster.type), sorted(hosts)


def events(recent: RecentEvents, kind: str) -> list[dict[str, Any]]:
    return [e for e in (json.loads(line) for _, line in recent) if e["event"] == kind]


def api_at(*endpoints: Endpoint) -> DesiredState:
    return DesiredState(services={"api": API}, endpoints={"api": endpoints})


async def test_a_name_that_stops_resolving_is_served_by_its_last_good_addresses_until_it_resolves_again() -> None:
    resolver = FakeResolver({"api.internal": ("10.0.0.2", "10.0.0.1")})
    reconciler, cache, recent = fleet(resolver)
    reconciler.update("file", api_at(Endpoint("api.internal", 8080, 2, (("team", "a"),)), Endpoint("10.0.0.9", 8080)))
    reconciler.build_now()
    as_name = ("STRICT_DNS", [("10.0.0.9", 8080, {}), ("api.internal", 8080, {"team": "a"})])
    assert served(cache) == as_name
    await reconciler.names.refresh()  # it resolves: served as the name, Envoy follows DNS itself
    assert reconciler.build_now() is None and served(cache) == as_name

    resolver.answers["api.internal"] = NXDOMAIN
    changes = reconciler.stats.changes
    await reconciler.names.refresh()
    assert reconciler.stats.changes == changes + 1, "the reconciler is told to build"
    reconciler.build_now()
    kept = {"team": "a", UNRESOLVED_NAME: "api.internal"}
    assert served(cache) == (
        "STRICT_DNS",  # an IP address resolves to itself: the cluster stays as it was
        [("10.0.0.1", 8080, kept), ("10.0.0.2", 8080, kept), ("10.0.0.9", 8080, {})],
    )
    (said,) = events(recent, "dns_unresolved")
    assert (said["name"], said["services"], said["kept"]) == ("api.internal", ["api"], ["10.0.0.1", "10.0.0.2"])
    assert "Name or service not known" in said["reason"]
    figures = reconciler.names.figures()
    assert (figures.resolving, figures.kept, figures.unresolved, figures.failures) == (0, 1, 0, 1)
    assert reconciler.names.status() == [
        {
            "name": "api.internal",
            "services": ["api"],
            "resolves": False,
            "last_good": ["10.0.0.1", "10.0.0.2"],
            "served": ["10.0.0.1", "10.0.0.2"],
        }
    ]

    await reconciler.names.refresh()  # still failing: reported once, nothing changes
    assert len(events(recent, "dns_unresolved")) == 1 and reconciler.build_now() is None

    resolver.answers["api.internal"] = ("10.0.0.3",)
    await reconciler.names.refresh()
    reconciler.build_now()
    assert served(cache) == as_name
    (back,) = events(recent, "dns_resolved")
    assert (back["name"], back["addresses"]) == ("api.internal", ["10.0.0.3"])


async def test_a_name_that_never_resolved_is_served_as_the_name_and_reported_once() -> None:
    resolver = FakeResolver({"gone.internal": ()})
    reconciler, cache, recent = fleet(resolver)
    reconciler.update("file", api_at(Endpoint("gone.internal", 80)))
    reconciler.build_now()
    await reconciler.names.refresh()
    await reconciler.names.refresh()
    assert reconciler.build_now() is None
    assert served(cache) == ("STRICT_DNS", [("gone.internal", 80, {})]), "Envoy keeps trying the name"
    (said,) = events(recent, "dns_unresolved")
    assert (said["reason"], said["kept"]) == ("no address", [])
    assert reconciler.names.figures().unresolved == 1


async def test_a_lookup_that_does_not_answer_in_time_counts_as_failed() -> None:
    resolver = FakeResolver({"api.internal": ("10.0.0.1",)})
    reconciler, cache, recent = fleet(resolver, timeout=0.01)
    reconciler.update("file", api_at(Endpoint("api.internal", 80)))
    reconciler.build_now()
    await reconciler.names.refresh()
    reconciler.names._resolver = Silent()  # (the resolver stops answering)
    await reconciler.names.refresh()
    reconciler.build_now()
    assert served(cache)[1] == [("10.0.0.1", 80, {UNRESOLVED_NAME: "api.internal"})]
    assert events(recent, "dns_unresolved")[0]["reason"] == "no answer in 0.01 s"


async def test_names_are_bounded_and_those_no_longer_used_are_forgotten() -> None:
    resolver = FakeResolver({"a.internal": ("10.0.0.1",), "b.internal": ("10.0.0.2",), "c.internal": ("10.0.0.3",)})
    reconciler, _, _ = fleet(resolver, max_names=2)
    names = ("a.internal", "b.internal", "c.internal")
    reconciler.update("file", api_at(*(Endpoint(n, 80) for n in names)))
    reconciler.build_now()
    await reconciler.names.refresh()
    assert sorted(resolver.asked) == ["a.internal", "b.internal"]
    assert reconciler.names.figures().left_out == 1
    reconciler.update("file", api_at(Endpoint("c.internal", 80), Endpoint("10.0.0.9", 80)))
    reconciler.build_now()
    resolver.asked.clear()
    await reconciler.names.refresh()
    assert resolver.asked == ["c.internal"] and reconciler.names.figures().resolving == 1


async def test_a_name_resolving_again_to_fewer_addresses_is_no_removal_for_the_guard() -> None:
    """Twelve kept addresses back to one name: the guard counts the name, and does not hold it."""
    many = tuple(f"10.0.0.{i}" for i in range(1, 13))
    resolver = FakeResolver({"api.internal": many})
    reconciler, cache, _ = fleet(resolver)
    reconciler.update("file", api_at(Endpoint("api.internal", 80)))
    reconciler.build_now()
    await reconciler.names.refresh()
    resolver.answers["api.internal"] = NXDOMAIN
    await reconciler.names.refresh()
    reconciler.build_now()
    assert len(served(cache)[1]) == 12
    resolver.answers["api.internal"] = many[:1]
    await reconciler.names.refresh()
    reconciler.build_now()
    assert reconciler.held is None and served(cache)[1] == [("api.internal", 80, {})]


async def test_with_refresh_0_nothing_is_looked_up() -> None:
    resolver = FakeResolver({})
    reconciler, cache, _ = fleet(resolver, refresh=0.0)
    reconciler.update("file", api_at(Endpoint("api.internal", 80)))
    reconciler.build_now()
    await reconciler.names.refresh()
    assert resolver.asked == [] and served(cache)[1] == [("api.internal", 80, {})]


def test_last_good_addresses_replace_only_their_name_and_an_address_is_served_once() -> None:
    merged = merge_states(
        {
            "file": DesiredState(
                services={"api": API, "web": ServiceSpec(name="web")},
                endpoints={
                    "api": (Endpoint("api.internal", 80, zone="z1"), Endpoint("10.0.0.1", 80)),
                    "web": (Endpoint("10.0.0.5", 80),),
                },
            )
        }
    )
    out = with_last_good(merged, Kept({"api.internal": ("10.0.0.1", "10.0.0.2")}, frozenset({"api"})))
    assert out.endpoints["api"] == (
        Endpoint("10.0.0.1", 80),  # (listed in the service already: served once)
        Endpoint("10.0.0.2", 80, 1, ((UNRESOLVED_NAME, "api.internal"),), "z1"),
    )
    assert out.endpoints["web"] is merged.endpoints["web"]
    assert with_last_good(merged, Kept()) is merged


def test_the_metadata_key_that_marks_a_kept_address_is_refused_in_input() -> None:
    problems: list[Any] = []
    parse_endpoint(
        {"address": "10.0.0.1", "port": 80, "metadata": {UNRESOLVED_NAME: "x"}}, "services.api.endpoints[0]", problems
    )
    assert [p.where for p in problems] == [f"services.api.endpoints[0].metadata.{UNRESOLVED_NAME}"]


async def test_the_hosts_resolver_answers_ipv4_first() -> None:
    assert await SystemResolver().addresses("localhost") == ("127.0.0.1",)


@given(
    st.lists(
        st.tuples(st.sampled_from([f"s{i}" for i in range(6)]), st.sampled_from(["", "a.internal", "b.internal"])),
        min_size=1,
        max_size=20,
    )
)
def test_noting_a_patched_merge_finds_the_names_a_fresh_look_finds(steps: list[tuple[str, str]]) -> None:
    """A build patched from the last merge notes its changed services alone; what it finds in use
    is what noting the whole merged state from scratch finds."""
    from pilotfish.build.desired import MergeMemo
    from pilotfish.reconcile.names import LastGoodNames

    memo = MergeMemo()
    incremental = LastGoodNames(NameSettings(), resolver=FakeResolver({}))
    endpoints: dict[str, tuple[Endpoint, ...]] = {}
    for service, host in steps:
        if host:  # the service uses that name (beside an IP address), or only an IP address
            endpoints = {**endpoints, service: (Endpoint("127.0.0.1", 9000), Endpoint(host, 9001))}
        else:
            endpoints = {**endpoints, service: (Endpoint("127.0.0.1", 9000),)}
        merged = merge_states({"registry": DesiredState(endpoints=dict(endpoints))}, memo=memo)
        incremental.note(merged)
        fresh = LastGoodNames(NameSettings(), resolver=FakeResolver({}))
        fresh.note(merged)
        assert incremental._users == fresh._users
