"""Who may change the registry: bearer tokens with scopes, read from a file that is followed.

The registry API (:mod:`pilotfish.api.registry`) puts every route in one of four classes
(:class:`Access`): ``/healthz`` is open; listing and reading services is a *read*; defining,
removing, registering, deregistering and heartbeating is a *write* to one named service; turning
self-preservation on or off is *admin*. With a tokens file (``serve --registry-tokens FILE``), a
request that is not open carries ``Authorization: Bearer <token>``, and :func:`authorize` decides:

- no token, a malformed header, or a token the file does not list: **401** with
  ``WWW-Authenticate: Bearer`` (a read is let through without a token when the file says
  ``reads: open``: then the header is not looked at);
- a listed token whose scope does not cover the request: **403** (``error="insufficient_scope"``).

The file (YAML, or JSON when it ends in ``.json``) lists tokens by name, each by the SHA-256 of
the token (hex), so the file itself grants nothing to whoever reads it::

    reads: scoped            # open: reads need no token; scoped (the default): a token with read
    tokens:
      deploy-web:
        sha256: 3f2a...      # printf %s "$TOKEN" | sha256sum; or `pilotfish token new`
        write: [web, "web-*"]   # services it may define, remove, (de)register and heartbeat
        read: true           # may read every service (default false)
      ops:
        sha256: 9b1c...
        admin: true          # may turn self-preservation on and off, and read (default false)

A presented token is hashed, looked up by its digest and confirmed with
:func:`hmac.compare_digest`: the timing of a refusal depends only on the digest of the guess,
which says nothing about how close the guess came (:meth:`TokenSet.find`). Write scopes are
service names and glob patterns (``*`` any run of characters, ``?`` one), matched against the
whole name.

:class:`TokenFile` keeps the last good token set of the file and looks at the file at most once a
second (:class:`~pilotfish.followed_file.FollowedFile`, which follows the SDS grants file
too). A file that became unreadable or invalid keeps the last good set: the problem is logged once
per version of the file, naming the file and field, and recorded as the event
``registry_tokens_error``. At start-up there is no last good set, so a bad file is a
:class:`ConfigError`.

Without a tokens file the API is open, as it always was; :func:`warn_if_open` says so once when
it listens beyond loopback.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import re
import secrets
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from aiohttp import web

from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog, ReportGate
from pilotfish.followed_file import FollowedFile, read_document
from pilotfish.transport.aio import Call
from pilotfish.transport.frames import GrpcStatus
from pilotfish.transport.site import is_loopback

__all__ = [
    "MAX_TOKENS",
    "MAX_TOKENS_FILE_BYTES",
    "TOKEN_NAME",
    "Access",
    "AdminTokenFile",
    "Allowed",
    "Denied",
    "NewToken",
    "TokenFile",
    "TokenGate",
    "TokenScope",
    "TokenSet",
    "authorize",
    "grpc_read_check",
    "hash_token",
    "load_tokens",
    "new_token",
    "parse_tokens",
    "token_command",
    "warn_if_open",
]

_log = logging.getLogger("pilotfish.registry")

MAX_TOKENS_FILE_BYTES = 1 << 20
"""A tokens file larger than this (1 MiB) is refused: it would be tens of thousands of tokens."""
MAX_TOKENS = 10_000
"""Tokens a file may list (a 1 MiB file holds about that many)."""

_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_PATTERN = re.compile(r"[A-Za-z0-9._\-*?]+")
_TOKEN_KEYS = {"sha256", "write", "read", "admin"}


class Access(enum.Enum):
    """What a registry API route needs."""

    OPEN = "open"
    """Anyone (``/healthz``)."""
    READ = "read"
    """A token with ``read: true`` (or ``admin: true``), or none when reads are open."""
    WRITE = "write"
    """A token whose ``write`` scope covers the service named in the path."""
    ADMIN = "admin"
    """A token with ``admin: true`` (turning self-preservation on or off)."""


@dataclass(frozen=True, slots=True)
class TokenScope:
    """One named token of the file: its digest and what it may do."""

    name: str
    """The token's name in the file: what logs and events say (never the token itself)."""
    digest: bytes
    """SHA-256 of the token's UTF-8 bytes."""
    write: tuple[str, ...] = ()
    """Service names and glob patterns it may write, as written in the file."""
    read: bool = False
    """Whether it may read when reads are scoped."""
    admin: bool = False
    """Whether it may turn self-preservation on and off (and read: an operator's token)."""

    _matcher: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The globs, as one anchored regex: '*' any run of characters, '?' one, the rest literal.
        globs = ["".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in p) for p in self.write]
        object.__setattr__(self, "_matcher", re.compile("|".join(f"(?:{g})" for g in globs) or r"(?!)", re.DOTALL))

    def may_write(self, service: str) -> bool:
        """Whether ``service`` is one of the names, or matches one of the patterns, of ``write``."""
        return self._matcher.fullmatch(service) is not None


