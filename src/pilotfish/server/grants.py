"""Which proxies may receive which SDS secrets: ``--grant-secret SECRET=SUBJECT``.

A secret is usually a private key. Without grants, any proxy that reaches the xDS port (with mTLS:
any proxy holding a certificate from the CA) could subscribe to any secret by name. A grant
``SECRET=identity:PATTERN`` lets proxies whose certificate identity (its SPIFFE URI SAN, else its
first DNS SAN; see :mod:`pilotfish.server.tls`) matches PATTERN receive the secrets whose names
match SECRET; ``SECRET=node:PATTERN`` does the same for the node ids proxies claim. The patterns
are :mod:`pilotfish.server.authorize`'s (one implementation): ``*`` stands for any run of
characters except ``/``, everything else for itself, and a pattern matches the whole string.

Choices, and why:

- **Fail closed.** A secret that no grant covers is served to no proxy: a forgotten grant shows up
  as a proxy waiting for its secret (and a ``secret_denied`` event), never as a private key handed
  to every peer. At start-up, ``serve`` warns naming the secrets no grant covers. (Before grants,
  every proxy could have every secret; no example or test served secrets, so nothing relied on it.)
- **Flags, not the snapshot file.** Who may read a key is the operator's policy, like
  ``--authorize-node`` and ``--client-ca`` next to it; the snapshot file (and the registry and
  etcd that feed the same snapshot) says what exists. So whoever can change the configuration
  cannot also hand themselves the keys, and a typo in a file cannot open anything.
- **Identities are proven, node ids are claimed.** An ``identity:`` grant needs mTLS
  (``--client-ca``): the identity comes from a certificate the handshake verified, and a
  connection without one has the identity ``""``, which no grant matches. A ``node:`` grant is only
  as strong as the binding of node ids to identities (``--authorize-node``): without it, any peer
  that can open a stream can claim any node id, and ``serve`` warns so. An empty node id matches no
  grant either.
- **A denied secret does not exist for that proxy.** The server takes it out of the stream's
  subscription before the cache sees it (:mod:`pilotfish.server.xds`), so the proxy gets the rest
  of its secrets and waits for the denied one as it would for one not yet defined; the stream and
  the other resources are untouched. A wildcard SDS subscription (``*``) is never honoured:
  secrets must be named (Envoy always names them), so "everything" cannot leak a key.
- **What was sent stays sent.** Grants are checked at every SDS request, so a grant that no longer
  covers a proxy (after a restart with other flags) stops every later version of the secret
  reaching it; but SotW SDS has no way to take back a secret a proxy holds, and a key that left
  cannot be recalled anyway: rotate it (new content under the same name goes only to proxies
  granted it).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pilotfish.server.authorize import compile_pattern

__all__ = ["ProxyGrants", "SecretGrant", "SecretGrants", "Subject", "parse_grant"]


class Subject(enum.Enum):
    """What a grant's pattern is matched against."""

    IDENTITY = "identity"
    """The identity the proxy's verified client certificate proves (needs mTLS)."""
    NODE = "node"
    """The node id the proxy claims (proven only through ``--authorize-node``)."""


@dataclass(frozen=True, slots=True)
class SecretGrant:
    """Proxies whose ``subject`` matches ``pattern`` may receive secrets whose names match ``secret``."""

    secret: str
    """Pattern of secret names."""
    subject: Subject
    pattern: str
    """Pattern of identities or node ids (by :attr:`subject`)."""

    def __str__(self) -> str:
        return f"{self.secret}={self.subject.value}:{self.pattern}"


_GRANT = re.compile(r"(?P<secret>.+?)=(?P<subject>identity|node):(?P<pattern>.+)", re.DOTALL)


def parse_grant(text: str) -> SecretGrant:
    """``SECRET=identity:PATTERN`` or ``SECRET=node:PATTERN`` -> a grant; ValueError saying what
    is wrong. The split is at the first ``=identity:`` or ``=node:``."""
    match = _GRANT.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not SECRET=identity:PATTERN or SECRET=node:PATTERN "
                         "(e.g. 'edge-cert=identity:spiffe://mesh/ns/edge/sa/*' or 'edge-*-cert=node:edge-*')")
    return SecretGrant(match["secret"], Subject(match["subject"]), match["pattern"])


class SecretGrants:
    """The grants, compiled. Immutable: to change grants, make a new one."""

    __slots__ = ("_compiled", "grants")

    def __init__(self, grants: Iterable[SecretGrant] = ()) -> None:
        self.grants = tuple(grants)
        self._compiled = [(compile_pattern(g.secret), g.subject, compile_pattern(g.pattern)) for g in self.grants]

    def for_proxy(self, *, identity: str, node_id: str) -> ProxyGrants:
        """What a proxy proving ``identity`` and claiming ``node_id`` is granted (a stream asks
        once, then matches each name it asks for against one expression)."""
        secrets = [secret_pattern.pattern for secret_pattern, subject, pattern in self._compiled
                   if (value := identity if subject is Subject.IDENTITY else node_id) and pattern.fullmatch(value)]
        return ProxyGrants(re.compile("|".join(f"(?:{p})" for p in secrets)) if secrets else None)

    def allows(self, secret: str, *, identity: str, node_id: str) -> bool:
        """Whether a proxy proving ``identity`` and claiming ``node_id`` may receive ``secret``."""
        return self.for_proxy(identity=identity, node_id=node_id).allows(secret)

    def ungranted(self, secrets: Iterable[str]) -> list[str]:
        """The secrets (sorted) that no grant covers, for any proxy: they are served to none."""
        patterns = [secret_pattern for secret_pattern, _, _ in self._compiled]
        return sorted(name for name in secrets if not any(p.fullmatch(name) for p in patterns))

    def of(self, subject: Subject) -> Sequence[SecretGrant]:
        """The grants by ``subject``."""
        return [g for g in self.grants if g.subject is subject]


@dataclass(frozen=True, slots=True)
class ProxyGrants:
    """The secrets one proxy is granted: one expression of every name pattern granted to it
    (a peer may name many secrets: each costs one match)."""

    secrets: re.Pattern[str] | None
    """None: nothing is granted."""

    def allows(self, secret: str) -> bool:
        return self.secrets is not None and self.secrets.fullmatch(secret) is not None

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """``names`` -> (granted, sorted; denied, in no particular order: a peer may name
        100,000 made-up secrets, and sorting them would be its cost)."""
        if self.secrets is None:
            return [], list(names)
        match = self.secrets.fullmatch
        granted: list[str] = []
        denied: list[str] = []
        for name in names:
            (granted if match(name) else denied).append(name)
        granted.sort()
        return granted, denied
