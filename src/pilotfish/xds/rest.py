"""REST xDS (aiohttp): JSON polls, answered with a JSON DiscoveryResponse or 304 Not Modified.

========  =========================  ==========================================
POST      /v3/discovery:clusters     CDS (no names: every cluster)
POST      /v3/discovery:endpoints    EDS (the named ClusterLoadAssignments)
POST      /v3/discovery:listeners    LDS (no names: every listener)
POST      /v3/discovery:routes       RDS (the named RouteConfigurations)
POST      /v3/discovery:secrets      SDS (the named secrets granted to the poller)
POST      /v3/discovery:runtime      RTDS (the named runtime layers)
POST      /v3/discovery:extension_configs  ECDS (the named extension configs)
========  =========================  ==========================================

These are the paths of the xDS services' ``google.api.http`` options, which Envoy with
``api_type: REST`` POSTs to every ``refresh_delay`` (plus up to as much again of jitter); the body is
a JSON ``DiscoveryRequest`` (node, ``resource_names``, ``version_info``). Each poll is answered
on its own from the cache (:mod:`pilotfish.protocol.rest` decides, without I/O): **304** with no
body when the poller is current, else **200** with the JSON ``DiscoveryResponse`` of every
subscribed resource at the type's current version (no nonce: REST has none). The JSON of a
response is made once per encoded response (those are shared, see :mod:`pilotfish.snapshot`) and
kept in a bounded memo, so a fleet polling one version costs one encoding.

Refusals are JSON ``{"error": ..., "field": ...}`` and change nothing: **404** for a path that is
not one of the above (the answer lists them), **405** for another method, **400** for a body that
is not a JSON ``DiscoveryRequest`` (the parser's message names the field) or a field that breaks
the protocol (``type_url`` of another type, a node id over the limit), **413** for a body over
``max_body`` bytes or more names than :attr:`~pilotfish.protocol.XdsLimits.max_resource_names`,
**403** when the poller's certificate may not claim its node id (``--authorize-node``), and
**503** before the first snapshot is published (sources not ready): Envoy treats any answer but
200 and 304 as a failed fetch and keeps what it has. Refusals of peers are logged and recorded
(``rest_refused``) at most once per ``report_every`` seconds, with how many were left out.

Security is the gRPC server's: the same TLS certificate (ALPN ``http/1.1``), the same client CA
(mTLS), the same identities and the same :class:`~pilotfish.xds.server.XdsPolicy` (one object
given to both), so ``--authorize-node`` and ``--grant-secret`` hold per poll as they hold per
stream, and a changed grants file holds for both at once. The cache is seen through the narrow
:class:`~pilotfish.cache.ConfigFetcher` (a group's current snapshot, a kept version): a poll
watches nothing. A secret not granted to the poller (its certificate identity, its claimed
node id) is left out of the answer as if it did not exist (``secret_denied``, once per node and
name, up to a bound), and a wildcard SDS poll is never honoured. A refused node claim is recorded
(``node_refused``) once per identity and node id.

What REST cannot do: Envoy never tells the server that it rejected a response (no NACK, no error
message: it logs it and counts ``update_rejected``, and its next poll still states the older
version); there is no ordering between types (each polls on its own timer), so make-before-break
does not apply; and every poller costs a request per type per refresh delay even when nothing
changes. Status (:class:`~pilotfish.status.SyncStatus`): a 200 records the version sent; the
version a poll states is what Envoy has applied (it sets ``version_info`` only after accepting a
response), recorded as ACKed; a 304 records the stated version as both. A poller is remembered
for the status' grace period after its last poll.

Node groups: :attr:`RestXds.group_of` maps a poll's node to the group whose snapshot answers it;
``serve`` gives it :meth:`~pilotfish.policy.groups.NodeGroups.rest_group_of`, so a poll is answered
from a group of kind rest, whose clusters and listeners poll EDS and RDS over REST too.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from pilotfish.cache import DEFAULT_GROUP, ConfigFetcher, NodeGroup
from pilotfish.errors import PeerError
from pilotfish.events import ReportGate
from pilotfish.protocol import WILDCARD, PeerOverLimit, Subscription, next_subscription
from pilotfish.protocol.limits import shorten
from pilotfish.protocol.rest import RestPoll, is_current, read_poll
from pilotfish.resources import CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE, RUNTIME, SECRET, ResourceType
from pilotfish.resources.anytypes import message_dict
from pilotfish.snapshot import EncodedResponse
from pilotfish.transport.site import REST_XDS, HttpConnectionLimits, serve_app
from pilotfish.transport.tls import peer_identity
from pilotfish.xds.server import XdsPolicy, node_info

__all__ = ["DEFAULT_MAX_BODY", "PATHS", "RestXds", "start_rest_server"]

_log = logging.getLogger("pilotfish.rest")

PATHS: dict[str, ResourceType] = {
    "/v3/discovery:clusters": CLUSTER,
    "/v3/discovery:endpoints": ENDPOINT,
    "/v3/discovery:listeners": LISTENER,
    "/v3/discovery:routes": ROUTE,
    "/v3/discovery:secrets": SECRET,
    "/v3/discovery:runtime": RUNTIME,
    "/v3/discovery:extension_configs": EXTENSION_CONFIG,
}
"""Path -> the type it serves (the ``google.api.http`` post paths of the v3 xDS services)."""

DEFAULT_MAX_BODY = 1 << 20
"""Bytes a poll's body may have (1 MiB: Envoy's, node and extension list included, is ~60 KB)."""
JSON_MEMO_ENTRIES = 1024
"""JSON responses kept (one per encoded response: per type, version and subscribed name set)."""
JSON_MEMO_BYTES = 64 * 1024 * 1024
"""Bytes of JSON responses kept; a larger one is made for each poll that asks for it."""
MAX_RECORDED = 10_000
"""(node, secret) pairs recorded as ``secret_denied`` and (identity, node) pairs as ``node_refused``
(each once: a poller asks again every refresh delay); past it the record starts again."""


def _default_group(node: base_pb2.Node) -> NodeGroup:
    return DEFAULT_GROUP


def _error(status: int, message: str, *, field: str | None = None, **extra: Any) -> web.Response:
    body = {"error": message, **({"field": field} if field is not None else {}), **extra}
    return web.json_response(body, status=status)


_NODE_KEPT = frozenset(
    {
        "id",
        "cluster",
        "metadata",
        "locality",
        "user_agent_name",
        "userAgentName",
        "user_agent_version",
        "userAgentVersion",
    }
)
"""The node fields a poll is read with (what :func:`~pilotfish.protocol.limits.kept_node` keeps), in
proto and JSON spelling."""


def parse_request(raw: bytes) -> discovery_pb2.DiscoveryRequest:
    """A poll's body -> DiscoveryRequest. Fields pilotfish does not know are ignored (a newer Envoy
    may send some); the node's other fields are dropped unread: Envoy's extension list is most of
    its ~60 KB, and protobuf's JSON parser takes ~9 ms for it against ~0.4 ms for the rest.
    Raises ``orjson.JSONDecodeError`` or ``json_format.ParseError`` naming what is wrong."""
    value = orjson.loads(raw)
    if not isinstance(value, dict):
        raise json_format.ParseError(f"the body must be a JSON object, not {type(value).__name__}")
    node = value.get("node")
    if isinstance(node, dict):
        value["node"] = {key: item for key, item in node.items() if key in _NODE_KEPT}
    return json_format.ParseDict(value, discovery_pb2.DiscoveryRequest(), ignore_unknown_fields=True)


def response_json(response: EncodedResponse) -> bytes:
    """The JSON of an encoded DiscoveryResponse (proto field names; ``Any`` with ``@type``)."""
    return orjson.dumps(message_dict(discovery_pb2.DiscoveryResponse.FromString(response.body)))


class _JsonMemo:
    """JSON bodies by encoded response (identity), least recently used dropped first, bounded
    in entries and bytes."""

    __slots__ = ("_bytes", "_entries")

    def __init__(self) -> None:
        self._entries: OrderedDict[int, tuple[EncodedResponse, bytes]] = OrderedDict()
        self._bytes = 0

    def get(self, response: EncodedResponse) -> bytes:
        key = id(response)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is response:
            self._entries.move_to_end(key)
            return entry[1]
        body = response_json(response)
        if len(body) > JSON_MEMO_BYTES // 4:
            return body
        if entry is not None:  # a response freed, its id reused
            self._bytes -= len(self._entries.pop(key)[1])
        self._entries[key] = (response, body)
        self._bytes += len(body)
        while len(self._entries) > JSON_MEMO_ENTRIES or self._bytes > JSON_MEMO_BYTES:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= len(dropped)
        return body

    def __len__(self) -> int:
        return len(self._entries)


class RestXds:
    """Serves the cache's snapshots to REST pollers and records the conversation."""

    def __init__(
        self,
        cache: ConfigFetcher,
        policy: XdsPolicy | None = None,
        *,
        group_of: Callable[[base_pb2.Node], NodeGroup] = _default_group,
        max_body: int = DEFAULT_MAX_BODY,
        report_every: float = 10.0,
    ) -> None:
        self.cache = cache
        self.policy = policy if policy is not None else XdsPolicy()
        """The gRPC server's (``serve`` gives both one): node claims, the grants in force, the
        limits, the subsetting indices (a poller is indexed at each poll, and keeps its index the
        grace period between polls), the status and the event log."""
        self.group_of = group_of
        """A poll's node -> the group whose snapshot answers it."""
        self.max_body = max_body
        self._json = _JsonMemo()
        self._recorded: set[tuple[str, str, str]] = set()
        self._gate = ReportGate(report_every)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{path:.*}", self._handle)
        return app

    # -- one poll ---------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rtype = PATHS.get(request.path)
        if rtype is None:
            return self._refuse(
                request,
                _error(
                    404,
                    f"no REST xDS resource at {shorten(request.path, 200)!r}; POST a JSON DiscoveryRequest to "
                    "one of the paths listed",
                    paths=list(PATHS),
                ),
            )
        if request.method != "POST":
            response = _error(405, f"{request.method} {request.path}: REST xDS takes POST (a JSON DiscoveryRequest)")
            response.headers["Allow"] = "POST"
            return self._refuse(request, response)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(
                request,
                _error(
                    413,
                    f"the body of POST {request.path} is larger than {self.max_body:,} bytes (Envoy's polls are "
                    "about 60 KB: send less node metadata)",
                ),
            )
        try:
            message = parse_request(raw)
        except (json_format.ParseError, orjson.JSONDecodeError, RecursionError) as exc:
            return self._refuse(
                request,
                _error(400, f"the body is not a JSON DiscoveryRequest: {shorten(str(exc), 400)}", field=_field_of(exc)),
            )
        try:
            poll = read_poll(message, rtype, self.policy.limits)
        except PeerOverLimit as exc:
            return self._refuse(request, _error(413, str(exc), field=_field_of(exc)))
        except PeerError as exc:
            return self._refuse(request, _error(400, str(exc), field=_field_of(exc)))
        return self._answer(request, poll)

    def _answer(self, request: web.Request, poll: RestPoll) -> web.StreamResponse:
        """Everything from here on runs without an await: the poll sees one snapshot."""
        node_id, type_url = poll.node.id, poll.rtype.url
        identity = _identity(request)
        policy = self.policy
        if policy.authorize is not None:
            refusal = policy.authorize(identity, node_id)
            if refusal is not None:
                if self._first_time("node_refused", identity, node_id):
                    policy.events.emit(
                        "node_refused", rest=True, node=node_id, identity=identity, peer=request.remote, reason=refusal
                    )
                return self._refuse(request, _error(403, refusal, field="node.id"))
        group = self.group_of(poll.node)
        snapshot = self.cache.snapshot(group)
        current = snapshot.get(type_url) if snapshot is not None else None
        if snapshot is not None and snapshot.subsets is not None and poll.rtype is ENDPOINT:
            current = snapshot.endpoints_for(policy.proxy_indices.touch(node_id))  # its own subsets
        if current is None:
            self._record(poll, answer=503)
            response = _error(
                503,
                "no configuration is published yet (pilotfish is waiting for its sources); "
                "keep what you have and poll again",
            )
            response.headers["Retry-After"] = "1"
            return response
        subscription = poll.subscription
        if poll.rtype is SECRET:
            subscription = self._granted(poll, identity, request.remote)
            if subscription is not poll.subscription:
                poll = RestPoll(poll.rtype, poll.node, poll.version_info, subscription)
        stated = None
        if poll.version_info and poll.version_info != current.version and not subscription.wildcard:
            stated = self.cache.kept(type_url, poll.version_info, group)
        status = policy.status
        # A poll is a stream of one request: remembered the grace period after.
        status.stream_opened(node_id, node_info(poll.node, address=request.remote or "", group=group, protocol="rest"))
        try:
            if is_current(poll, current, stated):
                status.sent(node_id, type_url, poll.version_info)
                status.acked(node_id, type_url, poll.version_info)
                self._record(poll, answer=304)
                return web.Response(status=304)
            # Without TTLs: a poller renews nothing between polls (Envoy's REST client takes no
            # Resource wrapper either); what it polled stays until a poll says otherwise.
            encoded = current.plain().response(subscription.names_to_send())
            body = self._json.get(encoded)
            status.sent(node_id, type_url, encoded.version)
            if poll.version_info:
                status.acked(node_id, type_url, poll.version_info)
        finally:
            status.stream_closed(node_id)
        self._record(poll, answer=200)
        if policy.events.conversation:
            policy.events.emit(
                "sent", node=node_id, type=type_url, version=encoded.version, rest=True, resources=encoded.carried
            )
        return web.Response(body=body, status=200, content_type="application/json")

    def _granted(self, poll: RestPoll, identity: str, peer: str | None) -> Subscription:
        """The poll's SDS subscription without the secrets not granted to the poller (nor a wildcard)."""
        subscription = poll.subscription
        grants = self.policy.grants.value.for_proxy(identity=identity, node_id=poll.node.id)
        names, denied = grants.split(subscription.names)
        if subscription.wildcard:
            denied.append(WILDCARD)
        if not denied:
            return subscription
        denied.sort()
        for name in denied:
            if not self._first_time("secret_denied", poll.node.id, name):
                continue
            self.policy.events.emit(
                "secret_denied", rest=True, node=poll.node.id, identity=identity, peer=peer, secret=name
            )
            _log.warning(
                "node %r (identity %r, %s) asked over REST for secret %r, not granted to it: not sent",
                shorten(poll.node.id, 200),
                identity,
                peer,
                shorten(name, 200),
            )
        return next_subscription(names, wildcard_capable=False, ever_named=True)

    # -- records ----------------------------------------------------------------------------------

    def _first_time(self, event: str, who: str, what: str) -> bool:
        """Whether (``event``, ``who``, ``what``) is recorded for the first time (up to
        :data:`MAX_RECORDED` of them)."""
        recorded, key = self._recorded, (event, who, what)
        if key in recorded:
            return False
        if len(recorded) >= MAX_RECORDED:
            recorded.clear()
        recorded.add(key)
        return True

    def _record(self, poll: RestPoll, *, answer: int) -> None:
        events = self.policy.events
        if not events.conversation:
            return
        subscription = poll.subscription
        names = {} if subscription.wildcard else {"resource_names": sorted(subscription.names)}
        events.emit(
            "rest_request",
            node=poll.node.id,
            type=poll.rtype.url,
            version_info=poll.version_info,
            answer=answer,
            **names,
        )

    def _refuse(self, request: web.Request, response: web.Response) -> web.Response:
        """Log and record a refused poll, at most once per ``report_every`` seconds."""
        left_out = self._gate.admit(asyncio.get_running_loop().time())
        if left_out is None:
            return response
        reason = response.text or ""
        _log.warning(
            "REST xDS refused %s %s from %s: %d %s%s",
            request.method,
            shorten(request.path, 200),
            request.remote,
            response.status,
            shorten(reason, 400),
            f" ({left_out} more refusal(s) since the last one logged)" if left_out else "",
        )
        self.policy.events.emit(
            "rest_refused",
            method=request.method,
            path=shorten(request.path, 200),
            status=response.status,
            peer=request.remote,
            reason=shorten(reason, 1000),
            unreported_before=left_out,
        )
        return response


def _identity(request: web.Request) -> str:
    transport = request.transport
    return peer_identity(transport.get_extra_info("peercert")) if transport is not None else ""


_FIELD = re.compile(r"(?:Failed to parse |^)([a-z_]+(?:\.[a-z_]+)*)(?: field|:| )")


def _field_of(exc: Exception) -> str | None:
    """The request field an error message names first (``resource_names``, ``node.id``...), if any."""
    text = str(exc)
    if isinstance(exc, json_format.ParseError):
        fields = re.findall(r"Failed to parse (\w+) field", text)
        return ".".join(fields) if fields else None
    match = _FIELD.search(text)
    return match[1] if match else None


async def start_rest_server(
    rest: RestXds, address: str, *, tls: ssl.SSLContext | None = None, limits: HttpConnectionLimits | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``rest`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding at most ``limits`` connections; returns the runner (``cleanup()`` stops it)
    and the bound ``host:port``."""
    return await serve_app(rest.app(), address, tls=tls, listener=REST_XDS, limits=limits)
