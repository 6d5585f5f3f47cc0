"""``pilotfish status``, ``wait``, ``confirm``, ``rollout`` and ``plan``: an operator's questions, asked
of the admin API.

``status`` prints the proxies table of ``/v1/proxies`` (as ``istioctl proxy-status`` does), one
row per connected proxy and a column per type, then the message of every NACK (``-o json``: the
proxies as the admin API gives them); it exits 1 when a proxy has NACKED, or has been STALE past
``--stale-grace``, so that a script can ask "is the fleet well?".

``wait`` is the step a deploy pipeline runs after changing the source of truth: it polls
``/v1/snapshots`` (per group and type, how many proxies have the current version: cheap at any
fleet size, where listing 10,000 proxies costs the server ~0.1 s) until every connected proxy has
taken the configuration (:func:`fleet_verdict`), and exits 0; at the timeout, or as soon as a
proxy rejects (NACKs) that configuration, or when fewer than ``--min-proxies`` (default 1: a
gate must not pass when the fleet is gone) are connected at the timeout, it reads
``/v1/proxies`` once and exits 1 naming the laggards and the NACK messages (:func:`laggards`).
What "taken" means, per proxy and per type it
was sent: it ACKed the version of its node group's current snapshot; a delta stream is sent
nothing when none of its resources changed, so there it is enough that it ACKed all it was sent
(the server counts the same way: ``current`` in ``/v1/snapshots``). ``--version V`` waits,
first, for a snapshot labelled ``V`` (a snapshot file's ``version``) to be the current one;
``--for-current`` (the default) waits for whatever is current, and for a change still being
debounced to be built first.

``rollout`` prints where the rollout of ``serve --rollout`` is (``/v1/rollout``, as
:func:`rollout_text`: phase, wave, candidate and baseline, who it waits for, the pause, the
bake's health, the held candidates; ``--json``: the answer as it is), and ``rollout promote``,
``pause``, ``resume`` and ``abort [--reason TEXT]`` command it (``POST /v1/rollout/<command>``).
A command that does not apply now is refused (409) with why: exit status 1.

``plan FILE`` sends FILE (a proposed snapshot file) to ``POST /v1/plan`` and prints what serving it
in place of the server's snapshot file would do, publishing nothing (:func:`plan_text`: per node
group and type ``+ added``, ``- removed``, ``~ changed`` with ``path: old -> new`` lines; then the
validation, the guard, the rollout; ``--json``: the answer as it is): exit 0 when it would be
published (or changes nothing), 1 when it would be refused, held by the guard, not served (a
candidate the rollout held) or not published yet. ``plan FILE --against OLD_FILE`` asks no server
(:func:`plan_offline`): the diff against OLD_FILE and the validation only, as a server serving
OLD_FILE alone would build them.

When the admin API has tokens (``serve --admin-tokens``), each command sends one as
``Authorization: Bearer``: the first line of ``--token-file FILE``, else the environment variable
:data:`TOKEN_VARIABLE` (``PILOTFISH_ADMIN_TOKEN``); ``status``, ``wait``, ``plan`` and ``rollout [status]``
need ``read: true``, ``confirm`` and the rollout's commands need ``admin: true``. A refusal (401,
403) ends the command at once with the server's reason and exit status 2; an admin API that
cannot be reached, exit status 3.

Plain ``urllib``: the commands are one-shot and synchronous.
"""

from __future__ import annotations

import dataclasses
import json
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pilotfish.status import nack_summary

__all__ = [
    "MAX_PLAN_BYTES",
    "ROLLOUT_ACTIONS",
    "TOKEN_VARIABLE",
    "AdminClient",
    "AdminUnreachable",
    "Verdict",
    "admin_token",
    "client_context",
    "confirm_command",
    "fleet_verdict",
    "laggards",
    "plan_command",
    "plan_offline",
    "plan_text",
    "rollout_command",
    "rollout_text",
    "status_command",
    "status_table",
    "unhealthy",
    "wait_command",
]

TYPES = ("CDS", "EDS", "LDS", "RDS", "SDS")
"""Table columns, in ADS order."""
_VERSION_CHARS = 12
_NACK_CHARS = 300
TOKEN_VARIABLE = "PILOTFISH_ADMIN_TOKEN"
"""The environment variable holding the admin API token, when no ``--token-file`` is given."""
MAX_TOKEN_FILE = 4096
"""Bytes of a token file read (a token is 43 characters; `pilotfish token new`)."""
EXIT_REFUSED = 2
EXIT_UNREACHABLE = 3
ROLLOUT_ACTIONS = ("status", "promote", "pause", "resume", "abort")
"""What ``pilotfish rollout`` does: show the rollout, or one of the operator's commands."""
_HELD_LINES = 5
_REASON_CHARS = 300
MAX_PLAN_BYTES = 16 * 1024 * 1024
"""The largest file ``plan`` sends (the admin API's :data:`~pilotfish.api.admin.MAX_PLAN_BODY`)."""
PLAN_TIMEOUT = 120.0
"""Seconds ``plan`` waits for its answer (a large file takes a while to build), and for a busy
server (429: one plan at a time) to take it."""
_VALUE_CHARS = 120


