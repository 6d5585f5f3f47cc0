"""Which proxies may receive which SDS secrets: ``--grant-secret SECRET=SUBJECT``.

A secret is usually a private key. Without grants, any proxy that reaches the xDS port (with mTLS:
any proxy holding a certificate from the CA) could subscribe to any secret by name. A grant
``SECRET=identity:PATTERN`` lets proxies whose certificate identity (its SPIFFE URI SAN, else its
first DNS SAN; see :mod:`pilotfish.transport.tls`) matches PATTERN receive the secrets whose names
match SECRET; ``SECRET=node:PATTERN`` does the same for the node ids proxies claim. The patterns
are :mod:`pilotfish.policy.authorize`'s (one implementation): ``*`` stands for any run of
characters except ``/``, everything else for itself (captures are ``--authorize-node``'s only:
here braces are text), and a pattern matches the whole string.

Choices, and why:

- **Fail closed.** A secret that no grant covers is served to no proxy: a forgotten grant shows up
  as a proxy waiting for its secret (and a ``secret_denied`` event), never as a private key handed
  to every peer. At start-up, ``serve`` warns naming the secrets no grant covers. (Before grants,
  every proxy could have every secret; no example or test served secrets, so nothing relied on it.)
- **Flags and a grants file, not the snapshot file.** Who may read a key is the operator's
  policy, like ``--authorize-node`` and ``--client-ca`` next to it; the snapshot file (and the
  registry and etcd that feed the same snapshot) says what exists. So whoever can change the
  configuration cannot also hand themselves the keys, and a typo in it cannot open anything. The
  grants file (``--grants-file``, :class:`GrantsFile`) holds more grants in the flags' grammar::

      grants:
        - edge-cert=identity:spiffe://mesh/ns/edge/sa/edge
        - "ingress-*-cert=node:ingress-*"

  It is followed as it changes (:class:`~pilotfish.followed_file.FollowedFile`, as the
  registry's tokens file is): a good version is in force within about a second, beside the
  flags' grants, and open streams are answered anew under it (a proxy waiting for a secret it is
  now granted receives it at once, :meth:`~pilotfish.xds.server.XdsServer.set_grants`); a bad
  version is reported (``grants_error``, naming the file and the entry) and the last good grants
  stay in force; a bad file at start-up stops ``serve``.
- **Identities are proven, node ids are claimed.** An ``identity:`` grant needs mTLS
  (``--client-ca``): the identity comes from a certificate the handshake verified, and a
  connection without one has the identity ``""``, which no grant matches. A ``node:`` grant is only
  as strong as the binding of node ids to identities (``--authorize-node``): without it, any peer
  that can open a stream can claim any node id, and ``serve`` warns so. An empty node id matches no
  grant either.
- **A denied secret does not exist for that proxy.** The server takes it out of the stream's
  subscription before the cache sees it (:mod:`pilotfish.xds.server`), so the proxy gets the rest
  of its secrets and waits for the denied one as it would for one not yet defined; the stream and
  the other resources are untouched. A wildcard SDS subscription (``*``) is never honoured:
  secrets must be named (Envoy always names them), so "everything" cannot leak a key.
- **What was sent stays sent.** Grants are checked at every SDS request, so a grant that no longer
  covers a proxy (after an edit of the grants file, or a restart with other flags) stops every
  later version of the secret reaching it; but SotW SDS has no way to take back a secret a proxy
  holds, and a key that left cannot be recalled anyway: rotate it (new content under the same
  name goes only to proxies granted it).
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog
from pilotfish.followed_file import FollowedFile
from pilotfish.policy.authorize import glob_match

__all__ = [
    "MAX_GRANTS",
    "GrantsFile",
    "ProxyGrants",
    "SecretGrant",
    "SecretGrants",
    "Subject",
    "parse_grant",
    "parse_grants",
]

_IDENTITIES_KEPT = 4096
"""Identities whose granted secrets :class:`SecretGrants` remembers (then it starts afresh)."""
MAX_GRANTS = 10_000
"""Grants a grants file may list (each is checked at every SDS request of the proxies it names)."""


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
        raise ValueError(
            f"{text!r} is not SECRET=identity:PATTERN or SECRET=node:PATTERN "
            "(e.g. 'edge-cert=identity:spiffe://mesh/ns/edge/sa/*' or 'edge-*-cert=node:edge-*')"
        )
    return SecretGrant(match["secret"], Subject(match["subject"]), match["pattern"])


class SecretGrants:
    """The grants. Immutable: to change grants, make a new one."""

    __slots__ = ("_by_identity", "_identity_grants", "_node_grants", "grants")

    def __init__(self, grants: Iterable[SecretGrant] = ()) -> None:
        self.grants = tuple(grants)
        self._identity_grants = [(g.pattern, g.secret) for g in self.grants if g.subject is Subject.IDENTITY]
        self._node_grants = [(g.pattern, g.secret) for g in self.grants if g.subject is Subject.NODE]
        self._by_identity: dict[str, list[str]] = {}
        """The secret patterns each identity is granted (memo, bounded by :data:`_IDENTITIES_KEPT`):
        many proxies share an identity (the replicas of a service account), and new grants are
        applied to every open stream at once."""

    def for_proxy(self, *, identity: str, node_id: str) -> ProxyGrants:
        """What a proxy proving ``identity`` and claiming ``node_id`` is granted (a stream asks
        once, then matches each name it asks for)."""
        secrets = self._by_identity.get(identity) if identity else []
        if secrets is None:
            secrets = [secret for pattern, secret in self._identity_grants if glob_match(pattern, identity)]
            if len(self._by_identity) >= _IDENTITIES_KEPT:
                self._by_identity.clear()
            self._by_identity[identity] = secrets
        if node_id and self._node_grants:
            secrets = secrets + [secret for pattern, secret in self._node_grants if glob_match(pattern, node_id)]
        if not secrets:
            return ProxyGrants(None)
        exact = frozenset(p for p in secrets if "*" not in p)
        return ProxyGrants(exact, tuple(p for p in secrets if "*" in p))

    def allows(self, secret: str, *, identity: str, node_id: str) -> bool:
        """Whether a proxy proving ``identity`` and claiming ``node_id`` may receive ``secret``."""
        return self.for_proxy(identity=identity, node_id=node_id).allows(secret)

    def ungranted(self, secrets: Iterable[str]) -> list[str]:
        """The secrets (sorted) that no grant covers, for any proxy: they are served to none."""
        return sorted(name for name in secrets if not any(glob_match(g.secret, name) for g in self.grants))

    def of(self, subject: Subject) -> Sequence[SecretGrant]:
        """The grants by ``subject``."""
        return [g for g in self.grants if g.subject is subject]


@dataclass(frozen=True, slots=True)
class ProxyGrants:
    """The secrets one proxy is granted: the exact names, and the patterns with ``*``, matched by
    :func:`~pilotfish.policy.authorize.glob_match` in linear time (a peer chooses the names it
    asks for, as many as a request may carry, and as long: no backtracking expression sees them)."""

    exact: frozenset[str] | None
    """None: nothing is granted."""
    patterns: tuple[str, ...] = ()

    def allows(self, secret: str) -> bool:
        if self.exact is None:
            return False
        return secret in self.exact or any(glob_match(p, secret) for p in self.patterns)

    def split(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """``names`` -> (granted, sorted; denied, in no particular order: a peer may name
        100,000 made-up secrets, and sorting them would be its cost)."""
        if self.exact is None:
            return [], list(names)
        allows = self.allows
        granted: list[str] = []
        denied: list[str] = []
        for name in names:
            (granted if allows(name) else denied).append(name)
        granted.sort()
        return granted, denied


# -- the grants file -------------------------------------------------------------------------------


def parse_grants(document: Any, source: str, *, mtls: bool) -> tuple[SecretGrant, ...]:
    """The grants of a grants file's plain values (``grants:``, a list of ``SECRET=identity:PATTERN``
    or ``SECRET=node:PATTERN``); :class:`ConfigError` naming every problem. ``mtls``: whether
    proxies present certificates (without, an ``identity:`` grant could never match: an error)."""
    if not isinstance(document, dict):
        raise ConfigError(
            source,
            [
                Problem(
                    "",
                    "the file must be a mapping with 'grants' (a list of "
                    f"SECRET=identity:PATTERN or SECRET=node:PATTERN); found "
                    f"{type(document).__name__}",
                )
            ],
        )
    problems = [
        Problem(str(key), "unknown setting; the file has 'grants'")
        for key in sorted(set(document) - {"grants"}, key=str)
    ]
    listed = document.get("grants")
    if not isinstance(listed, list):
        problems.append(
            Problem(
                "grants",
                "a list of SECRET=identity:PATTERN or SECRET=node:PATTERN is required "
                "(an empty list [] grants nothing)",
            )
        )
        listed = []
    elif len(listed) > MAX_GRANTS:
        problems.append(Problem("grants", f"{len(listed)} grants; at most {MAX_GRANTS} are read"))
        listed = []
    grants: list[SecretGrant] = []
    for i, text in enumerate(listed):
        where = f"grants[{i}]"
        if not isinstance(text, str):
            problems.append(
                Problem(
                    where,
                    f"a string SECRET=identity:PATTERN or SECRET=node:PATTERN is required, "
                    f"not {type(text).__name__} (quote it if YAML read it otherwise)",
                )
            )
            continue
        try:
            grant = parse_grant(text)
        except ValueError as exc:
            problems.append(Problem(where, str(exc)))
            continue
        if grant.subject is Subject.IDENTITY and not mtls:
            problems.append(
                Problem(
                    where,
                    f"{text!r}: identity: grants name certificate identities: they need "
                    "mTLS (serve with --client-ca FILE), or use node: grants",
                )
            )
            continue
        grants.append(grant)
    if problems:
        raise ConfigError(source, problems)
    return tuple(grants)


class GrantsFile(FollowedFile[tuple[SecretGrant, ...]]):
    """The last good grants of a grants file, re-read when it changes (see the module docstring)."""

    what = "SDS grants file"
    event = "grants"
    keeper = "the last good grants stay in force"
    empty = "write 'grants: []' to grant nothing"

    def __init__(
        self,
        path: Path,
        *,
        mtls: bool,
        events: EventLog | None = None,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[tuple[SecretGrant, ...]], None] | None = None,
    ) -> None:
        self.mtls = mtls
        super().__init__(path, events=events, every=every, clock=clock, on_change=on_change)

    def parse(self, document: Any, source: str) -> tuple[SecretGrant, ...]:
        return parse_grants(document, source, mtls=self.mtls)

    def summary(self, value: tuple[SecretGrant, ...]) -> dict[str, object]:
        return {"grants": len(value)}
