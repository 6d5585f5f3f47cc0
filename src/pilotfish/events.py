"""The JSON-lines event log: one object per line, written and flushed as it happens.

Every request a proxy sends (``request``, ``ack``, ``nack``), every response sent (``sent``), and
the life of the server, its streams and its snapshots are recorded, so an operator can read the
whole xDS conversation after the fact (``jq`` friendly). Events are also passed to the
``pilotfish.events`` logger at DEBUG level.

Many fields come from peers (node ids, resource names, NACK messages, type URLs), and a peer can
make them megabytes long. So a line is bounded: one longer than :data:`MAX_LINE` is written
again with every string shortened to :data:`MAX_FIELD` characters (:func:`shorten`: its start and
its end, where Envoy puts a NACK's reason, and its length) and every list cut to
:data:`MAX_ITEMS` items (``<field>_omitted`` says how many more there were). A usual line is
checked with one ``len``.

The server also keeps the latest events in memory (:class:`RecentEvents`, a ring of at most
:data:`RECENT_EVENTS` lines of at most :data:`RECENT_LINE` bytes each, whatever the event log's
level and whether it writes a file), for the admin API's ``/v1/events`` and the status page.
The routine conversation (:data:`CONVERSATION`) stays out of it: a fan-out to 10,000 proxies
would push everything else out in one go.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import orjson

from pilotfish.errors import shorten

__all__ = [
    "ANNOUNCE",
    "CONVERSATION",
    "EVENTS",
    "LOG_FIELDS",
    "MAX_FIELD",
    "MAX_ITEMS",
    "MAX_LINE",
    "RECENT_EVENTS",
    "RECENT_LINE",
    "EventLog",
    "EventSpec",
    "RecentEvents",
    "ReportGate",
    "check_event_log",
    "contract_problems",
    "read_events",
    "read_lines",
    "shorten",
]

ANNOUNCE = "pilotfish.announce"
"""The logger of what ``serve`` tells its operator at any verbosity, at INFO: the startup block,
and that a refused input was fixed (``pilotfish`` sets it to INFO whatever ``-v`` says)."""
LOG_FIELDS = "fields"
"""The ``extra`` key of a log record whose mapping ``--log-format json`` writes as fields of the
line (``logger.info(..., extra={LOG_FIELDS: {"xds": ...}})``)."""

CONVERSATION = frozenset({"request", "ack", "sent", "stale", "rest_request"})
"""Events of the routine xDS conversation: a line per request and response of every proxy (and
per REST poll).
``level="changes"`` leaves them out and keeps the rest (snapshots, NACKs, streams, sources)."""
LEVELS = ("all", "changes")

MAX_LINE = 16 * 1024
"""Bytes of an event line beyond which its fields are shortened."""
MAX_FIELD = 2048
"""Characters a string field keeps in a shortened line."""
MAX_ITEMS = 100
"""Items a list field keeps in a shortened line."""


RECENT_EVENTS = 500
"""Events the server keeps in memory for the admin API (:class:`RecentEvents`)."""
RECENT_LINE = 4096
"""Bytes one of them may take; a longer one is shortened harder than a log line (strings to
:data:`RECENT_FIELD` characters, lists to :data:`RECENT_ITEMS` items), so the ring holds at most
about ``RECENT_EVENTS * RECENT_LINE`` bytes whatever peers send."""
RECENT_FIELD = 1024
RECENT_ITEMS = 20


def _bounded(record: dict[str, Any], *, max_field: int = MAX_FIELD, max_items: int = MAX_ITEMS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, str):
            value = shorten(value, max_field)
        elif isinstance(value, list | tuple):
            if len(value) > max_items:
                out[f"{key}_omitted"] = len(value) - max_items
            value = [shorten(v, max_field) if isinstance(v, str) else v for v in value[:max_items]]
        out[key] = value
    return out


# -- the contract: every event and its fields ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class EventSpec:
    """One kind of event: when it is written, and every field it may carry (besides ``ts`` and
    ``event``; a field may be absent when it does not apply)."""

    when: str
    fields: frozenset[str]


def _spec(when: str, *fields: str) -> EventSpec:
    return EventSpec(when, frozenset(fields))


_REQUEST = (
    "stream",
    "node",
    "type",
    "version_info",
    "response_nonce",
    "error",
    "resource_names",
    # delta streams:
    "delta",
    "version",
    "subscribe",
    "unsubscribe",
    "initial_resources",
)
_INSTANCE = ("everywhere", "services", "service_count", "lapsed", "lost_in_window", "ttl_instances")

EVENTS: Mapping[str, EventSpec] = MappingProxyType(
    {
        # the server
        "server_started": _spec(
            "the servers listen", "xds", "registry", "snapshot", "tls", "rest", "admin", "admin_grpc"
        ),
        "server_stopped": _spec("the xDS server stopped"),
        "tls_reloaded": _spec("a certificate, key or CA file changed and is in force", "listener", "cert"),
        "tls_reload_failed": _spec(
            "a changed TLS file could not be used; the last good one serves", "listener", "reason"
        ),
        # snapshots
        "snapshot_loaded": _spec(
            "a new snapshot is served", "version", "versions", "watches_answered", "push_ms", "groups"
        ),
        "snapshot_unchanged": _spec("a change left the content as it was: nothing is sent", "version"),
        "snapshot_error": _spec("a change was refused; the last good snapshot serves", "reason", "file"),
        "snapshot_held": _spec("the blast-radius guard holds a snapshot back", "version", "reasons", "counts"),
        "snapshot_confirmed": _spec("the operator confirmed the held snapshot", "version", "reasons", "by"),
        "snapshot_hold_released": _spec("a held snapshot was dropped", "version", "reason"),
        "waiting_for_sources": _spec("nothing is published yet: a source has not reported", "sources", "reasons"),
        # streams and the xDS conversation
        "stream_open": _spec(
            "a stream's first request", "stream", "node", "peer", "service", "group", "identity", "ttls"
        ),
        "stream_closed": _spec("a stream ended", "stream", "node", "reason"),
        "node_refused": _spec(
            "a certificate may not claim the node id it sent", "stream", "identity", "peer", "reason", "node", "rest"
        ),
        "secret_denied": _spec(
            "a proxy asked for an SDS secret not granted to it", "stream", "node", "identity", "peer", "secret", "rest"
        ),
        "request": _spec("a request without a nonce", *_REQUEST),
        "ack": _spec("a request acknowledging the latest response", *_REQUEST),
        "nack": _spec("a request rejecting the latest response", *_REQUEST),
        "stale": _spec("a request with an older nonce: ignored", *_REQUEST),
        "sent": _spec(
            "a response went out",
            "stream",
            "node",
            "type",
            "version",
            "nonce",
            "resources",
            "delta",
            "names",
            "removed",
            "rest",
            "refresh",
        ),
        "rest_request": _spec("a REST poll", "node", "type", "version_info", "answer", "resource_names"),
        "rest_refused": _spec(
            "the REST server refused a poll (at most one per 10 s)",
            "method",
            "path",
            "status",
            "reason",
            "peer",
            "unreported_before",
        ),
        # the registry
        "registry_service_defined": _spec("a service was defined or changed", "service"),
        "registry_service_removed": _spec("a service was removed", "service"),
        "registry_registered": _spec("an instance registered (or re-registered)", "service", "instance", "ttl"),
        "registry_deregistered": _spec("an instance deregistered", "service", "instance"),
        "registry_expired": _spec("an instance's TTL lapsed", "service", "instance"),
        "registry_error": _spec("the registry's TTL expiry failed (see the log)", "reason"),
        "registry_self_preservation": _spec("TTL expiry paused or resumed", "state", "expired_now", *_INSTANCE),
        "registry_denied": _spec(
            "the registry API refused a request (at most one per 10 s)",
            "method",
            "path",
            "status",
            "token",
            "peer",
            "unreported_before",
        ),
        "registry_tokens_loaded": _spec("the tokens file changed and is in force", "file", "tokens", "reads"),
        "registry_tokens_error": _spec("the tokens file was refused; the last good tokens stay", "file", "reason"),
        "grants_loaded": _spec("the SDS grants file changed and is in force", "file", "grants"),
        "grants_error": _spec("the SDS grants file was refused; the last good grants stay", "file", "reason"),
        "admin_denied": _spec(
            "the admin API refused a request (at most one per 10 s)",
            "method",
            "path",
            "status",
            "token",
            "peer",
            "unreported_before",
        ),
        "admin_tokens_loaded": _spec("the admin API's tokens file changed and is in force", "file", "tokens", "reads"),
        "admin_tokens_error": _spec(
            "the admin API's tokens file was refused; the last good tokens stay", "file", "reason"
        ),
        # etcd
        "etcd_synced": _spec("etcd was listed", "revision", "keys", "bad"),
        "etcd_disconnected": _spec("the etcd watch broke, or stopped answering", "reason"),
        "etcd_bad_value": _spec("a value in etcd was left out", "key", "reason"),
        "docker_synced": _spec("a Docker engine's containers were listed", "engine", "containers", "endpoints", "bad"),
        "docker_disconnected": _spec(
            "a Docker engine's event stream broke, or it stopped answering; its last state serves", "engine", "reason"
        ),
        "docker_bad_label": _spec(
            "a container's labels cannot be used: it serves nothing", "engine", "container", "label", "reason"
        ),
        "dns_unresolved": _spec(
            "a host name of a DNS service does not resolve for pilotfish: served by its last good addresses "
            "(kept), or as the name if it never resolved",
            "name",
            "services",
            "reason",
            "kept",
        ),
        "dns_resolved": _spec(
            "a host name that did not resolve resolves again: served as the name", "name", "services", "addresses"
        ),
        "leader_elected": _spec(
            "this replica now runs the registry's singleton duties (etcd election)", "replica", "reason"
        ),
        "leader_lost": _spec("this replica no longer runs them", "replica", "reason"),
        # progressive delivery (docs/rollout.md)
        "rollout_baseline_set": _spec("the first change is the baseline of every proxy", "baseline"),
        "rollout_started": _spec("a new candidate rolls out", "candidate", "baseline", "waves", "types"),
        "rollout_wave_started": _spec(
            "a wave is served the candidate", "candidate", "wave", "index", "proxies", "skipped", "skipped_proxies"
        ),
        "rollout_wave_acked": _spec(
            "every member of the wave ACKed (or was dropped at the timeout); the bake starts",
            "candidate",
            "wave",
            "proxies",
            "lost",
            "lost_proxies",
            "not_sent",
            "not_sent_proxies",
        ),
        "rollout_wave_passed": _spec(
            "a wave passed its gates",
            "candidate",
            "wave",
            "result",
            "error_ratio",
            "baseline_error_ratio",
            "requests",
        ),
        "rollout_completed": _spec("the last wave passed: the candidate is the baseline", "candidate", "previous"),
        "rollout_failed": _spec("a gate failed", "candidate", "wave", "reason"),
        "rollout_rolled_back": _spec(
            "the proxies that had the candidate are served the baseline; the candidate is held",
            "candidate",
            "baseline",
            "proxies",
            "reason",
        ),
        "rollout_superseded": _spec(
            "a newer change replaced the candidate in progress", "candidate", "by", "wave", "baseline"
        ),
        "rollout_held": _spec("a held candidate was offered again: not served", "candidate", "reason"),
        "rollout_paused": _spec("no further wave starts until resumed", "candidate", "wave", "reason", "by"),
        "rollout_resumed": _spec("the operator resumed the rollout", "candidate", "wave", "by"),
        "rollout_promoted": _spec(
            "the operator sent the rollout to its next wave now", "candidate", "wave", "phase", "by"
        ),
        "rollout_aborted": _spec("the operator rolled the candidate back", "candidate", "wave", "reason", "by"),
    }
)
"""Every event pilotfish writes, and its fields: the event log's contract with whoever reads it
(README's table is checked against it, and the tests check every line they make)."""


def contract_problems(record: Mapping[str, Any]) -> list[str]:
    """What in one event-log record breaks :data:`EVENTS` (empty if nothing)."""
    name = record.get("event")
    spec = EVENTS.get(name) if isinstance(name, str) else None
    if spec is None:
        return [f"unknown event {name!r}"]
    extra = set(record) - spec.fields - {"ts", "event"}
    extra = {key for key in extra if not (key.endswith("_omitted") and key[: -len("_omitted")] in spec.fields)}
    return [f"event {name!r} has fields not in its contract: {sorted(extra)}"] if extra else []


def read_lines(path: Path, offset: int = 0) -> tuple[list[bytes], int]:
    """The complete lines of an event log from byte ``offset`` on, and the offset after the last
    of them: pass it back to read only what was appended since. A last line still being written
    is left for the next read; a file not created yet has no lines."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            chunk = file.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    return [line for line in chunk[:end].split(b"\n") if line.strip()], offset + end


def read_events(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The events of the complete lines from byte ``offset`` on (see :func:`read_lines`), and the
    offset to read on from. ValueError, naming the file, for a line that is not a JSON object."""
    lines, offset = read_lines(path, offset)
    records = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            shown = shorten(line.decode(errors="replace"), 200)
            raise ValueError(f"{path}: an event log line is not a JSON object: {shown}")
        records.append(record)
    return records, offset


def check_event_log(path: Path) -> list[str]:
    """What in an event log file breaks :data:`EVENTS`, each with its line number (a last line
    still being written is skipped)."""
    problems = []
    for number, line in enumerate(read_lines(path)[0], 1):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"{path}:{number}: not JSON ({exc})")
            continue
        problems.extend(f"{path}:{number}: {problem}" for problem in contract_problems(record))
    return problems


