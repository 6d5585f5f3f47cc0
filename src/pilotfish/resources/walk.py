"""Every mistake in one raw resource, each with its path: a walk of its JSON against the message.

protobuf's ``json_format.ParseDict`` stops at the first problem, so a resource with three
mistakes would take three rounds of fix and retry. :func:`json_problems` walks the same plain
value against the message's descriptors and reports all it finds, each at its path
(``load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value``):
unknown fields (with the closest names), enum names that do not exist (with the close ones), values
of the wrong JSON type, integers out of their field's range, ``Any`` values naming no known
message, repeated fields and maps that are not lists and mappings, well-known types written
wrongly (a ``Duration`` is ``"5s"``, a wrapper is its bare value, a ``Struct`` a mapping), two
fields of one oneof.

It follows the proto3 JSON mapping as ``ParseDict`` implements it (fields by JSON or proto name,
``null`` for "not set", integers as numbers or strings, floats' ``"NaN"`` and ``"Infinity"``), and
it only reports: ParseDict stays the authority on what parses. It runs only when ParseDict has
failed (a valid file costs nothing more), and a walk that finds nothing leaves ParseDict's own
message to be shown. Bounded: at most :data:`MAX_PROBLEMS` per resource, and no deeper than
protobuf's own recursion limit.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from google.protobuf import descriptor_pool, duration_pb2, field_mask_pb2, timestamp_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

from pilotfish.errors import shorten
from pilotfish.resources.anytypes import ensure_type

__all__ = ["MAX_PROBLEMS", "JsonPath", "json_problems", "path_text", "without"]

JsonPath = tuple[str | int, ...]
"""Where in a JSON value: field names and map keys (str), list indices (int)."""

MAX_PROBLEMS = 50
"""Problems reported per resource; beyond, one line says how many more there were."""
_MAX_DEPTH = 100
"""Nesting of messages walked (protobuf's own parser refuses deeper)."""

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_MAX = 3.4028234663852886e38
_FLOAT_WORDS = frozenset({"NaN", "Infinity", "-Infinity"})
_WRAPPERS = {
    "google.protobuf.DoubleValue": FieldDescriptor.TYPE_DOUBLE,
    "google.protobuf.FloatValue": FieldDescriptor.TYPE_FLOAT,
    "google.protobuf.Int64Value": FieldDescriptor.TYPE_INT64,
    "google.protobuf.UInt64Value": FieldDescriptor.TYPE_UINT64,
    "google.protobuf.Int32Value": FieldDescriptor.TYPE_INT32,
    "google.protobuf.UInt32Value": FieldDescriptor.TYPE_UINT32,
    "google.protobuf.BoolValue": FieldDescriptor.TYPE_BOOL,
    "google.protobuf.StringValue": FieldDescriptor.TYPE_STRING,
    "google.protobuf.BytesValue": FieldDescriptor.TYPE_BYTES,
}
_FROM_STRING = {
    "google.protobuf.Duration": (duration_pb2.Duration, 'a string of seconds such as "5s" or "0.250s"'),
    "google.protobuf.Timestamp": (timestamp_pb2.Timestamp, 'an RFC 3339 time such as "2024-01-31T12:00:00Z"'),
    "google.protobuf.FieldMask": (field_mask_pb2.FieldMask, 'a string of field paths such as "a.b,c"'),
}
_ANY = "google.protobuf.Any"
_STRUCT, _VALUE, _LIST_VALUE = "google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"


def json_problems(message: type[Message], value: Any) -> list[tuple[JsonPath, str]]:
    """Every problem of ``value`` as the JSON of a ``message``: (where, what is wrong),
    where from the message's own fields (``()``: the value itself), in document order. Past
    :data:`MAX_PROBLEMS`, one last item at ``()`` says how many more there were."""
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's own Descriptor class
    problems: list[tuple[JsonPath, str]] = []
    extra = 0
    for found in _message(descriptor, value, (), 0):
        if len(problems) < MAX_PROBLEMS:
            problems.append(found)
        else:
            extra += 1
    if extra:
        problems.append(((), f"... and {extra} more problem(s) (the first {MAX_PROBLEMS} are shown)"))
    return problems


class _MapKey(str):
    """A map's key in a path (shown ``[key]``, not ``.key``)."""

    __slots__ = ()


def path_text(path: JsonPath) -> str:
    """``path`` as the document names it: ``endpoints[0].lb_endpoints[0].endpoint``, ``metadata['k']``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, _MapKey):
            out += f"[{str(part)!r}]"
        else:
            out += f".{part}" if out else part
    return out


def without(value: Any, paths: Iterable[JsonPath]) -> Any | None:
    """A copy of ``value`` without what is at each of ``paths`` (a field, a list item, a map
    entry): what is left of a resource once its wrong parts are dropped, for the rules to check
    the rest. None when a path is the value itself."""
    chosen = set(paths)
    if () in chosen:
        return None
    copy = _copy(value)
    # Deepest and last first, so that dropping a list item leaves the indices still to drop valid.
    for path in sorted(chosen, key=lambda p: [(isinstance(s, int), s) for s in p], reverse=True):
        parent = copy
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if isinstance(parent, list) and isinstance(last, int):
            del parent[last]
        elif isinstance(parent, dict):
            parent.pop(last, None)
    return copy


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def _kind(value: Any) -> str:
    """A JSON value's kind, as a user would call it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {_echo(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _echo(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


@functools.lru_cache(maxsize=4096)
def _suggest(word: str, choices: tuple[str, ...]) -> str:
    """ " (did you mean 'x'?)" naming the choices closest to ``word``, or "". Remembered: a file
    of 10,000 resources tends to repeat one mistake, and each comparison costs ~1 ms."""
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def _message(descriptor: Descriptor, value: Any, path: JsonPath, depth: int) -> Iterator[tuple[JsonPath, str]]:
    full_name = descriptor.full_name
    if depth > _MAX_DEPTH:
        yield path, f"nested more than {_MAX_DEPTH} messages deep"
        return
    if full_name in _WRAPPERS:
        yield from _scalar_of(_WRAPPERS[full_name], None, value, path, f"a {descriptor.name} is its bare value")
        return
    if full_name in _FROM_STRING:
        yield from _from_string(full_name, value, path)
        return
    if full_name == _STRUCT:
        if not isinstance(value, dict):
            yield path, f"expected a mapping (a google.protobuf.Struct), got {_kind(value)}"
        return
    if full_name == _LIST_VALUE:
        if not isinstance(value, list):
            yield path, f"expected a list (a google.protobuf.ListValue), got {_kind(value)}"
        return
    if full_name == _VALUE:
        return  # any JSON value
    if not isinstance(value, dict):
        yield path, f"expected a mapping ({full_name}), got {_kind(value)}"
        return
    if full_name == _ANY:
        yield from _any(value, path, depth)
        return
    yield from _fields(descriptor, value, path, depth, skip=())


def _from_string(full_name: str, value: Any, path: JsonPath) -> Iterator[tuple[JsonPath, str]]:
    make, shape = _FROM_STRING[full_name]
    if not isinstance(value, str):
        yield path, f"expected {shape}, got {_kind(value)}"
        return
    try:
        make().FromJsonString(value)
    except ValueError as exc:
        yield path, f"{_echo(value)} is not {shape} ({str(exc).rstrip('.')})"


def _any(value: dict[str, Any], path: JsonPath, depth: int) -> Iterator[tuple[JsonPath, str]]:
    type_url = value.get("@type")
    if not isinstance(type_url, str) or not type_url:
        yield path, "an Any needs '@type' naming its message (type.googleapis.com/PACKAGE.MESSAGE)"
        return
    full_name = type_url.rsplit("/", 1)[-1]
    if not ensure_type(type_url):
        yield (
            path,
            f"unknown @type {shorten(type_url)!r}: no such message in the Envoy API (check spelling and v3 package)",
        )
        return
    inner = descriptor_pool.Default().FindMessageTypeByName(full_name)
    if inner.full_name in (*_WRAPPERS, *_FROM_STRING, _STRUCT, _VALUE, _LIST_VALUE, _ANY):
        # A well-known type inside an Any is written as {"@type": ..., "value": ...}.
        yield from _message(inner, value.get("value"), (*path, "value"), depth + 1)
        return
    yield from _fields(inner, value, path, depth + 1, skip=("@type",))


def _fields(
    descriptor: Descriptor, value: dict[str, Any], path: JsonPath, depth: int, *, skip: tuple[str, ...]
) -> Iterator[tuple[JsonPath, str]]:
    by_json = {f.json_name: f for f in descriptor.fields}
    oneofs: dict[str, str] = {}
    for key, item in value.items():
        if key in skip:
            continue
        where = (*path, str(key))
        field = by_json.get(key) or descriptor.fields_by_name.get(key)
        if field is None:
            if isinstance(key, str) and key.startswith("[") and key.endswith("]"):
                continue  # an extension: protobuf's parser decides
            names = tuple(f.name for f in descriptor.fields)
            yield where, f"unknown field of {descriptor.full_name}{_suggest(str(key), names)}"
            continue
        if item is None:
            continue  # null: not set (a Value's null is walked as any JSON)
        oneof = field.containing_oneof
        if oneof is not None:
            if oneof.name in oneofs:
                yield where, f"{oneofs[oneof.name]!r} is set too; only one field of the oneof {oneof.name!r} may be"
                continue
            oneofs[oneof.name] = str(key)
        yield from _field(field, item, where, depth)


def _is_map(field: FieldDescriptor) -> bool:
    message = field.message_type
    return message is not None and message.GetOptions().map_entry


def _field(field: FieldDescriptor, value: Any, path: JsonPath, depth: int) -> Iterator[tuple[JsonPath, str]]:
    if _is_map(field):
        if not isinstance(value, dict):
            yield path, f"expected a mapping (a map of {field.name}), got {_kind(value)}"
            return
        entry = field.message_type
        assert entry is not None  # a map's entry is a message
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for key, item in value.items():
            where = (*path, _MapKey(key) if isinstance(key, str) else key)
            if key_field.type == FieldDescriptor.TYPE_BOOL:
                if key not in ("true", "false", True, False):
                    yield where, 'a map key of bool is "true" or "false"'
            elif key_field.type != FieldDescriptor.TYPE_STRING:
                yield from _scalar(key_field, key, where)
            if item is None:
                yield where, "null is not allowed as a map value"
                continue
            yield from _single(value_field, item, where, depth)
        return
    if field.is_repeated:
        if not isinstance(value, list | tuple):
            yield path, f"expected a list (repeated {field.name}), got {_kind(value)}"
            return
        for index, item in enumerate(value):
            where = (*path, index)
            if item is None and not (field.message_type is not None and field.message_type.full_name == _VALUE):
                yield where, "null is not allowed in a list"
                continue
            yield from _single(field, item, where, depth)
        return
    yield from _single(field, value, path, depth)


def _single(field: FieldDescriptor, value: Any, path: JsonPath, depth: int) -> Iterator[tuple[JsonPath, str]]:
    if field.message_type is not None:
        yield from _message(field.message_type, value, path, depth + 1)
    else:
        yield from _scalar(field, value, path)


def _scalar(field: FieldDescriptor, value: Any, path: JsonPath) -> Iterator[tuple[JsonPath, str]]:
    if field.enum_type is not None:
        yield from _enum(field.enum_type, value, path)
    else:
        yield from _scalar_of(field.type, field.name, value, path, "")


def _scalar_of(kind: int, name: str | None, value: Any, path: JsonPath, hint: str) -> Iterator[tuple[JsonPath, str]]:
    """Problems of ``value`` as a scalar of protobuf type ``kind``."""
    after = f" ({hint})" if hint else ""
    if kind in _INT_RANGES:
        number = _integer(value)
        if number is None:
            yield path, f"expected an integer, got {_kind(value)}{after}"
            return
        low, high = _INT_RANGES[kind]
        if not low <= number <= high:
            yield path, f"{number} is out of range: {name or 'the value'} must be from {low} to {high}"
    elif kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        yield from _float(kind, value, path, after)
    elif kind == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            yield path, f"expected true or false (unquoted), got {_kind(value)}{after}"
    elif kind == FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            yield path, f"expected a string, got {_kind(value)} (quote it){after}"
    elif kind == FieldDescriptor.TYPE_BYTES:
        if not isinstance(value, str):
            yield path, f"expected base64 text, got {_kind(value)}{after}"
            return
        encoded = value.encode("utf-8")
        try:
            base64.urlsafe_b64decode(encoded + b"=" * (4 - len(encoded) % 4))
        except (binascii.Error, ValueError):
            yield path, f"{_echo(value)} is not base64{after}"


def _integer(value: Any) -> int | None:
    """``value`` as protobuf's JSON parser reads an integer (a number, or a string of one), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and " " not in value:
        try:
            return int(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                return None
            return int(number) if number.is_integer() else None
    return None


def _float(kind: int, value: Any, path: JsonPath, after: str) -> Iterator[tuple[JsonPath, str]]:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        yield path, f"expected a number, got {_kind(value)}{after}"
        return
    if isinstance(value, str):
        if value in _FLOAT_WORDS:
            return
        try:
            number = float(value)
        except ValueError:
            yield path, f"expected a number, got {_kind(value)}{after}"
            return
    else:
        number = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        yield path, 'write NaN and infinities quoted: "NaN", "Infinity", "-Infinity"'
    elif kind == FieldDescriptor.TYPE_FLOAT and math.isfinite(number) and abs(number) > _FLOAT_MAX:
        yield path, f"{value} is out of range of a float"


def _enum(enum: EnumDescriptor, value: Any, path: JsonPath) -> Iterator[tuple[JsonPath, str]]:
    """As protobuf's parser reads an enum: a value's name, or anything ``int()`` takes (a number)."""
    if isinstance(value, str) and value in enum.values_by_name:
        return
    names = tuple(v.name for v in enum.values)
    try:
        number = int(value)
    except (TypeError, ValueError):
        if isinstance(value, str):
            close = _suggest(value, names)
            listed = close or (f" (one of {', '.join(names)})" if len(names) <= 12 else f" ({len(names)} names)")
            yield path, f"{_echo(value)} is not a value of {enum.full_name}{listed}"
        else:
            yield path, f"expected a name of {enum.full_name} such as {names[0]!r}, got {_kind(value)}"
        return
    if number not in enum.values_by_number and getattr(enum, "is_closed", False):
        yield path, f"{number} is not a number of {enum.full_name} (one of {', '.join(names)})"
