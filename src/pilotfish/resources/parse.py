"""Envoy JSON/YAML -> protobuf, strictly.

A snapshot document is a mapping with an optional ``version``, an optional ``services`` section
(see :mod:`pilotfish.resources.services`) and one list per resource type (``clusters``,
``endpoints``, ``listeners``, ``routes``, ``secrets``), each resource written as Envoy's API docs
and ``config_dump`` write it. Unknown fields, unknown ``@type`` names, duplicate
names and wrong shapes are all reported together, each naming the resource and field at fault,
so one run of ``pilotfish validate`` shows everything to fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import re
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from pilotfish.errors import ConfigError, Problem
from pilotfish.resources.anytypes import ensure_types_in
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_seconds, parse_services
from pilotfish.resources.text_diff import changed_region
from pilotfish.resources.types import RUNTIME, TYPES, ResourceType, type_by_key
from pilotfish.resources.walk import MAX_PROBLEMS, json_problems, path_text, without
from pilotfish.resources.yaml_items import cut_piece, split_items

__all__ = [
    "ParseMemo",
    "ParsedDocument",
    "RuleCheck",
    "decode_document",
    "parse_document",
    "parse_resource",
    "read_document",
    "read_parsed",
    "without_collections",
]

_LIST_KEYS = frozenset(t.key for t in TYPES)
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML has it (about 10x faster than the pure-Python one, which
took 10 s for a file of 10,000 clusters and 10,000 endpoints); the same documents either way."""


@dataclass(frozen=True, slots=True)
class ParsedDocument:
    """The resources of one snapshot document, parsed into protobufs, in file order."""

    version: str | None
    resources: Mapping[ResourceType, tuple[Message, ...]]
    services: Mapping[str, ServiceSpec] = field(default_factory=dict)
    endpoints: Mapping[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    ttls: Mapping[ResourceType, Mapping[str, int]] = field(default_factory=dict)
    """The TTL in milliseconds of each resource that has one (a ``ttl`` beside its fields), by
    type and name; types without any are left out."""


MIN_TTL_MS = 1000
"""The shortest TTL a resource may have: heartbeats renew it a third of it before it runs out, and a shorter
one would leave no room for a busy server or network."""


MAX_FILE_BYTES = 256 * 1024 * 1024
"""A snapshot file larger than this is refused rather than read into memory."""


def read_document(path: Path, *, memo: ParseMemo | None = None) -> Any:
    """Read a JSON or YAML file into plain values; errors name the file and where in it.
    ``memo``: see :func:`decode_document`.

    Fails closed: a file that cannot be read or decoded (not UTF-8), is empty or holds only
    comments, or nests too deeply is a :class:`ConfigError`, never "nothing to serve". A file that
    means to serve nothing writes the empty lists explicitly (``clusters: []``).
    """
    source = str(path)
    return decode_document(_read_bytes(path, source), source, as_json=path.suffix == ".json", memo=memo)


def read_parsed(path: Path, *, rules: RuleCheck | None = None, memo: ParseMemo) -> ParsedDocument:
    """:func:`read_document` then :func:`parse_document`, the way a followed file is read: when the
    file differs from ``memo``'s last good document only inside one run of a resource list's
    items, only those items are decoded and parsed (:attr:`ParseMemo.edits` counts these), and
    the rest of the document is the last one's as it was; anything else is read whole."""
    source = str(path)
    as_json = path.suffix == ".json"
    text = _text(_read_bytes(path, source), source)
    edited = _parse_edit(text, as_json, memo, rules)
    if edited is not None:
        return edited
    return parse_document(_decode_text(text, source, as_json, memo), source, rules=rules, memo=memo)


def _read_bytes(path: Path, source: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                source,
                [
                    Problem(
                        "",
                        f"the file is {size} bytes; the most pilotfish reads is "
                        f"{MAX_FILE_BYTES} (split the configuration across sources)",
                    )
                ],
            )
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(source, [Problem("", f"cannot read: {exc.strerror or exc}")]) from exc


def decode_document(data: bytes, source: str, *, as_json: bool, memo: ParseMemo | None = None) -> Any:
    """A file's bytes (JSON with ``as_json``, else YAML) into plain values, as :func:`read_document`
    decodes them; errors name ``source`` and where in it.

    ``memo``: a resource whose text the memo knows from the last good document stands in the
    list as a :class:`Remembered` (which only :func:`parse_document` with the same memo takes),
    and the texts of the others are noted for it (:class:`ParseMemo`). YAML: such a resource is
    not decoded at all, and the others are decoded a few hundred at a time; a document that is
    not in the plain block shape :func:`~pilotfish.resources.yaml_items.split_items` cuts is
    decoded whole. JSON: each resource is decoded on its own (the decoder finds where its text
    ends), so no one call holds the GIL for the whole document."""
    return _decode_text(_text(data, source), source, as_json, memo)


def _text(data: bytes, source: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            source,
            [
                Problem(
                    f"byte {exc.start} (line {line})",
                    f"not UTF-8 (byte 0x{data[exc.start]:02x}): save the file as UTF-8",
                )
            ],
        ) from exc
    if not text.strip():
        raise ConfigError(source, [Problem("", _EMPTY.format(what="empty"))])
    return text


def _decode_text(text: str, source: str, as_json: bool, memo: ParseMemo | None) -> Any:
    try:
        document = None
        if memo is not None:
            spans: dict[str, _Spans] = {}
            document = _decode_json_by_items(text, memo, spans) if as_json else _decode_by_items(text, memo, spans)
            memo.reading(text, as_json, document, spans)
        if document is None:
            document = json.loads(text) if as_json else yaml.load(text, Loader=_YAML_LOADER)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ConfigError(source, [Problem(where, f"invalid JSON: {exc.msg}")]) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [Problem(where, f"invalid YAML: {reason}")]) from exc
    except RecursionError as exc:
        raise ConfigError(source, [Problem("", "nested too deeply to read")]) from exc
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # A value that decodes but cannot be built (YAML's `!!int 0x`, `2001-02-30`; a number of
        # more than 4,300 digits).
        raise ConfigError(source, [Problem("", f"invalid value: {_short(exc) or type(exc).__name__}")]) from exc
    if document is None:
        raise ConfigError(source, [Problem("", _EMPTY.format(what="only comments (or null)"))])
    return document


