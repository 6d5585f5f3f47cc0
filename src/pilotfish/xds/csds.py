"""Client status discovery (CSDS): which config each proxy has, in the standard service's words.

``envoy.service.status.v3.ClientStatusDiscoveryService`` answers a ``ClientStatusRequest`` (node
matchers: which proxies) with a ``ClientStatusResponse``: one ``ClientConfig`` per proxy. It reads
the same :class:`~pilotfish.status.SyncStatus` that ``/v1/proxies`` and ``pilotfish status`` read,
so any CSDS client (grpcdebug, grpcurl, a grpcio stub) sees what our CLI sees.

Each resource a connected proxy asked for is one ``GenericXdsConfig``, as its stream knows it
(given by ``resources``: :meth:`~pilotfish.xds.server.XdsServer.resource_states`): ``type_url``,
``name``, ``version_info`` (the version it has: over SotW the type's, over delta the resource's)
and ``client_status``: ACKED, NACKED (``error_state`` {details, version_info, time}: the type's
last NACK), UNKNOWN (sent, not answered yet), REQUESTED (asked for, nothing sent yet) or
DOES_NOT_EXIST (asked for, and pilotfish has none: over SotW once the proxy answered a response
without it, over delta once it was told). ``config_status`` is the type's.

A type known only from the status (a REST poller, a proxy served by another replica, a response
over the :attr:`CsdsLimits.max_resources` of one response) is one ``GenericXdsConfig`` for the
whole type (``name`` empty): the version the proxy runs (ACKed), and the state:

============  =====================  ==========================================================
ours          ``config_status``      ``client_status``
============  =====================  ==========================================================
SYNCED        SYNCED                 ACKED
STALE         STALE                  UNKNOWN (sent, neither ACKed nor NACKed yet)
NACKED        ERROR                  NACKED, ``error_state`` {details, version_info, time}
NOT_SENT      NOT_SENT               REQUESTED (it asked, nothing was sent yet)
============  =====================  ==========================================================

No resource is embedded (``xds_config`` is unset): a proxy's config can be megabytes, and a
response covers many proxies; the versions say which snapshot it runs.

Bounds: a response holds at most :attr:`CsdsLimits.max_proxies` proxies (the first by node id;
ask with matchers for others), a request at most :attr:`CsdsLimits.max_matchers` matchers, a
regex at most :attr:`CsdsLimits.max_regex` characters and one that cannot backtrack much
(:data:`MAX_REGEX_COST`; node ids are bounded by ``XdsLimits.max_node_id_chars``), a stream
at most one request per :attr:`CsdsLimits.min_gap` seconds, and at most
:attr:`CsdsLimits.max_streams` calls are open at once.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from envoy.admin.v3 import config_dump_shared_pb2
from envoy.service.status.v3 import csds_pb2
from envoy.type.matcher.v3 import node_pb2, string_pb2
from google.protobuf.message import DecodeError

from pilotfish.errors import shorten
from pilotfish.protocol import ResourceState
from pilotfish.status import ProxyRecord, SyncState, SyncStatus, TypeStatus
from pilotfish.transport.aio import Call, MethodFactory, RateLimitedLog, RpcError
from pilotfish.transport.frames import GrpcStatus

__all__ = [
    "CSDS_FETCH",
    "CSDS_STREAM",
    "ClientStatus",
    "CsdsLimits",
    "NodeSelector",
    "client_config",
]

_log = logging.getLogger("pilotfish.csds")

_SERVICE = "/envoy.service.status.v3.ClientStatusDiscoveryService"
CSDS_STREAM = f"{_SERVICE}/StreamClientStatus"
CSDS_FETCH = f"{_SERVICE}/FetchClientStatus"

_Status = config_dump_shared_pb2.ClientResourceStatus
_CONFIG_STATUS = {
    SyncState.SYNCED: csds_pb2.SYNCED,
    SyncState.STALE: csds_pb2.STALE,
    SyncState.NACKED: csds_pb2.ERROR,
    SyncState.NOT_SENT: csds_pb2.NOT_SENT,
}
_CLIENT_STATUS = {
    SyncState.SYNCED: _Status.ACKED,
    SyncState.STALE: _Status.UNKNOWN,
    SyncState.NACKED: _Status.NACKED,
    SyncState.NOT_SENT: _Status.REQUESTED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CsdsLimits:
    """What one CSDS client may ask of the server."""

    max_proxies: int = 1000
    """Proxies per response at most (the first by node id; narrow with node matchers)."""
    max_resources: int = 100_000
    """Resources listed one by one per response at most: a proxy whose resources would go over
    it is listed a type at a time."""
    max_matchers: int = 16
    """Node matchers per request at most."""
    max_regex: int = 256
    """Characters of a ``safe_regex`` at most."""
    min_gap: float = 0.1
    """Seconds a stream waits between two requests at least (sooner: RESOURCE_EXHAUSTED)."""
    max_streams: int = 32
    """CSDS calls open at once at most (past it: RESOURCE_EXHAUSTED)."""


class _BadRequest(ValueError):
    """A request names something pilotfish cannot match on; the message names the field."""


_parser: Any = importlib.import_module("re._parser")  # the stdlib's own regex parser (no stubs)
_ID_CHARS = 1024
"""What an unbounded repeat may span: a node id's length at most (``XdsLimits.max_node_id_chars``)."""
MAX_REGEX_COST = 4 * _ID_CHARS
"""A regex's backtracking bound at most: the product of its repeats' spans (an unbounded one:
:data:`_ID_CHARS`) and its alternatives' count. Python's ``re`` backtracks and has no step
limit, so a regex is admitted only if it cannot backtrack much: one unbounded repeat (``.*``)
and a few small ones, never a repeated group that itself repeats or branches (``(a+)+``,
``(a|a)*``), no back-references or look-arounds. Matching one node id then takes at most about
this many steps times the id's length."""
_REFUSED = {
    "GROUPREF": "a back-reference",
    "GROUPREF_EXISTS": "a conditional group",
    "ASSERT": "a look-around",
    "ASSERT_NOT": "a look-around",
}