class AdminUnreachable(Exception):
    """The admin API did not answer (or not with JSON)."""


def client_context(*, ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The TLS context to reach an admin API served over TLS (None: plain HTTP). Raises
    ``ValueError`` (or ``OSError``, naming the file) when the files are incomplete or unreadable."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--tls-cert and --tls-key are for an admin API over TLS: give --tls-ca FILE too")
        return None
    if (cert is None) != (key is None):
        raise ValueError("give both --tls-cert FILE and --tls-key FILE, or neither")
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None and key is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def admin_token(path: Path | None, environ: Mapping[str, str]) -> str | None:
    """The token to send: the first line of ``path``, else :data:`TOKEN_VARIABLE` of
    ``environ``; None: none. Raises ``ValueError`` (or ``OSError``) naming the file when it
    holds no token or cannot be read."""
    if path is None:
        return environ.get(TOKEN_VARIABLE, "").strip() or None
    with path.open("rb") as file:
        data = file.read(MAX_TOKEN_FILE)
    lines = data.decode("utf-8", "replace").splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"--token-file {path}: the file is empty; its first line must be the token")
    return token


@dataclass(frozen=True, slots=True)
class AdminClient:
    """How a command reaches the admin API: ``address`` (``host:port``), over TLS with ``tls``,
    sending ``token`` as a bearer token."""

    address: str
    tls: ssl.SSLContext | None = None
    token: str | None = None
    timeout: float = 10.0
    """Seconds one request may take."""

    def get_json(self, path: str, *, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        """(HTTP status, decoded body) of ``method path`` (sending ``body`` as JSON, if given).
        Raises :class:`AdminUnreachable`."""
        data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
        return self.request(path, method=method, data=data, content_type="application/json" if body is not None else "")

    def request(
        self, path: str, *, method: str = "GET", data: bytes | None = None, content_type: str = ""
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body) of ``method path`` sending ``data`` (as
        ``content_type``). Raises :class:`AdminUnreachable`."""
        url = f"{'http' if self.tls is None else 'https'}://{self.address}{path}"
        request = urllib.request.Request(url, method=method, data=data)
        if content_type:
            request.add_header("Content-Type", content_type)
        if self.token is not None:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.tls) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read())
            except ValueError:
                raise AdminUnreachable(f"{url}: HTTP {exc.code}, not JSON") from None
        except (OSError, ValueError) as exc:
            raise AdminUnreachable(f"{url}: {exc} (is `pilotfish serve --admin {self.address}` running?)") from None


def _short(version: str | None) -> str:
    if not version:
        return "-"
    return version if len(version) <= _VERSION_CHARS else version[:_VERSION_CHARS]


def _cell(status: Mapping[str, Any] | None) -> str:
    if status is None or status["state"] == "NOT_SENT":
        return "-"
    state = status["state"]
    if state == "STALE":
        return f"STALE {_short(status['sent_version'])} ({status.get('stale_for', 0):.0f}s)"
    if state == "NACKED":
        return f"NACKED {_short(status['nack'].get('version'))}"
    return f"{state} {_short(status['acked_version'])}"


def _reason(message: str) -> str:
    """A NACK message in one line that keeps the resource's name and Envoy's reason."""
    return nack_summary(message, _NACK_CHARS)


def status_table(proxies: Sequence[Mapping[str, Any]]) -> str:
    """The proxies as a table, then one line per NACK with Envoy's reason."""
    header = ("NAME", "CLUSTER", "GROUP", *TYPES, "AGENT")
    rows = [header]
    nacks = []
    for proxy in proxies:
        types = proxy["types"]
        agent = " ".join(part for part in (proxy["user_agent"], proxy["user_agent_version"]) if part)
        rows.append(
            (
                proxy["node"],
                proxy["cluster"] or "-",
                proxy["group"],
                *(_cell(types.get(t)) for t in TYPES),
                agent or "-",
            )
        )
        for short, status in types.items():
            if status["state"] == "NACKED":
                nack = status["nack"]
                nacks.append(f"{proxy['node']} rejected {short} {nack.get('version')}: {_reason(nack['message'])}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    if nacks:
        lines += ["", *nacks]
    return "\n".join(lines) + "\n"


def unhealthy(proxies: Sequence[Mapping[str, Any]], *, stale_grace: float) -> list[str]:
    """One line per proxy and type that is NACKED, or STALE for longer than ``stale_grace`` seconds:
    what makes ``status`` exit 1."""
    problems = []
    for proxy in proxies:
        for short, status in sorted(proxy["types"].items()):
            if status["state"] == "NACKED":
                problems.append(f"{proxy['node']}: {short} NACKED {status['nack'].get('version')}")
            elif status["state"] == "STALE" and status.get("stale_for", 0) > stale_grace:
                problems.append(
                    f"{proxy['node']}: {short} STALE {_short(status['sent_version'])} for {status['stale_for']:.0f}s"
                )
    return problems


def status_command(
    admin: AdminClient,
    *,
    node: str | None,
    cluster: str | None,
    state: str | None,
    out: TextIO,
    err: TextIO,
    stale_grace: float = 30.0,
    as_json: bool = False,
) -> int:
    """Print the proxies table (filters are globs; ``state``: rows with a type in that state), or
    (``as_json``) ``{"proxies": [...], "problems": [...]}``. 0: every proxy shown is well; 1: one
    has NACKED, or been STALE longer than ``stale_grace`` seconds (:func:`unhealthy`, named on
    ``err``); 2: the token is missing or falls short; 3: the admin API cannot be reached."""
    query = urllib.parse.urlencode(
        {key: value for key, value in (("node", node), ("cluster", cluster), ("state", state)) if value}
    )
    try:
        code, body = admin.get_json("/v1/proxies" + (f"?{query}" if query else ""))
    except AdminUnreachable as exc:
        print(f"pilotfish status: {exc}", file=err)
        return 3
    if code != 200:
        print(f"pilotfish status: {body.get('error', body)}", file=err)
        return 2
    proxies = body["proxies"]
    problems = unhealthy(proxies, stale_grace=stale_grace)
    if as_json:
        out.write(json.dumps({"proxies": proxies, "problems": problems}, indent=2, sort_keys=True) + "\n")
    elif not proxies:
        print("no proxy is connected" + (" that matches" if query else ""), file=out)
    else:
        out.write(status_table(proxies))
    return _report_problems(problems, err)


def _report_problems(problems: list[str], err: TextIO) -> int:
    """``pilotfish status``'s problems on stderr; its exit status (1: some, 0: none)."""
    if not problems:
        return 0
    print(f"pilotfish status: {len(problems)} problem(s):", file=err)
    for problem in problems:
        print(f"  {problem}", file=err)
    return 1


def _node_matcher(glob: str) -> Any:
    """``--node GLOB`` as a CSDS node matcher: exact without ``*``, else a regex of the glob."""
    from envoy.type.matcher.v3 import node_pb2, regex_pb2, string_pb2

    inner = glob.strip("*")
    if "*" not in glob:
        return node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(exact=glob))
    if "*" not in inner:  # edge-*, *.sidecar, *mesh*: no regex needed
        kind = (
            "contains"
            if glob.startswith("*") and glob.endswith("*")
            else "suffix"
            if glob.startswith("*")
            else "prefix"
        )
        return node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(**{kind: inner}))
    pattern = ".*".join(re.escape(part) for part in glob.split("*"))
    return node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern)))


