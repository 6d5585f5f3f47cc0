"""Checks a snapshot must pass before any proxy sees it.

Two kinds of check live here.

**Envoy's own proto rules.** Envoy's API annotates its fields with protoc-gen-validate (PGV) rules
(``(validate.rules)``: ``connect_timeout`` must be > 0s, a port <= 65535, a header name must be a
valid header name...). Envoy checks them on every resource it receives and NACKs what breaks one;
we check them first, so an invalid snapshot is refused here, with the resource, field path, rule
and value named, and never reaches a proxy. :class:`RuleChecker` reads the rules by reflection
over the message descriptors and compiles, once per message type, a plan into a small Python
function (as PGV generates code per message): only fields that have rules, or lead to messages
or ``Any`` values that may have some, are looked at. ``google.protobuf.Any`` values (filter
``typed_config``, transport sockets, extensions) are unpacked and checked against their own type,
as Envoy does when it instantiates them; an ``Any`` whose type is unknown is a problem. Results
are remembered by content hash (bounded), so an unchanged resource is checked once, not once per
build. The semantics follow PGV's C++ templates, which Envoy runs: a scalar's rules apply to its
value even when unset, a message's, wrapper's, duration's and ``Any``'s only when it is set
(``required`` aside), a oneof member's only when it is the one set. A rule this checker does not
understand (a new PGV or Envoy release) raises :class:`RuleNotUnderstood`: a rule is never
silently skipped.

**Cross references** (:func:`check_references`): an EDS cluster served over ADS needs its
ClusterLoadAssignment, and a listener whose HTTP connection manager uses RDS needs its
RouteConfiguration. Without them Envoy waits (the cluster never warms, the listener never becomes
active) with no NACK to explain why. A route to a cluster that does not exist makes Envoy answer
503; a filter chain that does not end in a terminal filter (or a connection manager whose HTTP
filters do not end in the router) is NACKed. All are refused up front, naming the resource.
"""

from __future__ import annotations

import hashlib
import keyword
import math
import re
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import validate.validate_pb2 as pgv
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from google.protobuf import descriptor_pool, message_factory, unknown_fields
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from pilotfish.errors import Problem
from pilotfish.resources import CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE, ResourceType
from pilotfish.resources.anytypes import ensure_type
from pilotfish.resources.refs import connection_managers

__all__ = [
    "UNDERSTOOD_RULES",
    "EncodedResource",
    "RuleChecker",
    "RuleNotUnderstood",
    "Violation",
    "check_references",
    "check_rules",
    "default_checker",
    "reference_names",
    "references_problems",
    "rule_problems",
    "understands",
]


# -- which rules exist, and which we understand ---------------------------------------------------

_NUMBER_RULES = frozenset({"const", "lt", "lte", "gt", "gte", "in", "not_in", "ignore_empty"})
_NUMBER_KINDS = (
    "float",
    "double",
    "int32",
    "int64",
    "uint32",
    "uint64",
    "sint32",
    "sint64",
    "fixed32",
    "fixed64",
    "sfixed32",
    "sfixed64",
)
_UNDERSTOOD: dict[str, frozenset[str]] = {
    **{kind: _NUMBER_RULES for kind in _NUMBER_KINDS},
    "bool": frozenset({"const"}),
    "string": frozenset(
        {
            "const",
            "len",
            "min_len",
            "max_len",
            "len_bytes",
            "min_bytes",
            "max_bytes",
            "pattern",
            "prefix",
            "suffix",
            "contains",
            "not_contains",
            "in",
            "not_in",
            "email",
            "hostname",
            "ip",
            "ipv4",
            "ipv6",
            "uri",
            "uri_ref",
            "address",
            "uuid",
            "well_known_regex",
            "strict",
            "ignore_empty",
        }
    ),
    "bytes": frozenset(
        {
            "const",
            "len",
            "min_len",
            "max_len",
            "pattern",
            "prefix",
            "suffix",
            "contains",
            "in",
            "not_in",
            "ip",
            "ipv4",
            "ipv6",
            "ignore_empty",
        }
    ),
    "enum": frozenset({"const", "defined_only", "in", "not_in"}),
    "message": frozenset({"skip", "required"}),
    "repeated": frozenset({"min_items", "max_items", "unique", "items", "ignore_empty"}),
    "map": frozenset({"min_pairs", "max_pairs", "no_sparse", "keys", "values", "ignore_empty"}),
    "any": frozenset({"required", "in", "not_in"}),
    "duration": frozenset({"required", "const", "lt", "lte", "gt", "gte", "in", "not_in"}),
    "timestamp": frozenset({"required", "const", "lt", "lte", "gt", "gte", "lt_now", "gt_now", "within"}),
}
_NESTED = {("repeated", "items"), ("map", "keys"), ("map", "values")}

UNDERSTOOD_RULES: frozenset[str] = frozenset(f"{kind}.{rule}" for kind, rules in _UNDERSTOOD.items() for rule in rules)
"""Every ``kind.rule`` the checker applies (``duration.gt``, ``string.well_known_regex``...)."""


def understands(rule: str) -> bool:
    """Whether a rule name, nested ones included (``repeated.items.string.min_len``), is applied."""
    parts = rule.split(".")
    while len(parts) > 2 and (parts[0], parts[1]) in _NESTED:
        parts = parts[2:]
    return len(parts) == 2 and parts[1] in _UNDERSTOOD.get(parts[0], ())


class RuleNotUnderstood(Exception):
    """A ``validate.rules`` annotation this checker cannot apply: our bug or a newer Envoy API.

    Never a user error: pilotfish must be taught the rule (or validation turned off) rather than
    let a value through unchecked.
    """


# -- results --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule inside one resource."""

    path: str
    """Field path from the resource, e.g. ``.connect_timeout`` or ``.virtual_hosts[0].domains[2]``."""
    rule: str
    """The PGV rule, e.g. ``duration.gt``; empty for an ``Any`` that cannot be checked at all."""
    text: str
    """What the rule asks, e.g. ``must be greater than 0s``."""
    value: str | None
    """The offending value as text; None when the value is absent."""

    def message(self) -> str:
        got = f", got {self.value}" if self.value is not None else ""
        rule = f" (validate rule {self.rule})" if self.rule else ""
        return f"{self.text}{rule}{got}"


class EncodedResource(Protocol):
    """What :func:`check_rules` needs of a resource (``pilotfish.snapshot.Resource`` has it)."""

    name: str
    hash: str

    @property
    def value(self) -> bytes: ...


# -- value formatting (only on a violation) -------------------------------------------------------

_SHOWN = 80