def _regex_cost(items: Any, field: str) -> int:
    """The backtracking bound of a parsed regex (see :data:`MAX_REGEX_COST`); raises
    :class:`_BadRequest` naming ``field`` for what is refused outright."""
    cost = 1
    for op, value in items:
        name = str(op)
        if name in _REFUSED:
            raise _BadRequest(
                f"{field} holds {_REFUSED[name]}: pilotfish matches node ids with repeats and classes only"
            )
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, body = value
            if _regex_cost(body, field) > 1 or any(str(o).endswith("REPEAT") for o, _ in _flat(body)):
                raise _BadRequest(
                    f"{field} repeats a group that repeats or branches (as (a+)+ or (a|b)*): it could backtrack"
                    " for ever"
                )
            cost *= _ID_CHARS if high is _parser.MAXREPEAT else max(1, min(high, _ID_CHARS) - low + 1)
        elif name == "BRANCH":
            cost *= sum(_regex_cost(branch, field) for branch in value[1])
        elif name == "SUBPATTERN":
            cost *= _regex_cost(value[-1], field)
        if cost > MAX_REGEX_COST:
            raise _BadRequest(
                f"{field} could backtrack too much (more than one unbounded repeat, or too many repeats or "
                "alternatives): use prefix, suffix or contains, or a simpler regex"
            )
    return cost


def _flat(items: Any) -> list[tuple[Any, Any]]:
    """Every (op, value) of a parsed regex, groups opened."""
    out: list[tuple[Any, Any]] = []
    for op, value in items:
        out.append((op, value))
        if str(op) == "SUBPATTERN":
            out.extend(_flat(value[-1]))
        elif str(op) == "BRANCH":
            for branch in value[1]:
                out.extend(_flat(branch))
    return out