@dataclass(frozen=True, slots=True)
class TokenSet:
    """The tokens of one version of the file."""

    tokens: tuple[TokenScope, ...] = ()
    reads_open: bool = False
    """``reads: open``: reads need no token."""
    _by_digest: dict[bytes, TokenScope] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", {scope.digest: scope for scope in self.tokens})

    def find(self, token: str) -> TokenScope | None:
        """The listed token ``token`` is, if any.

        Looked up by the SHA-256 of ``token``, so the cost does not grow with the number of tokens
        (comparing with each of 10,000 digests costs 1 ms). What the lookup's timing can tell is
        how the *digest* of a guess relates to a stored digest, and a digest cannot be steered
        towards a target (SHA-256 is preimage resistant), so it says nothing about the tokens. The
        match is confirmed with :func:`hmac.compare_digest`.
        """
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        scope = self._by_digest.get(digest)
        return scope if scope is not None and hmac.compare_digest(digest, scope.digest) else None


def hash_token(token: str) -> str:
    """The hex SHA-256 of ``token``: what the file's ``sha256`` field holds."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe base64)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class NewToken:
    """What ``pilotfish token new`` makes the entry of: its name and scopes."""

    name: str = "NAME"
    write: tuple[str, ...] = ()
    read: bool = False
    admin: bool = False


def token_command(
    action: str, stdin: IO[str], stdout: IO[str], *, new: NewToken | None = None, stderr: IO[str] | None = None
) -> int:
    """``pilotfish token new|hash``. ``new``: YAML on ``stdout`` only — the fresh token (``token:``,
    given to the client and stored nowhere) and its entry under ``tokens:``, named and scoped by
    ``new`` — and what to do with them on ``stderr``. ``hash``: the digest of the token read from
    ``stdin`` (its line ending is not part of it). The exit status."""
    err = stderr or sys.stderr
    if action == "new":
        new = new or NewToken()
        token = new_token()
        entry: dict[str, Any] = {"sha256": hash_token(token), "write": list(new.write), "read": new.read}
        if new.admin:
            entry["admin"] = True
        stdout.write(yaml.safe_dump({"token": token, "tokens": {new.name: entry}}, sort_keys=False))
        err.write(
            "pilotfish token new: give 'token' to the client (it is not stored anywhere); add the entry under "
            "'tokens:' to the tokens file (without 'token')" + (", then name it" if new.name == "NAME" else "") + "\n"
        )
        return 0
    token = stdin.readline().rstrip("\r\n")
    if not token:
        err.write('pilotfish token hash: give the token on stdin: printf %s "$TOKEN" | pilotfish token hash\n')
        return 2
    stdout.write(hash_token(token) + "\n")
    return 0


# -- the file --------------------------------------------------------------------------------------


def parse_tokens(document: Any, source: str) -> TokenSet:
    """A :class:`TokenSet` from the file's plain values; :class:`ConfigError` naming every problem."""
    problems: list[Problem] = []
    if not isinstance(document, dict):
        raise ConfigError(
            source,
            [Problem("", f"the file must be a mapping with 'tokens' (and 'reads'); found {type(document).__name__}")],
        )
    for key in sorted(set(document) - {"reads", "tokens"}, key=str):
        problems.append(Problem(str(key), "unknown setting; the file has 'reads' and 'tokens'"))
    reads = document.get("reads", "scoped")
    if reads not in ("open", "scoped"):
        problems.append(
            Problem(
                "reads",
                f"{reads!r} is neither 'open' (reads need no token) nor 'scoped' (reads need a token with read: true)",
            )
        )
    listed = document.get("tokens")
    if not isinstance(listed, dict):
        problems.append(
            Problem(
                "tokens",
                "a mapping of token names to {sha256, write, read, admin} is required "
                "(an empty mapping {} lets no one write)",
            )
        )
        listed = {}
    elif len(listed) > MAX_TOKENS:
        problems.append(Problem("tokens", f"{len(listed)} tokens; at most {MAX_TOKENS} are read"))
        listed = {}
    tokens: list[TokenScope] = []
    seen: dict[bytes, str] = {}
    for name, entry in listed.items():
        where = f"tokens.{name}"
        scope = _parse_token(str(name), entry, where, problems)
        if scope is None:
            continue
        if scope.digest in seen:
            problems.append(
                Problem(
                    f"{where}.sha256",
                    f"the same digest as tokens.{seen[scope.digest]}: one token "
                    "must have one scope; merge the two entries",
                )
            )
            continue
        seen[scope.digest] = scope.name
        tokens.append(scope)
    if problems:
        raise ConfigError(source, problems)
    return TokenSet(tokens=tuple(tokens), reads_open=reads == "open")


