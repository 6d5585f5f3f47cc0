"""Random DiscoveryRequest sequences on one SotW stream hold the protocol's invariants.

Hypothesis drives an ADS stream (state machine + real cache, in memory) with random requests
(any type, any names including ``*`` and names that never exist, versions that are empty, old,
current or bogus, nonces that are the latest, none, stale or bogus, with or without
error_detail) while snapshots change under it. The test keeps its own simple model of the proxy
(what it subscribes to, what it holds) and checks after every step (docs/architecture.md, behaviours 3-13):

- a request with a stale or unknown nonce gets no response and changes nothing: a twin stream
  that never saw those requests has been sent exactly the same responses;
- nonces are unique on the stream; every response is at the type's current version (for
  clusters, or the make-before-break bridge), and carries the full subscribed set that exists;
- make before break: a clusters response keeps every subscribed cluster that the routes the proxy
  says it runs, or was last sent, use (if the cache still has those routes and that cluster);
- NACKed content is not sent again unless it changed, the proxy named a resource it does not
  hold, or a cluster (listener) response since asks the endpoints (routes) to warm;
- at the end a well-behaved proxy ACKs what it gets; the conversation goes quiet within a few
  rounds, and the proxy then holds, at the current version, every resource it subscribes to
  that exists: no request is left unanswered forever.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from unittest import mock

from conftest import CDS, EDS, LDS, RDS, Received, StreamPair, assignment, build, cluster, listener, mixes, route
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.cache import HISTORY, SnapshotCache
from pilotfish.protocol import RequestKind
from pilotfish.resources.refs import referenced_clusters
from pilotfish.snapshot import Snapshot

TYPES = (CDS, EDS, LDS, RDS)
FULL_STATE = frozenset({CDS, LDS})
PARENT = {EDS: CDS, RDS: LDS}
"""A response of the parent type makes the child's next request due (warming, behaviour 13)."""
UNIVERSE: dict[str, tuple[str, ...]] = {
    CDS: ("a", "b", "c"),
    EDS: ("a", "b", "c"),
    LDS: ("l", "m"),
    RDS: ("r", "s", "t"),
}
NEVER = "zz"
"""A name no snapshot ever has."""


def _pool() -> list[Snapshot]:
    """Snapshots that differ in membership and in content, some equal to others."""
    rng = random.Random(8)
    pool = []
    for _ in range(9):
        clusters = [c for c in "abc" if rng.random() < 0.75]
        listeners = [name for name in "lm" if rng.random() < 0.7]
        routes = [r for r in "rst" if rng.random() < 0.75]
        targets = clusters or ["a"]
        pool.append(
            build(
                clusters=[cluster(c, rng.choice(["1s", "2s"])) for c in clusters],
                endpoints=[assignment(c, rng.choice([1, 2])) for c in "abc" if rng.random() < 0.8],
                listeners=[
                    listener(name, {"l": "r", "m": "s"}[name], port=10000 + rng.choice([0, 1])) for name in listeners
                ],
                routes=[route(r, rng.choice(targets)) for r in routes],
            )
        )
    pool.append(pool[0])  # the same content again
    return pool + mixes(pool, rng, 6)


POOL = _pool()


def _content_at(type_url: str, version: str, names: frozenset[str]) -> dict[str, str]:
    """What a proxy holds that states it has ``names`` at ``version`` of ``type_url``."""
    at = next((s.get(type_url) for s in POOL if s.version(type_url) == version), None)
    if at is None:
        return {}
    return {n: at.resources[n].hash for n in names if n in at.resources}


VERSIONS = sorted({s.version(t) or "" for s in POOL for t in TYPES})


@dataclass(frozen=True)
class Request:
    type_url: str
    names: tuple[str, ...]
    version: str
    """"", "old", "proxy" (what Envoy sends: the version it ACKs, else the one it runs),
    "current", or one of VERSIONS."""
    nonce: str
    """"", "latest", "stale" (an earlier nonce of the stream) or "bogus"."""
    error: str | None


@dataclass(frozen=True)
class Publish:
    index: int


def _names(type_url: str) -> st.SearchStrategy[tuple[str, ...]]:
    universe = UNIVERSE[type_url]
    # Mostly what a proxy does (everything, all but one, one, none), sometimes anything.
    typical = [universe, universe[:-1], universe[1:], universe[:1], ()]
    return st.one_of(
        st.sampled_from(typical),
        st.lists(st.sampled_from((*universe, NEVER, "*")), max_size=4, unique=True).map(tuple),
    )