def _string_matcher(matcher: string_pb2.StringMatcher, *, field: str, limits: CsdsLimits) -> Callable[[str], bool]:
    kind = matcher.WhichOneof("match_pattern")
    fold = matcher.ignore_case and kind != "safe_regex"

    def norm(text: str) -> str:
        return text.lower() if fold else text

    if kind == "exact":
        want = norm(matcher.exact)
        return lambda text: norm(text) == want
    if kind == "prefix":
        want = norm(matcher.prefix)
        return lambda text: norm(text).startswith(want)
    if kind == "suffix":
        want = norm(matcher.suffix)
        return lambda text: norm(text).endswith(want)
    if kind == "contains":
        want = norm(matcher.contains)
        return lambda text: want in norm(text)
    if kind == "safe_regex":
        pattern = matcher.safe_regex.regex
        if len(pattern) > limits.max_regex:
            raise _BadRequest(f"{field}.safe_regex.regex is {len(pattern)} characters; at most {limits.max_regex}")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise _BadRequest(f"{field}.safe_regex.regex does not compile: {exc}") from None
        _regex_cost(_parser.parse(pattern), f"{field}.safe_regex.regex")
        return lambda text: compiled.fullmatch(text) is not None
    raise _BadRequest(f"{field} sets no pattern (exact, prefix, suffix, contains or safe_regex)")


class NodeSelector:
    """Which proxies a request's node matchers select: any matcher may match (none: every proxy);
    within one, its ``node_id`` must match. ``node_metadatas`` is refused: pilotfish does not keep
    a node's metadata."""

    def __init__(self, matchers: list[node_pb2.NodeMatcher], *, limits: CsdsLimits = CsdsLimits()) -> None:
        if len(matchers) > limits.max_matchers:
            raise _BadRequest(f"node_matchers holds {len(matchers)} matchers; at most {limits.max_matchers}")
        self._tests: list[Callable[[str], bool]] = []
        for i, matcher in enumerate(matchers):
            field = f"node_matchers[{i}]"
            if matcher.node_metadatas:
                raise _BadRequest(f"{field}.node_metadatas: pilotfish does not keep node metadata; match on node_id")
            if matcher.HasField("node_id"):
                self._tests.append(_string_matcher(matcher.node_id, field=f"{field}.node_id", limits=limits))
            else:
                self._tests.append(lambda _text: True)

    def __call__(self, node_id: str) -> bool:
        return not self._tests or any(test(node_id) for test in self._tests)


def _xds_config(type_url: str, status: TypeStatus) -> csds_pb2.ClientConfig.GenericXdsConfig:
    state = status.state
    config = csds_pb2.ClientConfig.GenericXdsConfig(
        type_url=type_url,
        version_info=status.acked_version or "",
        config_status=_CONFIG_STATUS[state],
        client_status=_CLIENT_STATUS[state],
    )
    _type_times(config, status)
    return config


def _type_times(config: csds_pb2.ClientConfig.GenericXdsConfig, status: TypeStatus) -> None:
    """The type's last ACK time, and its last NACK when it is NACKED now."""
    if status.acked_at:
        config.last_updated.FromNanoseconds(round(status.acked_at * 1e9))
    if status.state is SyncState.NACKED:
        error = config.error_state
        error.details = status.nack_error or ""
        error.version_info = status.nacked_version or status.sent_version or ""
        error.last_update_attempt.FromNanoseconds(round(status.nacked_at * 1e9))


def _resource_configs(
    type_url: str, found: list[ResourceState], status: TypeStatus | None
) -> list[csds_pb2.ClientConfig.GenericXdsConfig]:
    configs = []
    for resource in found:
        config = csds_pb2.ClientConfig.GenericXdsConfig(
            type_url=type_url,
            name=resource.name,
            version_info=resource.version,
            client_status=_Status.Value(resource.status),
        )
        if status is not None:
            config.config_status = _CONFIG_STATUS[status.state]
            if resource.status in ("ACKED", "NACKED"):
                _type_times(config, status)
        configs.append(config)
    return configs


def client_config(
    proxy: ProxyRecord, resources: Mapping[str, list[ResourceState]] | None = None
) -> csds_pb2.ClientConfig:
    """One proxy's status as CSDS says it: its node (id, cluster, user agent) and, per type it
    asked for, a ``GenericXdsConfig`` per resource when ``resources`` has the type (what its
    stream knows), else one for the type."""
    config = csds_pb2.ClientConfig()
    info = proxy.info
    config.node.id = proxy.node_id
    config.node.cluster = info.cluster
    config.node.user_agent_name = info.user_agent
    if info.user_agent_version:
        config.node.user_agent_version = info.user_agent_version
    resources = resources or {}
    for url in sorted(proxy.types.keys() | resources.keys()):
        status = proxy.types.get(url)
        if url in resources:
            config.generic_xds_configs.extend(_resource_configs(url, resources[url], status))
        elif status is not None:
            config.generic_xds_configs.append(_xds_config(url, status))
    return config