_EMPTY = (
    "the file is {what}: refusing to read that as 'remove everything'. To serve nothing, write "
    "the empty sections explicitly, e.g. 'clusters: []' and 'listeners: []'"
)


_GROUP = 256
"""Items whose texts are new are decoded this many to a call: one call per item costs ~120 us of
libyaml's set-up, one for thousands frees their whole node graph at its end in one C call that holds
the GIL against the event loop (~45 ms for 20,000 resources)."""


def _decode_by_items(text: str, memo: ParseMemo, spans: dict[str, _Spans]) -> Any:
    """The YAML document ``text``, its resource lists decoded per item (only the texts ``memo``
    does not know); None when it cannot be cut (:func:`split_items`) or its pieces do not decode
    as the whole would: the caller decodes it whole, and names any error there.

    An item that names an anchor (``*name``) of an item before it is decoded after that item's
    text, and known by both texts together: a change to the anchor is a change to the item."""
    cut = split_items(text, _LIST_KEYS)
    if cut is None:
        return None
    for key, cut_spans in cut.spans.items():
        offsets = cut_spans.offsets
        spans[key] = _Spans(array("q", offsets[:-1]), array("q", offsets[1:]), cut_spans.indent)
    try:
        document: dict[str, Any] = {}
        for section in cut.rest:  # (each alone: a value left open in one is an error, not the next's text)
            value = yaml.load(section, Loader=_YAML_LOADER)
            if not isinstance(value, dict) or len(value) != 1:
                return None
            document.update(value)
        # An anchor twice in a document is an error (named when it is decoded whole); those of
        # the sections decoded whole count too.
        found = [name for section in cut.rest if "&" in section for name in _ANCHOR.findall(section)]
        defined = set(found)
        if len(defined) < len(found):
            return None
        anchors: dict[str, str] = {}  # anchor -> the text of the last item that defines it
        for key, texts in cut.items.items():
            items: list[Any] = []
            new: list[_Pending] = []
            for index, item_text in enumerate(texts):
                context = _anchors_used(item_text, anchors)
                remembered = memo.remembered(key, _known(context, item_text))
                items.append(remembered)
                if remembered is None:
                    new.append(_Pending(index, item_text, context))
                for name in _ANCHOR.findall(item_text) if "&" in item_text else ():
                    if name in anchors or name in defined:
                        return None
                    anchors[name] = item_text
            if not _decode_pending(new, items, key, memo):
                return None
            document[key] = items
    except Exception:  # (a value libyaml cannot build, ...: decoded whole, where it is named)
        return None
    return document


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_JSON = json.JSONDecoder()


def _skip(text: str, at: int) -> int:
    """``at``, past any JSON whitespace there."""
    found = _JSON_SPACE.match(text, at)
    assert found is not None  # (the pattern matches the empty string)
    return found.end()


def _decode_pending(new: list[_Pending], items: list[Any], key: str, memo: ParseMemo) -> bool:
    """Decode the items of list ``key`` whose texts are new into their places in ``items``, a few
    hundred to a call; False if their texts do not decode as that many items."""
    for batch in _batches(new):
        context = batch[0].context
        values = yaml.load("".join((*context, *(p.text for p in batch))), Loader=_YAML_LOADER)
        if not isinstance(values, list) or len(values) != len(context) + len(batch):
            return False
        for pending, value in zip(batch, values[len(context) :], strict=True):
            items[pending.index] = value
            memo.note_text(key, pending.known, value)
    return True