def _requests(type_url: str) -> st.SearchStrategy[Request]:
    return st.builds(
        Request,
        type_url=st.just(type_url),
        names=_names(type_url),
        version=st.tuples(
            st.sampled_from(["", "old", "proxy", "proxy", "proxy", "current", "current", "pool"]),
            st.sampled_from(VERSIONS),
        ).map(lambda choice: choice[1] if choice[0] == "pool" else choice[0]),
        nonce=st.sampled_from(["latest", "latest", "latest", "", "", "stale", "bogus"]),
        error=st.sampled_from([None, None, None, None, "rejected"]),
    )


_REQUEST = st.sampled_from(TYPES).flatmap(_requests)
STEPS = st.lists(
    # Mostly requests: a snapshot change resets much of what a stream holds.
    st.one_of(_REQUEST, _REQUEST, _REQUEST, _REQUEST, st.builds(Publish, index=st.integers(0, len(POOL) - 1))),
    max_size=40,
)


@dataclass
class Subscribed:
    wildcard: bool
    names: frozenset[str]

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names


@dataclass
class TypeModel:
    """The proxy's side of one type, as the test sees it."""

    requested: tuple[str, ...] | None = None
    """The names of its latest request that was not stale (None: never requested)."""
    subscribed: Subscribed | None = None
    ever_named: bool = False
    latest_nonce: str | None = None
    latest_version: str = ""
    accepted: str = ""
    """The version it runs (what it sends as version_info)."""
    running: str = ""
    """The version_info of its latest request that was not stale: the version it says it runs."""
    stated: bool = False
    """It has made a request without a nonce before seeing a response (its statement)."""
    held_version: str | None = None
    held: frozenset[str] = frozenset()
    held_all: bool = False
    content: dict[str, str] = field(default_factory=dict)
    """EDS/RDS: the content hash of each resource the proxy holds (a response carries only what
    changed, so this is what it has gathered)."""
    nack: str | None = None
    """After a NACK: the version rejected (sent and rejected still counts as held)."""
    warm: bool = False
    """A response of the parent type went out since this type's last response."""

    def version_info(self, nonce: str, error: str | None) -> str:
        """What Envoy sends: an ACK carries the version it ACKs, anything else the one it runs."""
        return self.latest_version if nonce and nonce == self.latest_nonce and error is None else self.accepted


