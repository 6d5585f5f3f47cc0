"""Which node ids a proxy may claim, given the identity its certificate proves (mTLS).

A node id is what a proxy says it is; the identity in its verified client certificate is what it
can prove. Without a binding between the two, any proxy holding a certificate from the CA could
claim another's node id and receive its configuration. A rule ``IDENTITY=NODE`` allows proxies
whose identity matches the pattern IDENTITY to claim node ids matching NODE. In both patterns
``*`` stands for any run of characters except ``/`` (so ``spiffe://mesh/ns/*/sa/edge`` names one
service account in any one namespace), and everything else stands for itself.

Once any rule is configured, a stream whose first request claims a node id that no rule allows
for its identity is refused: gRPC PERMISSION_DENIED and a ``node_refused`` event. A connection
without a verified certificate has the identity ``""``, which no rule matches (a pattern is never
empty), so rules need mTLS (``--client-ca``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["NodeAuthorizer", "NodeRule", "compile_pattern", "parse_rule"]

_MAX_SHOWN = 200
"""How much of a refused node id a message repeats (a peer chooses its length)."""


def compile_pattern(text: str) -> re.Pattern[str]:
    """A rule's pattern as a regular expression, to ``fullmatch``: ``*`` is any run of characters
    but ``/``, everything else stands for itself. (The SDS grants of :mod:`pilotfish.server.grants`
    use it too.)"""
    return re.compile("[^/]*".join(re.escape(part) for part in text.split("*")))


@dataclass(frozen=True, slots=True)
class NodeRule:
    """Proxies whose certificate identity matches ``identity`` may claim node ids matching ``node``."""

    identity: str
    node: str


def parse_rule(text: str) -> NodeRule:
    """``IDENTITY=NODE`` -> a rule; ValueError saying what is wrong. The split is at the last
    ``=`` (a SPIFFE id may hold one; node ids rarely do)."""
    identity, sep, node = text.rpartition("=")
    if not sep or not identity or not node:
        raise ValueError(f"{text!r} is not IDENTITY=NODE (e.g. 'spiffe://mesh/ns/*/sa/edge=edge-*')")
    return NodeRule(identity, node)


class NodeAuthorizer:
    """The rules, compiled; :meth:`refusal` says why a claim is refused, or None."""

    def __init__(self, rules: Iterable[NodeRule]) -> None:
        self.rules = tuple(rules)
        self._compiled = [(compile_pattern(r.identity), compile_pattern(r.node)) for r in self.rules]

    def refusal(self, identity: str, node_id: str) -> str | None:
        matched = False
        for identity_pattern, node_pattern in self._compiled:
            if identity_pattern.fullmatch(identity) is not None:
                matched = True
                if node_pattern.fullmatch(node_id) is not None:
                    return None
        shown = node_id if len(node_id) <= _MAX_SHOWN else node_id[:_MAX_SHOWN] + "..."
        if not identity:
            return (f"node id {shown!r} refused: the connection has no verified client certificate, and "
                    "--authorize-node rules admit certificate identities only")
        if not matched:
            return f"node id {shown!r} refused: no --authorize-node rule names the identity {identity!r}"
        return f"node id {shown!r} refused: the identity {identity!r} may not claim it (see --authorize-node)"
