"""A YAML snapshot document cut into its resources' texts, so that only changed ones are parsed.

A generated or hand-kept snapshot file writes each resource list in block style, one item per
``- `` line at the list's indentation::

    version: "7"
    clusters:
    - name: a        # one item's text: from its "- " line to the next one
      type: EDS
    - name: b
      ...

:func:`split_items` cuts such a document by its lines, without parsing it: each top-level key at
column 0 opens a section, and a section whose key stands alone on its line and whose first line
below it is a ``- `` item is cut into its items' texts; every other section (``version``,
``services``, a list written in flow style) is left whole, in :attr:`YamlItems.rest`. The caller
decodes each item's text (only the ones whose text it has not seen) and each other section on
its own.

The cut is conservative: anything it does not recognise (a directive or document marker, text
before the first key, a top-level line that is not a plain key, a key written twice, a tab in an
indentation, a character YAML refuses or a line break other than ``\n``, a line less indented
than the list's items inside a list) gives None, and the caller decodes the document whole. A cut in the
wrong place cannot go unnoticed: it leaves a quoted or flow value open (its text then fails to
parse) or changes how many items a text holds (which the caller checks); either way the caller
falls back to parsing the whole document, whose errors name the right lines. An alias (``*name``)
to an anchor in another item does not resolve in an item parsed alone: the caller parses a text
that holds a ``*`` on its own and falls back when it fails.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

__all__ = ["ItemSpans", "YamlItems", "cut_piece", "split_items"]

# Each pattern starts with a newline (a literal): the regular expression engine then skips to the
# next newline at the speed of a byte search. Written with ``^`` and MULTILINE instead, each
# scan of a 2.5 MB file took 15-20 ms, in one call that holds the GIL against the event loop.
_TOP = re.compile(r"\n(?=[^ \t#\r\n-])")
"""The end of the line before one that starts at column 0 with something other than a comment
or a sequence item."""
_KEY_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*):(?:[ \t]|$)", re.MULTILINE)
"""A top-level line that is a plain mapping key (``clusters:``, ``version: 7``)."""
_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*:[ \t]*(?:#.*)?$")
"""A key with nothing after it on its line (its value is the block below)."""
_TAB_INDENT = re.compile(r"\n[ ]*\t")
"""A tab in a line's indentation."""
_UNUSUAL = re.compile(r"[^\t\n\r\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""A character YAML refuses (a control character, even in a comment the cut leaves out), or a line
break other than ``\n`` and ``\r\n`` (``\x85``, ``\u2028``, ``\u2029``: YAML breaks lines there
too, and the cut would not)."""
_ASCII_USUAL = bytes([9, 10, 13, *range(0x20, 0x7F)])
"""The ASCII characters :data:`_UNUSUAL` lets through."""
_LONE_CR = re.compile(r"\r(?!\n)")
_WINDOW = 65536
"""Characters :data:`_UNUSUAL` looks at per call: a search over a whole 2.5 MB file took 13-36 ms
in one call, holding the GIL against the event loop."""


def _unusual(text: str) -> bool:
    """Whether ``text`` has a character the cut must not be trusted with (:data:`_UNUSUAL`, or a
    lone ``\r``)."""
    if "\r" in text and _LONE_CR.search(text):
        return True
    if text.isascii():
        return bool(text.encode("ascii").translate(None, _ASCII_USUAL))
    return any(_UNUSUAL.search(text, at, at + _WINDOW) for at in range(0, len(text), _WINDOW))


_COMMENTS = re.compile(r"(?:[ ]*(?:#[^\n]*)?\r?\n)*")
"""Blank and comment lines."""
_SIGNIFICANT = re.compile(r"^([ ]*)[^ #\r\n]", re.MULTILINE)
"""The first line below a key that is not blank or a comment, with its indentation."""


@dataclass(frozen=True, slots=True)
class YamlItems:
    """A YAML document cut by :func:`split_items`."""

    rest: list[str]
    """Each top-level section that was not cut (its key, and what follows it up to the next
    one): YAML of its own, each a mapping of that one key."""
    items: dict[str, list[str]]
    """Section key -> the text of each of its items, in order (each a one-item YAML sequence)."""
    spans: dict[str, ItemSpans]
    """Section key -> where its items are in the text."""


@dataclass(frozen=True, slots=True)
class ItemSpans:
    """Where a cut list's items are: item ``k`` is ``text[offsets[k]:offsets[k + 1]]`` (each item's
    text runs to the next one's, the last one's to the next top-level key)."""

    indent: int
    """The column of the items' ``-``."""
    offsets: list[int]
    """Each item's first character, then the end of the last one."""


