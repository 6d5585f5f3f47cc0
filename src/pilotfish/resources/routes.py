"""Routes of a service's listener: the ``routes:`` list of a ``services:`` entry.

Without ``routes`` an HTTP service's listener sends every request to the service itself (what it
always did). With them, the listener's route table is the list, tried in order, first match wins
(as Envoy does). A route is one flat mapping: what it matches, what it does, and options::

    routes:
      - path: /marker                          # exact path ...
        direct_response: {status: 200, body: "marker\\n"}
      - prefix: /slow                          # ... or a prefix, or a regex (RE2, whole path)
        to: slow                               # one service, or weighted: {pool: 90, canary: 10}
        timeout: 30s
      - to: pool                               # no path matcher: every path (prefix "/")

Matchers: one of ``prefix`` / ``path`` (exact) / ``regex``, plus ``host`` (one name or a list;
``*.example.com`` for any subdomain) and ``headers`` (name -> value: a string matches exactly,
``true`` means present, ``false`` absent, ``{prefix: ..}`` / ``{regex: ..}``). Actions, exactly
one: ``to``, ``direct_response`` (``{status, body}`` or a status alone) or ``redirect`` (``{scheme,
host, port, path | prefix, code, strip_query}``). Options of a ``to`` route: ``timeout`` and
``retries`` (default: the entry's own) and ``prefix_rewrite``.

Everything is checked here and every problem reported with its path
(``services.edge.routes[2].to``). Two checks need every source, and are made when the merged
services are built (:mod:`pilotfish.build.desired`): that each ``to`` names a service (or a raw
cluster), and what DNS endpoints allow. Regexes are checked as far as Python can: they must
compile as Python regular expressions once the RE2 spellings Python lacks (``\\pL``, ``\\z``,
``(?<name>``) are mapped to Python's, and use none of the Perl features RE2 does not have
(lookaround, backreferences, atomic groups, possessive quantifiers, conditionals). What RE2 alone
refuses beyond that (a program larger than Envoy's limit, say) is NACKed by Envoy and reported.

Host matching is a route-level matcher on the ``:authority`` header (a case-insensitive regex that
allows a ``:port`` suffix) rather than virtual hosts, so that the list's order is the only rule
of which route wins.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

from pilotfish.errors import Problem
from pilotfish.resources.services import is_host_name, is_service_name, parse_int, parse_seconds

__all__ = [
    "DirectResponse",
    "HeaderMatch",
    "Redirect",
    "Route",
    "host_regex",
    "parse_routes",
    "route_document",
]

MAX_ROUTES = 1000
"""The most routes one listener takes."""
MAX_REGEX = 1024
"""The longest regex accepted (Envoy's RE2 refuses large programs anyway)."""
MAX_BODY = 4096
"""The largest direct response body, in bytes (Envoy's default ``max_direct_response_body_size_bytes``)."""
MAX_SPLIT_WEIGHT = 10_000
"""The largest weight of one service in a split."""
REDIRECT_CODES = (301, 302, 303, 307, 308)

_HEADER_NAME = re.compile(r":?[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_PSEUDO_HEADERS = (":authority", ":method", ":path", ":scheme")


@dataclass(frozen=True, slots=True)
class HeaderMatch:
    """One header a route requires."""

    name: str
    """Lower case (HTTP header names are case-insensitive; Envoy matches them lower-cased)."""
    kind: str
    """``exact``, ``prefix``, ``regex``, ``present`` or ``absent``."""
    value: str = ""


@dataclass(frozen=True, slots=True)
class DirectResponse:
    status: int
    body: str = ""


@dataclass(frozen=True, slots=True)
class Redirect:
    """Where a redirect sends the client; None: the request's own."""

    scheme: str | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    """The whole new path."""
    prefix: str | None = None
    """What replaces the matched prefix (or path)."""
    code: int = 301
    strip_query: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One route of a listener's table."""

    match_kind: str = "prefix"
    """``prefix``, ``path`` (exact) or ``regex`` (RE2, the whole path)."""
    match: str = "/"
    hosts: tuple[str, ...] = ()
    """Host names (``*.suffix`` for subdomains); empty: any host."""
    headers: tuple[HeaderMatch, ...] = ()
    to: tuple[tuple[str, int], ...] = ()
    """(service, weight) pairs, sorted by service; empty: not a forwarding route."""
    split: bool = False
    """``to`` was written as a weighted mapping (a weighted cluster, even of one service)."""
    direct_response: DirectResponse | None = None
    redirect: Redirect | None = None
    timeout: float | None = None
    """Seconds for the whole request (0: none); None: the entry's ``timeout``."""
    retries: int | None = None
    """None: the entry's ``retries``."""
    prefix_rewrite: str | None = None

    def targets(self) -> tuple[str, ...]:
        """The services this route sends requests to."""
        return tuple(name for name, _ in self.to)

    def matches_everything(self) -> bool:
        return self.match_kind == "prefix" and self.match == "/" and not self.hosts and not self.headers


_MATCHERS = ("prefix", "path", "regex")
_ACTIONS = ("to", "direct_response", "redirect")
_OPTIONS = ("timeout", "retries", "prefix_rewrite")
_ROUTE_FIELDS = (*_MATCHERS, "host", "headers", *_ACTIONS, *_OPTIONS)
_REDIRECT_FIELDS = ("scheme", "host", "port", "path", "prefix", "code", "strip_query")


def parse_routes(value: Any, where: str, problems: list[Problem]) -> tuple[Route, ...]:
    """A ``routes`` list; each problem is added to ``problems`` naming its route and field."""
    if not isinstance(value, list) or not value:
        problems.append(Problem(where, "expected a non-empty list of routes (leave routes out for none)"))
        return ()
    if len(value) > MAX_ROUTES:
        problems.append(Problem(where, f"at most {MAX_ROUTES} routes per listener, got {len(value)}"))
        return ()
    routes: list[Route] = []
    for index, item in enumerate(value):
        route = _route(item, f"{where}[{index}]", problems)
        if route is None:
            continue
        _check_reachable(route, index, routes, f"{where}[{index}]", problems)
        routes.append(route)
    return tuple(routes) if len(routes) == len(value) else ()


def _route(value: Any, where: str, problems: list[Problem]) -> Route | None:
    if not isinstance(value, dict):
        problems.append(
            Problem(where, f"expected a mapping (a matcher such as prefix and an action such as to), got {value!r}")
        )
        return None
    found = len(problems)
    unknown = sorted(set(map(str, value)) - set(_ROUTE_FIELDS))
    if unknown:
        problems.append(Problem(where, f"unknown field(s) {', '.join(unknown)}; expected {', '.join(_ROUTE_FIELDS)}"))
    matchers = [key for key in _MATCHERS if key in value]
    if len(matchers) > 1:
        problems.append(
            Problem(where, f"conflicting matchers {' and '.join(matchers)}: a route matches the path one way")
        )
    kind = matchers[0] if matchers else "prefix"
    match = _path_matcher(kind, value.get(kind, "/"), f"{where}.{kind}", problems)
    hosts = _hosts(value["host"], f"{where}.host", problems) if "host" in value else ()
    headers = _headers(value["headers"], f"{where}.headers", problems) if "headers" in value else ()
    if hosts and any(h.name == ":authority" for h in headers):
        problems.append(Problem(f"{where}.headers", "conflicting matchers host and headers[':authority']: use host"))
    actions = [key for key in _ACTIONS if key in value]
    if len(actions) != 1:
        problems.append(
            Problem(
                where,
                f"needs exactly one action of {', '.join(_ACTIONS)}, got "
                + (" and ".join(actions) if actions else "none"),
            )
        )
    to: tuple[tuple[str, int], ...] = ()
    split = isinstance(value.get("to"), dict)
    if "to" in value:
        to = _targets(value["to"], f"{where}.to", problems)
    direct = (
        _direct(value["direct_response"], f"{where}.direct_response", problems) if "direct_response" in value else None
    )
    redirect = _redirect(value["redirect"], f"{where}.redirect", problems) if "redirect" in value else None
    options = [key for key in _OPTIONS if key in value]
    if options and "to" not in value:
        problems.append(Problem(where, f"{', '.join(options)} apply only to a route with to (one that forwards)"))
    timeout = (
        parse_seconds(value["timeout"], f"{where}.timeout", problems, allow_zero=True) if "timeout" in value else None
    )
    retries = parse_int(value["retries"], f"{where}.retries", problems, 0, 10) if "retries" in value else None
    rewrite = None
    if "prefix_rewrite" in value:
        rewrite = value["prefix_rewrite"]
        if not isinstance(rewrite, str) or not rewrite.startswith("/"):
            problems.append(Problem(f"{where}.prefix_rewrite", f"must start with '/', got {rewrite!r}"))
        elif kind == "regex":
            problems.append(
                Problem(
                    f"{where}.prefix_rewrite",
                    "rewrites the matched prefix or path: use it with prefix or path, not regex",
                )
            )
    if len(problems) > found or match is None:
        return None
    return Route(
        match_kind=kind,
        match=match,
        hosts=hosts,
        headers=headers,
        to=to,
        split=split,
        direct_response=direct,
        redirect=redirect,
        timeout=timeout,
        retries=retries,
        prefix_rewrite=rewrite,
    )


def _path_matcher(kind: str, value: Any, where: str, problems: list[Problem]) -> str | None:
    if not isinstance(value, str) or not value:
        problems.append(Problem(where, f"expected a non-empty string, got {value!r}"))
        return None
    if kind in ("prefix", "path") and not value.startswith("/"):
        problems.append(Problem(where, f"a path starts with '/', got {value!r}"))
        return None
    if kind == "regex":
        reason = regex_problem(value)
        if reason is not None:
            problems.append(Problem(where, reason))
            return None
    return value


_PERL_ONLY = (
    ("(?=", "lookahead"),
    ("(?!", "negative lookahead"),
    ("(?<=", "lookbehind"),
    ("(?<!", "negative lookbehind"),
    ("(?>", "atomic groups"),
    ("(?(", "conditionals"),
)


def regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a regex RE2 takes, as far as Python can tell; None: none found."""
    if len(pattern) > MAX_REGEX:
        return f"at most {MAX_REGEX} characters, got {len(pattern)}"
    python: list[str] = []
    index = 0
    while index < len(pattern):
        char = pattern[index]
        following = pattern[index + 1] if index + 1 < len(pattern) else ""
        if char == "\\":
            if following.isdigit() and following != "0":
                return f"RE2 has no backreferences (\\{following}): {pattern!r}"
            if following in "pP":  # \pL, \p{Greek}: Unicode classes Python lacks
                end = pattern.find("}", index) + 1 if pattern[index + 2 : index + 3] == "{" else index + 3
                if end <= index:
                    return f"unterminated \\{following}{{: {pattern!r}"
                python.append(".")
                index = end
                continue
            python.append({"z": "\\Z", "C": "."}.get(following, char + following))
            index += 2
            continue
        for opening, feature in _PERL_ONLY:
            if pattern.startswith(opening, index):
                return f"RE2 has no {feature} ({opening}...): {pattern!r}"
        if char in "*+?}" and following == "+":
            return f"RE2 has no possessive quantifiers ({char}+): {pattern!r}"
        if pattern.startswith("(?<", index):
            python.append("(?P<")
            index += 3
            continue
        python.append(char)
        index += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "possible nested set" for RE2's [[:alpha:]]
            re.compile("".join(python))
    except re.error as exc:
        return f"not a valid regex ({exc}): {pattern!r}"
    except RecursionError:
        return f"nested too deeply: {pattern[:40]!r}..."
    return None


def _hosts(value: Any, where: str, problems: list[Problem]) -> tuple[str, ...]:
    names = value if isinstance(value, list) else [value]
    hosts: list[str] = []
    for index, name in enumerate(names):
        at = f"{where}[{index}]" if isinstance(value, list) else where
        bare = name[2:] if isinstance(name, str) and name.startswith("*.") else name
        if not is_host_name(bare) and not _is_ipv4(bare):
            problems.append(
                Problem(
                    at, f"expected a host name (or *.domain for its subdomains) such as api.example.com, got {name!r}"
                )
            )
            continue
        hosts.append(name.lower().rstrip("."))
    if not names:
        problems.append(Problem(where, "expected a host name or a non-empty list of them"))
    return tuple(dict.fromkeys(hosts))


def _is_ipv4(value: Any) -> bool:
    parts = value.split(".") if isinstance(value, str) else []
    return len(parts) == 4 and all(p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts)


def host_regex(hosts: tuple[str, ...]) -> str:
    """The RE2 regex ``:authority`` must match for one of ``hosts``: any case, with or without a port."""
    alternatives = []
    for host in hosts:
        if host.startswith("*."):
            alternatives.append(r"[^:]+\." + host[2:].replace(".", r"\."))
        else:
            alternatives.append(host.replace(".", r"\."))
    return "(?i)(" + "|".join(alternatives) + r")(:[0-9]+)?"


def _headers(value: Any, where: str, problems: list[Problem]) -> tuple[HeaderMatch, ...]:
    if not isinstance(value, dict) or not value:
        problems.append(
            Problem(where, "expected a mapping of header name to value, true, false or {prefix|regex: ...}")
        )
        return ()
    found: dict[str, HeaderMatch] = {}
    for raw_name, spec in value.items():
        at = f"{where}[{raw_name!r}]"
        name = str(raw_name).lower()
        if not _HEADER_NAME.fullmatch(name) or (name.startswith(":") and name not in _PSEUDO_HEADERS):
            problems.append(
                Problem(
                    at,
                    f"not a header name (letters, digits and !#$%&'*+.^_`|~-; or one of {', '.join(_PSEUDO_HEADERS)})",
                )
            )
            continue
        if name in found:
            problems.append(Problem(at, f"{name!r} is listed twice (header names are case-insensitive)"))
            continue
        match = _header_value(name, spec, at, problems)
        if match is not None:
            found[name] = match
    return tuple(sorted(found.values(), key=lambda h: h.name))


def _header_value(name: str, spec: Any, where: str, problems: list[Problem]) -> HeaderMatch | None:
    if spec is True:
        return HeaderMatch(name, "present")
    if spec is False:
        return HeaderMatch(name, "absent")
    if isinstance(spec, str | int) and not isinstance(spec, bool):
        return HeaderMatch(name, "exact", str(spec))
    if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in ("exact", "prefix", "regex"):
        kind, text = next(iter(spec.items()))
        if not isinstance(text, str) or not text:
            problems.append(Problem(f"{where}.{kind}", f"expected a non-empty string, got {text!r}"))
            return None
        if kind == "regex" and (reason := regex_problem(text)) is not None:
            problems.append(Problem(f"{where}.regex", reason))
            return None
        return HeaderMatch(name, kind, text)
    problems.append(
        Problem(
            where,
            "expected a value (exact match), true (present), false (absent) or one of "
            f"{{exact|prefix|regex: ...}}, got {spec!r}",
        )
    )
    return None


def _targets(value: Any, where: str, problems: list[Problem]) -> tuple[tuple[str, int], ...]:
    if isinstance(value, str):
        if not is_service_name(value):
            problems.append(Problem(where, f"expected a service name, got {value!r}"))
            return ()
        return ((value, 1),)
    if not isinstance(value, dict) or not value:
        problems.append(
            Problem(where, f"expected a service name or a mapping of service name to weight, got {value!r}")
        )
        return ()
    targets = []
    for name, weight in value.items():
        at = f"{where}.{name}"
        if not is_service_name(str(name)):
            problems.append(Problem(at, f"expected a service name, got {name!r}"))
        elif isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_SPLIT_WEIGHT:
            problems.append(Problem(at, f"a weight is a whole number from 0 to {MAX_SPLIT_WEIGHT}, got {weight!r}"))
        else:
            targets.append((str(name), weight))
    if len(targets) == len(value) and sum(w for _, w in targets) == 0:
        problems.append(Problem(where, "the weights add up to 0: give at least one service a weight above 0"))
    return tuple(sorted(targets))


def _direct(value: Any, where: str, problems: list[Problem]) -> DirectResponse | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"status": value}
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected {{status, body}} or a status such as 204, got {value!r}"))
        return None
    unknown = sorted(set(map(str, value)) - {"status", "body"})
    if unknown:
        problems.append(Problem(where, f"unknown field(s) {', '.join(unknown)}; expected status, body"))
    if "status" not in value:
        problems.append(Problem(f"{where}.status", "is required"))
        return None
    status = parse_int(value["status"], f"{where}.status", problems, 200, 599)
    body = value.get("body", "")
    if not isinstance(body, str):
        problems.append(Problem(f"{where}.body", f"expected a string, got {type(body).__name__}"))
        return None
    if len(body.encode()) > MAX_BODY:
        problems.append(Problem(f"{where}.body", f"at most {MAX_BODY} bytes (Envoy's limit), got {len(body.encode())}"))
        return None
    return None if status is None or unknown else DirectResponse(status, body)


def _redirect(value: Any, where: str, problems: list[Problem]) -> Redirect | None:
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected a mapping with some of {', '.join(_REDIRECT_FIELDS)}, got {value!r}"))
        return None
    found = len(problems)
    unknown = sorted(set(map(str, value)) - set(_REDIRECT_FIELDS))
    if unknown:
        problems.append(
            Problem(where, f"unknown field(s) {', '.join(unknown)}; expected {', '.join(_REDIRECT_FIELDS)}")
        )
    if not any(key in value for key in ("scheme", "host", "port", "path", "prefix")):
        problems.append(Problem(where, "redirects nowhere: give at least one of scheme, host, port, path, prefix"))
    if "path" in value and "prefix" in value:
        problems.append(
            Problem(where, "conflicting path and prefix: a redirect replaces the whole path or the matched prefix")
        )
    scheme = value.get("scheme")
    if scheme is not None and scheme not in ("http", "https"):
        problems.append(Problem(f"{where}.scheme", f"must be http or https, got {scheme!r}"))
    host = value.get("host")
    if host is not None and not is_host_name(host) and not _is_ipv4(host):
        problems.append(Problem(f"{where}.host", f"expected a host name, got {host!r}"))
    port = parse_int(value["port"], f"{where}.port", problems, 1, 65535) if "port" in value else None
    for key in ("path", "prefix"):
        if key in value and (not isinstance(value[key], str) or not value[key].startswith("/")):
            problems.append(Problem(f"{where}.{key}", f"must start with '/', got {value[key]!r}"))
    code = value.get("code", 301)
    if code not in REDIRECT_CODES or isinstance(code, bool):
        problems.append(Problem(f"{where}.code", f"must be one of {', '.join(map(str, REDIRECT_CODES))}, got {code!r}"))
    strip = value.get("strip_query", False)
    if not isinstance(strip, bool):
        problems.append(Problem(f"{where}.strip_query", f"expected true or false, got {strip!r}"))
    if len(problems) > found:
        return None
    return Redirect(scheme, host, port, value.get("path"), value.get("prefix"), code, strip)


def _check_reachable(route: Route, index: int, earlier: list[Route], where: str, problems: list[Problem]) -> None:
    """A route an earlier one always wins over is a mistake (it is never used): report it."""
    for number, before in enumerate(earlier):
        if before.headers or (before.hosts and not (route.hosts and set(route.hosts) <= set(before.hosts))):
            continue  # ``before`` is narrower in some way: ``route`` can still match
        same = (before.match_kind, before.match) == (route.match_kind, route.match)
        covered = (
            before.match_kind == "prefix"
            and route.match_kind in ("prefix", "path")
            and route.match.startswith(before.match)
        )
        if same or covered:
            what = (
                "matches every request"
                if before.matches_everything()
                else f"{before.match_kind} {before.match!r} matches all it does"
            )
            problems.append(
                Problem(
                    where,
                    f"conflicting matchers: never used, routes[{number}] before it {what} "
                    "(order routes from specific to general)",
                )
            )
            return


def route_document(route: Route) -> dict[str, Any]:
    """A route as the mapping :func:`parse_routes` reads (the registry stores definitions so)."""
    document: dict[str, Any] = {}
    if not (route.match_kind == "prefix" and route.match == "/"):
        document[route.match_kind] = route.match
    if route.hosts:
        document["host"] = list(route.hosts)
    if route.headers:
        document["headers"] = {
            h.name: (h.kind == "present")
            if h.kind in ("present", "absent")
            else h.value
            if h.kind == "exact"
            else {h.kind: h.value}
            for h in route.headers
        }
    if route.to:
        document["to"] = dict(route.to) if route.split else route.to[0][0]
    if route.direct_response is not None:
        document["direct_response"] = {"status": route.direct_response.status, "body": route.direct_response.body}
    if route.redirect is not None:
        redirect = route.redirect
        document["redirect"] = {
            key: getattr(redirect, key)
            for key in _REDIRECT_FIELDS
            if getattr(redirect, key) is not None and not (key == "strip_query" and not redirect.strip_query)
        }
    for key in _OPTIONS:
        if getattr(route, key) is not None:
            document[key] = getattr(route, key)
    return document
