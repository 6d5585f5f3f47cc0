"""The election of one replica among those on one etcd: the holder runs the duties that must run
once (see :class:`Election`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pilotfish.etcd.client import EtcdClient, EtcdUnavailable, Lease, unb64

__all__ = ["Election", "Leadership"]

_log = logging.getLogger("pilotfish.sources.etcd")


class Leadership:
    """This replica's standing in the election, for those that ask before the election exists
    (it needs the bound xDS address, known once the server listens): not leading, no known
    holder, until an :class:`Election` made with it takes over the answers."""

    def __init__(self) -> None:
        self._election: Election | None = None

    @property
    def leader(self) -> bool:
        """Whether this replica runs the singleton duties now (see :attr:`Election.leader`)."""
        return self._election is not None and self._election.leader

    @property
    def holder(self) -> str | None:
        """Who holds the election, as last seen (None: nobody, or not known)."""
        return None if self._election is None else self._election.holder

    @property
    def elected(self) -> bool:
        """Whether an election answers (with ``--etcd``, once the server listens)."""
        return self._election is not None

    def _follow(self, election: Election) -> None:
        self._election = election


class Election:
    """Holds ``key`` in etcd for this replica while it can: the replica holding it runs the duties
    that must run once (see :mod:`pilotfish.api.registry_etcd`).

    The key is created (only if absent) attached to a lease of ``ttl`` seconds that this replica
    keeps alive every ``ttl / 3``; its value names the holder. A holder that dies stops renewing,
    etcd ends the lease and deletes the key, and the next attempt of another replica (every
    ``ttl / 3``) takes it: a hand-over within about ``ttl * 4 / 3``. A holder that cannot renew for
    ``ttl * 2 / 3`` (etcd unreachable) steps down before its lease can have ended, so two replicas
    never both believe they hold it for longer than a renewal round trip.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        identity: str,
        *,
        ttl: float = 6.0,
        on_event: Callable[..., None] | None = None,
        on_change: Callable[[bool], None] | None = None,
        leadership: Leadership | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.key = key
        self.identity = identity
        self.ttl = ttl
        self._leader = False
        self._renewed = 0.0
        """When the last successful renewal was *sent* (etcd counts the lease from no earlier)."""
        self.holder: str | None = None
        """Who holds the key, as last seen (None: nobody, or not known)."""
        self._emit = on_event or (lambda *_, **__: None)
        self._on_change = on_change or (lambda _: None)
        self._clock = clock
        if leadership is not None:  # (it answers for this election from now on)
            leadership._follow(self)

    @property
    def leader(self) -> bool:
        """Whether this replica holds the key now: it took it, and its last renewal was sent less
        than ``ttl * 2 / 3`` ago (a replica whose loop stalled stops believing it before its lease
        can have ended, even before its next renewal attempt fails)."""
        return self._leader and self._clock() - self._renewed < self.ttl * 2 / 3

    def _set(self, leader: bool, reason: str) -> None:
        if leader == self._leader:
            return
        self._leader = leader
        if leader:
            self.holder = self.identity
        _log.warning(
            "%s %s (%s)",
            self.identity,
            "now runs the singleton duties" if leader else "no longer runs the singleton duties",
            reason,
        )
        self._emit("leader_elected" if leader else "leader_lost", replica=self.identity, reason=reason)
        self._on_change(leader)

    async def run(self) -> None:
        """Campaign, hold and renew until cancelled; steps down on the way out."""
        every = self.ttl / 3
        lease: Lease = 0
        try:
            while True:
                try:
                    sent = self._clock()
                    if not lease:
                        lease, _ = await self.client.grant(self.ttl)
                        self._renewed = sent
                    elif await self.client.keepalive(lease) > 0:
                        self._renewed = sent
                    else:  # the lease ended (etcd was away longer than the ttl): start over
                        lease = 0
                        self._set(False, "its lease ended")
                        continue
                    created, held = await self.client.create(self.key, self.identity, lease=lease)
                    if created:
                        self._set(True, "took the election key")
                    else:
                        self.holder = unb64(held.get("value", "")) or None
                        if int(held.get("lease", 0)) == lease:  # ours (taken before, or an answer lost)
                            self._set(True, "holds the election key")
                        else:  # someone else's: the key went (deleted, or our lease ended) and was taken
                            self._set(False, f"the election key is held by {self.holder!r}")
                except EtcdUnavailable as exc:
                    if self._leader and not self.leader:
                        self._set(False, f"could not renew: {exc}")
                await asyncio.sleep(every)
        finally:
            if self._leader:
                self._set(False, "stopping")
                if lease:
                    with contextlib.suppress(EtcdUnavailable):
                        await self.client.revoke(lease)  # hand over now, not after the ttl
