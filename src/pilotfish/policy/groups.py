"""Which node group a connecting client belongs to, and what each group is served.

Each node group is served its own snapshot of the same sources (:func:`pilotfish.build.desired.build_snapshots`);
what differs is the group's *kind* (:class:`~pilotfish.resources.builders.ClientKind`): Envoys
(``envoy``) get socket listeners, proxyless gRPC clients (``grpc``) get API listeners, Envoys
polling REST xDS (``rest``) get socket listeners and clusters whose RDS and EDS are polled over
REST too (an ADS config source is useless to a client without an ADS stream). A stream's group is
chosen once, from the node of its first request, and a REST poll's from its node, by the first
rule that matches:

``--node-group NAME[:KIND][@ZONE]=RULE`` (repeatable; KIND is ``envoy``, ``grpc`` or ``rest``,
default ``envoy``; ZONE: the group's clients run in that zone, and of a service with ``zone_local: true``
they get only the endpoints in it, while it has any) where RULE is one of

- ``cluster:PATTERN``: the node's ``cluster``;
- ``id:PATTERN``: the node's ``id``;
- ``metadata:KEY=PATTERN``: the string value of the node's metadata field KEY;
- ``agent:PATTERN``: the node's ``user_agent_name`` (Envoy says ``envoy``; grpcio ``gRPC C-core
  linux Python``; the other gRPC libraries ``gRPC ...`` too);
- ``zone:PATTERN``: the node's locality zone.

In a PATTERN ``*`` stands for any run of characters except ``/`` (as in ``--authorize-node``), and
everything else for itself; the whole value must match (:func:`~pilotfish.policy.authorize.glob_match`:
time linear in the value's length, which the peer chooses). After the operator's rules come two
built-in ones: a node whose ``user_agent_name`` starts with ``gRPC`` joins the group ``grpc``
(kind grpc), so a proxyless client resolving ``xds:///NAME`` finds the API listener NAME with no
configuration; every other node joins ``default`` (kind envoy), which is what every node got
before groups existed. A rule may name ``default`` or ``grpc`` to send other nodes there.

The way a client came decides between the kinds: a poll arriving at the REST server (``serve
--rest``) is a REST client by definition, so it is matched against the rules of ``rest`` groups
only and, if none matches, joins the built-in group ``rest`` (kind rest; it exists when ``--rest``
is given); a gRPC stream is matched against the other rules only. So a REST poller never gets
``ads: {}`` it cannot follow, nor an ADS stream REST config sources, whatever the rules say.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2

from pilotfish.build.desired import View
from pilotfish.cache import DEFAULT_GROUP, NodeGroup
from pilotfish.policy.authorize import glob_match
from pilotfish.resources.builders import ClientKind
from pilotfish.resources.services import MAX_ZONE, is_zone

__all__ = ["GRPC_GROUP", "MAX_GROUPS", "REST_GROUP", "NodeGroupRule", "NodeGroups", "parse_node_group"]

GRPC_GROUP = NodeGroup("grpc")
"""The built-in group of proxyless gRPC clients."""
REST_GROUP = NodeGroup("rest")
"""The built-in group of REST pollers (with ``--rest``)."""
_GRPC_AGENTS = "gRPC*"
_FIELDS = ("cluster", "id", "metadata", "agent", "zone")
MAX_GROUPS = 64
"""Node groups a server accepts: each is one more snapshot per build."""


@dataclass(frozen=True, slots=True)
class NodeGroupRule:
    """Nodes whose ``field`` (for ``metadata``: the value under ``key``) matches ``pattern`` join ``group``."""

    group: NodeGroup
    kind: ClientKind
    field: str
    pattern: str
    key: str = ""
    zone: str = ""
    """The zone of the group's clients ("": none)."""

    @property
    def view(self) -> View:
        return View(kind=self.kind, zone=self.zone)

    def __str__(self) -> str:
        kind = "" if self.kind is ClientKind.ENVOY else f":{self.kind.value}"
        zone = f"@{self.zone}" if self.zone else ""
        key = f"{self.key}=" if self.field == "metadata" else ""
        return f"{self.group}{kind}{zone}={self.field}:{key}{self.pattern}"