class ReportGate:
    """Lets at most one report through per ``every`` seconds and counts those it holds back: what a
    peer can cause in a loop (refused requests, protocol errors) is logged and recorded, but cannot
    fill the log. :meth:`admit` says whether to report now, and how many were held back since."""

    __slots__ = ("_every", "_next", "held")

    def __init__(self, every: float) -> None:
        self._every = every
        self._next = -math.inf
        self.held = 0
        """Reports held back since the last one let through."""

    def ready(self, now: float) -> bool:
        """Whether a report at ``now`` would be let through."""
        return now >= self._next

    def admit(self, now: float) -> int | None:
        """None: hold this report back (it is counted). Otherwise report it: the count held back
        before it is returned (and reset)."""
        if now < self._next:
            self.held += 1
            return None
        self._next = now + self._every
        held, self.held = self.held, 0
        return held


def _recent_line(record: dict[str, Any]) -> bytes:
    """``record`` as one JSON object of at most :data:`RECENT_LINE` bytes (see :class:`RecentEvents`)."""
    bounded = _bounded(record, max_field=RECENT_FIELD, max_items=RECENT_ITEMS)
    line = orjson.dumps(bounded, default=str)
    if len(line) <= RECENT_LINE:
        return line
    # Still too long: a map of many entries (a node group each). Keep the fields that fit.
    kept: dict[str, Any] = {}
    size = 2
    for key, value in bounded.items():
        part = len(orjson.dumps({key: value}, default=str))
        if key in ("ts", "event") or size + part <= RECENT_LINE - 64:
            kept[key] = value
            size += part
    return orjson.dumps(kept, default=str)


