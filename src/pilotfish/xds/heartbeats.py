"""Heartbeats: what a stream holds with a TTL is renewed before the TTL runs out.

A resource served with a TTL (``ttl:`` in the snapshot file) is dropped by the proxy that long
after it last arrived, unless it arrives again: so when pilotfish goes away, an override goes
with it. While pilotfish serves the proxy, each stream that holds such resources is sent a
refresh a little before the shortest TTL it holds runs out (:data:`MARGIN`; less up to a tenth
of the period, at random, so a fleet that was pushed at once spreads its refreshes out):

- over delta xDS, a heartbeat: each such resource's name, version and TTL without the resource
  (the client renews the TTL of the version it has);
- over SotW, the resources themselves at the same version: Envoy's SotW client (without
  ``envoy.reloadable_features.unified_mux``) does not renew a TTL from a heartbeat, only from
  the resource. For clusters and listeners (full state) that is the whole response the proxy
  holds; for the other types only the resources with a TTL.

Either is one shared body per version and set held (made by the type snapshot, memoized there),
with the stream's nonce appended: a fleet at one version costs one encoding. A refresh waits
while the stream's latest response of the type is unanswered or was rejected (what the proxy
runs is then not what it was sent); it is tried again shortly.

One timer for the whole server, armed for the earliest refresh due. Streams register when they
send a type snapshot that has TTLs (:meth:`Heartbeats.expect`) and leave when they end
(:meth:`Heartbeats.forget`): at most one entry per stream and type.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from typing import Protocol

from pilotfish.resources import TypeUrl
from pilotfish.snapshot import TypeSnapshot

__all__ = ["MARGIN", "Heartbeats", "Refreshable"]

MARGIN = 5.0
"""Seconds before the shortest TTL a stream holds runs out that its refresh is due, at most (and
at most a third of the TTL): a refresh goes out ``ttl - min(ttl / 3, MARGIN)`` after the last one
(less up to :data:`_SPREAD` of that). A 30 s TTL is renewed every 22.5-25 s; a 3 s one every
1.8-2 s. Enough to absorb a busy event loop (its longest stalls are milliseconds to a few hundred
of them), while a fleet's refreshes cost as little as they can: each is a write and an ACK per
proxy, whatever the bytes."""
_SPREAD = 0.1
_TICK = 0.25
"""Seconds between two runs of the timer, at least: a run sends every refresh due within this of
now (a little early), so a fleet's refreshes go out in batches, not one timer wake-up each."""
_RETRY = 1.0
"""Seconds before a refresh that had to wait (its stream's latest response unanswered) is tried
again, at most (less for short TTLs: a quarter of the period)."""


class Refreshable(Protocol):
    """A stream, as heartbeats see it."""

    @property
    def closed(self) -> bool: ...

    def refresh(self, type_url: TypeUrl, current: TypeSnapshot) -> bool | None:
        """Send what renews the TTLs the stream holds of ``type_url`` (from ``current``, the type
        snapshot of its latest response): True if sent, False if it must wait (try again soon),
        None if there is nothing to renew."""
        ...


class _Entry:
    __slots__ = ("current", "due", "period", "stream", "type_url")

    def __init__(self, stream: Refreshable, type_url: TypeUrl, current: TypeSnapshot, period: float) -> None:
        self.stream = stream
        self.type_url = type_url
        self.current = current
        self.period = period
        """:meth:`Heartbeats.period` of :attr:`current` (found when it is set, not per refresh)."""
        self.due = 0.0