def _text(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= _SHOWN else shown[:_SHOWN] + "..."


def _duration_text(nanos: int) -> str:
    sign = "-" if nanos < 0 else ""
    seconds, rest = divmod(abs(nanos), 1_000_000_000)
    return f"{sign}{seconds}.{rest:09d}".rstrip("0") + "s" if rest else f"{sign}{seconds}s"


def _timestamp_text(nanos: int) -> str:
    seconds, rest = divmod(nanos, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + (f".{rest:09d}".rstrip("0") if rest else "") + "Z"


def _number_text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


class _Key:
    """A map key in a field path (built only when a violation is reported)."""

    __slots__ = ("key",)

    def __init__(self, key: object) -> None:
        self.key = key


def _path_text(chain: Any) -> str:
    # A path is a chain of (parent, segment) tuples, built cheaply while walking and turned into
    # text only for a violation. Segments: ".field" (or any preformatted text), an int index,
    # or a _Key.
    parts: list[str] = []
    while chain is not None:
        chain, segment = chain
        if isinstance(segment, str):
            parts.append(segment)
        elif isinstance(segment, int):
            parts.append(f"[{segment}]")
        else:
            parts.append(f"[{_text(segment.key)}]")
    return "".join(reversed(parts))


# -- well-known string formats (as PGV's C++ helpers define them) --------------------------------

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# RFC 7230 token (PGV's pattern: "+-." there is a range, so ',' is allowed as well), with an
# optional leading ':' for HTTP/2 pseudo-headers.
_HEADER_NAME = re.compile(r":?[0-9a-zA-Z!#$%&'*\x2b-\x2e^_|~`]+")
_HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
_HEADER_STRING = re.compile(r"[^\x00\x0a\x0d]*")
"""``strict: false``: anything but NUL, LF and CR."""


def _is_ipv4(value: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, value)
    except (OSError, ValueError):
        return False
    return True


def _is_ipv6(value: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, value)
    except (OSError, ValueError):
        return False
    return True


def _is_ip(value: str) -> bool:
    return _is_ipv4(value) or _is_ipv6(value)


def _is_hostname(value: str) -> bool:
    if len(value) > 253:
        return False
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    return all(_HOST_LABEL.fullmatch(label) for label in labels)


def _is_email(value: str) -> bool:
    if value.endswith(">") and "<" in value:  # "Name <addr>"
        value = value[value.rindex("<") + 1 : -1]
    local, at, domain = value.rpartition("@")
    return bool(at and local and len(local.encode()) <= 64 and _is_hostname(domain))


def _is_uri(value: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return False
    return bool(parts.scheme) and not any(c.isspace() for c in value)


def _is_uri_ref(value: str) -> bool:
    try:
        urllib.parse.urlsplit(value)
    except ValueError:
        return False
    return not any(c.isspace() for c in value)


_WELL_KNOWN: dict[str, tuple[Callable[[str], bool], str]] = {
    "email": (_is_email, "must be a valid email address"),
    "hostname": (_is_hostname, "must be a valid hostname"),
    "ip": (_is_ip, "must be a valid IP address"),
    "ipv4": (_is_ipv4, "must be a valid IPv4 address"),
    "ipv6": (_is_ipv6, "must be a valid IPv6 address"),
    "uri": (_is_uri, "must be a valid absolute URI"),
    "uri_ref": (_is_uri_ref, "must be a valid URI reference"),
    "address": (lambda v: _is_hostname(v) or _is_ip(v), "must be an IP address or a hostname"),
    "uuid": (lambda v: _UUID.fullmatch(v) is not None, "must be a valid UUID"),
}


def _re2(pattern: str) -> str:
    """An RE2 pattern as a Python one with the same meaning, for ``fullmatch``.

    PGV's C++ code (Envoy's) uses ``RE2::FullMatch``. Python's ``$`` also matches before a final
    newline and ``\\z`` is spelled ``\\Z``; everything else Envoy's patterns use is the same. A
    construct Python lacks (``\\pL`` classes) fails to compile: loudly, at plan time.
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append("\\Z" if nxt == "z" and not in_class else c + nxt)
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            # A ']' right after '[' or '[^' is a literal.
            if i < len(pattern) and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                out.append("\\]")
                i += 1
            continue
        elif c == "$":
            out.append("\\Z")
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


# -- bounded memo ---------------------------------------------------------------------------------


class _Generations:
    """A dict bounded by generations: when the current one is full it becomes the previous one
    (the one before is dropped). An entry used again is carried into the current generation, so
    what every build uses stays, and memory is at most two generations."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.current: dict[Any, Any] = {}
        self._previous: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        found = self.current.get(key)
        if found is None:
            found = self._previous.pop(key, None)
            if found is not None:
                self.put(key, found)
        return found

    def put(self, key: Any, value: Any) -> None:
        if len(self.current) >= self._limit:
            self._previous, self.current = self.current, {}
        self.current[key] = value

    def __len__(self) -> int:
        return len(self.current) + len(self._previous)


# -- the checker ----------------------------------------------------------------------------------

_WRAPPERS = {
    "google.protobuf.DoubleValue": "double",
    "google.protobuf.FloatValue": "float",
    "google.protobuf.Int64Value": "int64",
    "google.protobuf.UInt64Value": "uint64",
    "google.protobuf.Int32Value": "int32",
    "google.protobuf.UInt32Value": "uint32",
    "google.protobuf.BoolValue": "bool",
    "google.protobuf.StringValue": "string",
    "google.protobuf.BytesValue": "bytes",
}
_DURATION = "google.protobuf.Duration"
_TIMESTAMP = "google.protobuf.Timestamp"
_ANY = "google.protobuf.Any"
_SCALAR_KINDS = {
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_SINT32: "sint32",
    FieldDescriptor.TYPE_SINT64: "sint64",
    FieldDescriptor.TYPE_FIXED32: "fixed32",
    FieldDescriptor.TYPE_FIXED64: "fixed64",
    FieldDescriptor.TYPE_SFIXED32: "sfixed32",
    FieldDescriptor.TYPE_SFIXED64: "sfixed64",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_ENUM: "enum",
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Metadata.typed_filter_metadata: Envoy keeps values of types it has no factory for opaque, so
# an unknown type there is not an error (a known one is still checked).
_OPAQUE_ANY_FIELDS = frozenset({"envoy.config.core.v3.Metadata.typed_filter_metadata"})

_Raw = tuple[Any, Any, int, Any]
"""A violation while walking: (path parent, path segment, rule id, raw value)."""


@dataclass(frozen=True, slots=True)
class _Rule:
    name: str
    text: str
    show: Callable[[Any], str | None]


def _absent(_: object) -> None:
    return None


def _rules_of(field: FieldDescriptor) -> pgv.FieldRules | None:
    options = field.GetOptions()
    if not options.HasExtension(pgv.rules):
        return None
    rules: pgv.FieldRules = options.Extensions[pgv.rules]
    return rules


def _message_type(field: FieldDescriptor) -> Descriptor:
    desc = field.message_type
    assert desc is not None, field.full_name
    return desc


def _value_kind(field: FieldDescriptor) -> str:
    """The PGV rule kind that applies to one value of ``field`` (an item, for repeated fields)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        name = _message_type(field).full_name
        if name in _WRAPPERS:
            return _WRAPPERS[name]
        return {_DURATION: "duration", _TIMESTAMP: "timestamp", _ANY: "any"}.get(name, "message")
    if field.type == FieldDescriptor.TYPE_GROUP:
        return "message"
    return _SCALAR_KINDS[field.type]


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE and _message_type(field).GetOptions().map_entry
    )


def _message_flags(desc: Descriptor) -> tuple[bool, bool]:
    options = desc.GetOptions()
    disabled = options.HasExtension(pgv.disabled) and bool(options.Extensions[pgv.disabled])
    ignored = options.HasExtension(pgv.ignored) and bool(options.Extensions[pgv.ignored])
    return disabled, ignored


class RuleChecker:
    """Checks messages against Envoy's ``validate.rules``; remembers results by content hash.

    One instance serves any number of builds (:func:`default_checker` is shared). ``memo_entries``
    bounds the resources remembered per type (two generations of that size at most).
    """

    def __init__(self, *, memo_entries: int = 1 << 17, any_memo_entries: int = 1 << 14) -> None:
        self._namespace: dict[str, Any] = {"_any": self._check_any, "_Key": _Key, "_math": math, "_time": time}
        self._functions: dict[str, str | None] = {}
        """Message full name -> name of its compiled function (None: nothing to check)."""
        self._failed: dict[str, RuleNotUnderstood] = {}
        self._needs: dict[str, bool] = {}
        self._rules: list[_Rule] = []
        self._constants = 0
        self._memo_entries = memo_entries
        self._memos: dict[str, _Generations] = {}
        self._any_memo_entries = any_memo_entries
        self._any_memo = _Generations(any_memo_entries)
        self._classes: dict[str, type[Message] | None] = {}
        self._pending: dict[str, str | None] = {}
        self._serial = 0

    # -- public -----------------------------------------------------------------------------------

    def check_message(self, message: Message) -> tuple[Violation, ...]:
        """Every rule ``message`` breaks, with paths relative to it. Raises RuleNotUnderstood."""
        function = self._function(_descriptor(message))
        if function is None:
            return ()
        found: list[_Raw] = []
        self._namespace[function](message, None, found)
        return tuple(self._violation(raw) for raw in found)

    def check_resource(
        self, rtype: ResourceType, resource: EncodedResource, message: Message | None = None
    ) -> tuple[Violation, ...]:
        """:meth:`check_message` for a resource, remembered by its content hash.

        ``message`` is the decoded resource when the caller has it; otherwise the encoding is
        decoded here (and not kept).
        """
        memo = self._memo(rtype)
        found: tuple[Violation, ...] | None = memo.get(resource.hash)
        if found is None:
            if message is None:
                message = rtype.message.FromString(resource.value)
            found = self.check_message(message)
            memo.put(resource.hash, found)
        return found

    def check_resources(
        self,
        rtype: ResourceType,
        resources: Iterable[EncodedResource],
    ) -> Iterator[tuple[EncodedResource, tuple[Violation, ...] | RuleNotUnderstood]]:
        """:meth:`check_resource` for many: yields those that break a rule with their violations,
        and those it cannot check with why. What the last build checked costs a lookup each."""
        memo = self._memo(rtype)
        remembered = memo.current  # read directly: the common case, by far
        for resource in resources:
            found = remembered.get(resource.hash)
            if found is None:
                try:
                    found = self.check_resource(rtype, resource)
                except RuleNotUnderstood as exc:
                    yield resource, exc
                    continue
                remembered = memo.current  # the generations may have turned
            if found:
                yield resource, found

    def _memo(self, rtype: ResourceType) -> _Generations:
        memo = self._memos.get(rtype.url)
        if memo is None:
            memo = self._memos[rtype.url] = _Generations(self._memo_entries)
        return memo

    def compile(self, descriptor: Any) -> None:
        """Build the plan of a message type (its ``Descriptor``, and every type it reaches): raises
        RuleNotUnderstood for any rule, on any of them, that the checker cannot apply."""
        self._function(descriptor)

    def forget(self) -> None:
        """Drop every remembered result (plans stay): the next check of anything is a first one."""
        self._memos.clear()
        self._any_memo = _Generations(self._any_memo_entries)

    def remembered(self) -> int:
        """How many resource results are remembered (for tests and metrics)."""
        return sum(len(memo) for memo in self._memos.values())

    # -- Any --------------------------------------------------------------------------------------

    def _message_class(self, type_url: str) -> type[Message] | None:
        if type_url in self._classes:
            return self._classes[type_url]
        name = type_url.rsplit("/", 1)[-1]
        cls: type[Message] | None = None
        if name and ensure_type(name):
            desc = descriptor_pool.Default().FindMessageTypeByName(name)
            cls = message_factory.GetMessageClass(desc)
        if len(self._classes) < 4096:  # type URLs come from users: bounded
            self._classes[type_url] = cls
        return cls

    def _check_any(self, packed: Any, chain: Any, out: list[_Raw], opaque: bool = False) -> None:
        type_url: str = packed.type_url
        value: bytes = packed.value
        key = (type_url, hashlib.sha256(value).digest(), opaque)
        found: tuple[tuple[str, int, Any], ...] | None = self._any_memo.get(key)
        if found is None:
            found = self._any_violations(type_url, value, opaque)
            self._any_memo.put(key, found)
        for segment, rule, raw in found:
            out.append((chain, segment, rule, raw))

    def _any_violations(self, type_url: str, value: bytes, opaque: bool) -> tuple[tuple[str, int, Any], ...]:
        cls = self._message_class(type_url)
        if cls is None:
            if opaque:
                return ()
            return (
                (
                    "",
                    self._rule_id(
                        "",
                        "must hold a message type of the Envoy API (check its @type and "
                        "package) so that its rules can be checked",
                        _text,
                    ),
                    type_url,
                ),
            )
        try:
            message = cls.FromString(value)
        except DecodeError:
            return (("", self._rule_id("", f"must hold a valid encoding of {type_url}", _absent), None),)
        function = self._function(_descriptor(cls))
        if function is None:
            return ()
        inner: list[_Raw] = []
        self._namespace[function](message, None, inner)
        # Paths inside become preformatted text, so the result can be shared wherever this Any sits.
        return tuple((_path_text((parent, segment)), rule, raw) for parent, segment, rule, raw in inner)

    # -- compiling --------------------------------------------------------------------------------

    def _violation(self, raw: _Raw) -> Violation:
        parent, segment, rule_id, value = raw
        rule = self._rules[rule_id]
        return Violation(_path_text((parent, segment)), rule.name, rule.text, rule.show(value))

    def _rule_id(self, name: str, text: str, show: Callable[[Any], str | None]) -> int:
        self._rules.append(_Rule(name, text, show))
        return len(self._rules) - 1

    def _constant(self, value: object) -> str:
        self._constants += 1
        name = f"_k{self._constants}"
        self._namespace[name] = value
        return name

    def _function(self, desc: Descriptor) -> str | None:
        name = desc.full_name
        if name in self._failed:
            raise self._failed[name]
        if name in self._functions:
            return self._functions[name]
        try:
            self._compile_closure(desc)
        except RuleNotUnderstood as exc:
            self._failed[name] = exc
            raise
        return self._functions[name]

    def _look_at(self, desc: Descriptor) -> tuple[bool, list[Descriptor]]:
        """Whether a message type needs work of its own (rules, required oneofs, Any fields), and
        the message types of its fields that checking may descend into."""
        disabled, ignored = _message_flags(desc)
        if disabled or ignored:
            return False, []
        kids: list[Descriptor] = []
        has_work = any(self._oneof_required(o) for o in desc.oneofs)
        for field in desc.fields:
            rules = _rules_of(field)
            if rules is not None:
                _check_understood(rules, field)
                has_work = True
            target = _target(field)
            if target is None:
                continue
            if target.full_name == _ANY:
                has_work = True
            elif (
                target.full_name not in _WRAPPERS
                and target.full_name not in (_DURATION, _TIMESTAMP)
                and (rules is None or not _skipped(rules, field))
            ):
                kids.append(target)
        return has_work, kids

    def _compile_closure(self, root: Descriptor) -> None:
        # Every type reachable from root, and whether each needs any work (own rules, Any
        # fields, or a reachable type that does). Then one function per type that does.
        reach: dict[str, Descriptor] = {}
        children: dict[str, list[str]] = {}
        own: dict[str, bool] = {}
        stack = [root]
        while stack:
            desc = stack.pop()
            if desc.full_name in reach or desc.full_name in self._functions:
                continue
            reach[desc.full_name] = desc
            has_work, kids = self._look_at(desc)
            stack.extend(kids)
            own[desc.full_name] = has_work
            children[desc.full_name] = [kid.full_name for kid in kids]
        needs = dict(own)
        changed = True
        while changed:
            changed = False
            for full_name, names in children.items():
                if not needs[full_name] and any(needs.get(kid, self._functions.get(kid) is not None) for kid in names):
                    needs[full_name] = True
                    changed = True
        # Names first (the functions call each other), then every source; only when all of them
        # were written are they compiled and the names published.
        self._pending = {}
        for full_name in reach:
            self._serial += 1
            self._pending[full_name] = f"_v{self._serial}" if needs[full_name] else None
        try:
            sources = []
            for full_name, desc in reach.items():
                function = self._pending[full_name]
                if function is not None:
                    sources.append((full_name, _Writer(self, desc, function).source()))
            for full_name, source in sources:
                exec(compile(source, f"<validate.rules of {full_name}>", "exec"), self._namespace)
            self._functions.update(self._pending)
        finally:
            self._pending = {}

    def _function_name(self, full_name: str) -> str | None:
        """The function of a message type being compiled or compiled earlier (KeyError: neither)."""
        if full_name in self._pending:
            return self._pending[full_name]
        return self._functions[full_name]

    @staticmethod
    def _oneof_required(oneof: Any) -> bool:
        options = oneof.GetOptions()
        return options.HasExtension(pgv.required) and bool(options.Extensions[pgv.required])


def _target(field: FieldDescriptor) -> Descriptor | None:
    """The message type a field's values are (for maps: the value type), if any."""
    if field.type not in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
        return None
    if _is_map(field):
        value = _message_type(field).fields_by_name["value"]
        return _message_type(value) if value.type == FieldDescriptor.TYPE_MESSAGE else None
    return _message_type(field)


def _skipped(rules: pgv.FieldRules, field: FieldDescriptor) -> bool:
    if _is_map(field):
        return bool(rules.map.values.message.skip)
    if field.is_repeated:
        return bool(rules.repeated.items.message.skip or rules.message.skip)
    return bool(rules.message.skip)


def _check_understood(rules: Message, field: FieldDescriptor, prefix: str = "") -> None:
    where = field.full_name
    if len(unknown_fields.UnknownFieldSet(rules)):
        raise RuleNotUnderstood(
            f"{where}: validate rule {prefix or 'rules'} has fields this checker's "
            "validate.proto does not know (a newer protoc-gen-validate?)"
        )
    for kind_field, kind_rules in rules.ListFields():
        kind = kind_field.name
        if kind not in _UNDERSTOOD:
            raise RuleNotUnderstood(f"{where}: validate rule kind {prefix}{kind} is not understood")
        if len(unknown_fields.UnknownFieldSet(kind_rules)):
            raise RuleNotUnderstood(
                f"{where}: validate rule {prefix}{kind} has fields this checker's "
                "validate.proto does not know (a newer protoc-gen-validate?)"
            )
        for rule_field, value in kind_rules.ListFields():
            rule = rule_field.name
            if rule not in _UNDERSTOOD[kind]:
                raise RuleNotUnderstood(f"{where}: validate rule {prefix}{kind}.{rule} is not understood")
            if (kind, rule) in _NESTED:
                _check_understood(value, field, f"{prefix}{kind}.{rule}.")


# -- code generation ------------------------------------------------------------------------------


_INLINE_DEPTH = 4
_INLINE_LINES = 80


class _Writer:
    """Writes the Python function that checks one message type.

    ``def _vN(m, p, out)``: ``m`` the message, ``p`` its path chain, ``out`` the list violations
    go to as ``(parent, segment, rule id, value)``. Constants (bounds, sets, patterns) live in the
    checker's namespace under generated names; only field names (checked to be identifiers) and
    numbers written by us appear in the source.
    """

    def __init__(
        self,
        checker: RuleChecker,
        desc: Descriptor,
        function: str,
        *,
        m: str = "m",
        p: str = "p",
        outer: _Writer | None = None,
    ) -> None:
        self.checker = checker
        self.desc = desc
        self.function = function
        self.lines: list[str] = []
        self.temp = 0
        self.m = m
        """The expression of the message being checked (``m``, or a variable when inlined)."""
        self.p = p
        """The expression of its path chain (built only on a violation when inlined)."""
        self.outer = outer
        self.ancestors: tuple[str, ...] = (desc.full_name, *(outer.ancestors if outer else ()))

    # helpers

    def fresh(self, stem: str) -> str:
        if self.outer is not None:
            return self.outer.fresh(stem)
        self.temp += 1
        return f"{stem}{self.temp}"

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    def fail(self, field: FieldDescriptor, what: str) -> RuleNotUnderstood:
        return RuleNotUnderstood(f"{self.desc.full_name}.{field.name}: {what}")

    def bad(
        self,
        indent: int,
        parent: str,
        segment: str,
        rule: str,
        text: str,
        show: Callable[[Any], str | None],
        value: str,
    ) -> None:
        rule_id = self.checker._rule_id(rule, text, show)
        self.emit(indent, f"out.append(({parent}, {segment}, {rule_id}, {value}))")

    def const(self, value: object) -> str:
        return self.checker._constant(value)

    @staticmethod
    def attribute(obj: str, name: str) -> str:
        if not _IDENTIFIER.fullmatch(name):
            raise RuleNotUnderstood(f"field name {name!r} is not an identifier")
        return f"getattr({obj}, {name!r})" if keyword.iskeyword(name) else f"{obj}.{name}"

    # the function

    def source(self) -> str:
        self.emit(0, f"def {self.function}(m, p, out):")
        body_start = len(self.lines)
        self.body(1)
        if len(self.lines) == body_start:
            self.emit(1, "pass")
        return "\n".join(self.lines) + "\n"

    def body(self, indent: int) -> None:
        """The checks of the message ``self.m``, at ``indent``."""
        in_oneof: set[str] = set()
        for oneof in self.desc.oneofs:
            members = list(oneof.fields)
            in_oneof.update(f.name for f in members)
            self.oneof(oneof, members, indent)
        for field in self.desc.fields:
            if field.name not in in_oneof:
                self.field(field, indent)

    def oneof(self, oneof: Any, members: list[FieldDescriptor], indent: int) -> None:
        required = RuleChecker._oneof_required(oneof)
        checks: list[tuple[FieldDescriptor, list[str]]] = []
        for field in members:
            saved, self.lines = self.lines, []
            self.present(field, indent + 1)
            if self.lines:
                checks.append((field, self.lines))
            self.lines = saved
        if not checks and not required:
            return
        which = self.fresh("w")
        self.emit(indent, f"{which} = {self.m}.WhichOneof({oneof.name!r})")
        keyword_ = "if"
        for field, lines in checks:
            self.emit(indent, f"{keyword_} {which} == {field.name!r}:")
            self.lines.extend(lines)
            keyword_ = "elif"
        if required:
            self.emit(indent, f"{keyword_} {which} is None:")
            names = ", ".join(f.name for f in members)
            self.bad(
                indent + 1,
                self.p,
                repr("." + oneof.name),
                "oneof.required",
                f"exactly one of {names} must be set",
                _absent,
                "None",
            )

    def field(self, field: FieldDescriptor, indent: int) -> None:
        """A field outside any oneof."""
        rules = _rules_of(field)
        if field.is_repeated:
            self.repeated(field, rules, indent)
            return
        if field.type not in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            if field.has_presence:  # proto2 optional: rules apply when set
                saved, self.lines = self.lines, []
                self.present(field, indent + 1)
                lines, self.lines = self.lines, saved
                if lines:
                    self.emit(indent, f"if {self.m}.HasField({field.name!r}):")
                    self.lines.extend(lines)
                return
            self.present(field, indent)
            return
        required = rules is not None and (
            rules.message.required or rules.duration.required or rules.timestamp.required or rules.any.required
        )
        saved, self.lines = self.lines, []
        self.present(field, indent + 1)
        lines, self.lines = self.lines, saved
        if not lines and not required:
            return
        self.emit(indent, f"if {self.m}.HasField({field.name!r}):")
        self.lines.extend(lines or ["    " * (indent + 1) + "pass"])
        if required:
            kind = _value_kind(field)
            rule = (
                f"{kind}.required"
                if kind in ("duration", "timestamp", "any") and getattr(rules, kind).required
                else "message.required"
            )
            self.emit(indent, "else:")
            self.bad(indent + 1, self.p, repr("." + field.name), rule, "is required: set it", _absent, "None")

    def present(self, field: FieldDescriptor, indent: int) -> None:
        """Checks of a singular field's value, when it is set (or always, for proto3 scalars)."""
        rules = _rules_of(field)
        value = self.fresh("v")
        saved, self.lines = self.lines, []
        self.value(
            field,
            rules,
            value,
            self.p,
            repr("." + field.name),
            indent,
            field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None,
        )
        lines, self.lines = self.lines, saved
        if lines:
            self.emit(indent, f"{value} = {self.attribute(self.m, field.name)}")
            self.lines.extend(lines)

    def repeated(self, field: FieldDescriptor, rules: pgv.FieldRules | None, indent: int) -> None:
        is_map = _is_map(field)
        kind = "map" if is_map else "repeated"
        if rules is not None:
            for set_kind, _ in rules.ListFields():
                if set_kind.name != kind and not (set_kind.name == "message" and not rules.message.required):
                    raise self.fail(field, f"validate rule {set_kind.name} on a {kind} field is not understood")
        own = getattr(rules, kind) if rules is not None else None
        items = self.fresh("r")
        seg = repr("." + field.name)
        body: list[str] = []
        saved, self.lines = self.lines, body
        inner = indent + (1 if own is not None and own.ignore_empty else 0)
        count = f"len({items})"
        if own is not None:
            low, high = ("min_pairs", "max_pairs") if is_map else ("min_items", "max_items")
            unit = "pair(s)" if is_map else "item(s)"
            if own.HasField(low) and getattr(own, low):
                self.emit(inner, f"if {count} < {getattr(own, low)}:")
                self.bad(
                    inner + 1,
                    self.p,
                    seg,
                    f"{kind}.{low}",
                    f"must have at least {getattr(own, low)} {unit}",
                    _counted(unit),
                    count,
                )
            if own.HasField(high):
                self.emit(inner, f"if {count} > {getattr(own, high)}:")
                self.bad(
                    inner + 1,
                    self.p,
                    seg,
                    f"{kind}.{high}",
                    f"must have at most {getattr(own, high)} {unit}",
                    _counted(unit),
                    count,
                )
            if not is_map and own.unique:
                self.unique(field, items, seg, inner)
        parent = self.fresh("q")
        loop: list[str] = []
        self.lines = loop
        target = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
        if is_map:
            key_field = _message_type(field).fields_by_name["key"]
            value_field = _message_type(field).fields_by_name["value"]
            key_rules = own.keys if own is not None and own.HasField("keys") else None
            value_rules = own.values if own is not None and own.HasField("values") else None
            key, item = self.fresh("k"), self.fresh("x")
            self.value(key_field, key_rules, key, parent, f"_Key({key})", inner + 1, None)
            self.value(
                value_field,
                value_rules,
                item,
                parent,
                f"_Key({key})",
                inner + 1,
                value_field.message_type if value_field.type == FieldDescriptor.TYPE_MESSAGE else None,
                opaque=f"{self.desc.full_name}.{field.name}" in _OPAQUE_ANY_FIELDS,
            )
            header = f"for {key}, {item} in {items}.items():"
        else:
            item_rules = own.items if own is not None and own.HasField("items") else None
            skip = rules is not None and rules.message.skip
            index, item = self.fresh("i"), self.fresh("x")
            self.value(field, item_rules, item, parent, index, inner + 1, None if skip else target)
            header = f"for {index}, {item} in enumerate({items}):"
        self.lines = body
        if loop:
            self.emit(inner, f"{parent} = ({self.p}, {seg})")
            self.emit(inner, header)
            self.lines.extend(loop)
        self.lines = saved
        if body:
            self.emit(indent, f"{items} = {self.attribute(self.m, field.name)}")
            if own is not None and own.ignore_empty:
                self.emit(indent, f"if {items}:")
            self.lines.extend(body)

    def unique(self, field: FieldDescriptor, items: str, seg: str, indent: int) -> None:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            keys = f"[e.SerializeToString(deterministic=True) for e in {items}]"
        else:
            keys = f"list({items})"
        seen = self.fresh("u")
        self.emit(indent, f"{seen} = {keys}")
        self.emit(indent, f"if len(set({seen})) != len({seen}):")
        first, index, item = self.fresh("s"), self.fresh("i"), self.fresh("y")
        self.emit(indent + 1, f"{first} = set()")
        self.emit(indent + 1, f"for {index}, {item} in enumerate({seen}):")
        self.emit(indent + 2, f"if {item} in {first}:")
        self.bad(
            indent + 3,
            f"({self.p}, {seg})",
            index,
            "repeated.unique",
            "must not repeat an earlier item",
            _text,
            f"{items}[{index}]" if field.type != FieldDescriptor.TYPE_MESSAGE else "None",
        )
        self.emit(indent + 2, f"{first}.add({item})")

    # one value

    def value(
        self,
        field: FieldDescriptor,
        rules: pgv.FieldRules | None,
        var: str,
        parent: str,
        seg: str,
        indent: int,
        target: Descriptor | None,
        *,
        opaque: bool = False,
    ) -> None:
        """Checks of one value ``var`` (a field's, an item's, a map key's or value's)."""
        kind = _value_kind(field)
        if rules is not None:
            self._check_rule_kinds(field, kind, rules)
        own = getattr(rules, kind) if rules is not None and kind != "message" and rules.HasField(kind) else None
        skip = rules is not None and rules.message.skip
        if kind == "any":
            if own is not None:
                self.any_(own, var, parent, seg, indent)
            if not skip:
                self.emit(indent, f"_any({var}, ({parent}, {seg}), out{', True' if opaque else ''})")
        elif kind == "message":
            if target is not None and not skip:
                self.message(field, target, var, f"({parent}, {seg})", indent)
        elif own is not None:
            self.scalar(field, kind, own, var, parent, seg, indent)

    def _check_rule_kinds(self, field: FieldDescriptor, kind: str, rules: pgv.FieldRules) -> None:
        """Every rule set on the field is one for its kind of value (or for any message)."""
        for set_kind, _ in rules.ListFields():
            name = set_kind.name
            if name == "message":
                if field.type != FieldDescriptor.TYPE_MESSAGE:
                    raise self.fail(field, "validate rule message on a scalar field is not understood")
            elif name != kind and not _only_required(rules, name, field):
                raise self.fail(field, f"validate rule {name} on a {kind} value is not understood")

    def scalar(self, field: FieldDescriptor, kind: str, own: Any, var: str, parent: str, seg: str, indent: int) -> None:
        """The rules ``own`` of a number, bool, string, bytes, enum, duration or timestamp value."""
        if kind in _NUMBER_KINDS:
            self.number(own, kind, self.unwrapped(field, var, indent), parent, seg, indent, _number_text, lambda x: x)
        elif kind == "bool":
            if own.HasField("const"):
                self.emit(indent, f"if {self.unwrapped(field, var, indent)} != {own.const!r}:")
                self.bad(
                    indent + 1,
                    parent,
                    seg,
                    "bool.const",
                    f"must be {str(own.const).lower()}",
                    lambda v: str(v).lower(),
                    self.unwrapped(field, var, indent),
                )
        elif kind == "string":
            self.string(own, self.unwrapped(field, var, indent), parent, seg, indent)
        elif kind == "bytes":
            self.bytes_(own, self.unwrapped(field, var, indent), parent, seg, indent)
        elif kind == "enum":
            enum = field.enum_type
            assert enum is not None
            self.enum(own, enum, var, parent, seg, indent)
        elif kind in ("duration", "timestamp") and any(f.name != "required" for f, _ in own.ListFields()):
            nanos = self.fresh("n")
            self.emit(indent, f"{nanos} = {var}.seconds * 1000000000 + {var}.nanos")
            show = _duration_text if kind == "duration" else _timestamp_text
            self.number(own, kind, nanos, parent, seg, indent, show, _nanos)
            if kind == "timestamp":
                self.timestamp_now(own, nanos, parent, seg, indent)

    def any_(self, own: pgv.AnyRules, var: str, parent: str, seg: str, indent: int) -> None:
        """An Any's ``in`` and ``not_in`` (the type URLs it may, or may not, hold)."""
        url = f"{var}.type_url"
        if getattr(own, "in"):
            allowed = self.const(frozenset(getattr(own, "in")))
            self.emit(indent, f"if {url} not in {allowed}:")
            self.bad(
                indent + 1, parent, seg, "any.in", f"must hold one of the types {list(getattr(own, 'in'))}", _text, url
            )
        if own.not_in:
            denied = self.const(frozenset(own.not_in))
            self.emit(indent, f"if {url} in {denied}:")
            self.bad(
                indent + 1, parent, seg, "any.not_in", f"must not hold any of the types {list(own.not_in)}", _text, url
            )

    def message(self, field: FieldDescriptor, target: Descriptor, var: str, path: str, indent: int) -> None:
        """A sub-message: its type's checks, in place or called."""
        try:
            function = self.checker._function_name(target.full_name)
        except KeyError:
            raise self.fail(field, f"no plan for {target.full_name} (checker bug)") from None
        if function is not None and not self.inline(target, var, path, indent):
            self.emit(indent, f"{function}({var}, {path}, out)")

    def inline(self, target: Descriptor, var: str, path: str, indent: int) -> bool:
        """Write a small sub-message's checks in place (no call, and its path is built only on a
        violation); False when it is too big, too deep or recursive (then it is called)."""
        if len(self.ancestors) > _INLINE_DEPTH or target.full_name in self.ancestors:
            return False
        inner = _Writer(self.checker, target, self.function, m=var, p=path, outer=self)
        inner.body(indent)
        if len(inner.lines) > _INLINE_LINES:
            return False
        self.lines.extend(inner.lines)
        return True

    def unwrapped(self, field: FieldDescriptor, var: str, indent: int) -> str:
        if field.type == FieldDescriptor.TYPE_MESSAGE:  # google.protobuf.*Value
            return f"{var}.value"
        return var

    def number(
        self,
        own: Any,
        kind: str,
        var: str,
        parent: str,
        seg: str,
        indent: int,
        show: Callable[[Any], str],
        convert: Callable[[Any], Any],
    ) -> None:
        def has(name: str) -> bool:
            return bool(own.HasField(name))

        def bound(name: str) -> Any:
            return convert(getattr(own, name))

        def shown(name: str) -> str:
            return show(bound(name))

        body: list[str] = []
        saved, self.lines = self.lines, body
        if has("const"):
            self.emit(indent, f"if {var} != {self.const(bound('const'))}:")
            self.bad(indent + 1, parent, seg, f"{kind}.const", f"must equal {shown('const')}", show, var)
        low = "gt" if has("gt") else "gte" if has("gte") else None
        high = "lt" if has("lt") else "lte" if has("lte") else None
        ops = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
        words = {
            "gt": "greater than",
            "gte": "greater than or equal to",
            "lt": "less than",
            "lte": "less than or equal to",
        }
        if low and high:
            lo, hi = self.const(bound(low)), self.const(bound(high))
            rule = f"{kind}.{low}+{high}"
            if bound(high) > bound(low):
                left, right = ("(" if low == "gt" else "["), (")" if high == "lt" else "]")
                self.emit(indent, f"if not ({var} {ops[low]} {lo} and {var} {ops[high]} {hi}):")
                self.bad(
                    indent + 1,
                    parent,
                    seg,
                    rule,
                    f"must be inside range {left}{shown(low)}, {shown(high)}{right}",
                    show,
                    var,
                )
            else:
                # lt <= gt: an exclusive range, the value must be outside [lt, gt] (ends per rule).
                left, right = ("[" if high == "lt" else "("), ("]" if low == "gt" else ")")
                inverse = {"lt": ">=", "lte": ">", "gt": "<=", "gte": "<"}
                self.emit(indent, f"if {var} {inverse[high]} {hi} and {var} {inverse[low]} {lo}:")
                self.bad(
                    indent + 1,
                    parent,
                    seg,
                    rule,
                    f"must be outside range {left}{shown(high)}, {shown(low)}{right}",
                    show,
                    var,
                )
        elif low or high:
            name = low or high
            assert name is not None
            self.emit(indent, f"if not ({var} {ops[name]} {self.const(bound(name))}):")
            self.bad(indent + 1, parent, seg, f"{kind}.{name}", f"must be {words[name]} {shown(name)}", show, var)
        members = getattr(own, "in", None) if kind != "timestamp" else None
        if members:
            values = [convert(v) for v in members]
            self.emit(indent, f"if {var} not in {self.const(frozenset(values))}:")
            self.bad(
                indent + 1, parent, seg, f"{kind}.in", f"must be one of {', '.join(show(v) for v in values)}", show, var
            )
        excluded = own.not_in if kind != "timestamp" else None
        if excluded:
            values = [convert(v) for v in excluded]
            self.emit(indent, f"if {var} in {self.const(frozenset(values))}:")
            self.bad(
                indent + 1,
                parent,
                seg,
                f"{kind}.not_in",
                f"must not be any of {', '.join(show(v) for v in values)}",
                show,
                var,
            )
        self.lines = saved
        if body:
            if kind in _NUMBER_KINDS and own.ignore_empty:
                self.emit(indent, f"if {var}:")
                self.lines.extend("    " + line for line in body)
            else:
                self.lines.extend(body)

    def timestamp_now(self, own: Any, nanos: str, parent: str, seg: str, indent: int) -> None:
        now = "_time.time_ns()"
        if own.lt_now:
            self.emit(indent, f"if not ({nanos} < {now}):")
            self.bad(indent + 1, parent, seg, "timestamp.lt_now", "must be in the past", _timestamp_text, nanos)
        if own.gt_now:
            self.emit(indent, f"if not ({nanos} > {now}):")
            self.bad(indent + 1, parent, seg, "timestamp.gt_now", "must be in the future", _timestamp_text, nanos)
        if own.HasField("within"):
            window = _nanos(own.within)
            self.emit(indent, f"if abs({nanos} - {now}) > {window}:")
            self.bad(
                indent + 1,
                parent,
                seg,
                "timestamp.within",
                f"must be within {_duration_text(window)} of now",
                _timestamp_text,
                nanos,
            )

    def string(self, own: pgv.StringRules, var: str, parent: str, seg: str, indent: int) -> None:
        def more(check: Callable[[str, str, str], None]) -> None:
            if own.HasField("len_bytes") or own.HasField("min_bytes") or own.HasField("max_bytes"):
                size = self.fresh("b")
                self.emit(indent, f"{size} = len({var}) if {var}.isascii() else len({var}.encode())")
                if own.HasField("len_bytes"):
                    check(f"{size} != {own.len_bytes}", "len_bytes", f"must be exactly {own.len_bytes} bytes long")
                if own.HasField("min_bytes") and own.min_bytes:
                    check(
                        f"{size} < {own.min_bytes}",
                        "min_bytes",
                        "must not be empty" if own.min_bytes == 1 else f"must be at least {own.min_bytes} bytes long",
                    )
                if own.HasField("max_bytes"):
                    check(f"{size} > {own.max_bytes}", "max_bytes", f"must be at most {own.max_bytes} bytes long")
            if own.HasField("not_contains"):
                check(
                    f"{self.const(own.not_contains)} in {var}", "not_contains", f"must not contain {own.not_contains!r}"
                )
            well_known = own.WhichOneof("well_known")
            if well_known == "well_known_regex":
                if own.well_known_regex == pgv.HTTP_HEADER_NAME:
                    pattern, text = (
                        (_HEADER_NAME, "must be a valid HTTP header name")
                        if own.strict
                        else (_HEADER_STRING, "must not contain NUL, CR or LF")
                    )
                elif own.well_known_regex == pgv.HTTP_HEADER_VALUE:
                    pattern, text = (
                        (_HEADER_VALUE, "must be a valid HTTP header value (no control characters)")
                        if own.strict
                        else (_HEADER_STRING, "must not contain NUL, CR or LF")
                    )
                else:
                    raise RuleNotUnderstood(f"well_known_regex {own.well_known_regex} is not understood")
                check(f"{self.const(pattern)}.fullmatch({var}) is None", "well_known_regex", text)
            elif well_known is not None and getattr(own, well_known):
                test, text = _WELL_KNOWN[well_known]
                check(f"not {self.const(test)}({var})", well_known, text)

        self._sized(own, str, var, parent, seg, indent, more)

    def bytes_(self, own: pgv.BytesRules, var: str, parent: str, seg: str, indent: int) -> None:
        def more(check: Callable[[str, str, str], None]) -> None:
            well_known = own.WhichOneof("well_known")
            if well_known is not None and getattr(own, well_known):
                sizes, text = {
                    "ip": ((4, 16), "must be an IP address (4 or 16 bytes)"),
                    "ipv4": ((4,), "must be an IPv4 address (4 bytes)"),
                    "ipv6": ((16,), "must be an IPv6 address (16 bytes)"),
                }[well_known]
                check(f"len({var}) not in {sizes!r}", well_known, text)

        self._sized(own, bytes, var, parent, seg, indent, more)

    def _sized(
        self,
        own: pgv.StringRules | pgv.BytesRules,
        kind: type[str] | type[bytes],
        var: str,
        parent: str,
        seg: str,
        indent: int,
        more: Callable[[Callable[[str, str, str], None]], None],
    ) -> None:
        """The rules strings and bytes share (const, in, lengths, affixes, pattern), then ``more``;
        all of them skipped for an empty value under ``ignore_empty``."""
        rule, unit = ("string.", "characters") if kind is str else ("bytes.", "bytes")
        body: list[str] = []
        saved, self.lines = self.lines, body

        def check(condition: str, name: str, text: str) -> None:
            self.emit(indent, f"if {condition}:")
            self.bad(indent + 1, parent, seg, rule + name, text, _text, var)

        if own.HasField("const"):
            check(f"{var} != {self.const(own.const)}", "const", f"must equal {own.const!r}")
        if getattr(own, "in"):
            members = list(getattr(own, "in"))
            check(f"{var} not in {self.const(frozenset(members))}", "in", f"must be one of {members}")
        if own.not_in:
            check(f"{var} in {self.const(frozenset(own.not_in))}", "not_in", f"must not be any of {list(own.not_in)}")
        if own.HasField("len"):
            check(f"len({var}) != {own.len}", "len", f"must be exactly {own.len} {unit} long")
        if own.HasField("min_len") and own.min_len:
            check(
                f"len({var}) < {own.min_len}",
                "min_len",
                "must not be empty" if own.min_len == 1 else f"must be at least {own.min_len} {unit} long",
            )
        if own.HasField("max_len"):
            check(f"len({var}) > {own.max_len}", "max_len", f"must be at most {own.max_len} {unit} long")
        if own.HasField("prefix"):
            check(f"not {var}.startswith({self.const(own.prefix)})", "prefix", f"must start with {own.prefix!r}")
        if own.HasField("suffix"):
            check(f"not {var}.endswith({self.const(own.suffix)})", "suffix", f"must end with {own.suffix!r}")
        if own.HasField("contains"):
            check(f"{self.const(own.contains)} not in {var}", "contains", f"must contain {own.contains!r}")
        if own.HasField("pattern"):
            source = _re2(own.pattern)
            try:
                compiled = re.compile(source if kind is str else source.encode())
            except re.error as exc:
                raise RuleNotUnderstood(f"pattern {own.pattern!r} cannot be checked: {exc}") from exc
            check(
                f"{self.const(compiled)}.fullmatch({var}) is None",
                "pattern",
                f"must match the regular expression {own.pattern!r}",
            )
        more(check)
        self.lines = saved
        if body:
            if own.ignore_empty:
                self.emit(indent, f"if {var}:")
                self.lines.extend("    " + line for line in body)
            else:
                self.lines.extend(body)

    def enum(self, own: pgv.EnumRules, enum: EnumDescriptor, var: str, parent: str, seg: str, indent: int) -> None:
        def show(value: Any) -> str:
            found = enum.values_by_number.get(value)
            return found.name if found is not None else str(value)

        def names(values: Iterable[int]) -> str:
            return ", ".join(show(v) for v in values)

        if own.HasField("const"):
            self.emit(indent, f"if {var} != {own.const}:")
            self.bad(indent + 1, parent, seg, "enum.const", f"must be {show(own.const)}", show, var)
        if own.defined_only:
            defined = sorted(enum.values_by_number)
            self.emit(indent, f"if {var} not in {self.const(frozenset(defined))}:")
            listed = names(defined) if len(defined) <= 12 else names(defined[:12]) + ", ..."
            self.bad(
                indent + 1,
                parent,
                seg,
                "enum.defined_only",
                f"must be a defined value of {enum.full_name} ({listed})",
                show,
                var,
            )
        if getattr(own, "in"):
            self.emit(indent, f"if {var} not in {self.const(frozenset(getattr(own, 'in')))}:")
            self.bad(indent + 1, parent, seg, "enum.in", f"must be one of {names(getattr(own, 'in'))}", show, var)
        if own.not_in:
            self.emit(indent, f"if {var} in {self.const(frozenset(own.not_in))}:")
            self.bad(indent + 1, parent, seg, "enum.not_in", f"must not be any of {names(own.not_in)}", show, var)


def _only_required(rules: pgv.FieldRules, kind: str, field: FieldDescriptor) -> bool:
    # Envoy writes ``(validate.rules).any = {required: true}`` on some fields that are not Any
    # (ExtensionConfigSource.config_source): PGV then checks presence only, as message.required.
    if field.type != FieldDescriptor.TYPE_MESSAGE or kind not in ("any", "duration", "timestamp"):
        return False
    return [f.name for f, _ in getattr(rules, kind).ListFields()] == ["required"]


def _counted(unit: str) -> Callable[[Any], str]:
    return lambda count: f"{count} {unit}"


def _descriptor(message: Message | type[Message]) -> Descriptor:
    desc: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's own Descriptor class
    return desc


def _nanos(duration: Any) -> int:
    return int(duration.seconds) * 1_000_000_000 + int(duration.nanos)


# -- checking a build -----------------------------------------------------------------------------

_default: RuleChecker | None = None


def default_checker() -> RuleChecker:
    """The process-wide checker: its plans and remembered results serve every build."""
    global _default
    if _default is None:
        _default = RuleChecker()
    return _default


def rule_problems(message: Message) -> list[tuple[str, str, bool]]:
    """Every ``validate.rules`` violation of one message, as :data:`pilotfish.resources.parse.RuleCheck`
    wants them: (path from the message, what is wrong, whether it is about an absent value). For
    the part of a resource that parses when the rest does not; a rule the checker cannot apply
    reports nothing here (the resource is refused for its other problems anyway)."""
    try:
        found = default_checker().check_message(message)
    except RuleNotUnderstood:
        return []
    return [(v.path, v.message(), v.value is None) for v in found]


def check_rules(
    raw: Mapping[ResourceType, Sequence[tuple[EncodedResource, Message]]],
    built: Mapping[ResourceType, Iterable[EncodedResource]] | None = None,
    *,
    checker: RuleChecker | None = None,
    positions: Mapping[ResourceType, Iterable[int]] | None = None,
) -> list[Problem]:
    """Every ``validate.rules`` violation in a build, as problems.

    ``raw``: the user's own resources with their messages, per type, in their order (named
    ``clusters[3] (name 'web')``); ``built``: resources built from services (named
    ``services.web (its cluster 'web')``). A rule the checker cannot apply is reported as an
    internal error naming it (the snapshot is refused rather than served unchecked).
    ``positions``: check only the raw resources at these places of their type's list (still
    named by their place), e.g. the ones an edit changed.
    """
    checker = checker or default_checker()
    problems: list[Problem] = []

    def report(where: str, outcome: tuple[Violation, ...] | RuleNotUnderstood) -> None:
        if isinstance(outcome, RuleNotUnderstood):
            problems.append(
                Problem(
                    where,
                    f"internal error: pilotfish cannot check the validate rules here "
                    f"({outcome}); please report it, or serve with validation off to let "
                    "it through",
                )
            )
        else:
            problems.extend(Problem(f"{where}{v.path}", v.message()) for v in outcome)

    for rtype, items in raw.items():
        check = checker.check_resource
        for index in positions.get(rtype, range(len(items))) if positions else range(len(items)):
            resource, message = items[index]
            outcome: tuple[Violation, ...] | RuleNotUnderstood
            try:
                outcome = check(rtype, resource, message)
            except RuleNotUnderstood as exc:
                outcome = exc
            if outcome:  # (named only when reported: most resources break no rule)
                report(f"{rtype.key}[{index}] (name {resource.name!r})", outcome)
    for rtype, resources in (built or {}).items():
        for resource, outcome in checker.check_resources(rtype, resources):
            report(f"services.{resource.name} (its {rtype.key[:-1]} {resource.name!r})", outcome)
    return problems


# -- cross references -----------------------------------------------------------------------------

# Network filters Envoy 1.40 treats as terminal (isTerminalFilterByProto), by typed_config type:
# the last filter of a chain must be one of them, and none of them may come before the last.
TERMINAL_NETWORK_FILTERS = frozenset(
    {
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "envoy.extensions.filters.network.direct_response.v3.Config",
        "envoy.extensions.filters.network.redis_proxy.v3.RedisProxy",
        "envoy.extensions.filters.network.thrift_proxy.v3.ThriftProxy",
        "envoy.extensions.filters.network.dubbo_proxy.v3.DubboProxy",
        "envoy.extensions.filters.network.echo.v3.Echo",
        "envoy.extensions.filters.network.generic_proxy.v3.GenericProxy",
        "envoy.extensions.filters.network.reverse_tunnel.v3.ReverseTunnel",
    }
)
# HTTP filters that end a connection manager's chain (checked with `envoy --mode validate`).
TERMINAL_HTTP_FILTERS = frozenset(
    {
        "envoy.extensions.filters.http.router.v3.Router",
        "envoy.extensions.filters.http.mcp_router.v3.McpRouter",
        "envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec",
    }
)
# Filters whose configuration says whether they are terminal: not judged here.
_EITHER = frozenset(
    {
        "envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
        "envoy.extensions.filters.network.dynamic_modules.v3.DynamicModuleNetworkFilter",
    }
)


def _served_by_xds(source: config_source_pb2.ConfigSource) -> bool:
    # Resources read from files on the proxy's disk are not ours to provide.
    return source.WhichOneof("config_source_specifier") not in ("path", "path_config_source")


def _route_clusters(config: route_pb2.RouteConfiguration) -> Iterator[tuple[str, str]]:
    """(where, cluster name) for every cluster a route configuration names statically."""
    for hi, host in enumerate(config.virtual_hosts):
        for ri, route in enumerate(host.routes):
            if not route.HasField("route"):
                continue
            action = route.route
            where = f"virtual_hosts[{hi}].routes[{ri}].route"
            specifier = action.WhichOneof("cluster_specifier")
            if specifier == "cluster":
                yield f"{where}.cluster", action.cluster
            elif specifier == "weighted_clusters":
                for ci, weighted in enumerate(action.weighted_clusters.clusters):
                    yield f"{where}.weighted_clusters.clusters[{ci}].name", weighted.name
            # cluster_header and cluster_specifier_plugin pick a cluster per request: not checked.
            for mi, mirror in enumerate(action.request_mirror_policies):
                if mirror.cluster:
                    yield f"{where}.request_mirror_policies[{mi}].cluster", mirror.cluster


def _chains(listener: listener_pb2.Listener) -> Iterator[tuple[str, listener_components_pb2.FilterChain]]:
    for index, chain in enumerate(listener.filter_chains):
        yield f"filter_chains[{index}]", chain
    if listener.HasField("default_filter_chain"):
        yield "default_filter_chain", listener.default_filter_chain


def _filter_type(network_filter: Any) -> str | None:
    if network_filter.HasField("typed_config"):
        name: str = network_filter.typed_config.TypeName()
        return None if name in _EITHER else name
    return None  # config_discovery (ECDS): the type arrives later; not ours to check here


_UNTYPED = (
    "has neither typed_config nor config_discovery: Envoy finds a filter by the @type of its "
    "typed_config (the name alone is not enough) and would reject the listener"
)


def _untyped(any_filter: Any) -> bool:
    return not any_filter.HasField("typed_config") and not any_filter.HasField("config_discovery")


def _check_chain(where: str, chain: listener_components_pb2.FilterChain) -> Iterator[Problem]:
    if not chain.filters:
        # Envoy accepts it, then closes every connection the chain matches.
        yield Problem(
            f"{where}.filters",
            "has no filters, so every connection it matches would be closed: end it "
            "with a terminal filter such as envoy.filters.network."
            "http_connection_manager or tcp_proxy",
        )
        return
    last = len(chain.filters) - 1
    for index, network_filter in enumerate(chain.filters):
        if _untyped(network_filter):
            yield Problem(f"{where}.filters[{index}] (name {network_filter.name!r})", _UNTYPED)
            continue
        kind = _filter_type(network_filter)
        if kind is None:
            continue
        terminal = kind in TERMINAL_NETWORK_FILTERS
        if index == last and not terminal:
            yield Problem(
                f"{where}.filters[{index}] (name {network_filter.name!r})",
                f"the last network filter must be a terminal filter (such as http_connection_manager "
                f"or tcp_proxy), got {kind}: Envoy would reject the listener",
            )
        elif index != last and terminal:
            yield Problem(
                f"{where}.filters[{index}] (name {network_filter.name!r})",
                f"terminal filter {kind} must be the last filter of its chain: Envoy would reject the listener",
            )


def _check_http_filters(where: str, hcm: hcm_pb2.HttpConnectionManager) -> Iterator[Problem]:
    filters = hcm.http_filters  # none at all is fine: Envoy then uses the router
    last = len(filters) - 1
    for index, http_filter in enumerate(filters):
        if _untyped(http_filter) and not http_filter.is_optional:
            yield Problem(f"{where}.http_filters[{index}] (name {http_filter.name!r})", _UNTYPED)
            continue
        kind = _filter_type(http_filter)
        if kind is None or http_filter.is_optional:
            continue
        terminal = kind in TERMINAL_HTTP_FILTERS
        if index == last and not terminal:
            yield Problem(
                f"{where}.http_filters[{index}] (name {http_filter.name!r})",
                f"the last HTTP filter must be the router (envoy.filters.http.router), got {kind}: "
                "Envoy would reject the listener",
            )
        elif index != last and terminal:
            yield Problem(
                f"{where}.http_filters[{index}] (name {http_filter.name!r})",
                f"terminal HTTP filter {kind} must be the last one: Envoy would reject the listener",
            )


def check_references(
    resources: Mapping[ResourceType, tuple[Message, ...]],
    *,
    more_endpoints: Iterable[str] = (),
    more_routes: Iterable[str] = (),
    more_clusters: Iterable[str] = (),
) -> list[Problem]:
    """Problems with references between resources, and with filter chains.

    Missing endpoints or route configs; routes (RDS or inline) and tcp_proxy filters naming a
    cluster that does not exist; filter chains that do not end in a terminal filter; connection
    managers whose HTTP filters do not end in the router. ``more_endpoints``, ``more_routes`` and
    ``more_clusters`` name resources that exist besides ``resources`` (built from services, whose
    own references are right by construction).
    """
    if not any(resources.values()):
        return []  # only the resources given refer to others (the more_* ones are right by construction)
    return references_problems(
        resources,
        reference_names(resources, more_endpoints=more_endpoints, more_routes=more_routes, more_clusters=more_clusters),
    )


ReferenceNames = tuple[frozenset[str], frozenset[str], frozenset[str], frozenset[tuple[str, str]]]
"""The names that exist to be referred to: endpoints (ClusterLoadAssignments), route
configurations, clusters, and extension configs (each with the type of its typed_config)."""


def reference_names(
    resources: Mapping[ResourceType, tuple[Message, ...]],
    *,
    more_endpoints: Iterable[str] = (),
    more_routes: Iterable[str] = (),
    more_clusters: Iterable[str] = (),
) -> ReferenceNames:
    """What :func:`check_references` checks references against (see it)."""
    endpoint_names = {m.cluster_name for m in resources.get(ENDPOINT, ())}  # type: ignore[attr-defined]
    endpoint_names.update(more_endpoints)
    route_names = {m.name for m in resources.get(ROUTE, ())}  # type: ignore[attr-defined]
    route_names.update(more_routes)
    cluster_names = {m.name for m in resources.get(CLUSTER, ())}  # type: ignore[attr-defined]
    cluster_names.update(more_clusters)
    extensions = extension_names(resources.get(EXTENSION_CONFIG, ()))
    return frozenset(endpoint_names), frozenset(route_names), frozenset(cluster_names), extensions


def extension_names(configs: Iterable[Message]) -> frozenset[tuple[str, str]]:
    """The extension configs that exist, each with the type of its typed_config."""
    return frozenset((m.name, m.typed_config.TypeName()) for m in configs)  # type: ignore[attr-defined]


def references_problems(resources: Mapping[ResourceType, tuple[Message, ...]], names: ReferenceNames) -> list[Problem]:
    """:func:`check_references` of ``resources`` against ``names``: a function of the clusters,
    listeners and route configurations given and of the names alone (an edit of an endpoint
    that renames nothing leaves it as it was)."""
    endpoint_names, route_names, cluster_names, extensions = names
    problems: list[Problem] = []
    for index, cluster in enumerate(resources.get(CLUSTER, ())):
        assert isinstance(cluster, cluster_pb2.Cluster)
        wanted = _eds_wanted(cluster)
        if wanted is not None and wanted not in endpoint_names:
            problems.append(
                Problem(
                    f"clusters[{index}] (name {cluster.name!r})",
                    f"EDS cluster needs endpoints: add an entry with cluster_name {wanted!r} under 'endpoints'",
                )
            )
    for index, listener in enumerate(resources.get(LISTENER, ())):
        assert isinstance(listener, listener_pb2.Listener)
        label = f"listeners[{index}] (name {listener.name!r})"
        problems.extend(_listener_problems(label, listener, cluster_names, route_names))
        problems.extend(_extension_problems(label, listener, extensions))
    for index, config in enumerate(resources.get(ROUTE, ())):
        assert isinstance(config, route_pb2.RouteConfiguration)
        for where, name in _route_clusters(config):
            if name not in cluster_names:
                problems.append(_missing_cluster(f"routes[{index}] (name {config.name!r}).{where}", name))
    return problems


def _missing_cluster(where: str, name: str) -> Problem:
    return Problem(
        where,
        f"cluster {name!r} does not exist: add it under 'clusters' (or define service "
        f"{name!r}); Envoy would answer 503",
    )


def _eds_wanted(cluster: cluster_pb2.Cluster) -> str | None:
    """The endpoints an EDS cluster served over xDS asks for (None: it asks for none)."""
    if cluster.type != cluster_pb2.Cluster.EDS or cluster.WhichOneof("cluster_discovery_type") != "type":
        return None
    eds = cluster.eds_cluster_config
    if eds.HasField("eds_config") and not _served_by_xds(eds.eds_config):
        return None
    wanted: str = eds.service_name or cluster.name
    return wanted


def _listener_problems(
    label: str, listener: listener_pb2.Listener, cluster_names: frozenset[str], route_names: frozenset[str]
) -> Iterator[Problem]:
    """A listener's filter chains, the clusters its tcp proxies and inline routes name, and the
    route configurations it asks RDS for."""
    for chain_where, chain in _chains(listener):
        yield from _check_chain(f"{label}.{chain_where}", chain)
        for fi, network_filter in enumerate(chain.filters):
            if _filter_type(network_filter) == tcp_proxy_pb2.TcpProxy.DESCRIPTOR.full_name:
                proxy = tcp_proxy_pb2.TcpProxy()
                network_filter.typed_config.Unpack(proxy)
                yield from _tcp_proxy_problems(
                    f"{label}.{chain_where}.filters[{fi}].typed_config", proxy, cluster_names
                )
    for where, hcm in connection_managers(listener):
        hcm_where = f"{label}.{where}.typed_config" if where != "api_listener" else f"{label}.api_listener"
        yield from _check_http_filters(hcm_where, hcm)
        specifier = hcm.WhichOneof("route_specifier")
        if specifier == "route_config":
            for cluster_where, name in _route_clusters(hcm.route_config):
                if name not in cluster_names:
                    yield _missing_cluster(f"{hcm_where}.route_config.{cluster_where}", name)
        if specifier != "rds" or not _served_by_xds(hcm.rds.config_source):
            continue
        wanted = hcm.rds.route_config_name
        if wanted not in route_names:
            yield Problem(
                f"{label}.{where}",
                f"RDS route_config_name {wanted!r} has no route configuration: add it under 'routes'",
            )


def _extension_problems(
    label: str, listener: listener_pb2.Listener, extensions: frozenset[tuple[str, str]]
) -> Iterator[Problem]:
    """Filters that take their config from ECDS (HTTP, network and listener filters with
    ``config_discovery`` over xDS): the extension config they name must exist (unless the filter
    has a default config: Envoy then uses it meanwhile) and be of a type the filter accepts
    (``type_urls``)."""
    types = dict(extensions)
    for at, name, discovery in _discovered_filters(label, listener):
        if not _served_by_xds(discovery.config_source):
            continue
        kind = types.get(name)
        if kind is None:
            if not discovery.HasField("default_config"):
                yield Problem(
                    at,
                    f"extension config {name!r} does not exist: add it under 'extension_configs' "
                    "(or give the filter a default_config); Envoy would hold the listener until it arrives",
                )
            continue
        accepted = {url.rpartition("/")[2] for url in discovery.type_urls}
        if accepted and kind not in accepted:
            yield Problem(
                at,
                f"extension config {name!r} is a {kind}, but the filter accepts only "
                f"{', '.join(sorted(accepted))} (config_discovery.type_urls): Envoy would reject it",
            )


def _discovered_filters(label: str, listener: listener_pb2.Listener) -> Iterator[tuple[str, str, Any]]:
    """(where, name, its ``config_discovery``) of each filter of ``listener`` that has one: its
    listener filters, the network filters of its filter chains, and the HTTP filters of its
    connection managers."""
    for index, listener_filter in enumerate(listener.listener_filters):
        if listener_filter.HasField("config_discovery"):
            at = f"{label}.listener_filters[{index}] (name {listener_filter.name!r})"
            yield at, listener_filter.name, listener_filter.config_discovery
    chains = [(f"filter_chains[{i}]", chain) for i, chain in enumerate(listener.filter_chains)]
    if listener.HasField("default_filter_chain"):
        chains.append(("default_filter_chain", listener.default_filter_chain))
    for chain_where, chain in chains:
        for index, network_filter in enumerate(chain.filters):
            if network_filter.HasField("config_discovery"):
                at = f"{label}.{chain_where}.filters[{index}] (name {network_filter.name!r})"
                yield at, network_filter.name, network_filter.config_discovery
    for where, hcm in connection_managers(listener):
        hcm_where = f"{label}.{where}.typed_config" if where != "api_listener" else f"{label}.api_listener"
        for index, http_filter in enumerate(hcm.http_filters):
            if http_filter.HasField("config_discovery"):
                at = f"{hcm_where}.http_filters[{index}] (name {http_filter.name!r})"
                yield at, http_filter.name, http_filter.config_discovery


def _tcp_proxy_problems(where: str, proxy: tcp_proxy_pb2.TcpProxy, cluster_names: frozenset[str]) -> Iterator[Problem]:
    if proxy.WhichOneof("cluster_specifier") == "cluster" and proxy.cluster not in cluster_names:
        yield _missing_cluster(f"{where}.cluster", proxy.cluster)
    for ci, weighted in enumerate(proxy.weighted_clusters.clusters):
        if weighted.name not in cluster_names:
            yield _missing_cluster(f"{where}.weighted_clusters.clusters[{ci}].name", weighted.name)