def _parse_token(name: str, entry: Any, where: str, problems: list[Problem]) -> TokenScope | None:
    if not isinstance(entry, dict):
        problems.append(Problem(where, "a mapping with sha256 and write/read/admin is required"))
        return None
    before = len(problems)
    for key in sorted(set(entry) - _TOKEN_KEYS, key=str):
        problems.append(Problem(f"{where}.{key}", "unknown field; a token has sha256, write, read and admin"))
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        problems.append(
            Problem(
                f"{where}.sha256",
                "64 hexadecimal digits are required: the SHA-256 of the token "
                '(printf %s "$TOKEN" | sha256sum, or pilotfish token new); '
                "the token itself never goes in the file",
            )
        )
    write = entry.get("write", [])
    if not isinstance(write, list):
        problems.append(
            Problem(
                f"{where}.write",
                f"a list of service names or patterns is required, e.g. [web, 'web-*']; found {type(write).__name__}",
            )
        )
        write = []
    for i, pattern in enumerate(write):
        if not isinstance(pattern, str) or not _PATTERN.fullmatch(pattern):
            problems.append(
                Problem(
                    f"{where}.write[{i}]",
                    f"{pattern!r} is not a service name or pattern: letters, digits, '-', '_', '.', and '*' or '?'",
                )
            )
    flags = {}
    for key in ("read", "admin"):
        value = entry.get(key, False)
        if not isinstance(value, bool):
            problems.append(Problem(f"{where}.{key}", f"true or false is required, not {value!r}"))
        flags[key] = value is True
    if len(problems) > before:
        return None
    assert isinstance(digest, str)
    return TokenScope(name=name, digest=bytes.fromhex(digest), write=tuple(write), **flags)


def load_tokens(path: Path) -> TokenSet:
    """Read and parse a tokens file; :class:`ConfigError` naming the file, and line or field."""
    document = read_document(path, max_bytes=MAX_TOKENS_FILE_BYTES, empty=_EMPTY)
    return parse_tokens(document, str(path))


_EMPTY = "write 'tokens: {}' to let no one write"