def _decode_json_by_items(text: str, memo: ParseMemo, spans: dict[str, _Spans]) -> Any:
    """The JSON document ``text``, each resource of its lists decoded by a call of its own (and
    known by its text when ``memo`` knows it); None when it is not an object whose keys are
    each once, or does not decode: the caller decodes it whole, and names any error there."""
    try:
        at = _skip(text, 0)
        if text[at : at + 1] != "{":
            return None
        document: dict[str, Any] = {}
        at = _skip(text, at + 1)
        while text[at : at + 1] != "}":
            if document:
                if text[at : at + 1] != ",":
                    return None
                at = _skip(text, at + 1)
            key, at = _JSON.raw_decode(text, at)
            at = _skip(text, at)
            if not isinstance(key, str) or key in document or text[at : at + 1] != ":":
                return None
            at = _skip(text, at + 1)
            if key in _LIST_KEYS and text[at : at + 1] == "[":
                found = spans[key] = _Spans(array("q"), array("q"), -1)
                document[key], at = _json_items(text, _skip(text, at + 1), key, memo, found)
            else:
                document[key], at = _JSON.raw_decode(text, at)
            at = _skip(text, at)
        if _skip(text, at + 1) != len(text):
            return None
    except (ValueError, IndexError):  # (JSONDecodeError is a ValueError)
        return None
    return document


def _json_items(text: str, at: int, key: str, memo: ParseMemo, spans: _Spans) -> tuple[list[Any], int]:
    """The items of the JSON list whose first item starts at ``at``, and where the list ends;
    where each item is goes in ``spans``."""
    items: list[Any] = []
    while text[at : at + 1] != "]":
        if items:
            if text[at : at + 1] != ",":
                raise ValueError("expected ',' or ']'")
            at = _skip(text, at + 1)
        at = _json_item(text, at, key, memo, items, spans)
    return items, at + 1


def _json_item(text: str, at: int, key: str, memo: ParseMemo, items: list[Any], spans: _Spans) -> int:
    """Decode the item of list ``key`` at ``at`` (or know it by its text) into ``items``, note
    where it is in ``spans``; where the next item (or the list's end) may be."""
    value, end = _JSON.raw_decode(text, at)
    item_text = text[at:end]
    known = memo.remembered(key, item_text)
    if known is None:
        memo.note_text(key, item_text, value)
    items.append(value if known is None else known)
    spans.starts.append(at)
    spans.ends.append(end)
    return _skip(text, end)


def _json_piece(text: str, start: int, end: int, key: str, memo: ParseMemo) -> tuple[list[Any], _Spans] | None:
    """The items of list ``key`` in ``text[start:end]``, a run of whole items separated by commas,
    and where they are; None if it is not one."""
    items: list[Any] = []
    spans = _Spans(array("q"), array("q"), -1)
    try:
        at = start
        while True:
            at = _json_item(text, at, key, memo, items, spans)
            if spans.ends[-1] >= end:
                return (items, spans) if spans.ends[-1] == end else None
            if text[at : at + 1] != ",":
                return None
            at = _skip(text, at + 1)
    except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError; read whole, they are named there)
        return None


