"""Which node ids a proxy may claim, given the identity its certificate proves (mTLS).

A node id is what a proxy says it is; the identity in its verified client certificate is what it
can prove. Without a binding between the two, any proxy holding a certificate from the CA could
claim another's node id and receive its configuration. A rule ``IDENTITY=NODE`` allows proxies
whose identity matches the pattern IDENTITY to claim node ids matching NODE. In both patterns
``*`` stands for any run of characters except ``/`` (so ``spiffe://mesh/ns/*/sa/edge`` names one
service account in any one namespace), and everything else stands for itself.

**Captures** bind the two patterns, so that one rule serves a fleet:
``spiffe://mesh/ns/{ns}/sa/{sa}={sa}`` lets ``.../sa/edge-a`` claim ``edge-a`` and nothing else.

- In IDENTITY, ``{name}`` matches a non-empty run of characters without ``/`` and remembers it
  (an empty one would prove nothing; SPIFFE path segments are never empty). A segment (the text
  between two ``/``) holds at most one capture and then no ``*``, with literal text before and
  after it if wanted (``{host}.mesh.example``): so what a capture took is never ambiguous, and
  matching stays a prefix and a suffix test per segment.
- In NODE, ``{name}`` stands for exactly what IDENTITY captured under that name (literally: a
  ``*`` in a certificate's name is not a wildcard), as often as wanted, beside ``*`` and text
  (``{ns}.{sa}-*``).
- A name is letters, digits and ``_``, not starting with a digit. A capture named twice in
  IDENTITY, one used in NODE that IDENTITY does not define, a second capture or a ``*`` in a
  segment that has one, and a brace that does not open or close a capture are errors at start,
  naming the rule and the capture (:func:`parse_rule`, :class:`NodeRule`). A capture IDENTITY
  defines and NODE does not use is allowed (``{ns}`` above): it matches as a non-empty ``*``.

Matching takes time linear in the lengths of the patterns and values, however many ``*`` and
captures there are (:func:`glob_match`): no regular expression, which would backtrack over a
node id, a value a peer chooses.

Once any rule is configured, a stream whose first request claims a node id that no rule allows
for its identity is refused: gRPC PERMISSION_DENIED and a ``node_refused`` event. A connection
without a verified certificate has the identity ``""``, which no rule matches (a pattern is never
empty), so rules need mTLS (``--client-ca``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["NodeAuthorizer", "NodeRule", "compile_pattern", "glob_match", "parse_rule"]

_MAX_SHOWN = 200
"""How much of a refused node id a message repeats (a peer chooses its length)."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"\{([^{}/]*)\}")


def compile_pattern(text: str) -> re.Pattern[str]:
    """A rule's pattern as a regular expression, to ``fullmatch``: ``*`` is any run of characters
    but ``/``, everything else stands for itself. The definition :func:`glob_match` is tested
    against; rules, grants and node groups match with :func:`glob_match`, which cannot backtrack."""
    return re.compile("[^/]*".join(re.escape(part) for part in text.split("*")))


def glob_match(pattern: str, value: str) -> bool:
    """Whether ``value`` matches ``pattern`` as :func:`compile_pattern`'s expression does, in time
    linear in their lengths (a few ``str.find`` per ``*``) however many ``*`` the pattern has: a
    regular expression with several ``*`` backtracks for a time that grows as a power of the
    length of a value that does not match, and values a peer chooses (node ids) can be long."""
    first = pattern.find("*")
    if first < 0:
        return pattern == value
    after = pattern.rfind("*") + 1  # the text before the first '*' and after the last is the value's own:
    if (
        first + len(pattern) - after > len(value)
        or not value.startswith(pattern[:first])
        or not value.endswith(pattern[after:])
    ):  # most values that do not match fail here, at once
        return False
    segments = pattern.split("/")  # '*' never crosses '/'
    if value.count("/") != len(segments) - 1:  # (before splitting a value of 100,000 '/')
        return False
    return all(_runs_match(s.split("*"), v) for s, v in zip(segments, value.split("/"), strict=True))