class TokenFile(FollowedFile[TokenSet]):
    """The last good :class:`TokenSet` of a file, re-read when the file changes (see
    :class:`~pilotfish.followed_file.FollowedFile`: :meth:`current` looks at the file at
    most once per ``every`` seconds; a bad version is reported once and leaves the last good set
    in place)."""

    what = "registry tokens file"
    event = "registry_tokens"
    keeper = "the registry API keeps the last good tokens"
    empty = _EMPTY

    @property
    def tokens(self) -> TokenSet:
        """The token set in force."""
        return self.value

    def parse(self, document: Any, source: str) -> TokenSet:
        return parse_tokens(document, source)

    def load(self) -> TokenSet:
        return load_tokens(self.path)

    def summary(self, value: TokenSet) -> dict[str, object]:
        return {"tokens": len(value.tokens), "reads": "open" if value.reads_open else "scoped"}


class AdminTokenFile(TokenFile):
    """The admin API's tokens file: the same grammar and following as the registry's, its own
    log lines and events (``admin_tokens_loaded``, ``admin_tokens_error``)."""

    what = "admin tokens file"
    event = "admin_tokens"
    keeper = "the admin API keeps the last good tokens"


# -- deciding --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allowed:
    token: str | None
    """The name of the token that allowed it (None: the request needed none)."""


@dataclass(frozen=True, slots=True)
class Denied:
    status: int
    """401 (no usable token) or 403 (the token's scope does not cover the request)."""
    message: str
    challenge: str
    """The ``WWW-Authenticate`` header to send (RFC 6750 section 3)."""
    token: str | None = None
    """The name of the token presented, when it is a listed one."""