def split_items(text: str, list_keys: Collection[str]) -> YamlItems | None:
    """Cut ``text``'s block-style lists under the top-level keys in ``list_keys`` into their
    items' texts; None when there are none, or the document is not in the plain shape this cuts
    safely."""
    if (
        text.startswith(("\ufeff", "%", "---", "...", "\t", " \t"))
        or "\n---" in text
        or "\n..." in text
        or ("\t" in text and _TAB_INDENT.search(text))
        or _unusual(text)
    ):
        return None
    lines = [0] if text[:1] not in ("", " ", "#", "\r", "\n", "-") else []
    lines.extend(found.end() for found in _TOP.finditer(text))
    starts: list[tuple[int, str]] = []  # (offset, key) of each top-level key, in order
    seen: set[str] = set()
    for offset in lines:
        key = _KEY_LINE.match(text, offset)
        if key is None or key.group(1) in seen:
            return None
        seen.add(key.group(1))
        starts.append((offset, key.group(1)))
    head = _COMMENTS.match(text)
    if not starts or head is None or head.end() < starts[0][0]:
        return None  # (something before the first key: decoded whole, where it is named)
    rest: list[str] = []
    items: dict[str, list[str]] = {}
    spans: dict[str, ItemSpans] = {}
    for at, (start, name) in enumerate(starts):
        end = starts[at + 1][0] if at + 1 < len(starts) else len(text)
        body = text.find("\n", start, end) + 1  # (0: the key is the last line)
        header_end = body - 2 if body >= 2 and text[body - 2] == "\r" else body - 1
        cut = None
        if name in list_keys and body and _BARE_KEY.match(text, start, header_end):
            cut = _cut_list(text, body, end)
        if cut is None:
            rest.append(text[start:end])
        elif cut is False:
            return None
        else:
            offsets = cut.offsets
            items[name] = [text[a:b] for a, b in pairwise(offsets)]
            spans[name] = cut
    return YamlItems(rest, items, spans) if items else None


def _cut_list(text: str, start: int, end: int) -> ItemSpans | Literal[False] | None:
    """Where the items of the block sequence in ``text[start:end]`` are (``start`` begins a
    line); None if it is not a block sequence (left whole), False if it is one this does not cut
    safely (parse it all)."""
    first = _SIGNIFICANT.search(text, start, end)
    if first is None:
        return None
    indent = len(first.group(1))
    newline = first.start() - 1  # (the items' patterns start at the newline before a line)
    if not _item(indent).match(text, newline, end):
        return None
    if _out_of_list(text, newline, end, indent):
        return False
    return ItemSpans(indent, [*_item_starts(text, newline, end, indent), end])


def _item(indent: int) -> re.Pattern[str]:
    """The newline before an item's ``-`` at column ``indent``."""
    return re.compile(rf"\n[ ]{{{indent}}}-(?=[ \r\n]|$)")


def _item_starts(text: str, start: int, end: int, indent: int) -> list[int]:
    """Where each item of a list at column ``indent`` in ``text[start:end]`` starts (``start``: a newline)."""
    return [found.start() + 1 for found in _item(indent).finditer(text, start, end)]


def _out_of_list(text: str, start: int, end: int, indent: int) -> bool:
    """Whether a line of ``text[start:end]`` (``start``: a newline) cannot be inside a block list
    at column ``indent``: a line less indented than the items, or one at the items' indentation
    that does not start an item."""
    if indent and re.compile(rf"\n[ ]{{0,{indent - 1}}}[^ #\r\n]").search(text, start, end):
        return True
    return re.compile(rf"\n[ ]{{{indent}}}(?:[^ #\r\n-]|-[^ \r\n])").search(text, start, end) is not None


def cut_piece(text: str, start: int, end: int, indent: int) -> list[int] | None:
    """Where the items of ``text[start:end]`` start, a run of whole items of a block list at column
    ``indent`` that an edit put in place of others in a document :func:`split_items` cut (the text
    around it is as it was); None if it is not one (empty, not starting with an item, not ending a
    line, or any line that could not be inside such a list or that this cut would not trust)."""
    piece = text[start:end]
    if (
        not _item(indent).match("\n" + piece[: indent + 2])
        or (end < len(text) and not piece.endswith("\n"))
        or "\n---" in piece
        or "\n..." in piece
        or ("\t" in piece and _TAB_INDENT.search(piece))
        or _unusual(piece)
        or _TOP.search(piece)
    ):
        return None
    if _out_of_list(text, start - 1, end, indent):
        return None
    return [start, *_item_starts(text, start, end, indent)]