def _runs_match(runs: Sequence[str], value: str) -> bool:
    """Whether ``value`` is ``runs`` joined by runs of characters (the literal text between the
    ``*`` of one segment): leftmost first is right, as each ``*`` may take any run."""
    if len(runs) == 1:
        return runs[0] == value
    first, last = runs[0], runs[-1]
    if len(first) + len(last) > len(value) or not value.startswith(first) or not value.endswith(last):
        return False
    position, end = len(first), len(value) - len(last)
    for part in runs[1:-1]:
        found = value.find(part, position, end)
        if found < 0:
            return False
        position = found + len(part)
    return True


# -- rules with captures ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _CaptureSegment:
    """A segment of IDENTITY holding a capture: literal ``prefix``, the capture, literal ``suffix``."""

    prefix: str
    name: str
    suffix: str

    def take(self, value: str) -> str | None:
        """What the capture takes of ``value`` (None: ``value`` does not match, or leaves it empty)."""
        if (
            len(value) > len(self.prefix) + len(self.suffix)
            and value.startswith(self.prefix)
            and value.endswith(self.suffix)
        ):
            return value[len(self.prefix) : len(value) - len(self.suffix)]
        return None


_Piece = str | tuple[str]
"""Of a NODE segment: literal text, ``"*"`` as its own piece, or ``(name,)`` for a capture."""


def _split_braces(text: str, where: str) -> list[str | tuple[str]]:
    """``text`` (one segment) as literal runs, ``*`` and captures; ValueError naming ``where``."""
    pieces: list[str | tuple[str]] = []
    position = 0
    for match in _BRACED.finditer(text):
        pieces.extend(_literal_and_stars(text[position : match.start()], where))
        name = match[1]
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: {match[0]!r} is not a capture: a capture is {{name}}, the name letters, "
                "digits and '_', not starting with a digit"
            )
        pieces.append((name,))
        position = match.end()
    pieces.extend(_literal_and_stars(text[position:], where))
    return pieces


def _literal_and_stars(text: str, where: str) -> list[str]:
    if "{" in text or "}" in text:
        raise ValueError(
            f"{where}: a '{{' or '}}' that is not part of a capture {{name}} (braces are reserved for captures)"
        )
    pieces: list[str] = []
    for i, run in enumerate(text.split("*")):
        if i:
            pieces.append("*")
        if run:
            pieces.append(run)
    return pieces