@dataclass
class Run:
    cache: SnapshotCache
    pair: StreamPair
    twin: StreamPair
    """Sees the same snapshots and every request except the stale ones."""
    models: dict[str, TypeModel] = field(default_factory=lambda: {t: TypeModel() for t in TYPES})
    snapshot: Snapshot = POOL[0]
    previous: Snapshot | None = None
    nonces: list[str] = field(default_factory=list)
    published: list[Snapshot] = field(default_factory=list)
    """Every snapshot the cache was given, the first included."""

    def kept(self, type_url: str, version: str | None) -> bool:
        """Whether the cache can still answer a proxy at ``version`` with changes since it."""
        newest_first = dict.fromkeys(s.version(type_url) for s in reversed([*self.published, self.snapshot]))
        return version in list(newest_first)[:HISTORY]

    # -- actions ----------------------------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> None:
        self.published.append(self.snapshot)
        self.previous, self.snapshot = self.snapshot, snapshot
        for type_url, model in self.models.items():
            if model.nack is not None and model.nack != snapshot.version(type_url):
                model.nack = None  # the content changed: it may be sent
        before = len(self.pair.inbox)
        self.cache.set_snapshot(snapshot)
        self.twin.cache.set_snapshot(snapshot)
        self.received(self.pair.inbox[before:])

    def request(self, step: Request) -> None:
        model = self.models[step.type_url]
        nonce = {"": "", "latest": model.latest_nonce or "", "bogus": "bogus-1"}.get(step.nonce)
        if nonce is None:  # stale: any earlier nonce of the stream that is not this type's latest
            earlier = [n for n in self.nonces if n != model.latest_nonce]
            nonce = earlier[len(earlier) // 2] if earlier else "bogus-2"
        stale = bool(nonce) and nonce != model.latest_nonce
        version = {
            "": "",
            "old": "old",
            "proxy": model.version_info(nonce, step.error),
            "current": self.snapshot.version(step.type_url) or "",
        }.get(step.version, step.version)
        sent = self.pair.send(step.type_url, step.names, version=version, nonce=nonce, error=step.error)
        if stale:
            assert self.pair.outcomes[-1].kind is RequestKind.STALE
            assert sent == [], f"a response to a stale nonce {nonce!r}: {sent}"
            return
        self.requested(step.type_url, step.names, version, nonce, step.error)
        self.twin.send(step.type_url, step.names, version=version, nonce=nonce, error=step.error)
        self.received(sent)

    def requested(self, type_url: str, names: tuple[str, ...], version: str, nonce: str, error: str | None) -> None:
        """The proxy's model after a request the server processes."""
        model = self.models[type_url]
        named = frozenset(names) - {"*"}
        wildcard = "*" in names or (type_url in FULL_STATE and not names and not model.ever_named)
        model.ever_named |= bool(named)
        model.requested, model.subscribed = names, Subscribed(wildcard, named)
        model.running = version
        # Before any response: what the proxy holds is what it states (its first request); a later
        # request stating another version holds nothing we know of.
        if not nonce and model.latest_nonce is None and (not model.stated or (version or None) != model.held_version):
            trusted = not model.stated and bool(version)
            model.held_version = version or None
            model.held = named if trusted else frozenset()
            model.content = _content_at(type_url, version, named) if trusted else {}
            model.held_all = trusted and wildcard
            model.stated = True
            return
        if type_url not in FULL_STATE and not wildcard:
            # The proxy drops what it no longer subscribes to.
            if model.held_all:
                at = next((s.get(type_url) for s in POOL if s.version(type_url) == model.held_version), None)
                model.held = frozenset(at.resources) if at is not None else frozenset()
                model.held_all = False
            model.held &= named
            model.content = {n: h for n, h in model.content.items() if n in named}
        if nonce and error is None:
            model.accepted = model.latest_version  # an ACK: the proxy runs what it ACKed
        if nonce and error is not None:
            model.nack = model.latest_version

    def received(self, responses: list[Received]) -> None:
        for response in responses:
            self.check_response(response)
            model = self.models[response.type_url]
            model.latest_nonce, model.latest_version = response.nonce, response.version
            current = self.snapshot.get(response.type_url)
            assert current is not None
            if response.type_url in FULL_STATE:
                model.held = frozenset(response.names)
            else:
                # A response of changes: the proxy keeps what it held and takes what was sent.
                model.content.update((n, current.resources[n].hash) for n in response.names)
                subscribed = model.subscribed
                assert subscribed is not None
                model.held = frozenset(n for n in current.resources if subscribed.wants(n))
                stale = {n for n in model.held if model.content.get(n) != current.resources[n].hash}
                assert not stale, f"{response.type_url}: after the response the proxy lacks {stale} as they are now"
            model.held_version, model.held_all = response.version, False
            model.warm = False
            self.nonces.append(response.nonce)
            for child, parent in PARENT.items():
                if parent == response.type_url:
                    self.models[child].warm = True
        assert self.twin.inbox == self.pair.inbox, "stale requests changed what the stream was sent"

    # -- invariants -------------------------------------------------------------------------------

    def check_response(self, response: Received) -> None:
        type_url = response.type_url
        model = self.models[type_url]
        assert response.nonce not in self.nonces, f"nonce {response.nonce!r} used twice on one stream"
        subscribed = model.subscribed
        assert subscribed is not None, f"a response of {type_url} before any request of it"
        current = self.snapshot.get(type_url)
        assert current is not None
        expected = {name for name in current.resources if subscribed.wants(name)}
        names = set(response.names)
        if response.version == current.version and type_url not in FULL_STATE:
            assert names <= expected, f"{type_url} response carries what is not subscribed or does not exist"
            unchanged = {n for n in names if n in model.held and model.content.get(n) == current.resources[n].hash}
            # (A wildcard EDS/RDS subscription, which Envoy never makes, is answered in full, and so is
            # a proxy at a version the cache does not keep.)
            assert not unchanged or model.warm or subscribed.wildcard or not self.kept(type_url, model.held_version), (
                f"{type_url} response re-sends {unchanged}, which the proxy holds"
            )
        elif response.version == current.version:
            assert names == expected, f"{type_url} response is not the whole subscribed set"
        else:
            # Only clusters may differ from the snapshot: the bridge keeps clusters that the
            # routes of earlier snapshots used (make before break, behaviour 12).
            assert type_url == CDS and self.previous is not None, f"{type_url} at a version not current"
            earlier = {name for s in self.published for name in s.get(CDS).resources}  # type: ignore[union-attr]
            assert names >= expected and names - expected <= earlier, "not a bridge"
        if type_url == CDS:
            missing = self.routed_clusters() - names
            assert not {n for n in missing if subscribed.wants(n)}, f"clusters {missing} taken from routes still in use"
        if model.nack is not None and response.version == model.nack:
            # Prompted: the proxy's set differs (full state), or it lacks a name sent (it dropped
            # it since, and asked for it again).
            prompted = names != model.held if type_url in FULL_STATE else not names <= model.held
            assert prompted or model.warm, f"NACKed {type_url} content {model.nack} sent again unprompted"
        model.nack = None

    def routed_clusters(self) -> set[str]:
        """The clusters that routes the proxy says it runs, or was last sent, send traffic to, if
        they are not the current routes: those of them that a version of the clusters the cache
        still keeps has (the bridge keeps them until the proxy runs the current routes)."""
        snapshots = [*self.published, self.snapshot]
        used: set[str] = set()
        for type_url in (LDS, RDS):
            model = self.models[type_url]
            for version in {model.running, model.latest_version} - {"", self.snapshot.version(type_url)}:
                at = next((s.get(type_url) for s in snapshots if s.version(type_url) == version), None)
                if at is not None and self.kept(type_url, version):
                    messages = [r.message for r in at.resources.values()]
                    used |= referenced_clusters(messages, ()) if type_url == LDS else referenced_clusters((), messages)
        kept = {n for s in snapshots if self.kept(CDS, s.version(CDS)) for n in s.get(CDS).resources}  # type: ignore[union-attr]
        return used & kept

    def settle(self) -> None:
        """A well-behaved proxy: re-states each subscription with its latest nonce and ACKs all it
        gets. The conversation must go quiet, with everything subscribed held at the current
        version."""
        for _ in range(6):
            before = len(self.pair.inbox)
            for type_url, model in self.models.items():
                if model.requested is not None:
                    nonce = model.latest_nonce or ""
                    names, version = model.requested, model.version_info(nonce, None)
                    sent = self.pair.send(type_url, names, version=version, nonce=nonce)
                    self.requested(type_url, names, version, nonce, None)
                    self.twin.send(type_url, names, version=version, nonce=nonce)
                    self.received(sent)
            if len(self.pair.inbox) == before:
                break
        else:
            raise AssertionError("ACKing every response does not go quiet: a response loop")
        for type_url, model in self.models.items():
            if model.subscribed is None:
                continue
            current = self.snapshot.get(type_url)
            assert current is not None
            wanted = {name for name in current.resources if model.subscribed.wants(name)}
            assert model.held_version == current.version, f"{type_url}: the proxy is left at an old version"
            assert model.held_all or wanted <= model.held, (
                f"{type_url}: subscribed {sorted(wanted - model.held)} never sent"
            )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.integers(0, len(POOL) - 1), steps=STEPS)
def test_random_request_sequences_keep_the_protocol_invariants(start: int, steps: list[Request | Publish]) -> None:
    _play(start, steps).settle()


def _play(start: int, steps: list[Request | Publish]) -> Run:
    cache, twin_cache = SnapshotCache(), SnapshotCache()
    cache.set_snapshot(POOL[start])
    twin_cache.set_snapshot(POOL[start])
    run = Run(cache, StreamPair(cache), StreamPair(twin_cache), snapshot=POOL[start])
    for step in steps:
        if isinstance(step, Publish):
            run.publish(POOL[step.index])
        else:
            run.request(step)
    return run


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.integers(0, len(POOL) - 1), steps=STEPS)
def test_a_publication_answers_what_a_look_at_every_watch_would(start: int, steps: list[Request | Publish]) -> None:
    """The cache passes over the watches of a type whose very resources it served before (none
    waiting on them can be due): it must answer exactly what looking at every watch answers."""
    passing = _play(start, steps)
    with mock.patch("pilotfish.cache._nothing_new", return_value=False):
        looking = _play(start, steps)
    assert (passing.pair.inbox, passing.twin.inbox) == (looking.pair.inbox, looking.twin.inbox)
