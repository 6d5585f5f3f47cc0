"""etcd as the source of truth, through etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/watch``).

Key layout under the prefix (default ``/pilotfish/``), values are JSON:

- ``{prefix}services/{name}``: a service definition, the same fields as a ``services:`` entry of
  the snapshot file (``listen``, ``protocol``, ``connect_timeout``, ``grpc``, ``zone_local``, ...;
  ``endpoints`` allowed);
- ``{prefix}instances/{service}/{id}``: one instance, ``{"address": ..., "port": ...,
  "weight"?: ..., "metadata"?: {...}, "zone"?: ...}``.

The source lists the prefix, then watches it from the listed revision + 1, so no change between
the two is missed. When the watch breaks (etcd restarts, the history was compacted, the network
fails), it lists again and resumes; the list replaces the whole view, so nothing is lost or
duplicated, and the last good configuration keeps serving meanwhile. A value that does not parse
is reported (with its key and why) and left out; everything else keeps serving.

The JSON gateway was chosen over a gRPC etcd client: it needs only aiohttp, and the asyncio etcd
clients on PyPI pin protobuf versions older than the Envoy API modules need.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pilotfish.desired import DesiredState
from pilotfish.errors import Problem
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_endpoint, parse_service

__all__ = ["EtcdSource", "EtcdView", "prefix_end"]

_log = logging.getLogger("pilotfish.sources.etcd")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode("utf-8", errors="replace")


def prefix_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    raw[-1] += 1
    return raw.decode("latin-1")


@dataclass(slots=True)
class EtcdView:
    """The parsed keys under the prefix. Pure: no I/O."""

    prefix: str
    services: dict[str, ServiceSpec] = field(default_factory=dict)
    service_endpoints: dict[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    instances: dict[str, tuple[str, Endpoint]] = field(default_factory=dict)
    """key -> (service, endpoint)."""
    bad: dict[str, str] = field(default_factory=dict)
    """key -> why its value was left out."""

    def put(self, key: str, value: str) -> str | None:
        """Apply a key's new value; return the problem if it was left out."""
        self.delete(key)
        rest = key[len(self.prefix):]
        kind, _, name = rest.partition("/")
        try:
            document: Any = json.loads(value)
        except json.JSONDecodeError as exc:
            return self._bad(key, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
        problems: list[Problem] = []
        if kind == "services" and name and "/" not in name:
            spec, found, problems = parse_service(name, document, "")
            if spec is not None and not problems:
                self.services[name] = spec
                self.service_endpoints[name] = found
                return None
        elif kind == "instances" and name.count("/") == 1 and all(name.split("/")):
            service = name.split("/")[0]
            endpoint = parse_endpoint(document, "", problems)
            if endpoint is not None and not problems:
                self.instances[key] = (service, endpoint)
                return None
        else:
            return self._bad(key, f"unknown key: expected {self.prefix}services/NAME or "
                                  f"{self.prefix}instances/SERVICE/ID")
        return self._bad(key, "; ".join(f"{p.where.lstrip('.') or 'value'}: {p.message}" for p in problems))

    def _bad(self, key: str, reason: str) -> str:
        self.bad[key] = reason
        return reason

    def delete(self, key: str) -> None:
        self.bad.pop(key, None)
        self.instances.pop(key, None)
        rest = key[len(self.prefix):]
        if rest.startswith("services/"):
            name = rest[len("services/"):]
            self.services.pop(name, None)
            self.service_endpoints.pop(name, None)

    def state(self) -> DesiredState:
        endpoints: dict[str, list[Endpoint]] = {n: list(e) for n, e in self.service_endpoints.items()}
        for service, endpoint in self.instances.values():
            endpoints.setdefault(service, []).append(endpoint)
        deduped = {n: tuple({e.address: e for e in found}.values()) for n, found in endpoints.items()}
        return DesiredState(services=dict(self.services), endpoints=deduped)


class EtcdSource:
    """Lists and watches a prefix in etcd, reporting the whole view on every change."""

    def __init__(
        self,
        endpoint: str,
        prefix: str,
        *,
        on_state: Callable[[DesiredState], None],
        on_event: Callable[..., None] | None = None,
        backoff: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        self.base = f"http://{endpoint}"
        self.prefix = prefix
        self._on_state = on_state
        self._emit = on_event or (lambda *_, **__: None)
        self._backoff = backoff
        self.view = EtcdView(prefix)
        self.connected = asyncio.Event()
        self.resyncs = 0
        self.problem: str | None = "not contacted yet"
        """Why etcd is not being followed right now (None: it is)."""

    async def run(self) -> None:
        """List and watch until cancelled; on any failure, wait a little and start over."""
        delay = self._backoff[0]
        timeout = aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=None)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                try:
                    revision = await self._list(http)
                    delay = self._backoff[0]
                    await self._watch(http, revision + 1)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    expected = isinstance(exc, aiohttp.ClientError | OSError | ValueError | KeyError | TimeoutError)
                    reason = (str(exc) or type(exc).__name__) if expected else f"internal error: {exc!r}"
                    if not expected:
                        _log.exception("etcd at %s: unexpected error; retrying", self.base)
                    if self.connected.is_set():
                        _log.warning("etcd at %s: %s; serving the last good state and retrying", self.base, reason)
                        self._emit("etcd_disconnected", reason=reason)
                    self.problem = reason
                    self.connected.clear()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])

    async def _post(self, http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> Any:
        async with http.post(self.base + path, json=body) as response:
            response.raise_for_status()
            return await response.json(content_type=None)

    async def _list(self, http: aiohttp.ClientSession) -> int:
        answer = await self._post(http, "/v3/kv/range",
                                  {"key": _b64(self.prefix), "range_end": _b64(prefix_end(self.prefix))})
        view = EtcdView(self.prefix)
        for kv in answer.get("kvs", []):
            key = _unb64(kv["key"])
            problem = view.put(key, _unb64(kv.get("value", "")))
            if problem:
                self._report_bad(key, problem)
        revision = int(answer["header"]["revision"])
        self.view = view
        self.resyncs += 1
        self.problem = None
        self.connected.set()
        self._emit("etcd_synced", revision=revision, keys=len(answer.get("kvs", [])), bad=len(view.bad))
        self._on_state(view.state())
        return revision

    def _report_bad(self, key: str, reason: str) -> None:
        _log.error("etcd key %s left out: %s", key, reason)
        self._emit("etcd_bad_value", key=key, reason=reason)

    async def _watch(self, http: aiohttp.ClientSession, start: int) -> None:
        body = {"create_request": {"key": _b64(self.prefix), "range_end": _b64(prefix_end(self.prefix)),
                                   "start_revision": start}}
        async with http.post(self.base + "/v3/watch", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.strip():
                    continue
                message = json.loads(line)
                if "error" in message:
                    raise ValueError(f"watch failed: {message['error']}")
                result = message.get("result", {})
                if result.get("compact_revision") not in (None, "0"):
                    raise ValueError(f"history compacted to revision {result['compact_revision']}; listing again")
                if result.get("canceled"):
                    raise ValueError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
                events = result.get("events", [])
                if not events:
                    continue
                for event in events:
                    kv = event["kv"]
                    key = _unb64(kv["key"])
                    if event.get("type") == "DELETE":
                        self.view.delete(key)
                    else:
                        problem = self.view.put(key, _unb64(kv.get("value", "")))
                        if problem:
                            self._report_bad(key, problem)
                self._on_state(self.view.state())
        raise ValueError("the watch stream ended")