class RecentEvents:
    """The latest events, in memory, for the admin API: a ring of at most ``size`` JSON objects of
    at most :data:`RECENT_LINE` bytes each. Every event gets a sequence number (1, 2, ...), so a
    reader that polls asks for what came after the last one it saw (:meth:`since`)."""

    __slots__ = ("_lines", "last", "size")

    def __init__(self, size: int = RECENT_EVENTS) -> None:
        if size < 1:
            raise ValueError(f"the recent events ring must hold at least one event, not {size}")
        self.size = size
        self._lines: deque[tuple[int, bytes]] = deque(maxlen=size)
        self.last = 0
        """The sequence number of the latest event (0: none yet)."""

    def add(self, record: dict[str, Any], line: bytes | None = None) -> None:
        """Keep ``record`` (``line``: it as JSON already, if it fits), pushing out the oldest."""
        if line is None or len(line) > RECENT_LINE:
            line = _recent_line(record)
        self.last += 1
        self._lines.append((self.last, line.rstrip(b"\n")))

    def since(self, after: int = 0, *, limit: int | None = None) -> list[tuple[int, bytes]]:
        """The events kept with a sequence number above ``after``, oldest first: the latest
        ``limit`` of them (all, when None). Each is ``(seq, JSON object)``."""
        out: list[tuple[int, bytes]] = []
        for seq, line in reversed(self._lines):
            if seq <= after or (limit is not None and len(out) >= limit):
                break
            out.append((seq, line))
        out.reverse()
        return out

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)