def csds_command(
    address: str,
    *,
    tls: ssl.SSLContext | None,
    token: str | None,
    node: str | None,
    out: TextIO,
    err: TextIO,
    as_json: bool = False,
    timeout: float = 10.0,
) -> int:
    """``pilotfish status --csds HOST:PORT``: the proxies as CSDS (FetchClientStatus) gives them,
    on the admin gRPC port (or the xDS port with ``--csds-on-xds``); a row per proxy and type (how
    many resources, their version if they share one, their statuses counted), or (``as_json``)
    the ClientStatusResponse in proto3 JSON, a resource at a time. 0: no type NACKED; 1: one is (named on
    ``err``); 2: refused (token, bad matcher); 3: unreachable."""
    from envoy.admin.v3 import config_dump_shared_pb2
    from envoy.service.status.v3 import csds_pb2
    from google.protobuf import json_format

    from pilotfish.transport.unary import CallFailed, unary_call

    request = csds_pb2.ClientStatusRequest()
    if node:
        request.node_matchers.append(_node_matcher(node))
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    path = "/envoy.service.status.v3.ClientStatusDiscoveryService/FetchClientStatus"
    try:
        data = unary_call(address, path, request.SerializeToString(), tls=tls, metadata=metadata, timeout=timeout)
    except CallFailed as exc:
        print(f"pilotfish status --csds {address}: {exc.message}", file=err)
        return 3 if exc.code in (4, 14) else 2
    response = csds_pb2.ClientStatusResponse.FromString(data)
    names = config_dump_shared_pb2.ClientResourceStatus.Name
    problems = []
    rows = [("NODE", "TYPE", "RESOURCES", "VERSION", "STATUS", "ERROR")]
    for config in response.config:
        # A row per type: its resources' statuses counted (a type listed whole counts as one).
        by_type: dict[str, list[Any]] = {}
        for xds in config.generic_xds_configs:
            by_type.setdefault(xds.type_url.rsplit(".", 1)[-1], []).append(xds)
        for short, entries in by_type.items():
            statuses = Counter(names(xds.client_status) for xds in entries)
            if len(statuses) == 1:
                status = next(iter(statuses))
            else:
                status = ", ".join(f"{name} {n}" for name, n in sorted(statuses.items()))
            versions = {xds.version_info for xds in entries if xds.version_info}
            version = versions.pop() if len(versions) == 1 else f"{len(versions)} versions" if versions else "-"
            errors = [xds.error_state.details for xds in entries if xds.HasField("error_state")]
            error = nack_summary(errors[0]) if errors and statuses.get("NACKED") else ""
            count = "-" if len(entries) == 1 and not entries[0].name else str(len(entries))
            rows.append((config.node.id, short, count, version, status, error))
            if statuses.get("NACKED"):
                problems.append(f"{config.node.id} NACKED {short}: {error}")
    if as_json:
        out.write(json_format.MessageToJson(response, indent=2, sort_keys=True) + "\n")
    elif not response.config:
        print("no proxy is connected" + (" that matches" if node else ""), file=out)
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            out.write(
                "  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True))
                + f"  {row[5]}".rstrip()
                + "\n"
            )
    return _report_problems(problems, err)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where the fleet stands against the configuration waited for."""

    done: bool
    """Every connected proxy has it (and there are enough of them)."""
    rejected: bool
    """A proxy NACKed it: waiting longer will not help until the source changes."""
    problems: tuple[str, ...]
    """One line per laggard (and what else is missing), naming the proxy and, for a NACK, Envoy's reason."""
    proxies: int