class Heartbeats:
    """When each stream's TTLs are to be renewed, and the one timer that does it."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        arm: Callable[[float, Callable[[], object]], Callable[[], object]] | None = None,
        spread: Callable[[], float] = random.random,
        tick: float = _TICK,
    ) -> None:
        """``clock``: the time now (seconds, monotonic). ``arm(due, run)``: sets a timer that calls
        ``run`` (:meth:`run`) at ``due``, the time of the earliest refresh (when it is earlier than
        the one set before, which is cancelled), and returns what cancels it (None: the caller
        calls :meth:`run` itself, as tests with a fake clock do).
        ``spread``: a number in [0, 1) per refresh (how much of :data:`_SPREAD` it comes early).
        ``tick``: see :data:`_TICK` (0: each refresh at its time)."""
        self._tick = tick
        self._clock = clock
        self._arm = arm
        self._spread = spread
        self._entries: dict[tuple[int, TypeUrl], _Entry] = {}
        self._heap: list[tuple[float, int, tuple[int, TypeUrl]]] = []
        self._order = itertools.count()
        self._armed: float | None = None
        self._cancel: Callable[[], object] | None = None
        self.sent = 0
        """Refreshes sent, in all."""

    def __len__(self) -> int:
        return len(self._entries)

    def period(self, current: TypeSnapshot) -> float:
        """Seconds from one refresh of ``current``'s TTLs to the next (before the spread)."""
        ttl = min(current.ttls().values()) / 1000
        return ttl - min(ttl / 3, MARGIN)

    def expect(self, stream: Refreshable, type_url: TypeUrl, current: TypeSnapshot) -> None:
        """``stream`` sent a response of ``type_url`` from ``current``, which has TTLs: renew them
        from now on, no later than a period from now (an entry due earlier keeps its time). A
        stream whose later responses have none is dropped when its refresh finds nothing to renew."""
        key = (id(stream), type_url)
        entry = self._entries.get(key)
        period = self.period(current)
        due = self._clock() + period * (1 - _SPREAD * self._spread())
        if entry is None:
            self._entries[key] = entry = _Entry(stream, type_url, current, period)
        else:
            entry.current, entry.period = current, period
            if entry.due <= due:
                return
        entry.due = due
        self._push(key, due)

    def forget(self, stream: Refreshable, type_urls: Iterable[TypeUrl]) -> None:
        """``stream`` ended: no more refreshes of ``type_urls`` for it."""
        for type_url in type_urls:
            self._entries.pop((id(stream), type_url), None)

    def run(self) -> int:
        """Send every refresh that is due; arm the timer for the next. Returns how many went out."""
        now = self._clock()
        self._armed = self._cancel = None
        heap, entries = self._heap, self._entries
        sent = 0
        horizon = now + self._tick
        again: list[tuple[tuple[int, TypeUrl], float]] = []
        while heap and heap[0][0] <= horizon:
            due, _, key = heapq.heappop(heap)
            entry = entries.get(key)
            if entry is None or entry.due != due:
                continue  # gone, or moved (its newer place is in the heap)
            if entry.stream.closed:
                del entries[key]
                continue
            outcome = entry.stream.refresh(entry.type_url, entry.current)
            if outcome is None:
                del entries[key]
                continue
            period = entry.period
            if outcome:
                sent += 1
                entry.due = now + period * (1 - _SPREAD * self._spread())
            else:
                entry.due = now + min(_RETRY, period / 4)
            again.append((key, entry.due))  # (pushed after the loop: a retry may be due within the tick)
        for key, due in again:
            self._push(key, due, arm=False)
        self.sent += sent
        if len(heap) > 2 * len(entries) + 64:  # places of entries that moved or went
            self._heap = [(e.due, next(self._order), k) for k, e in entries.items()]
            heapq.heapify(self._heap)
        if self._heap:
            self._arm_for(max(self._heap[0][0], horizon))
        return sent

    def _push(self, key: tuple[int, TypeUrl], due: float, *, arm: bool = True) -> None:
        heapq.heappush(self._heap, (due, next(self._order), key))
        if arm:
            self._arm_for(due)

    def _arm_for(self, due: float) -> None:
        if self._arm is not None and (self._armed is None or due < self._armed):
            if self._cancel is not None:
                self._cancel()
            self._armed = due
            self._cancel = self._arm(due, self.run)

    def close(self) -> None:
        """Cancel the timer; forget every stream."""
        if self._cancel is not None:
            self._cancel()
        self._cancel = self._armed = None
        self._entries.clear()
        self._heap.clear()
