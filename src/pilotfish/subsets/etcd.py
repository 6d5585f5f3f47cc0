"""Subsetting indices in etcd (``serve --etcd``): every replica, and every restart, computes the
same subsets, and a proxy that moves between replicas keeps its own.

Keys, next to the source prefix (``/pilotfish/`` gives ``/pilotfish.subsets/``):

- ``backends/{service}``: the service's backend :class:`~pilotfish.build.subsetting.IndexTable` (JSON).
  Written only by the replica that holds the election (:class:`BackendIndexWriter`): after each
  build it computes the tables the merged state needs (:func:`pilotfish.build.desired.subset_tables`:
  the lowest free index for each new backend, freed ones dropped) and writes those that differ,
  each only if the key is still at the revision it last read (a deposed leader's late write loses).
  Every replica builds with the tables as etcd has them (the reconciler never allocates on etcd),
  so a backend is in subsets once its index is in etcd, a few milliseconds after it appeared:
  byte-identical snapshots on every replica from the same keys.
- ``proxies/{node}`` -> its index, and ``index/{i}`` -> the node: a proxy's index
  (:class:`EtcdProxyIndices`). The replica a proxy connects to reads it from its view; a new proxy
  is given the lowest index free in the view at once (so its first response already carries its
  subset) and the pair is created in etcd in one transaction that fails if either key exists. Two
  replicas giving one index to two new proxies at the same moment is the rare loser's case: the
  loser takes the next free index (or the one another replica gave the same node) and the proxy is
  sent the subset every replica agrees on, on the streams it has.
  The keys are attached to the lease of the replica serving the proxy (kept alive by it; its TTL
  is the grace period). A proxy that reconnects to another replica is taken over (its keys re-put
  on that replica's lease, only if the index is still its own). A proxy that leaves keeps its index
  for the grace period, then its replica deletes the keys if they are still on its lease; a
  replica that dies leaves its proxies' keys until its lease runs out: the grace period again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from pilotfish.build.desired import DesiredState, Merged, subset_tables
from pilotfish.build.subsetting import INDEX_LIMIT, Index, IndexTable, Presence
from pilotfish.errors import ConfigError
from pilotfish.etcd.client import (
    DEFAULT_KEEPALIVE,
    Change,
    EtcdClient,
    EtcdUnavailable,
    KeyValue,
    Lease,
    compare,
    delete_op,
    follow_prefix,
    put_op,
    unb64,
)

__all__ = ["READY_SOURCE", "BackendIndexWriter", "EtcdProxyIndices", "SharedTables", "SubsetKeys"]

READY_SOURCE = "etcd-subsets"
"""The reconciler waits for this "source" (it contributes nothing) until the subset keys are
listed: a build before that would serve every proxy every endpoint."""

_log = logging.getLogger("pilotfish.subsets")


class SharedTables(Protocol):
    """What the indices feed (the reconciler): the backend tables every replica builds with, as
    etcd has them, and the readiness of the keys (a "source" contributing nothing)."""

    def set_subset_tables(self, tables: Mapping[str, IndexTable]) -> None: ...

    def update(self, source: str, state: DesiredState) -> None: ...


class SubsetKeys:
    """Where the indices live, under one base (``/pilotfish.subsets/`` for ``/pilotfish/``)."""

    def __init__(self, source_prefix: str) -> None:
        self.base = source_prefix.rstrip("/") + ".subsets/"

    def backends(self, service: str = "") -> str:
        return f"{self.base}backends/{service}"

    def proxy(self, node: str = "") -> str:
        return f"{self.base}proxies/{node}"

    def index(self, index: int | None = None) -> str:
        return f"{self.base}index/" + ("" if index is None else str(index))


class EtcdProxyIndices:
    """Proxies' indices shared through etcd; the interface of
    :class:`~pilotfish.build.subsetting.ProxyIndices` (``acquire``, ``release``, ``index``, ``expire``)."""

    def __init__(
        self,
        client: EtcdClient,
        keys: SubsetKeys,
        *,
        grace: float = 300.0,
        limit: int = 200_000,
        keepalive: float = DEFAULT_KEEPALIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.keys = keys
        self.grace = grace
        self.keepalive = keepalive
        """Seconds within which a watch of the keys that stopped answering is noticed and made again."""
        self.limit = limit
        self._into: SharedTables | None = None
        """Told the backend tables as etcd has them, and that the keys are listed (while :meth:`run` runs)."""
        self._on_moved: Callable[[str], None] = lambda _: None
        """Called with a node whose index changed under its open streams (they are sent its new subset)."""
        self._on_listed: Callable[[], None] = lambda: None
        """Called after each full listing (the backend writer looks again)."""
        self._subsetting = False
        """Whether etcd holds any backend table (until then no proxy needs an index)."""
        self._nodes: dict[str, tuple[Index, Lease, int]] = {}
        """Node -> (index, lease, mod revision) as etcd has it."""
        self._holders: dict[int, str] = {}
        """Index -> node, as etcd has it."""
        self._mine: dict[str, Index] = {}
        """Nodes with streams here (or in their grace period here) -> the index they were given."""
        self._presence = Presence(grace=grace, clock=clock)
        self._backends: dict[str, tuple[IndexTable, int]] = {}
        """Service -> (its backend table, the key's mod revision), as etcd has it."""
        self.lease: Lease = 0
        self._work: dict[str, None] = {}
        """Nodes whose keys this replica has to settle in etcd (each once, in arrival order)."""
        self._wake = asyncio.Event()
        self.changes = 0
        self.connected = False
        self.listed_once = False

    # -- the interface of ProxyIndices -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def index(self, node: str) -> Index | None:
        mine = self._mine.get(node)
        if mine is not None:
            return mine
        found = self._nodes.get(node)
        return None if found is None else found[0]

    def acquire(self, node: str) -> Index | None:
        """A stream of ``node`` opened here: its index, given now if it has none (only once the
        keys are listed and something is subsetted: until then it is given at the listing, or
        when subsetting starts, and looked up when its endpoints are answered)."""
        self._presence.arrive(node)
        return self._give(node)

    def touch(self, node: str) -> Index | None:
        """A REST poll of ``node``: its index; one held by another replica is left there (polls
        round-robin over the replicas: moving the keys at each would be a write per poll)."""
        known = self._nodes.get(node)
        if known is not None and node not in self._mine:
            return known[0]
        index = self.acquire(node)
        self.release(node)
        return index

    def _give(self, node: str) -> Index | None:
        if not self.connected or not self._subsetting:
            return self.index(node)
        index = self.index(node)
        if index is None:
            if len(self._nodes) >= self.limit:
                return None
            index = self._lowest_free()
        self._mine[node] = index
        self._queue(node)  # created, or taken over, in etcd
        return index

    def give_present(self) -> None:
        """Index every node with streams here that has none (the keys were just listed, or
        subsetting just started)."""
        for node in self._presence.present():
            if node not in self._mine:
                self._give(node)

    def _queue(self, node: str) -> None:
        self._work[node] = None
        self._wake.set()

    def release(self, node: str) -> None:
        if self._presence.leave(node) and node in self._mine:
            self._presence.gone(node)

    def expire(self) -> None:
        for node in self._presence.expired():
            self._queue(node)  # deleted in etcd, if still ours

    def table(self) -> IndexTable:
        """The indices etcd holds, with this replica's own not written yet."""
        merged = {node: found[0] for node, found in self._nodes.items()}
        merged.update(self._mine)
        if len(set(merged.values())) != len(merged):  # a race being settled: etcd's word
            merged = {node: found[0] for node, found in self._nodes.items()}
        return IndexTable(merged)

    def _lowest_free(self) -> Index:
        taken = set(self._holders) | set(self._mine.values())
        candidate = 0
        while candidate in taken:
            candidate += 1
        if candidate >= INDEX_LIMIT:  # pragma: no cover - 2**32 proxies do not fit in memory
            raise ValueError("no free proxy index below 2**32")
        return Index(candidate)

    # -- etcd -------------------------------------------------------------------------------------

    async def run(
        self,
        into: SharedTables,
        *,
        on_moved: Callable[[str], None] | None = None,
        on_listed: Callable[[], None] | None = None,
    ) -> None:
        """Follow the keys, keep this replica's lease, and write what acquire/expire queued.
        ``into`` (the reconciler) is told the backend tables and when the keys are first listed;
        ``on_moved`` a node whose index changed under its open streams (the xDS server sends
        them its new subset); ``on_listed`` each full listing (the backend writer looks again)."""
        self._into = into
        self._on_moved = on_moved or (lambda _: None)
        self._on_listed = on_listed or (lambda: None)
        tasks = [
            asyncio.create_task(
                follow_prefix(
                    self.client,
                    self.keys.base,
                    listed=self._listed,
                    changed=self._changed,
                    lost=self._lost,
                    keepalive=self.keepalive,
                ),
                name="subset-keys",
            ),
            asyncio.create_task(self._keep_lease(), name="subset-lease"),
            asyncio.create_task(self._write_forever(), name="subset-writes"),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _lost(self, exc: Exception) -> None:
        if self.connected:
            _log.warning("subsetting indices in etcd: %s; keeping the last known and retrying", exc)
        self.connected = False

    async def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        self._nodes.clear()
        self._holders.clear()
        self._backends.clear()
        for key, value, lease, modified in kvs:
            self._apply(key, value, lease, modified)
        self.connected = True
        self._tables_changed()
        if self.listed_once is False:
            self.listed_once = True
            if self._into is not None:  # the subset keys are known: builds may start
                self._into.update(READY_SOURCE, DesiredState())
        self.give_present()
        self._on_listed()

    async def _changed(self, changes: list[Change], revision: int) -> None:
        backends = False
        for key, value, lease, modified in changes:
            backends |= self._apply(key, value, lease, modified)
        if backends:
            self._tables_changed()

    def _apply(self, key: str, value: str | None, lease: Lease, revision: int) -> bool:
        """One key's news; True if it was a backend table."""
        keys = self.keys
        if key.startswith(keys.backends()):
            service = key[len(keys.backends()) :]
            if value is None:
                self._backends.pop(service, None)
            else:
                try:
                    self._backends[service] = (IndexTable.from_json(json.loads(value), source=key), revision)
                except (ValueError, ConfigError) as exc:
                    _log.error(
                        "etcd key %s is not a backend index table (%s); the replica holding the election "
                        "writes it again",
                        key,
                        exc,
                    )
                    # An empty table at the bad key's revision: the service is served whole until
                    # the elected replica writes it again (over exactly that revision).
                    self._backends[service] = (IndexTable(), revision)
            return True
        if key.startswith(keys.proxy()):
            node = key[len(keys.proxy()) :]
            old = self._nodes.pop(node, None)
            if old is not None and self._holders.get(old[0]) == node:
                del self._holders[old[0]]
            if value is not None and value.isdigit() and int(value) < INDEX_LIMIT:
                index = Index(int(value))
                self._nodes[node] = (index, lease, revision)
                self._holders[index] = node
            elif value is not None:
                _log.error(
                    "etcd key %s is not a proxy index (%r): left out; the replica serving %r writes it again",
                    key,
                    value[:100],
                    node,
                )
                if node in self._mine:
                    self._queue(node)
            return False
        return False

    def _tables_changed(self) -> None:
        self.changes += 1
        tables = {service: table for service, (table, _) in self._backends.items()}
        started = not self._subsetting and bool(tables)
        self._subsetting = bool(tables)
        if self._into is not None:
            self._into.set_subset_tables(tables)
        if started:
            self.give_present()  # subsetting started: proxies need indices now

    async def _keep_lease(self) -> None:
        while True:
            try:
                if not self.lease or await self.client.keepalive(self.lease) <= 0:
                    self.lease, _ = await self.client.grant(self.grace)
                    for node in list(self._mine):  # our keys went with the old lease
                        self._queue(node)
            except EtcdUnavailable as exc:
                _log.info("subsetting lease: %s; retrying", exc)
            await asyncio.sleep(max(1.0, min(self.grace / 3, 30.0)))

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._work:
                node = next(iter(self._work))
                del self._work[node]
                try:
                    await self._settle(node)
                except EtcdUnavailable as exc:
                    _log.info("subsetting index of %r not written yet (%s); retrying", node, exc)
                    self._queue(node)
                    await asyncio.sleep(1.0)
                except Exception:  # our bug: say so, and keep the others going
                    _log.exception("subsetting index of %r: unexpected error; retrying in a second", node)
                    self._queue(node)
                    await asyncio.sleep(1.0)

    async def _settle(self, node: str) -> None:
        """Make etcd say what this replica holds about ``node`` (create, take over or delete)."""
        mine = self._mine.get(node)
        if mine is None:
            return
        if not self._presence.here(node):  # its grace period ended here
            del self._mine[node]
            await self._delete_if_ours(node, mine)
            return
        while not self.lease:
            await asyncio.sleep(0.05)
        known = self._nodes.get(node)
        if known is not None and known[0] == mine and known[1] == self.lease:
            return  # already so
        keys = self.keys
        value = str(mine)
        if known is not None and known[0] == mine:  # take it over: still this index, on our lease
            compares = [compare(keys.proxy(node), "VALUE", value)]
        else:
            compares = [compare(keys.proxy(node), "CREATE", 0), compare(keys.index(mine), "CREATE", 0)]
        puts = [put_op(keys.proxy(node), value, lease=self.lease), put_op(keys.index(mine), node, lease=self.lease)]
        answer = await self.client.txn(compares, puts)
        if answer.get("succeeded"):
            return
        # Lost a race: etcd's word wins. The node has an index there (another replica gave it one
        # just now), or our candidate index went to another node.
        current = await self.client.range(keys.proxy(node))
        kvs = current.get("kvs", [])
        text = unb64(kvs[0].get("value", "")) if kvs else ""
        if text.isdigit() and int(text) < INDEX_LIMIT:
            adopted = Index(int(text))
        elif kvs:  # a value that is not an index: overwrite it (if it is still that value)
            _log.error("etcd key %s is not a proxy index (%r); writing it again", keys.proxy(node), text[:100])
            await self.client.txn(
                [compare(keys.proxy(node), "MOD", kvs[0].get("mod_revision", "0"))], [delete_op(keys.proxy(node))]
            )
            self._queue(node)
            return
        else:
            self._holders.setdefault(mine, "")  # taken: skip it (the watch says by whom)
            adopted = self._lowest_free()
        self._mine[node] = adopted
        _log.info(
            "subsetting: proxy %r moved from index %d to %d (another replica indexed it at the same "
            "moment); it is sent its new subset",
            node,
            mine,
            adopted,
        )
        self._on_moved(node)
        self._queue(node)

    async def _delete_if_ours(self, node: str, index: Index) -> None:
        keys = self.keys
        await self.client.txn(
            [compare(keys.proxy(node), "LEASE", self.lease), compare(keys.proxy(node), "VALUE", str(index))],
            [delete_op(keys.proxy(node)), delete_op(keys.index(index))],
        )

    # -- backends (the elected replica) -------------------------------------------------------------

    def backend_tables(self) -> Mapping[str, tuple[IndexTable, int]]:
        return self._backends


class _Stale(Exception):
    """A backend table changed in etcd since it was read."""


class BackendIndexWriter:
    """The elected replica's duty: keep etcd's backend index tables up to date with the merged
    state (see the module docstring). Told every build's merged state (:meth:`merged`: the
    reconciler's ``on_merged``); writes in the background (:meth:`run`, beside the indices it
    keeps in step), at most one write per service at a time. ``default_size``: the subset size of
    services that set none; ``leading``: whether this replica holds the election now."""

    def __init__(
        self, client: EtcdClient, keys: SubsetKeys, *, leading: Callable[[], bool], default_size: int | None = None
    ) -> None:
        self.client = client
        self.keys = keys
        self.default_size = default_size
        self._leading = leading
        self._pending: Merged | None = None
        self._wake = asyncio.Event()

    def merged(self, merged: Merged) -> None:
        self._pending = merged
        self._wake.set()

    def poke(self) -> None:
        """Look again (leadership or etcd's tables changed)."""
        self._wake.set()

    async def run(self, indices: EtcdProxyIndices) -> None:
        """Write the tables ``indices`` (this replica's view of the keys) lack, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            merged = self._pending
            if merged is None or not self._leading() or not indices.connected:
                continue
            try:
                await self._write(merged, indices)
            except (EtcdUnavailable, _Stale) as exc:
                _log.info("backend indices not written yet (%s); retrying", exc)
                await asyncio.sleep(1.0 if isinstance(exc, EtcdUnavailable) else 0.2)
                self._wake.set()
            except Exception:  # our bug: say so, and keep going
                _log.exception("writing the backend indices failed; retrying in a second")
                await asyncio.sleep(1.0)
                self._wake.set()

    async def _write(self, merged: Merged, indices: EtcdProxyIndices) -> None:
        current = indices.backend_tables()
        wanted = subset_tables(
            merged, {service: table for service, (table, _) in current.items()}, default_size=self.default_size
        )
        for service, table in sorted(wanted.items()):
            known = current.get(service)
            if known is not None and known[0] == table:
                continue
            key = self.keys.backends(service)
            compares = [compare(key, "MOD", known[1])] if known is not None else [compare(key, "CREATE", 0)]
            answer = await self.client.txn(compares, [put_op(key, json.dumps(table.to_json(), sort_keys=True))])
            if not answer.get("succeeded"):
                # The key changed since this replica read it (another leader wrote, or the watch
                # lags): look again once the watch has the news.
                _log.info("backend indices of %s changed in etcd meanwhile; looking again", service)
                raise _Stale(service)
        for service in sorted(current.keys() - wanted.keys()):
            known = current[service]
            await self.client.txn(
                [compare(self.keys.backends(service), "MOD", known[1])], [delete_op(self.keys.backends(service))]
            )