def parse_node_group(text: str) -> NodeGroupRule:
    """``NAME[:KIND][@ZONE]=FIELD:PATTERN`` (``metadata:KEY=PATTERN``) -> a rule; ValueError saying
    what is wrong."""
    example = (
        "e.g. 'proxyless:grpc=cluster:payments-*', 'edge:rest=cluster:rest-*' or "
        "'east@us-east-1=metadata:zone=us-east-1'"
    )
    head, sep, rule = text.partition("=")
    if not sep or not head or not rule:
        raise ValueError(f"{text!r} is not NAME[:KIND][@ZONE]=RULE ({example})")
    head, _, zone = head.partition("@")
    if "@" in text.partition("=")[0] and (not zone or not is_zone(zone)):
        raise ValueError(f"{text!r}: a zone uses letters, digits, '-', '_' and '.', at most {MAX_ZONE} of them")
    name, _, kind_text = head.partition(":")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"{text!r}: a group name uses letters, digits, '-', '_' and '.' only")
    try:
        kind = ClientKind(kind_text or "envoy")
    except ValueError:
        raise ValueError(f"{text!r}: the kind of a group is envoy, grpc or rest, not {kind_text!r}") from None
    field, sep, pattern = rule.partition(":")
    if not sep or field not in _FIELDS:
        raise ValueError(f"{text!r}: a rule is {', '.join(f + ':PATTERN' for f in _FIELDS)} ({example})")
    key = ""
    if field == "metadata":
        key, sep, pattern = pattern.partition("=")
        if not sep or not key:
            raise ValueError(f"{text!r}: a metadata rule is metadata:KEY=PATTERN ({example})")
    if not pattern:
        raise ValueError(f"{text!r}: the pattern is empty (use '*' for any value)")
    return NodeGroupRule(NodeGroup(name), kind, field, pattern, key, zone)


def _value(node: base_pb2.Node, field: str, key: str) -> str | None:
    if field == "cluster":
        return str(node.cluster)
    if field == "id":
        return str(node.id)
    if field == "agent":
        return str(node.user_agent_name)
    if field == "zone":
        return str(node.locality.zone)
    value = node.metadata.fields.get(key)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)


class NodeGroups:
    """The rules, compiled, and the groups they name: :meth:`group_of` picks the group of a gRPC
    stream's node, :meth:`rest_group_of` that of a REST poll's node.

    ``rest``: REST xDS is served (``--rest``): the built-in group ``rest`` exists, and so may
    groups of kind rest (without it they could never be joined, so they are refused).
    """

    def __init__(self, rules: Iterable[NodeGroupRule] = (), *, rest: bool = False) -> None:
        built_in = NodeGroupRule(GRPC_GROUP, ClientKind.GRPC, "agent", _GRPC_AGENTS)
        self.rules = (*rules, built_in)
        views: dict[NodeGroup, View] = {DEFAULT_GROUP: View()}
        if rest:
            views[REST_GROUP] = View(kind=ClientKind.REST)
        for rule in (built_in, *self.rules):
            if rule.kind is ClientKind.REST and not rest:
                raise ValueError(
                    f"--node-group {rule}: a group of kind rest serves REST polls: give --rest HOST:PORT too"
                )
            known = views.setdefault(rule.group, rule.view)
            if known.kind is not rule.kind:
                raise ValueError(
                    f"--node-group {rule}: the group {rule.group} is of kind {known.kind.value} "
                    f"(by an earlier rule or built in), not {rule.kind.value}"
                )
            if known.zone != rule.zone:
                raise ValueError(
                    f"--node-group {rule}: the group {rule.group} is in zone {known.zone!r} "
                    f"(by an earlier rule or built in), not {rule.zone!r}"
                )
        if len(views) > MAX_GROUPS:
            raise ValueError(f"--node-group: {len(views)} groups, more than the {MAX_GROUPS} a server builds")
        self._views = views
        self._matchers = [
            (rule.group, rule.field, rule.key, rule.pattern) for rule in self.rules if rule.kind is not ClientKind.REST
        ]
        self._rest_matchers = [
            (rule.group, rule.field, rule.key, rule.pattern) for rule in self.rules if rule.kind is ClientKind.REST
        ]

    def group_of(self, node: base_pb2.Node) -> NodeGroup:
        """The group of a gRPC stream's node: the first rule of a group not of kind rest that
        matches, else ``default``."""
        return _first_match(self._matchers, node) or DEFAULT_GROUP

    def rest_group_of(self, node: base_pb2.Node) -> NodeGroup:
        """The group of a REST poll's node: the first rule of a group of kind rest that matches,
        else ``rest``."""
        return _first_match(self._rest_matchers, node) or REST_GROUP

    def views(self) -> dict[NodeGroup, View]:
        """Every group (the built-in ones too, the default first) and what it is served."""
        return dict(self._views)


def _first_match(matchers: list[tuple[NodeGroup, str, str, str]], node: base_pb2.Node) -> NodeGroup | None:
    for group, field, key, pattern in matchers:
        value = _value(node, field, key)
        if value is not None and glob_match(pattern, value):
            return group
    return None