def authorize(
    tokens: TokenSet,
    access: Access,
    service: str | None,
    header: str | None,
    *,
    request: str,
    api: str = "registry",
    admin_action: str = "change self-preservation",
) -> Allowed | Denied:
    """Whether a request needing ``access`` (to ``service``, for writes) may go ahead with the
    ``Authorization`` header ``header``. ``request`` (e.g. ``PUT /v1/services/web``) is named in
    the messages, with ``api`` (whose tokens: the realm of the challenge) and ``admin_action``
    (what ``admin: true`` allows there)."""
    realm = f'Bearer realm="pilotfish {api}"'
    if access is Access.OPEN or (access is Access.READ and tokens.reads_open):
        return Allowed(None)
    if header is None or not header.strip():
        return Denied(401, f"{request} needs a token: send the header 'Authorization: Bearer <token>'", realm)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return Denied(
            401, f"{request}: the Authorization header must be 'Bearer <token>'", f'{realm}, error="invalid_request"'
        )
    scope = tokens.find(token)
    if scope is None:
        return Denied(
            401,
            f"{request}: the bearer token is not one the {api} API knows (revoked, or mistyped?)",
            f'{realm}, error="invalid_token"',
        )
    if access is Access.READ:
        ok, needs = scope.read or scope.admin, "read (read: true)"
    elif access is Access.ADMIN:
        ok, needs = scope.admin, f"{admin_action} (admin: true)"
    else:
        ok, needs = service is not None and scope.may_write(service), f"write service {service!r}"
    if ok:
        return Allowed(scope.name)
    held = ", ".join(scope.write) or "no service"
    return Denied(
        403,
        f"{request}: token {scope.name!r} may not {needs}; it may write {held}"
        f"{', read' if scope.read else ''}{', admin' if scope.admin else ''}. "
        "Use a token whose scope covers this, or widen this one in the tokens file",
        f'{realm}, error="insufficient_scope"',
        scope.name,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TOKEN_NAME = web.RequestKey("pilotfish_token_name", str)
"""Set by :class:`TokenGate` on a request it let through with a listed token: the token's name
(what a handler records as who did it; never the token itself)."""


class TokenGate:
    """The aiohttp middleware of an API with a tokens file: decides every request before its
    handler runs (and before its body is read) by the :class:`Access` its route needs
    (``routes``: (method, canonical path) -> access; a route missing there needs ``admin``, a
    path no route matches is let through to its 404 or 405), and answers a refusal with 401 or
    403: ``{"error": ..., "problems": [{"field": "Authorization", "message": ...}]}`` and
    ``WWW-Authenticate``. Refusals are logged and recorded (event ``<api>_denied``) at most once
    per ``report_every`` seconds, with the count of those left out, so a client guessing tokens
    cannot fill the log. A request let through with a listed token carries the token's name
    (``request[TOKEN_NAME]``), for its handler to record who did what."""

    def __init__(
        self,
        tokens: TokenFile,
        routes: Mapping[tuple[str, str], Access],
        *,
        events: EventLog,
        api: str = "registry",
        admin_action: str = "change self-preservation",
        admin_actions: Mapping[str, str] | None = None,
        report_every: float = 10.0,
    ) -> None:
        self.tokens = tokens
        self.routes = routes
        self.events = events
        self.api = api
        self.admin_action = admin_action
        self.admin_actions = admin_actions or {}
        """Per canonical path, what ``admin: true`` allows there, when not ``admin_action``."""
        self._gate = ReportGate(report_every)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route
        if request.match_info.http_exception is not None or route.resource is None:
            return await handler(request)  # no such route (404/405): nothing to protect
        method = "GET" if request.method == "HEAD" else request.method
        access = self.routes.get((method, route.resource.canonical), Access.ADMIN)  # missing (a bug): the most
        decision = authorize(
            self.tokens.current(),
            access,
            request.match_info.get("service"),
            request.headers.get("Authorization"),
            request=f"{request.method} {request.path}",
            api=self.api,
            admin_action=self.admin_actions.get(route.resource.canonical, self.admin_action),
        )
        if isinstance(decision, Denied):
            self._report(request, decision)
            problems = [{"field": "Authorization", "message": decision.message}]
            return web.json_response(
                {"error": decision.message, "problems": problems},
                status=decision.status,
                headers={"WWW-Authenticate": decision.challenge},
            )
        if decision.token is not None:
            request[TOKEN_NAME] = decision.token
        return await handler(request)

    def _report(self, request: web.Request, denied: Denied) -> None:
        left_out = self._gate.admit(asyncio.get_running_loop().time())
        if left_out is None:
            return
        _log.warning(
            "%s API refused a request from %s: %d %s%s",
            self.api,
            request.remote,
            denied.status,
            denied.message[:400],
            f" ({left_out} more refusal(s) since the last one logged)" if left_out else "",
        )
        self.events.emit(
            f"{self.api}_denied",
            method=request.method,
            path=request.path[:200],
            status=denied.status,
            token=denied.token,
            peer=request.remote,
            unreported_before=left_out,
        )


def warn_if_open(host: str) -> bool:
    """Warn (once, at start) that the registry API takes writes from anyone who can reach it,
    unless ``host`` is loopback only. Whether it warned."""
    if is_loopback(host):
        return False
    _log.warning(
        "the registry API on %s accepts writes from anyone who can reach it: give --registry-tokens "
        "FILE to require bearer tokens (see the README, 'Registry API tokens')",
        host or "every address",
    )
    return True


def grpc_read_check(tokens: TokenFile | None, *, what: str) -> Callable[[Call], tuple[int, str] | None]:
    """The bearer-token check of a gRPC service that reads what the admin API reads (CSDS on
    the admin gRPC port): a call's ``authorization`` metadata must carry a token the admin
    tokens file lets read (``read: true`` or ``admin: true``; anyone with ``reads: open``).
    Returns the refusal as (gRPC status, message): UNAUTHENTICATED without a usable token,
    PERMISSION_DENIED for a known token whose scope does not read. ``tokens`` None: no check."""

    def check(call: Call) -> tuple[int, str] | None:
        if tokens is None:
            return None
        decision = authorize(tokens.current(), Access.READ, None, call.authorization, request=what, api="admin")
        if isinstance(decision, Allowed):
            return None
        code = GrpcStatus.UNAUTHENTICATED if decision.status == 401 else GrpcStatus.PERMISSION_DENIED
        return code, decision.message.replace("the header 'Authorization: ", "the metadata 'authorization: ")

    return check