@dataclass(frozen=True, slots=True)
class NodeRule:
    """Proxies whose certificate identity matches ``identity`` may claim node ids matching ``node``
    (with captures: see the module's docstring). ValueError on a malformed rule, naming it."""

    identity: str
    node: str

    _identity: tuple[str | _CaptureSegment, ...] = field(init=False, repr=False, compare=False)
    """IDENTITY by segment: a glob (``*`` and text) or a capture segment."""
    _node: tuple[tuple[_Piece, ...], ...] | None = field(init=False, repr=False, compare=False)
    """NODE by segment, as pieces; None when it uses no capture (then it is a plain glob)."""

    def __post_init__(self) -> None:
        rule = f"rule {self.identity + '=' + self.node!r}"
        segments: list[str | _CaptureSegment] = []
        defined: set[str] = set()
        for text in self.identity.split("/"):
            pieces = _split_braces(text, rule)
            captures = [p[0] for p in pieces if isinstance(p, tuple)]
            if not captures:
                segments.append(text)
                continue
            for name in captures:
                if name in defined:
                    raise ValueError(
                        f"{rule}: the capture {{{name}}} appears twice in IDENTITY; name each "
                        "capture once (the node id can use it as often as needed)"
                    )
                defined.add(name)
            if len(captures) > 1 or "*" in pieces:
                raise ValueError(
                    f"{rule}: {text!r} holds {'two captures' if len(captures) > 1 else 'a capture and *'}"
                    f"; a capture ({{{captures[0]}}}) must be the only capture and wildcard between "
                    "two '/' of IDENTITY, or what it takes would be ambiguous"
                )
            prefix, suffix = text.split("{" + captures[0] + "}")
            segments.append(_CaptureSegment(prefix, captures[0], suffix))
        node: list[tuple[_Piece, ...]] = []
        uses = False
        for text in self.node.split("/"):
            pieces = _split_braces(text, rule)
            for piece in pieces:
                if isinstance(piece, tuple):
                    uses = True
                    if piece[0] not in defined:
                        known = ", ".join(f"{{{n}}}" for n in sorted(defined)) or "none"
                        raise ValueError(
                            f"{rule}: the capture {{{piece[0]}}} in NODE is not defined in IDENTITY "
                            f"(it captures: {known}); capture it there (e.g. "
                            f"spiffe://mesh/ns/*/sa/{{{piece[0]}}}) or take it out of NODE"
                        )
            node.append(tuple(pieces))
        object.__setattr__(self, "_identity", tuple(segments))
        object.__setattr__(self, "_node", tuple(node) if uses else None)

    def captures(self, identity: str) -> Mapping[str, str] | None:
        """What IDENTITY captures of ``identity`` (empty without captures); None: no match."""
        if identity.count("/") != len(self._identity) - 1:
            return None
        taken: dict[str, str] = {}
        for segment, value in zip(self._identity, identity.split("/"), strict=True):
            if isinstance(segment, str):
                if not _runs_match(segment.split("*"), value):
                    return None
                continue
            captured = segment.take(value)
            if captured is None:
                return None
            taken[segment.name] = captured
        return taken

    def allows(self, captures: Mapping[str, str], node_id: str) -> bool:
        """Whether NODE, with ``captures`` in place of its captures, matches ``node_id``."""
        if self._node is None:
            return glob_match(self.node, node_id)
        if node_id.count("/") != len(self._node) - 1:  # (a captured value holds no '/')
            return False
        return all(
            _runs_match(_runs(pieces, captures), value)
            for pieces, value in zip(self._node, node_id.split("/"), strict=True)
        )

    def expected(self, captures: Mapping[str, str]) -> str:
        """NODE with ``captures`` filled in (for a refusal's message)."""
        if self._node is None:
            return self.node
        return "/".join("".join(captures[p[0]] if isinstance(p, tuple) else p for p in pieces) for pieces in self._node)


def _runs(pieces: Sequence[_Piece], captures: Mapping[str, str]) -> list[str]:
    """A NODE segment's literal runs between its ``*``, captures filled in (as text, even a ``*``)."""
    runs: list[str] = []
    run: list[str] = []
    for piece in pieces:
        if piece == "*":
            runs.append("".join(run))
            run = []
        else:
            run.append(captures[piece[0]] if isinstance(piece, tuple) else piece)
    runs.append("".join(run))
    return runs


def parse_rule(text: str) -> NodeRule:
    """``IDENTITY=NODE`` -> a rule; ValueError saying what is wrong. The split is at the last
    ``=`` (a SPIFFE id may hold one; node ids rarely do)."""
    identity, sep, node = text.rpartition("=")
    if not sep or not identity or not node:
        raise ValueError(
            f"{text!r} is not IDENTITY=NODE (e.g. 'spiffe://mesh/ns/*/sa/edge=edge-*', "
            "or with captures 'spiffe://mesh/ns/{ns}/sa/{sa}={sa}')"
        )
    return NodeRule(identity, node)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...")


class NodeAuthorizer:
    """The rules, compiled; :meth:`refusal` says why a claim is refused, or None."""

    def __init__(self, rules: Iterable[NodeRule]) -> None:
        self.rules = tuple(rules)

    def refusal(self, identity: str, node_id: str) -> str | None:
        expected: list[str] = []
        matched = False
        for rule in self.rules:
            captures = rule.captures(identity)
            if captures is None:
                continue
            matched = True
            if rule.allows(captures, node_id):
                return None
            if captures and len(expected) < 3:
                expected.append(rule.expected(captures))
        shown = _shown(node_id)
        if not identity:
            return (
                f"node id {shown} refused: the connection has no verified client certificate, and "
                "--authorize-node rules admit certificate identities only"
            )
        if not matched:
            return f"node id {shown} refused: no --authorize-node rule names the identity {_shown(identity)}"
        hint = f" (its rules allow node ids matching {', '.join(map(_shown, expected))})" if expected else ""
        return f"node id {shown} refused: the identity {_shown(identity)} may not claim it{hint} (see --authorize-node)"
