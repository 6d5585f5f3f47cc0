"""The one etcd client: the v3 calls pilotfish makes over etcd's JSON gateway, transactions, and
following a prefix (list, then watch) with a keepalive probe.

**A watch that stops answering is noticed.** A watch is a long HTTP stream that is silent while
nothing changes, so a stalled etcd (a paused process, a hung disk) or a half-open connection (a
middlebox dropped it without a reset) looks like a quiet one. etcd's Go client finds these with
gRPC keepalive pings on its connection (HTTP/2 PINGs); the JSON gateway has no pings, and a
progress request cannot be sent on its stream (a watch there is one HTTP/1.1 request), so the
watch keeps alive its own way, every ``keepalive`` seconds at most: after ``keepalive / 2`` of
silence on the stream it *probes* etcd with a read on another connection (the newest key under
the prefix, ``limit 1``), which must answer within ``keepalive / 2``. A probe that fails or hangs
ends the watch: the stall is reported as etcd being lost (log warning, event
``etcd_disconnected``, the ``problem`` of ``/healthz``) within ``keepalive`` seconds of the last
word from etcd, and the source lists again until etcd answers (then ``etcd_synced``: what changed
meanwhile is in the listing). A probe that answers but shows a
key changed at a revision the watch has not delivered by the next probe means the stream itself is
dead (etcd is fine): the watch is ended and made again the same way. (Only a put shows: etcd keeps
no record of a deleted key to compare with, so a dead stream that misses only deletes is found at
the next put. The probe sorts the keys by revision, which costs etcd a pass over the prefix's keys:
about one probe per ``keepalive / 2`` per watch while nothing changes, none while changes flow.)
The watch also asks for etcd's progress notifications (``progress_notify``), so an etcd run with a
short ``--experimental-watch-progress-notify-interval`` keeps the stream talking and needs fewer
probes.

:class:`EtcdClient` is the few calls pilotfish makes (range, put, delete, transactions, leases);
every failure to reach etcd or get an answer from it is an :class:`EtcdUnavailable` naming what
failed. The JSON gateway was chosen over a gRPC etcd client: it needs only aiohttp, and the
asyncio etcd clients on PyPI pin protobuf versions older than the Envoy API modules need.

Transactions are built here (:func:`compare`, :func:`put_op`, :func:`delete_op`, :meth:`EtcdClient.txn`):
this module is the one place that knows the ``/v3/kv/txn`` JSON and the base64 of keys and values.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

__all__ = [
    "DEFAULT_KEEPALIVE",
    "Change",
    "EtcdClient",
    "EtcdUnavailable",
    "KeyValue",
    "Lease",
    "b64",
    "compare",
    "delete_op",
    "follow_prefix",
    "prefix_end",
    "put_op",
    "unb64",
]

_log = logging.getLogger("pilotfish.sources.etcd")


def b64(text: str) -> str:
    """``text`` as the JSON gateway carries keys and values (base64 of its UTF-8)."""
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    """A key or value from the JSON gateway as text (undecodable bytes replaced)."""
    return base64.b64decode(text).decode("utf-8", errors="replace")


def prefix_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    raw[-1] += 1
    return raw.decode("latin-1")


Lease = int
"""An etcd lease id (0: none)."""

DEFAULT_KEEPALIVE = 10.0
"""Seconds within which a watch that stopped answering is noticed (see the module docstring)."""


def compare(key: str, target: str, value: str | int) -> dict[str, Any]:
    """One comparison of a transaction: ``target`` is ``VALUE`` (``value`` is the text),
    ``CREATE`` / ``MOD`` (a revision: ``0`` with ``CREATE`` means the key is absent) or ``LEASE``."""
    field_name = {"VALUE": "value", "CREATE": "create_revision", "MOD": "mod_revision", "LEASE": "lease"}[target]
    return {"key": b64(key), "target": target, field_name: b64(str(value)) if target == "VALUE" else str(value)}


def put_op(key: str, value: str, *, lease: Lease | None = None) -> dict[str, Any]:
    """A put within a transaction (attached to ``lease`` if given)."""
    request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease is not None:
        request["lease"] = str(lease)
    return {"request_put": request}


def delete_op(key: str) -> dict[str, Any]:
    """A delete of one key within a transaction."""
    return {"request_delete_range": {"key": b64(key)}}


class EtcdUnavailable(Exception):
    """etcd could not be reached, or did not do what was asked; the message says which and why."""


class EtcdClient:
    """The etcd v3 calls pilotfish makes, over the JSON gateway, on one aiohttp session.

    Keys and values are text here and base64 on the wire. Each call either returns etcd's answer
    or raises :class:`EtcdUnavailable` (connection refused, timeout, an error status, an answer
    that is not what etcd sends).
    """

    def __init__(self, endpoint: str, *, timeout: float = 5.0) -> None:
        self.endpoint = endpoint
        self.base = f"http://{endpoint}"
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(2.0, timeout))
        self._http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path``; etcd's answer, or :class:`EtcdUnavailable`."""
        try:
            async with self.session().post(self.base + path, json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200 or not isinstance(answer, dict):
                    message = answer.get("message") if isinstance(answer, dict) else None
                    raise EtcdUnavailable(
                        f"etcd at {self.endpoint} answered {path} with HTTP {response.status}"
                        + (f": {message}" if message else "")
                    )
                return answer
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise EtcdUnavailable(
                f"etcd at {self.endpoint} unreachable ({path}): {str(exc) or type(exc).__name__}"
            ) from exc

    @staticmethod
    def revision(answer: dict[str, Any]) -> int:
        return int(answer.get("header", {}).get("revision", 0))

    async def range(self, key: str, *, prefix: bool = False, **options: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(key), **options}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        return await self.call("/v3/kv/range", body)

    async def latest(self, prefix: str, *, timeout: float) -> tuple[int, int]:
        """(etcd's revision, the revision the newest key under ``prefix`` was changed at; 0: no
        key), answered within ``timeout`` seconds or :class:`EtcdUnavailable`."""
        try:
            answer = await asyncio.wait_for(
                self.range(prefix, prefix=True, keys_only=True, limit=1, sort_order="DESCEND", sort_target="MOD"),
                timeout,
            )
        except TimeoutError:
            raise EtcdUnavailable(
                f"etcd at {self.endpoint} did not answer within {timeout:g}s (stalled, or the network dropped it)"
            ) from None
        newest = max((int(kv.get("mod_revision", 0)) for kv in answer.get("kvs", [])), default=0)
        return self.revision(answer), newest

    async def get(self, key: str) -> str | None:
        """The value of ``key`` (None: no such key)."""
        kvs = (await self.range(key)).get("kvs", [])
        return unb64(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: str, *, lease: Lease = 0) -> int:
        """Set ``key``; the revision of the write."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self.revision(await self.call("/v3/kv/put", body))

    async def delete(self, *keys: str, prefixes: tuple[str, ...] = ()) -> int:
        """Delete ``keys`` and every key under ``prefixes`` in one transaction; its revision."""
        ops = [{"request_delete_range": {"key": b64(key)}} for key in keys]
        ops += [{"request_delete_range": {"key": b64(p), "range_end": b64(prefix_end(p))}} for p in prefixes]
        return self.revision(await self.call("/v3/kv/txn", {"success": ops}))

    async def create(self, key: str, value: str, *, lease: Lease = 0) -> tuple[bool, dict[str, Any]]:
        """Put ``key`` only if it does not exist. (True, answer) if it was created; otherwise
        (False, the existing key-value)."""
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = await self.call(
            "/v3/kv/txn",
            {
                "compare": [{"key": b64(key), "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": b64(key)}}],
            },
        )
        if answer.get("succeeded"):
            return True, answer
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, kvs[0] if kvs else {}

    async def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A transaction: ``success`` if every ``compare`` holds, else ``failure`` (see :func:`compare`,
        :func:`put_op`, :func:`delete_op`); etcd's answer."""
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure is not None:
            body["failure"] = failure
        return await self.call("/v3/kv/txn", body)

    async def grant(self, ttl: float) -> tuple[Lease, int]:
        """A new lease of ``ttl`` seconds (etcd counts whole seconds, and grants at least its
        minimum, about 2 s): (its id, the TTL granted)."""
        answer = await self.call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        if "ID" not in answer:
            raise EtcdUnavailable(f"etcd at {self.endpoint} granted no lease: {answer.get('error', answer)}")
        return int(answer["ID"]), int(answer.get("TTL", 0))

    async def keepalive(self, lease: Lease) -> int:
        """Renew ``lease``; the seconds it now has left (0: it expired or never existed)."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def time_to_live(self, lease: Lease) -> int:
        """The seconds ``lease`` has left (0: it ended or never existed)."""
        answer = await self.call("/v3/lease/timetolive", {"ID": str(lease)})
        return max(0, int(answer.get("TTL", 0)))

    async def revoke(self, lease: Lease) -> None:
        """End ``lease`` now (its keys are deleted); one that is already gone is fine."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdUnavailable as exc:
            if "lease not found" not in str(exc):
                raise


KeyValue = tuple[str, str, Lease, int]
"""A key, its value, its lease (0: none) and the revision it was last changed at."""
Change = tuple[str, str | None, Lease, int]
"""A key, its new value (None: deleted), its lease and the revision of the change."""


async def follow_prefix(
    client: EtcdClient,
    prefix: str,
    *,
    listed: Callable[[list[KeyValue], int], Awaitable[None]],
    changed: Callable[[list[Change], int], Awaitable[None]],
    lost: Callable[[Exception], None],
    backoff: tuple[float, float] = (0.1, 2.0),
    keepalive: float = DEFAULT_KEEPALIVE,
) -> None:
    """List every key under ``prefix`` (``listed(kvs, revision)``), then watch from the next
    revision (``changed(changes, revision)`` per batch of events, with the highest revision among
    them), so no change between the two is missed. When the watch breaks (etcd restarts, the
    history was compacted, the network fails) or stops answering (no word from etcd, probes
    included, for ``keepalive`` seconds: see the module docstring), ``lost(why)`` is called and,
    after a backoff that doubles from ``backoff[0]`` to ``backoff[1]``, it lists again: the listing
    replaces the whole view, so nothing is lost or duplicated. Runs until cancelled."""
    if not (math.isfinite(keepalive) and keepalive > 0):
        raise ValueError(f"keepalive must be a positive number of seconds, got {keepalive!r}")
    delay = backoff[0]
    timeout = aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            try:
                answer = await client.range(prefix, prefix=True)
                revision = int(answer["header"]["revision"])
                await listed(
                    [
                        (
                            unb64(kv["key"]),
                            unb64(kv.get("value", "")),
                            int(kv.get("lease", 0)),
                            int(kv.get("mod_revision", 0)),
                        )
                        for kv in answer.get("kvs", [])
                    ],
                    revision,
                )
                delay = backoff[0]
                await _Watch(http, client, prefix, revision, changed, keepalive).run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                lost(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, backoff[1])


class _Watch:
    """One watch stream from ``listed + 1``, kept alive by probes (see the module docstring); ends
    by raising why."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        client: EtcdClient,
        prefix: str,
        listed: int,
        changed: Callable[[list[Change], int], Awaitable[None]],
        keepalive: float,
    ) -> None:
        self.http, self.client, self.prefix, self.changed = http, client, prefix, changed
        self.half = keepalive / 2
        self.delivered = listed
        """Every change up to this revision has come (listed, or through the stream)."""
        self.owed = 0
        """A revision the last probe showed a key changed at, not delivered then (0: none)."""

    async def run(self) -> None:
        body = {
            "create_request": {
                "key": b64(self.prefix),
                "range_end": b64(prefix_end(self.prefix)),
                "start_revision": self.delivered + 1,
                "progress_notify": True,
            }
        }
        async with self.http.post(self.client.base + "/v3/watch", json=body) as response:
            response.raise_for_status()
            # One read at a time, never cancelled while the stream lives (a cancelled readline
            # loses the part of a line it had taken); a probe runs while it waits.
            reading: asyncio.Task[bytes] | None = None
            try:
                while True:
                    if reading is None:
                        reading = asyncio.ensure_future(response.content.readline())
                    done, _ = await asyncio.wait({reading}, timeout=self.half)
                    if not done:
                        await self.probe()
                        continue
                    line, reading = reading.result(), None
                    if not line:
                        break
                    if line.strip():
                        await self.handle(json.loads(line))
            finally:
                if reading is not None:
                    reading.cancel()
        raise ValueError("the watch stream ended")

    async def probe(self) -> None:
        """The stream was silent for ``keepalive / 2``: etcd must answer a read within as long, and
        a change the last probe saw must have come through the stream by now."""
        _, newest = await self.client.latest(self.prefix, timeout=self.half)
        if self.owed and self.delivered < self.owed:
            raise EtcdUnavailable(
                f"the watch on etcd at {self.client.endpoint} did not deliver the change at "
                f"revision {self.owed} within {self.half * 2:g}s (its connection is dead); "
                "watching again"
            )
        self.owed = newest if newest > self.delivered else 0

    async def handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise ValueError(f"watch failed: {message['error']}")
        result = message.get("result", {})
        if result.get("compact_revision") not in (None, "0"):
            raise ValueError(f"history compacted to revision {result['compact_revision']}; listing again")
        if result.get("canceled"):
            raise ValueError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
        events = result.get("events", [])
        if not events:
            if not result.get("created"):  # a progress notification: everything up to its revision came
                self.delivered = max(self.delivered, self.client.revision(result))
            return
        changes: list[Change] = []
        revision = 0
        for event in events:
            kv = event["kv"]
            # The events' own revisions, not the header's: a header may be ahead of events
            # still to come.
            modified = int(kv.get("mod_revision", 0))
            revision = max(revision, modified)
            deleted = event.get("type") == "DELETE"
            changes.append(
                (unb64(kv["key"]), None if deleted else unb64(kv.get("value", "")), int(kv.get("lease", 0)), modified)
            )
        self.delivered = max(self.delivered, revision)
        await self.changed(changes, revision)