_ANCHOR = re.compile(r"(?<![0-9A-Za-z_-])&([0-9A-Za-z_-]+)")
"""An anchor's name (``&name`` at the start of a node; may also match inside a string, which
only costs a decode in context or of the whole)."""
_ALIAS = re.compile(r"(?<![0-9A-Za-z_-])\*([0-9A-Za-z_-]+)")
"""An alias's name (``*name``), likewise."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """An item whose text the memo does not know: decoded after ``context``, the texts of the
    items whose anchors it names."""

    index: int
    text: str
    context: tuple[str, ...]

    @property
    def known(self) -> str:
        return _known(self.context, self.text)


def _known(context: tuple[str, ...], text: str) -> str:
    """What the memo knows an item by: its text, after the texts it is decoded after."""
    return "".join((*context, text)) if context else text


def _anchors_used(text: str, anchors: Mapping[str, str]) -> tuple[str, ...]:
    """The texts of the items before that define the anchors ``text`` names (in their order)."""
    if "*" not in text:
        return ()
    return tuple({anchors[name]: None for name in _ALIAS.findall(text) if name in anchors})


def _batches(new: list[_Pending]) -> Iterator[list[_Pending]]:
    """``new`` in runs decoded by one call each: at most :data:`_GROUP` items in a row decoded
    after the same texts, none but the last defining an anchor (a later one would see it)."""
    batch: list[_Pending] = []
    for pending in new:
        if batch and (len(batch) >= _GROUP or pending.context != batch[0].context or "&" in batch[-1].text):
            yield batch
            batch = []
        batch.append(pending)
    if batch:
        yield batch


def _short(error: Exception) -> str:
    # protobuf appends a long list of the message's field names; keep the sentence that matters.
    text = str(error).split("\n", 1)[0].strip()
    return text.rstrip(".")


def _ttl_ms(value: Any, where: str, problems: list[Problem]) -> int | None:
    """A resource's ``ttl`` in milliseconds; None (and a problem) if it is not a duration of at
    least :data:`MIN_TTL_MS` and at most a day."""
    seconds = parse_seconds(value, where, problems)
    if seconds is None:
        return None
    if seconds * 1000 < MIN_TTL_MS:
        problems.append(
            Problem(
                where, f"must be at least {MIN_TTL_MS // 1000}s (heartbeats must have room to renew it), got {value!r}"
            )
        )
        return None
    return round(seconds * 1000)


def _parse_section(
    rtype: ResourceType,
    items: list[Any],
    rules: RuleCheck | None,
    memo: ParseMemo | None,
    problems: list[Problem],
    ttls: dict[str, int] | None = None,
) -> tuple[Message, ...]:
    """One section's resources, parsed (or found in ``memo``), in order; adds what is wrong to
    ``problems``. A resource's ``ttl`` (not a field of the resource: the xDS wrapper's) is taken
    off before it is parsed and put in ``ttls`` by name."""
    messages: list[Message] = []
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        decoded = item
        written_ttl = item.ttl if isinstance(item, Remembered) else _NO_TTL
        if isinstance(item, dict) and "ttl" in item:
            item = dict(item)
            written_ttl = item.pop("ttl")
        ttl = None if written_ttl is _NO_TTL else _ttl_ms(written_ttl, f"{rtype.key}[{index}].ttl", problems)
        message: Message | None = None
        if isinstance(item, Remembered):
            assert memo is not None  # (only a decode with the memo makes them)
            message = memo.get(item.key)
            assert message is not None  # (the memo keeps what it remembers until the document ends)
            memo.keep_text(rtype.key, item)
        else:
            key = memo.key(rtype, item) if memo is not None and isinstance(item, dict) else None
            message = None if key is None or memo is None else memo.get(key)
            if message is None:
                message, found = parse_resource(rtype, item, f"{rtype.key}[{index}]", rules=rules)
                problems.extend(found)
                if message is None:
                    continue
                if key is not None and memo is not None:
                    memo.put(key, message)
            if key is not None and memo is not None:
                memo.known_text(decoded, key, written_ttl)
        name = getattr(message, rtype.name_field)
        if name in first_index:
            problems.append(
                Problem(
                    f"{rtype.key}[{index}] ({rtype.name_field} {name!r})",
                    f"duplicate name: {rtype.key}[{first_index[name]}] has the same {rtype.name_field}",
                )
            )
            continue
        first_index[name] = index
        messages.append(message)
        if ttl is not None and ttls is not None:
            ttls[name] = ttl
    return tuple(messages)


_NO_TTL: Any = object()
"""A :class:`Remembered` resource written without a ``ttl``."""


@dataclass(frozen=True, slots=True)
class Remembered:
    """A resource whose text (YAML or JSON) is one the memo's last good document had, and so is
    its parse: :func:`decode_document` gives it in place of its value (YAML: without decoding it)."""

    text: str
    key: tuple[str, str]
    """Its :meth:`ParseMemo.key` (the memo holds its message under it)."""
    ttl: Any
    """Its ``ttl`` as written (:data:`_NO_TTL`: none)."""


@dataclass(slots=True)
class _Spans:
    """Where the items of one list are in a document's text: item ``k`` is ``text[starts[k]:ends[k]]``
    (arrays of machine integers: 8 bytes an offset, where a list of ints takes about 36)."""

    starts: array[int]
    ends: array[int]
    indent: int
    """YAML: the column of the items' ``-`` (JSON: -1)."""


@dataclass(slots=True)
class _Reading:
    """A document decoded with the memo, by items: what its last good record is made of once it
    parses whole."""

    text: str
    as_json: bool
    document: Any
    spans: dict[str, _Spans]


@dataclass(slots=True)
class _LastList:
    """One resource list of the last good document: where its items are, and what they are."""

    rtype: ResourceType
    spans: _Spans
    items: list[Remembered]
    """Each item's text and key, in order (one per resource: a good document has no other)."""
    names: set[str]


@dataclass(slots=True)
class _LastGood:
    """The last good document read by items: its text, what it parsed into, and where its
    resource lists' items are (an edit inside one of them is parsed alone, :func:`_parse_edit`)."""

    text: str
    as_json: bool
    parsed: ParsedDocument
    lists: dict[str, _LastList]
    anchors: bool
    """YAML: whether the text has an anchor (``&name``) that an alias could name."""