_log = logging.getLogger("pilotfish.events")


class EventLog:
    """Appends events to a file (or nowhere, when no path is given).

    Lines are flushed once per turn of the event loop rather than one by one: an event is on disk
    as soon as the code that caused it yields, and a fan-out to thousands of proxies costs one
    write, not thousands. Without a running loop every line is flushed at once.

    ``recent``: also keep the events outside the routine conversation there (the admin API's
    ``/v1/events``), with or without a file.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        level: str = "all",
        clock: Any = time.time,
        recent: RecentEvents | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"event log level must be one of {', '.join(LEVELS)}, not {level!r}")
        self.recent = recent
        self._file: IO[bytes] | None = open(path, "ab") if path else None  # noqa: SIM115
        self._skip = CONVERSATION if level == "changes" else frozenset()
        self._clock = clock
        self._lines: list[bytes] = []
        self._flush_scheduled = False

    @property
    def enabled(self) -> bool:
        """Whether events go anywhere (callers may skip building costly fields if not)."""
        return self._file is not None or self.recent is not None or _log.isEnabledFor(logging.DEBUG)

    @property
    def conversation(self) -> bool:
        """Whether the routine request and response events (:data:`CONVERSATION`) are recorded
        (never in :attr:`recent`: only a file or the debug log takes them)."""
        return not self._skip and (self._file is not None or _log.isEnabledFor(logging.DEBUG))

    def emit(self, event: str, **fields: Any) -> None:
        """Record one event; ``fields`` must be JSON-serializable."""
        debug = _log.isEnabledFor(logging.DEBUG)
        recent = self.recent if event not in CONVERSATION else None
        if event in self._skip or (self._file is None and not debug and recent is None):
            return
        record = {"ts": self._clock(), "event": event, **fields}
        # orjson: a fan-out to 10,000 proxies logs 20,000 lines, and the json module spends ~10x longer.
        line = orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE)
        if len(line) > MAX_LINE:
            line = orjson.dumps(_bounded(record), default=str, option=orjson.OPT_APPEND_NEWLINE)
        if recent is not None:
            recent.add(record, line)
        if self._file is not None:
            self._lines.append(line)
            if not self._flush_scheduled:
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                    self._flush_scheduled = True
                except RuntimeError:
                    self.flush()
        if debug:
            _log.debug("%s", line.decode().rstrip())

    def flush(self) -> None:
        """Write out the buffered lines."""
        self._flush_scheduled = False
        if self._file is not None and self._lines:
            self._file.write(b"".join(self._lines))
            self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