class ClientStatus:
    """The CSDS service over a :class:`SyncStatus`; ``authorize(call)`` returns a refusal's
    (code, message), or None to let the call through."""

    def __init__(
        self,
        status: SyncStatus,
        *,
        limits: CsdsLimits = CsdsLimits(),
        authorize: Callable[[Call], tuple[int, str] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        resources: Callable[[str], Mapping[str, list[ResourceState]] | None] | None = None,
    ) -> None:
        self.status = status
        self.resources = resources
        """Node id -> what its open streams know of each resource, by type (None: not known here)."""
        self.limits = limits
        self.authorize = authorize
        self.clock = clock
        self.open_calls = 0
        self.refused_log = RateLimitedLog(_log, what="refused CSDS calls")

    def methods(self) -> Mapping[str, MethodFactory]:
        return {
            CSDS_STREAM: lambda call: _CsdsCall(self, call, unary=False),
            CSDS_FETCH: lambda call: _CsdsCall(self, call, unary=True),
        }

    def answer(self, request: csds_pb2.ClientStatusRequest) -> csds_pb2.ClientStatusResponse:
        """The response to ``request``: the connected proxies its matchers select (raises
        :class:`ValueError` naming the field it cannot match on)."""
        select = NodeSelector(list(request.node_matchers), limits=self.limits)
        response = csds_pb2.ClientStatusResponse()
        room = self.limits.max_resources
        for proxy in self.status.proxies():
            if len(response.config) >= self.limits.max_proxies:
                break
            if proxy.streams and select(proxy.node_id):  # connected ones, as /v1/proxies
                found = self.resources(proxy.node_id) if self.resources is not None else None
                if found is not None:
                    count = sum(map(len, found.values()))
                    if count > room:
                        found = None  # over the response's bound: a type at a time
                    else:
                        room -= count
                response.config.append(client_config(proxy, found))
        return response


class _CsdsCall:
    """One CSDS call: unary (FetchClientStatus) or a stream of requests, each answered."""

    __slots__ = ("_call", "_last", "_open", "_service", "_unary")

    def __init__(self, service: ClientStatus, call: Call, *, unary: bool) -> None:
        self._service = service
        self._call = call
        self._unary = unary
        self._last: float | None = None
        self._open = False
        if service.authorize is not None:
            refusal = service.authorize(call)
            if refusal is not None:
                self._refuse(*refusal)
        if service.open_calls >= service.limits.max_streams:
            self._refuse(
                GrpcStatus.RESOURCE_EXHAUSTED,
                f"{service.limits.max_streams} CSDS calls are open already; close one and ask again",
            )
        service.open_calls += 1
        self._open = True

    def on_message(self, data: bytes) -> None:
        service = self._service
        now = service.clock()
        if self._last is not None and now - self._last < service.limits.min_gap:
            self._refuse(
                GrpcStatus.RESOURCE_EXHAUSTED,
                f"CSDS requests on one stream come at most every {service.limits.min_gap:g}s",
            )
        self._last = now
        request = csds_pb2.ClientStatusRequest()
        try:
            request.ParseFromString(data)
        except DecodeError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, f"not a ClientStatusRequest: {exc}")
        try:
            response = service.answer(request)
        except _BadRequest as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))
        self._call.send(response.SerializeToString())
        if self._unary:
            self._end()
            self._call.finish()

    def _refuse(self, code: int, message: str) -> NoReturn:
        self._service.refused_log.log("CSDS call from %s refused: %s", self._call.peer, message)
        self._end()
        raise RpcError(code, shorten(message, 1000))

    def on_half_close(self) -> None:
        self._end()
        self._call.finish()

    def on_closed(self, reason: str) -> None:
        self._end()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._service.open_calls -= 1