def _waiting_on(snapshots: Mapping[str, Any], *, version: str | None) -> list[str]:
    problems = []
    if version is None and snapshots.get("pending"):
        problems.append("a change is still being built (debounce)")
    if snapshots.get("held"):
        problems.append(
            f"snapshot {snapshots['held']['version']} is held by the blast-radius guard: "
            "`pilotfish confirm` publishes it"
        )
    return problems


def fleet_verdict(snapshots: Mapping[str, Any], *, version: str | None = None, min_proxies: int = 0) -> Verdict:
    """Judge ``/v1/snapshots`` alone: per node group with connected proxies, is its snapshot the
    one waited for, and does every proxy it was sent to have it (``current``)?"""
    problems = _waiting_on(snapshots, version=version)
    rejected = False
    connected: Mapping[str, int] = snapshots.get("connected", {})
    total = sum(connected.values())
    if total < min_proxies:
        problems.append(f"{total} of at least {min_proxies} proxies connected")
    rollout = snapshots.get("rollout")
    if rollout and rollout.get("latest_held"):
        rejected = True  # (its proxies are served the baseline again: nothing else would say so)
        problems.append(f"the change was rolled back and is held: {rollout['latest_held']}")
    for group in sorted(connected):
        current = snapshots["groups"].get(group)
        if current is None:
            problems.append(f"node group {group!r}: nothing is published for it")
            continue
        if version is not None and current["label"] != version:
            problems.append(f"node group {group!r} is served {current['label']}, not {version} (yet)")
            continue
        for short, progress in sorted(current["types"].items()):
            if progress["nacked"]:
                rejected = True
            if progress["current"] < progress["proxies"]:
                problems.append(
                    f"node group {group!r}: {short} {progress['version']}: {progress['current']} of "
                    f"{progress['proxies']} proxies have it, {progress['nacked']} rejected it"
                )
    return Verdict(not problems, rejected, tuple(problems), total)


def laggards(
    proxies: Sequence[Mapping[str, Any]],
    snapshots: Mapping[str, Any],
    *,
    version: str | None = None,
    min_proxies: int = 0,
) -> Verdict:
    """Judge ``/v1/proxies`` (connected ones) against ``/v1/snapshots``: see the module docstring."""
    groups = snapshots["groups"]
    problems = _waiting_on(snapshots, version=version)
    rejected = False
    connected = [proxy for proxy in proxies if proxy.get("connected", True)]
    if len(connected) < min_proxies:
        problems.append(f"{len(connected)} of at least {min_proxies} proxies connected")
    for proxy in connected:
        name, group = proxy["node"], proxy["group"]
        current = groups.get(group)
        if current is None:
            problems.append(f"{name}: nothing is published for its node group {group!r}")
            continue
        if version is not None and current["label"] != version:
            problems.append(f"{name}: its node group {group!r} is served {current['label']}, not {version} (yet)")
            continue
        behind = []
        for short, status in sorted(proxy["types"].items()):
            state = status["state"]
            target = current["types"].get(short, {}).get("version")
            if state == "NOT_SENT" or target is None:
                continue
            if state == "NACKED":
                nack = status["nack"]
                rejected = rejected or nack.get("version") == target
                behind.append(f"{short} NACKED {nack.get('version')}: {_reason(nack['message'])}")
            elif state == "STALE":
                behind.append(f"{short} STALE {_short(status['sent_version'])} for {status.get('stale_for', 0):.1f}s")
            elif status["acked_version"] != target and proxy.get("protocol") != "delta":
                behind.append(f"{short} at {_short(status['acked_version'])}, not {_short(target)}")
        if behind:
            problems.append(f"{name}: " + "; ".join(behind))
    return Verdict(not problems, rejected, tuple(problems), len(connected))