class ParseMemo:
    """The resources of the last good document, by content: a resource whose text did not change
    is not parsed again, and is the very message it was (so what is built from it downstream is
    reused by identity too).

    A resource's key is its JSON (compact, keys in the order written: an ``Any`` keeps that order
    in its bytes) with its type; only resources that parsed without a problem are kept. A
    document read with the memo is also known by its items' texts (:func:`decode_document`): a
    resource whose text is the same is not keyed again (nor, in YAML, decoded). Bounded: what
    the last document that parsed whole used (a document is at most :data:`MAX_FILE_BYTES`), plus
    at most :attr:`max_entries` new ones while the next is parsed. A document that fails keeps the
    last good one's entries. One document at a time: not for concurrent use.
    """

    def __init__(self, *, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._kept: dict[tuple[str, str], Message] = {}
        """The last good document's resources."""
        self._used: dict[tuple[str, str], Message] = {}
        """The resources of the document being parsed."""
        self._texts_kept: dict[str, dict[str, Remembered]] = {}
        """Section -> item text -> the resource, of the last good document's items (by section
        and not by pair: a pair per item would be a new container per item per document, which
        the garbage collector then walks)."""
        self._texts_used: dict[str, dict[str, Remembered]] = {}
        """The same, of the document being parsed."""
        self._texts_count = 0
        """Entries in :attr:`_texts_used`."""
        self._noted: dict[int, tuple[str, str, Any]] = {}
        """id of an item decoded from its text -> (section, text, the item), until it is parsed."""
        self.parsed = 0
        """Resources parsed (not found here), in all: the tests count them."""
        self.decoded = 0
        """Items not known by their text, in all (YAML: the ones decoded; JSON decodes every
        item, and keys and parses these)."""
        self.edits = 0
        """Documents read as an edit of the last good one (only the changed items decoded)."""
        self._reading: _Reading | None = None
        """The document being decoded, by items."""
        self._last: _LastGood | None = None

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def texts(self) -> int:
        """Item texts known from the last good document."""
        return sum(len(texts) for texts in self._texts_kept.values())

    def reading(self, text: str, as_json: bool, document: Any, spans: dict[str, _Spans]) -> None:
        """``text`` was decoded by items into ``document`` (None: it could not be)."""
        self._reading = None if document is None else _Reading(text, as_json, document, spans)

    def begin(self, document: Any = None) -> None:
        """``document`` is parsed next (None: the items of an edit)."""
        self._used = {}
        self._texts_used = {}
        self._texts_count = 0
        if self._reading is not None and self._reading.document is not document:
            self._reading = None

    def end(self, *, good: bool, parsed: ParsedDocument | None = None) -> None:
        """The document parsed whole (``good``, into ``parsed``): its resources are the ones kept
        from now on, and an edit of it can be parsed alone."""
        if good:
            self._kept = self._used
            self._texts_kept = self._texts_used
            self._last = None if parsed is None else self._last_good(parsed)
        self._clear()

    def _clear(self) -> None:
        self._used = {}
        self._texts_used = {}
        self._texts_count = 0
        self._noted = {}
        self._reading = None

    def _last_good(self, parsed: ParsedDocument) -> _LastGood | None:
        """The record of a document that parsed whole, if it was decoded by items and each of its
        cut lists' items is remembered (none is past :attr:`max_entries`)."""
        reading = self._reading
        if reading is None:
            return None
        lists: dict[str, _LastList] = {}
        for key, spans in reading.spans.items():
            rtype = type_by_key(key)
            if rtype is None or rtype is RUNTIME:
                continue
            messages = parsed.resources.get(rtype, ())
            items = self._items_used(key)
            if not (len(spans.starts) == len(items) == len(messages)):
                return None  # (more items than the memo keeps)
            lists[key] = _LastList(rtype, spans, items, {getattr(m, rtype.name_field) for m in messages})
        return _LastGood(reading.text, reading.as_json, parsed, lists, not reading.as_json and "&" in reading.text)

    def _items_used(self, section: str) -> list[Remembered]:
        """The items of ``section`` in the document being parsed, in order (its texts are kept in
        the order the items came; a good document has no text twice)."""
        return list(self._texts_used.get(section, {}).values())

    def commit_edit(self, key: str, removed: list[Remembered]) -> list[Remembered]:
        """An edit of the last good document replaced ``removed`` in list ``key`` with the items
        just parsed: forget the removed ones, keep the new ones; the new items, in order."""
        texts = self._texts_kept.setdefault(key, {})
        for item in removed:
            self._kept.pop(item.key, None)
            texts.pop(item.text, None)
        self._kept.update(self._used)
        for section, used in self._texts_used.items():
            self._texts_kept.setdefault(section, {}).update(used)
        added = self._items_used(key)
        self._clear()
        self.edits += 1
        return added

    @staticmethod
    def key(rtype: ResourceType, value: Any) -> tuple[str, str] | None:
        """``value``'s key (None: it has no JSON form, e.g. a YAML date, or a mapping key that is
        not a string, which JSON would write as one (YAML's ``1:`` and ``"1":`` must not meet):
        not memoized)."""
        try:
            if _non_string_key(value):
                return None
            return rtype.key, json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return None

    def get(self, key: tuple[str, str]) -> Message | None:
        message = self._used.get(key)
        if message is None:
            message = self._kept.get(key)
            if message is not None:
                self._used[key] = message
        return message

    def put(self, key: tuple[str, str], message: Message) -> None:
        self.parsed += 1
        if len(self._used) < self.max_entries:
            self._used[key] = message

    def remembered(self, section: str, text: str) -> Remembered | None:
        """The resource of the last good document whose item in ``section`` had this text."""
        found = self._texts_kept.get(section, {}).get(text)
        return found if found is not None and found.key in self._kept else None

    def note_text(self, section: str, text: str, item: Any) -> None:
        """``item`` was decoded from ``text``: once it is parsed, that text is known."""
        self.decoded += 1
        if isinstance(item, dict) and len(self._noted) < self.max_entries:
            self._noted[id(item)] = (section, text, item)

    def known_text(self, item: Any, key: tuple[str, str], ttl: Any) -> None:
        """``item`` (decoded, with ``ttl`` as written taken off) parsed under ``key``: remember its text."""
        noted = self._noted.pop(id(item), None)
        if noted is not None and noted[2] is item:
            self.keep_text(noted[0], Remembered(noted[1], key, ttl))

    def keep_text(self, section: str, remembered: Remembered) -> None:
        """A remembered item is in the document being parsed: keep knowing its text."""
        if self._texts_count < self.max_entries:
            texts = self._texts_used.get(section)
            if texts is None:
                texts = self._texts_used[section] = {}
            texts[remembered.text] = remembered
            self._texts_count += 1


_SELF_REFERENCE = "nested too deeply, or refers to itself (a YAML alias inside its own anchor)"

_MAX_WALK = 1_000_000
"""Containers :func:`_non_string_key` looks at before it gives up (a value that contains itself,
a YAML alias inside its own anchor, would have it walk forever)."""


def _non_string_key(value: Any) -> bool:
    """Whether a mapping anywhere in ``value`` has a key that is not a string (or it is too large
    to tell: then it is not memoized either)."""
    pending = [value]
    walked = 0
    while pending:
        found = pending.pop()
        walked += 1
        if walked > _MAX_WALK:
            return True
        if isinstance(found, dict):
            for key, inner in found.items():
                if not isinstance(key, str):
                    return True
                if isinstance(inner, dict | list | tuple):
                    pending.append(inner)
        elif isinstance(found, list | tuple):  # (YAML's !!omap and !!pairs are lists of pairs)
            pending.extend(inner for inner in found if isinstance(inner, dict | list | tuple))
    return False


RuleCheck = Callable[[Message], Iterable[tuple[str, str, bool]]]
"""Envoy's proto rules (``validate.rules``) applied to a message: (path from the message, such as
``.connect_timeout``, what is wrong, whether it is about an absent value) per rule broken. Given
by the layer that has the checker (:func:`pilotfish.build.validate.rule_problems`)."""


def _walked(rtype: ResourceType, value: dict[str, Any], label: str, rules: RuleCheck | None) -> list[Problem]:
    """Every problem :func:`~pilotfish.resources.walk.json_problems` finds, at ``label`` and its
    path; with ``rules``, also the rules broken by what is left once those parts are dropped (a
    port of 99999 is a rule's, not the parser's: it would otherwise wait for the next round)."""
    try:
        found = json_problems(rtype.message, value)
    except RecursionError:
        return []
    problems = [Problem(f"{label}.{path_text(path)}" if path else label, what) for path, what in found]
    if not problems or rules is None or len(found) > MAX_PROBLEMS:
        return problems
    message = rtype.message()
    try:
        rest = without(value, (path for path, _ in found))
        if rest is None:
            return problems
        json_format.ParseDict(rest, message)
    except (json_format.ParseError, TypeError, ValueError, RecursionError):
        return problems  # what is left does not parse either: the walk's problems are what we know
    dropped = ["." + path_text(path) for path, _ in found]
    for path, what, absent in rules(message):
        # Not what the walk reported already: a rule on a part it dropped, or on a missing value
        # (a required field or oneof) that is missing because a part below it was dropped.
        if any(_within(path, part) or (absent and _within(part, path)) for part in dropped):
            continue
        problems.append(Problem(f"{label}{path}", what))
    return problems


def _within(path: str, outer: str) -> bool:
    """Whether rule path ``path`` is ``outer`` or inside it (``.a.b[0]`` is inside ``.a``)."""
    return path == outer or path.startswith((outer + ".", outer + "[")) or not outer


def parse_resource(
    rtype: ResourceType, value: Any, where: str, *, rules: RuleCheck | None = None
) -> tuple[Message | None, list[Problem]]:
    """Parse one resource; return it (or None) and the problems found. ``rules``: applied to
    what parses of a resource that does not (see :func:`_walked`); the rules of a resource that
    parses are checked with the whole snapshot's."""
    if not isinstance(value, dict):
        kind = rtype.message.DESCRIPTOR.name
        return None, [Problem(where, f"expected a mapping (an Envoy {kind}), got {type(value).__name__}")]
    name = value.get(rtype.name_field)
    label = f"{where} ({rtype.name_field} {name!r})" if isinstance(name, str) else where
    try:
        unknown = ensure_types_in(value)
    except RecursionError:
        return None, [Problem(label, _SELF_REFERENCE)]
    if unknown:
        walked = _walked(rtype, value, label, rules)
        return None, walked or [
            Problem(label, f"unknown @type {t!r}: no such message in the Envoy API (check spelling and v3 package)")
            for t in unknown
        ]
    message = rtype.message()
    try:
        json_format.ParseDict(value, message)
    except (json_format.ParseError, TypeError, ValueError, KeyError, AttributeError, OverflowError, SystemError) as exc:
        # ParseDict stops at the first problem: walk the resource for every one (only now, so a
        # valid file costs nothing more); protobuf's own message when the walk finds none.
        return None, _walked(rtype, value, label, rules) or [Problem(label, _short(exc))]
    except RecursionError:
        return None, [Problem(label, "nested too deeply")]
    if not getattr(message, rtype.name_field):
        return None, [Problem(label, f"{rtype.name_field} is required and must not be empty")]
    return message, []


_gc_lock = threading.Lock()
_gc_holds = 0
_gc_restore = False


@contextlib.contextmanager
def without_collections() -> Iterator[None]:
    """No automatic garbage collection while a document is decoded and parsed (from any thread:
    the collector is enabled again, if it was, once the last one is done).

    A document of 10,000 resources decodes into some 300,000 containers, alive until it is
    parsed: enough to make the collector walk every object of the process (a full collection),
    several times, for 100-450 ms each, holding the GIL against the event loop that serves the
    proxies. Those containers are freed by reference counting once the document is dropped, so
    nothing is owed to the collector afterwards; cycles made meanwhile elsewhere wait for the
    next collection.
    """
    global _gc_holds, _gc_restore
    with _gc_lock:
        if _gc_holds == 0:
            _gc_restore = gc.isenabled()
            gc.disable()
        _gc_holds += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holds -= 1
            if _gc_holds == 0 and _gc_restore:
                gc.enable()


def parse_document(
    document: Any, source: str, *, rules: RuleCheck | None = None, memo: ParseMemo | None = None
) -> ParsedDocument:
    """Parse a whole snapshot document; raise :class:`ConfigError` listing every problem.
    ``rules``: see :func:`parse_resource`. ``memo``: the resources of the last good document
    (see :class:`ParseMemo`), updated by this one."""
    if memo is None:
        return _parse_document(document, source, rules, None)
    memo.begin(document)
    parsed = None
    try:
        parsed = _parse_document(document, source, rules, memo)
        return parsed
    finally:
        memo.end(good=parsed is not None, parsed=parsed)


def _parse_edit(text: str, as_json: bool, memo: ParseMemo, rules: RuleCheck | None) -> ParsedDocument | None:
    """``text`` parsed as an edit of the memo's last good document: when all that differs lies
    within the items of one resource list, only the items there now are decoded and parsed, and
    the others are the last document's. None when it is not such an edit, or those items do not
    decode and parse without a problem (a name the list has elsewhere counts): the caller then
    reads the document whole, and names any problem there."""
    last = memo._last
    if last is None or last.as_json != as_json:
        return None
    if text == last.text:
        return last.parsed
    start, old_end, new_end = changed_region(last.text, text)
    before = [
        (lst.spans.starts[0], key)
        for key, lst in last.lists.items()
        if lst.spans.starts and lst.spans.starts[0] <= start
    ]
    if not before:
        return None
    key = max(before)[1]
    found = last.lists[key]
    spans = found.spans
    if old_end > spans.ends[-1]:
        return None
    first = bisect_left(spans.ends, start)
    final = bisect_right(spans.starts, old_end) - 1
    if first > final or spans.starts[first] > start or spans.ends[final] < old_end:
        return None  # (between two JSON items: a comma or spaces changed)
    shift = new_end - old_end
    low, high = spans.starts[first], spans.ends[final] + shift
    if low == high:
        return None
    removed = found.items[first : final + 1]
    if last.anchors and any("&" in item.text for item in removed):
        return None  # (an item after it may name its anchor)
    piece = _edited_items(text, low, high, key, spans.indent, memo, last.anchors)
    if piece is None:
        return None
    items, new_spans = piece
    rtype = found.rtype
    problems: list[Problem] = []
    ttls: dict[str, int] = {}
    memo.begin()
    try:
        messages = _parse_section(rtype, items, rules, memo, problems, ttls)
    except Exception:
        memo.end(good=False)
        raise
    old = last.parsed.resources[rtype]
    removed_names = {getattr(m, rtype.name_field) for m in old[first : final + 1]}
    names = [getattr(m, rtype.name_field) for m in messages]
    if (
        problems
        or len(messages) != len(items)
        or len(memo._texts_used.get(key, ())) != len(items)
        or any(name in found.names and name not in removed_names for name in names)
        or len(memo) - len(removed) + len(items) > memo.max_entries  # (read whole: the bound applies)
    ):
        memo.end(good=False)
        return None
    added = memo.commit_edit(key, removed)
    resources = dict(last.parsed.resources)
    resources[rtype] = old[:first] + messages + old[final + 1 :]
    all_ttls = dict(last.parsed.ttls)
    kept_ttls = {name: ms for name, ms in all_ttls.pop(rtype, {}).items() if name not in removed_names}
    kept_ttls.update(ttls)
    if kept_ttls:
        all_ttls[rtype] = kept_ttls
    for other in last.lists.values():
        if other is not found and other.spans.starts and other.spans.starts[0] > low:
            other.spans.starts = _shifted(other.spans.starts, shift)
            other.spans.ends = _shifted(other.spans.ends, shift)
    tail = final + 1
    spans.starts = spans.starts[:first] + new_spans.starts + _shifted(spans.starts[tail:], shift)
    spans.ends = spans.ends[:first] + new_spans.ends + _shifted(spans.ends[tail:], shift)
    found.items = found.items[:first] + added + found.items[tail:]
    found.names.difference_update(removed_names)
    found.names.update(names)
    last.text = text
    last.parsed = dataclasses.replace(last.parsed, resources=resources, ttls=all_ttls)
    return last.parsed


def _shifted(offsets: array[int], shift: int) -> array[int]:
    return array("q", [at + shift for at in offsets]) if shift else offsets


def _edited_items(
    text: str, low: int, high: int, key: str, indent: int, memo: ParseMemo, anchors: bool
) -> tuple[list[Any], _Spans] | None:
    """The items of list ``key`` that an edit put at ``text[low:high]`` (each known by its text
    where the memo knows it, else decoded), and where they are; None if they are not whole
    items of that list, or do not decode. YAML: nor if they define an anchor, or may name one
    (``anchors``: the rest of the document defines some)."""
    if indent < 0:
        return _json_piece(text, low, high, key, memo)
    starts = cut_piece(text, low, high, indent)
    if starts is None or "&" in text[low:high] or (anchors and "*" in text[low:high]):
        return None
    ends = [*starts[1:], high]
    items: list[Any] = []
    new: list[_Pending] = []
    for index, (start, end) in enumerate(zip(starts, ends, strict=True)):
        item_text = text[start:end]
        remembered = memo.remembered(key, item_text)
        items.append(remembered)
        if remembered is None:
            new.append(_Pending(index, item_text, ()))
    try:
        if not _decode_pending(new, items, key, memo):
            return None
    except Exception:  # (a value libyaml cannot build, ...: read whole, where it is named)
        return None
    return items, _Spans(array("q", starts), array("q", ends), indent)


def runtime_items(items: Any, problems: list[Problem]) -> Any:
    """The ``runtime`` section as Envoy's Runtime resources: written either as Envoy writes them
    (a list of ``{name, layer}``) or as a mapping of layer name to its keys and values. A value
    must be a string, number or boolean (or a mapping, whose keys Envoy joins with dots); a list
    or null is named in ``problems``, since Envoy would refuse the whole layer."""
    if isinstance(items, dict):
        items = [{"name": str(name), "layer": layer} for name, layer in items.items()]
        where = [f"runtime.{item['name']}" for item in items]
    elif isinstance(items, list):
        where = [f"runtime[{index}].layer" for index in range(len(items))]
    else:
        return items  # named by the caller
    for place, item in zip(where, items, strict=True):
        layer = item.get("layer") if isinstance(item, dict) else None
        if isinstance(layer, dict):  # (anything else is named when the resource is parsed)
            try:
                _runtime_values(layer, place, problems)
            except RecursionError:
                problems.append(Problem(place, _SELF_REFERENCE))
    return items


def _runtime_values(layer: Mapping[Any, Any], place: str, problems: list[Problem]) -> None:
    for key, value in layer.items():
        at = f"{place}.{key}"
        if isinstance(value, dict):
            _runtime_values(value, at, problems)
        elif value is None or isinstance(value, list):
            problems.append(
                Problem(
                    at, f"a runtime value is a string, number or boolean, not {'null' if value is None else 'a list'}"
                )
            )


def _parse_document(document: Any, source: str, rules: RuleCheck | None, memo: ParseMemo | None) -> ParsedDocument:
    problems: list[Problem] = []
    if not isinstance(document, dict):
        raise ConfigError(source, [Problem("", f"the top level must be a mapping, got {type(document).__name__}")])

    version: str | None = None
    raw_version = document.get("version")
    if raw_version is not None:
        if isinstance(raw_version, bool) or not isinstance(raw_version, str | int):
            problems.append(Problem("version", 'must be a string such as "7"'))
        else:
            version = str(raw_version)
            if not version:
                problems.append(Problem("version", "must not be empty (omit it to use content hashes)"))

    sections = ", ".join(t.key for t in TYPES)
    if not any(key == "services" or type_by_key(str(key)) is not None for key in document):
        problems.append(
            Problem(
                "",
                f"no section to serve: expected services or {sections} (to serve nothing, "
                "write the empty sections explicitly, e.g. 'clusters: []')",
            )
        )
    for key in document:
        if key not in ("version", "services") and type_by_key(str(key)) is None:
            problems.append(Problem(str(key), f"unknown section; expected version, services, {sections}"))
    services, endpoints, service_problems = parse_services(document.get("services"))
    problems.extend(service_problems)

    parsed: dict[ResourceType, tuple[Message, ...]] = {}
    ttls: dict[ResourceType, dict[str, int]] = {}
    for rtype in TYPES:
        items = document.get(rtype.key)
        if items is None:
            parsed[rtype] = ()
            continue
        if rtype is RUNTIME:
            items = runtime_items(items, problems)
        if not isinstance(items, list):
            problems.append(Problem(rtype.key, f"must be a list of resources, got {type(items).__name__}"))
            continue
        found: dict[str, int] = {}
        parsed[rtype] = _parse_section(rtype, items, rules, memo, problems, found)
        if found:
            ttls[rtype] = found

    if problems:
        raise ConfigError(source, problems)
    return ParsedDocument(version=version, resources=parsed, services=services, endpoints=endpoints, ttls=ttls)