def wait_command(
    admin: AdminClient,
    *,
    version: str | None,
    timeout: float,
    min_proxies: int,
    out: TextIO,
    err: TextIO,
    every: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll until :func:`fleet_verdict` says done (0), a proxy rejected the configuration (1), or
    the timeout passed (1, naming the laggards: :func:`laggards`); 3 if the admin API cannot be
    reached; 2 if it refuses the request (a token is missing or falls short)."""
    deadline = clock() + timeout
    while True:
        try:
            code, snapshots = admin.get_json("/v1/snapshots")
            if code in (401, 403):
                print(f"pilotfish wait: {snapshots.get('error', snapshots)}", file=err)
                return EXIT_REFUSED
            verdict = fleet_verdict(snapshots, version=version, min_proxies=min_proxies)
            if verdict.done:
                served = sorted(snapshots["connected"])
                labels = ", ".join(
                    f"{snapshots['groups'][group]['label']}" + (f" ({group})" if len(served) > 1 else "")
                    for group in served
                )
                count = verdict.proxies
                print(f"{count} prox{'y has' if count == 1 else 'ies have'} {labels or 'nothing'}", file=out)
                return 0
            if verdict.rejected or clock() >= deadline:
                _, proxies = admin.get_json("/v1/proxies")
                named = laggards(proxies["proxies"], snapshots, version=version, min_proxies=min_proxies)
                break
        except AdminUnreachable as exc:
            if clock() >= deadline:
                print(f"pilotfish wait: {exc}", file=err)
                return 3
        sleep(every)
    if verdict.rejected:
        why = "a proxy rejected the configuration"
    elif verdict.proxies < min_proxies:
        needed = f"{min_proxies} prox{'y' if min_proxies == 1 else 'ies'}"
        why = f"{verdict.proxies} of at least {needed} connected after {timeout:g}s"
    else:
        why = f"not every proxy has it after {timeout:g}s"
    print(f"pilotfish wait: {why}:", file=err)
    for problem in named.problems or verdict.problems:
        print(f"  {problem}", file=err)
    return 1


def confirm_command(admin: AdminClient, *, out: TextIO, err: TextIO) -> int:
    """Publish the snapshot the blast-radius guard holds (``POST /v1/held/confirm``)."""
    try:
        code, body = admin.get_json("/v1/held/confirm", method="POST")
    except AdminUnreachable as exc:
        print(f"pilotfish confirm: {exc}", file=err)
        return 3
    if code != 200:
        print(f"pilotfish confirm: {body.get('error', body)}", file=err)
        return EXIT_REFUSED if code in (401, 403) else 1
    held = body["confirmed"]
    print(f"published {held['version']} ({'; '.join(held['reasons'])})", file=out)
    return 0


# -- the rollout -------------------------------------------------------------------------------------


def _for(seconds: float) -> str:
    """A duration as people read it: ``45s``, ``12 min``, ``3.5 h``."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.2f} %"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def rollout_text(status: Mapping[str, Any]) -> str:
    """``/v1/rollout`` as ``pilotfish rollout`` prints it: one line per thing an operator asks
    (what rolls out over what, which wave and phase, the pause, who is awaited, the bake's health,
    the proxies, the held candidates), a label first."""
    now = status.get("now") or time.time()
    waves = list(status.get("waves") or [])
    lines: list[tuple[str, str]] = []
    candidate, baseline = status.get("candidate"), status.get("baseline")
    if candidate is None:
        lines.append(
            (
                "rollout",
                "none in progress: every proxy is served the baseline " + _short(baseline)
                if baseline
                else "none yet: nothing is published",
            )
        )
        lines.append(("waves", f"{', '.join(waves)} (types {', '.join(status.get('types') or [])})"))
        lines.append(("proxies", f"{status.get('proxies', 0)} connected"))
    else:
        lines.append(("rollout", f"{_short(candidate)} over baseline {_short(baseline)}"))
        index = status.get("wave_index")
        where = f" ({index + 1} of {len(waves)}: {', '.join(waves)})" if isinstance(index, int) else ""
        started = status.get("wave_started")
        since = f", for {_for(now - started)}" if started else ""
        lines.append(("phase", f"{status['phase']}, wave {status.get('wave')}{where}{since}"))
        paused = status.get("paused")
        if paused == "operator":
            lines.append(("paused", "by the operator: no further wave starts; `pilotfish rollout resume` goes on"))
        elif paused:
            lines.append(("paused", f"{_clip(paused)}; `pilotfish rollout promote` goes on, `abort` rolls back"))
        deadline = status.get("deadline")
        if status["phase"] == "acking":
            count = status.get("waiting", 0)
            named = list(status.get("waiting_proxies") or [])
            more = f" and {count - len(named)} more" if count > len(named) else ""
            timeout = f" (ACK timeout in {_for(deadline - now)})" if deadline else ""
            who = f": {', '.join(named)}{more}" if named else ""
            lines.append(("waiting", f"{count} prox{'y' if count == 1 else 'ies'} to ACK the candidate{timeout}{who}"))
        elif status["phase"] == "baking":
            ends = status.get("bake_ends")
            if ends is None:
                baked = "baking"
            elif ends > now:
                baked = f"the bake ends in {_for(ends - now)}"
            else:
                baked = f"the bake ended {_for(now - ends)} ago" + (
                    ": the next wave waits for the pause" if paused else ""
                )
            lines.append(("baking", baked))
            health = status.get("health")
            if health:
                text = (
                    f"error ratio {_percent(health['error_ratio'])} of {health['requests']:,} requests; "
                    f"baseline {_percent(health['baseline_error_ratio'])} of {health['baseline_requests']:,}"
                )
                if health.get("reason"):
                    text += f" ({_clip(health['reason'])})"
                lines.append(("health", text))
        lines.append(("proxies", f"{status.get('on_candidate', 0)} of {status.get('proxies', 0)} on the candidate"))
    held = list(status.get("held") or [])
    count = status.get("held_count", len(held))
    if held:
        lines.append(("held", f"{count} candidate{'' if count == 1 else 's'}, never served again (the newest first):"))
    width = max(len(label) for label, _ in lines)
    out = [f"{label.ljust(width)}  {text}" for label, text in lines]
    shown = held[:_HELD_LINES]
    for entry in shown:
        out.append(f"  {_short(entry['candidate'])}  {_for(now - entry['at'])} ago  {_clip(entry['reason'])}")
    if count > len(shown):
        listed = f" (--json lists the newest {len(held)})" if len(held) > len(shown) else ""
        out.append(f"  ... and {count - len(shown)} older{listed}")
    return "\n".join(out) + "\n"


def _done(action: str, answer: Mapping[str, Any]) -> str:
    """What a rollout command did, in a line, from its answer (the rollout after it)."""
    was = _short(answer.get("candidate"))
    after = answer["rollout"]
    now_at = f"wave {after.get('wave')} ({after['phase']})"
    if action == "abort":
        baseline = _short(after.get("baseline"))
        return f"aborted the rollout of {was}: every proxy is served the baseline {baseline}; {was} is held"
    if after.get("candidate") is None:
        return (
            f"{action}d the rollout of {was}: it completed, {_short(after.get('baseline'))} is every proxy's baseline"
        )
    if action == "pause":
        return f"paused the rollout of {was} at {now_at}: no further wave starts until `pilotfish rollout resume`"
    return f"{action}d the rollout of {was}: now {now_at}"


def rollout_command(
    admin: AdminClient, action: str, *, reason: str | None = None, as_json: bool = False, out: TextIO, err: TextIO
) -> int:
    """``pilotfish rollout [status]``: print the rollout; ``promote``, ``pause``, ``resume``,
    ``abort``: command it. 0 done; 1 refused (the command does not apply now, 409; or no rollout
    runs, 404), with the server's reason on ``err``; 2 the token is missing or falls short; 3 the
    admin API cannot be reached."""
    name = f"pilotfish rollout {action}"
    try:
        if action == "status":
            code, body = admin.get_json("/v1/rollout")
        else:
            code, body = admin.get_json(
                f"/v1/rollout/{action}", method="POST", body={"reason": reason} if reason else None
            )
    except AdminUnreachable as exc:
        print(f"{name}: {exc}", file=err)
        return EXIT_UNREACHABLE
    if code != 200:
        return _refused(name, code, body, err)
    if as_json:
        out.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
    elif action == "status":
        out.write(rollout_text(body))
    else:
        print(_done(action, body), file=out)
    return 0


# -- plans -------------------------------------------------------------------------------------------


def _value(value: Any) -> str:
    """A JSON value of a field change, on one line (None: the field is absent)."""
    if value is None:
        return "(none)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun.replace('proxy', 'proxie')}s"


def _type_lines(short: str, diff: Mapping[str, Any]) -> list[str]:
    counts, left_out = diff["counts"], diff["left_out"]
    summary = ", ".join(f"{counts[what]} {what}" for what in ("added", "removed", "changed") if counts[what])
    lines = [f"  {short}: {summary}"]
    lines += [f"    + {name}" for name in diff["added"]]
    lines += [f"    - {name}" for name in diff["removed"]]
    for change in diff["changed"]:
        lines.append(f"    ~ {change['name']}")
        for field in change["changes"]:
            lines.append(f"        {field['path']}: {_value(field['old'])} -> {_value(field['new'])}")
        if change["changes_left_out"]:
            lines.append(f"        ... and {change['changes_left_out']} more changes")
    for what in ("added", "removed", "changed"):
        if left_out[what]:
            lines.append(f"    ... and {left_out[what]} more {what} (not listed)")
    return lines


def _guard_text(guard: Mapping[str, Any]) -> str:
    if not guard["enabled"]:
        return "off (serve --guard off): it would hold nothing"
    removes = "; ".join(
        f"removes {count['removed']} of {count['before']} {what}" for what, count in sorted(guard["counts"].items())
    )
    if guard["hold"]:
        return f"would HOLD it: {'; '.join(guard['reasons'])} (`pilotfish confirm` would publish it)"
    return "would not hold it" + (f" ({removes})" if removes else "")


def _rollout_text(rollout: Mapping[str, Any] | None) -> str:
    if rollout is None:
        return "none (serve runs no --rollout): every proxy would get it at once"
    decision = rollout["decision"]
    supersedes = rollout.get("supersedes")
    superseded = f"; the rollout of {_short(supersedes)} in progress would be superseded" if supersedes else ""
    if decision == "roll out":
        waves = ", ".join(f"{wave['name']} ({_counted(wave['proxies'], 'proxy')})" for wave in rollout["waves"])
        types = ", ".join(rollout.get("types") or [])
        paused = "; its first wave would stay paused (the operator paused the rollout)" if rollout.get("paused") else ""
        return f"in waves ({types} changes): {waves}{superseded}{paused}"
    if decision == "both":
        return "all at once: only types that do not roll out change (endpoints); a rollout in progress goes on"
    if decision == "initial":
        return "all at once: the first change, every proxy's baseline"
    if decision == "unchanged":
        return "the candidate already rolling out: nothing moves"
    if decision == "baseline":
        return f"back to the baseline: every proxy would be served it{superseded}"
    if decision == "held":
        return (
            f"NOT SERVED: this change was rolled back and is held ({_clip(rollout.get('held') or '')}); "
            f"every proxy would keep the baseline{superseded}"
        )
    return str(decision)


_VERDICTS = {
    "publish": "would be published",
    "no change": "no change: the server would serve what it serves now",
    "refuse": "would be REFUSED (the last good snapshot keeps serving)",
    "hold": "would be HELD by the blast-radius guard until confirmed",
    "wait": "would not be published yet: the server waits for a source",
    "not served": "would be published, but NOT SERVED: the rollout holds that change",
}


def plan_text(plan: Mapping[str, Any], *, file: str = "", against: str = "") -> str:
    """A plan (``POST /v1/plan``'s answer) as ``pilotfish plan`` prints it: per node group and type
    what is added (``+``), removed (``-``) and changed (``~``, with ``path: old -> new``), then
    lines for the validation, the waiting, the guard, the rollout and the verdict."""
    lines: list[str] = []
    offline = plan.get("offline")
    if offline:
        lines.append(
            f"offline plan: {file or 'FILE'} against {against or 'OLD_FILE'}: the diff and the validation only "
            "(no guard, rollout or proxies: those are a server's; `pilotfish plan FILE` asks one)"
        )
    verdict = plan["verdict"]
    problems = plan["problems"]
    if not problems and verdict != "no change":
        for group, entry in plan["groups"].items():
            proxies = entry.get("proxies")
            connected = "" if proxies is None else f" ({_counted(proxies, 'proxy')} connected)"
            if not entry["changed"]:
                lines.append(f"node group {group}{connected}: no change")
                continue
            before = _short(entry["before"]) if entry["before"] else "nothing"
            lines.append(f"node group {group}{connected}: {before} -> {_short(entry['after'])}")
            if not entry["types"]:
                lines.append("  only which endpoints each proxy's subset holds")
            for short, diff in entry["types"].items():
                lines.extend(_type_lines(short, diff))
    labels: list[tuple[str, str]] = []
    if problems:
        labels.append(("validation", f"{len(problems)} problem(s) in {plan['sources']}:"))
    else:
        labels.append(("validation", "ok"))
    width = 10
    lines += [f"{label.ljust(width)}  {text}" for label, text in labels]
    lines += [
        f"  {problem['where']}: {problem['message']}" if problem["where"] else f"  {problem['message']}"
        for problem in problems
    ]
    more: list[tuple[str, str]] = []
    if plan.get("waiting_for"):
        more.append(("waiting", "for " + ", ".join(plan["waiting_for"]) + ": nothing is published before they report"))
    if not problems and verdict != "no change":
        if plan.get("guard") is not None:
            more.append(("guard", _guard_text(plan["guard"])))
        if not offline:
            more.append(("rollout", _rollout_text(plan.get("rollout"))))
    more.append(("verdict", _VERDICTS.get(verdict, verdict)))
    lines += [f"{label.ljust(width)}  {text}" for label, text in more]
    return "\n".join(lines) + "\n"


def _plan_exit(verdict: str) -> int:
    return 0 if verdict in ("publish", "no change") else 1


def plan_command(
    admin: AdminClient,
    path: Path,
    *,
    as_json: bool = False,
    out: TextIO,
    err: TextIO,
    timeout: float = PLAN_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``pilotfish plan FILE``: what serving FILE in place of the server's snapshot file would do
    (``POST /v1/plan``). 0: it would be published, or changes nothing; 1: it would be refused,
    held, not served or not published yet (or the server refused the request: too large); 2: the
    file cannot be read, or the token is missing or falls short; 3: the admin API cannot be reached."""
    name = "pilotfish plan"
    try:
        size = path.stat().st_size
        if size > MAX_PLAN_BYTES:
            print(f"{name}: {path} is {size:,} bytes; a plan takes files of at most {MAX_PLAN_BYTES:,}", file=err)
            return 1
        data = path.read_bytes()
    except OSError as exc:
        print(f"{name}: cannot read {path}: {exc.strerror or exc}", file=err)
        return EXIT_REFUSED
    shown = str(path) if len(str(path)) <= 256 else path.name[-256:]
    query = urllib.parse.urlencode({"name": shown})
    content_type = "application/json" if path.suffix == ".json" else "application/yaml"
    client = dataclasses.replace(admin, timeout=timeout)
    deadline = clock() + timeout
    try:
        while True:
            code, body = client.request(f"/v1/plan?{query}", method="POST", data=data, content_type=content_type)
            if code != 429 or clock() >= deadline:
                break
            sleep(1.0)  # another plan is being made: one at a time
    except AdminUnreachable as exc:
        print(f"{name}: {exc}", file=err)
        return EXIT_UNREACHABLE
    if code != 200:
        return _refused(name, code, body, err)
    out.write(json.dumps(body, indent=2, sort_keys=True) + "\n" if as_json else plan_text(body, file=str(path)))
    return _plan_exit(body["verdict"])


def plan_offline(path: Path, against: Path, *, as_json: bool = False, out: TextIO, err: TextIO) -> int:
    """``pilotfish plan FILE --against OLD_FILE``, with no server: what a server serving OLD_FILE
    alone would make of FILE, by the reconciler's own build (:meth:`~pilotfish.reconcile.Reconciler.plan`):
    the diff and the validation, no guard, rollout or proxies. 0 and 1 as :func:`plan_command`;
    2 when OLD_FILE cannot be read or built (there is nothing to compare with)."""
    from pilotfish.cache import SnapshotCache
    from pilotfish.errors import ConfigError
    from pilotfish.reconcile import BuildOptions, GuardSettings, Plan, Reconciler
    from pilotfish.sources.file import SOURCE, load_desired

    for given in (path, against):
        try:
            given.stat()
        except OSError as exc:
            print(f"pilotfish plan: cannot read {given}: {exc.strerror or exc}", file=err)
            return EXIT_REFUSED
    reconciler = Reconciler(
        SnapshotCache(), guard=GuardSettings(enabled=False), build=BuildOptions(labels={SOURCE: str(against)})
    )
    try:
        old = load_desired(against)
        # Checked before it is published: a refused build would be logged as a server's.
        first = reconciler.plan(SOURCE, old)
        if first.problems:
            raise ConfigError(first.sources, first.problems)
    except ConfigError as exc:
        print(f"pilotfish plan: --against {against} cannot be built, so there is nothing to compare with:", file=err)
        print(exc.describe(), file=err)
        return EXIT_REFUSED
    reconciler.update(SOURCE, old)
    reconciler.build_now()
    try:
        plan = dataclasses.replace(reconciler.plan(SOURCE, load_desired(path), label=str(path)), guard=None)
    except ConfigError as exc:
        plan = Plan(sources=str(path), problems=exc.problems)
    answer = plan.to_json(offline=True)
    if as_json:
        out.write(json.dumps(answer, indent=2, sort_keys=True) + "\n")
    else:
        out.write(plan_text(answer, file=str(path), against=str(against)))
    return _plan_exit(answer["verdict"])


def _refused(name: str, code: int, body: Any, err: TextIO) -> int:
    """Say what the admin API answered instead of 200; the exit code for it (2: the token, 1: refused)."""
    message = body.get("error", body) if isinstance(body, dict) else body
    print(f"{name}: {message}", file=err)
    return EXIT_REFUSED if code in (401, 403) else 1
