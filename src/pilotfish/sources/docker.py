"""Docker engines as a source: running containers with labels become endpoints.

``serve --docker unix:///var/run/docker.sock`` (or ``tcp://HOST:PORT``, with TLS) lists the
engine's running containers, then follows its event stream (``/events``); each engine is a source
of its own, named ``docker:<url>``, merged with the others like any source. What a container's
labels say it serves (:func:`read_labels`) is an endpoint while the container runs, is not
paused, and (when its image or ``docker run`` has a HEALTHCHECK) is ``healthy``.

Labels (docs/sources.md has the table): pilotfish's own, ``pilotfish.service``
(``NAME[:PORT][,NAME[:PORT]...]``: one container may serve several services), ``pilotfish.port``
(the container port of entries without one), ``pilotfish.weight``, ``pilotfish.zone`` and
``pilotfish.metadata.KEY``; or Sidecar's, ``ServiceName`` and ``ServicePort_<container port>=<service
port>`` (the service port is kept as the endpoint's ``service_port`` metadata). A container port
becomes the endpoint's port as the engine published it (``docker run -p``); a container on the host
network listens on the labelled port itself. The endpoint's address is the engine's host address
(``--docker URL@ADDRESS``; 127.0.0.1 for a local socket).

**Nothing missed between the list and the follow.** The event stream is opened first, then the
containers are listed; events that arrived meanwhile are read after the list and applied to it.
An event never carries the whole truth about a container, so each one that may change what it
serves makes the source look at the container again (``/containers/{id}/json``): applying events
late, twice, or out of order converges on what the engine says now.

**Stopping drains first.** A ``kill`` with a stopping signal (TERM, KILL, INT, QUIT; what ``docker
stop`` sends first) removes the container's endpoints at once, before it exits, so proxies stop
sending it new requests while it finishes the ones it has; ``stop`` does too. It serves again only
after a new ``start``. Pausing removes it (a paused process answers nothing); ``unpause`` puts it
back. A container that restarts in a loop is damped like any flapping endpoint (the reconciler's
flap damping).

**A lost engine keeps its last state.** When the event stream ends or breaks, or the engine stops
answering a ping (every ``ping_every`` seconds, so a half-open TCP connection is noticed), the
source says so (``docker_disconnected``) and keeps serving what it last listed; it tries again with
backoff and, once the engine answers, lists again, which replaces its whole view (a container
started meanwhile is found; one gone meanwhile goes). An engine that has not answered since the
start has reported nothing, and holds publication like any source that has not reported yet.

**Bad labels and a hostile engine.** A container whose labels cannot be used (a port that is not a
number, a service name Envoy cannot use) is reported once per problem (``docker_bad_label``, naming
the container and the label) and serves nothing; the others serve. What the engine sends is
bounded (:class:`DockerLimits`): the size of a listing, of one container's description, of one event,
and the number of containers; beyond them the engine is treated as broken, reported, and retried.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pilotfish.build.desired import DesiredState
from pilotfish.errors import Problem, shorten
from pilotfish.resources.services import MAX_WEIGHT, UNRESOLVED_NAME, Endpoint, is_service_name, is_zone

__all__ = [
    "SOURCE_PREFIX",
    "Container",
    "DockerEngine",
    "DockerFigures",
    "DockerLimits",
    "DockerSource",
    "DockerView",
    "Serves",
    "container_of_inspect",
    "container_of_summary",
    "parse_engine",
    "read_labels",
]

_log = logging.getLogger("pilotfish.sources.docker")

SOURCE_PREFIX = "docker:"
"""An engine's source is named ``docker:<url>``."""
API = "/v1.41"
"""The Engine API version spoken (Docker 20.10 and every later engine answer it)."""
LABEL_PREFIX = "pilotfish."
STOPPING_SIGNALS = frozenset(
    {"2", "3", "9", "15", "SIGINT", "SIGQUIT", "SIGKILL", "SIGTERM", "INT", "QUIT", "KILL", "TERM"}
)
"""``kill`` signals that end a container (``docker stop`` sends TERM; others, e.g. HUP, do not)."""
_LOOK_AGAIN = frozenset({"start", "unpause", "pause", "restart", "rename", "update", "oom"})
_GONE = frozenset({"die", "destroy"})
MAX_METADATA_CHARS = 4096
"""A container's ``pilotfish.metadata.*`` keys and values together, in characters."""


@dataclass(frozen=True, slots=True)
class DockerEngine:
    """One engine to follow (``--docker URL[@ADDRESS]``)."""

    url: str
    """``unix:///path/to/docker.sock`` or ``tcp://HOST:PORT``."""
    address: str
    """The host address its containers' endpoints get."""

    @property
    def source(self) -> str:
        """The source name (``docker:<url>``)."""
        return SOURCE_PREFIX + self.url

    @property
    def socket_path(self) -> str | None:
        return self.url.removeprefix("unix://") if self.url.startswith("unix://") else None

    @property
    def base(self) -> str:
        """The HTTP base URL of the Engine API (a unix socket is spoken to as ``http://docker``)."""
        return "http://docker" if self.socket_path is not None else "http://" + self.url.removeprefix("tcp://")


def parse_engine(text: str) -> DockerEngine:
    """``--docker URL[@ADDRESS]`` -> a :class:`DockerEngine`; ValueError saying what is wrong."""
    url, _, address = text.partition("@")
    if url.startswith("unix://"):
        if not url.removeprefix("unix://").startswith("/"):
            raise ValueError(f"--docker {text!r}: a socket is unix:///ABSOLUTE/PATH")
        address = address or "127.0.0.1"
    elif url.startswith("tcp://"):
        host, _, port = url.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--docker {text!r}: a TCP engine is tcp://HOST:PORT")
        if not address:
            try:
                ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                raise ValueError(
                    f"--docker {text!r}: say which address its containers are reached at: {url}@ADDRESS"
                ) from None
            address = host.strip("[]")
    else:
        raise ValueError(f"--docker {text!r}: expected unix:///PATH or tcp://HOST:PORT, optionally @ADDRESS")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"--docker {text!r}: @{address} is not an IP address") from None
    return DockerEngine(url=url, address=address)


@dataclass(frozen=True, slots=True, kw_only=True)
class DockerLimits:
    """What an engine may send: beyond, it is taken as broken (reported, retried)."""

    max_containers: int = 10_000
    """Running containers followed per engine (beyond: the rest are left out, and said so)."""
    max_listing: int = 64 * 1024 * 1024
    """Bytes of one container listing."""
    max_container: int = 4 * 1024 * 1024
    """Bytes of one container's description."""
    max_event: int = 1024 * 1024
    """Bytes of one event."""


@dataclass(frozen=True, slots=True)
class Container:
    """What the source needs to know of one container."""

    id: str
    name: str
    labels: Mapping[str, str]
    running: bool
    paused: bool
    health: str | None
    """``starting``, ``healthy`` or ``unhealthy``; None: it has no HEALTHCHECK."""
    host_network: bool
    published: Mapping[int, int]
    """Container TCP port -> the host port the engine published it on."""

    @property
    def serving(self) -> bool:
        """Whether its endpoints are served: running, not paused, and healthy if it is checked."""
        return self.running and not self.paused and self.health in (None, "healthy")


def _labels(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("labels are not a mapping of strings")
    return value


def container_of_summary(item: Mapping[str, Any]) -> Container:
    """One entry of ``GET /containers/json``; ValueError when it is not one."""
    try:
        state = item.get("State")
        status = str(item.get("Status") or "")
        health = (
            "unhealthy"
            if "(unhealthy)" in status
            else "healthy"
            if "(healthy)" in status
            else "starting"
            if "(health: starting)" in status
            else None
        )
        published: dict[int, int] = {}
        for port in item.get("Ports") or ():
            if port.get("Type") == "tcp" and port.get("PublicPort"):
                published.setdefault(int(port["PrivatePort"]), int(port["PublicPort"]))
        names = item.get("Names") or ["/" + str(item["Id"])[:12]]
        return Container(
            id=str(item["Id"]),
            name=str(names[0]).lstrip("/"),
            labels=_labels(item.get("Labels")),
            running=state in ("running", "paused"),
            paused=state == "paused",
            health=health,
            host_network=(item.get("HostConfig") or {}).get("NetworkMode") == "host",
            published=published,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a container listing entry: {exc!r}") from None


def container_of_inspect(document: Mapping[str, Any]) -> Container:
    """The answer of ``GET /containers/{id}/json``; ValueError when it is not one."""
    try:
        state = document["State"]
        health = state.get("Health") or {}
        published = {}
        for key, bindings in ((document.get("NetworkSettings") or {}).get("Ports") or {}).items():
            port, _, protocol = str(key).partition("/")
            if protocol == "tcp" and bindings:
                published[int(port)] = int(bindings[0]["HostPort"])
        return Container(
            id=str(document["Id"]),
            name=str(document.get("Name") or document["Id"][:12]).lstrip("/"),
            labels=_labels((document.get("Config") or {}).get("Labels")),
            running=bool(state.get("Running")),
            paused=bool(state.get("Paused")),
            health=health.get("Status") if health.get("Status") in ("starting", "healthy", "unhealthy") else None,
            host_network=(document.get("HostConfig") or {}).get("NetworkMode") == "host",
            published=published,
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(f"not a container description: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class Serves:
    """What a container's labels say it serves (nothing when any label is wrong)."""

    endpoints: tuple[tuple[str, Endpoint], ...] = ()
    """(service, endpoint) pairs."""
    problems: tuple[Problem, ...] = ()
    """What is wrong, each naming the container and the label."""
    labelled: bool = False
    """Whether it carries a service label at all (a container without one is not ours)."""


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() and 1 <= int(text) <= 65535 else None


_Wanted = list[tuple[str, int, dict[str, str]]]
"""(service, container port, metadata of its own) of each service a container serves."""


def _not_a_name(name: str) -> str:
    return f"{name!r} is not a service name (letters, digits, '-', '_' and '.')"


def _pilotfish_services(labels: Mapping[str, str], where: str, problems: list[Problem]) -> _Wanted:
    """``pilotfish.service`` (``NAME[:PORT],...``) and ``pilotfish.port``."""
    wanted: _Wanted = []
    default_port = None
    if LABEL_PREFIX + "port" in labels:
        default_port = _port(labels[LABEL_PREFIX + "port"].strip())
        if default_port is None:
            problems.append(
                Problem(f"{where} label pilotfish.port", f"expected a port 1-65535, got {labels['pilotfish.port']!r}")
            )
    label = f"{where} label pilotfish.service"
    for entry in labels[LABEL_PREFIX + "service"].split(","):
        name, colon, port_text = entry.strip().partition(":")
        port = _port(port_text.strip()) if colon else default_port
        if not is_service_name(name):
            problems.append(Problem(label, _not_a_name(name)))
        elif colon and port is None:
            problems.append(Problem(label, f"{entry.strip()!r}: expected NAME:PORT with a port 1-65535"))
        elif port is None and LABEL_PREFIX + "port" not in labels:
            problems.append(Problem(label, f"{name!r} has no port: write {name}:PORT or set pilotfish.port"))
        elif port is not None:
            wanted.append((name, port, {}))
    return wanted


def _sidecar_services(labels: Mapping[str, str], where: str, problems: list[Problem]) -> _Wanted:
    """Sidecar's ``ServiceName`` and ``ServicePort_<container port>=<service port>``."""
    name = labels["ServiceName"].strip()
    if not is_service_name(name):
        problems.append(Problem(f"{where} label ServiceName", _not_a_name(name)))
    ports = [(k, v) for k, v in sorted(labels.items()) if k.startswith("ServicePort_")]
    if not ports:
        problems.append(
            Problem(f"{where} label ServiceName", "needs a ServicePort_<container port>=<service port> label")
        )
    wanted: _Wanted = []
    for key, value in ports:
        inner, outer = _port(key.removeprefix("ServicePort_")), _port(value.strip())
        if inner is None or outer is None:
            problems.append(
                Problem(
                    f"{where} label {key}", f"expected ServicePort_<port>=<port>, ports 1-65535, got {key}={value!r}"
                )
            )
        elif is_service_name(name):
            wanted.append((name, inner, {"service_port": str(outer)}))
    return wanted


def _endpoint_labels(labels: Mapping[str, str], where: str, problems: list[Problem]) -> tuple[int, str, dict[str, str]]:
    """``pilotfish.weight``, ``pilotfish.zone`` and ``pilotfish.metadata.*``."""
    weight = 1
    if LABEL_PREFIX + "weight" in labels:
        text = labels[LABEL_PREFIX + "weight"].strip()
        if not text.isdigit() or not 1 <= int(text) <= MAX_WEIGHT:
            problems.append(
                Problem(f"{where} label pilotfish.weight", f"expected a whole number 1-{MAX_WEIGHT}, got {text!r}")
            )
        else:
            weight = int(text)
    zone = labels.get(LABEL_PREFIX + "zone", "").strip()
    if not is_zone(zone):
        problems.append(
            Problem(f"{where} label pilotfish.zone", f"{zone!r} is not a zone name (letters, digits, '-', '_', '.')")
        )
    prefix = LABEL_PREFIX + "metadata."
    metadata = {k.removeprefix(prefix): v for k, v in labels.items() if k.startswith(prefix)}
    if sum(len(k) + len(v) for k, v in metadata.items()) > MAX_METADATA_CHARS:
        problems.append(Problem(f"{where} labels {prefix}*", f"at most {MAX_METADATA_CHARS} characters in all"))
    if "" in metadata:
        problems.append(Problem(f"{where} label {prefix}", f"a metadata label names its key: {prefix}KEY"))
    if UNRESOLVED_NAME in metadata:
        problems.append(
            Problem(f"{where} label {prefix}{UNRESOLVED_NAME}", "pilotfish's own metadata key: use another")
        )
    return weight, zone, metadata


def read_labels(container: Container, host: str, *, engine: str = "") -> Serves:
    """The services ``container`` serves and its endpoint in each, at ``host`` (the engine's
    address); pilotfish's labels win over Sidecar's when a container has both. Each endpoint's
    metadata names the container (``container``) and, when given, the engine's URL (``engine``)."""
    labels = container.labels
    where = f"container {container.name}"
    problems: list[Problem] = []
    if LABEL_PREFIX + "service" in labels:
        wanted = _pilotfish_services(labels, where, problems)
    elif "ServiceName" in labels:
        wanted = _sidecar_services(labels, where, problems)
    else:
        return Serves()
    weight, zone, metadata = _endpoint_labels(labels, where, problems)
    endpoints = []
    for service, port, extra in wanted:
        host_port = port if container.host_network else container.published.get(port)
        if host_port is None:
            problems.append(
                Problem(
                    f"{where} label {f'ServicePort_{port}' if extra else 'pilotfish.service'}",
                    f"container port {port} is not published (docker run -p {port}) and the container is not "
                    "on the host network (--network host)",
                )
            )
            continue
        where_from = {"container": container.name, **({"engine": engine} if engine else {})}
        pairs = tuple(sorted({**metadata, **extra, **where_from}.items()))
        endpoints.append((service, Endpoint(host, host_port, weight, pairs, zone)))
    if problems:
        return Serves(problems=tuple(problems), labelled=True)
    return Serves(endpoints=tuple(endpoints), labelled=True)


@dataclass(slots=True)
class DockerView:
    """The containers of one engine and what each serves. Pure: no I/O."""

    host: str
    """The engine's host address (the endpoints')."""
    engine: str = ""
    """The engine's URL, in each endpoint's metadata ("": left out)."""
    max_containers: int = DockerLimits().max_containers
    containers: dict[str, Container] = field(default_factory=dict)
    serves: dict[str, Serves] = field(default_factory=dict)
    stopping: set[str] = field(default_factory=set)
    """Containers told to stop: served nothing until they start again."""
    left_out: int = 0
    """Containers beyond :attr:`max_containers` in the last listing or since."""
    changed: bool = False
    """Whether the last :meth:`event` may have changed what is served."""

    def replace(self, containers: Iterable[Container]) -> list[tuple[Container, Problem]]:
        """A listing: the view becomes exactly it (what was stopping and is still running stays
        stopping). Returns the label problems not reported before."""
        old, self.containers, self.left_out = self.containers, {}, 0
        old_serves, self.serves = self.serves, {}
        self.stopping &= {c.id for c in containers if c.running}
        fresh = []
        for container in containers:
            if len(self.containers) >= self.max_containers:
                self.left_out += 1
                continue
            fresh += self._put(container, old.get(container.id), old_serves.get(container.id))
        return fresh

    def put(self, container: Container) -> list[tuple[Container, Problem]]:
        """What the engine says of one container now; returns its label problems not reported before."""
        if not container.running:
            self.remove(container.id)
            return []
        if container.id not in self.containers and len(self.containers) >= self.max_containers:
            self.left_out += 1
            return []
        return self._put(container, self.containers.get(container.id), self.serves.get(container.id))

    def _put(
        self, container: Container, old: Container | None, old_serves: Serves | None
    ) -> list[tuple[Container, Problem]]:
        self.containers[container.id] = container
        if (
            old is not None
            and old_serves is not None
            and (old.labels, old.host_network, old.published, old.name)
            == (
                container.labels,
                container.host_network,
                container.published,
                container.name,
            )
        ):
            self.serves[container.id] = old_serves  # (the same labels and ports: the same endpoints)
            return []
        serves = self.serves[container.id] = read_labels(container, self.host, engine=self.engine)
        said = set(old_serves.problems) if old_serves is not None else set()
        return [(container, p) for p in serves.problems if p not in said]

    def remove(self, container_id: str) -> bool:
        """The container is gone (``die``, ``destroy``, or not running); whether it was known."""
        self.stopping.discard(container_id)
        self.serves.pop(container_id, None)
        return self.containers.pop(container_id, None) is not None

    def stop(self, container_id: str) -> bool:
        """Told to stop (``kill`` with a stopping signal, ``stop``): its endpoints go at once,
        until it starts again. Whether that is news."""
        if container_id not in self.containers or container_id in self.stopping:
            return False
        self.stopping.add(container_id)
        return True

    def event(self, event: Mapping[str, Any]) -> str | None:
        """Apply one event of the engine's stream: returns the id of a container to look at again
        (and :meth:`put`), or None; :attr:`changed` says whether what is served may have moved."""
        action = str(event.get("Action") or event.get("status") or "")
        actor = event.get("Actor") or {}
        container_id = str(actor.get("ID") or event.get("id") or "") if isinstance(actor, dict) else ""
        self.changed = False
        if not container_id or event.get("Type", "container") != "container":
            return None
        kind = action.partition(":")[0]
        if kind == "kill":
            signal = str((actor.get("Attributes") or {}).get("signal", "15"))
            if signal in STOPPING_SIGNALS:
                self.changed = self.stop(container_id)
            return None
        if kind == "stop":
            self.changed = self.stop(container_id)
            return None
        if kind in _GONE:
            self.changed = self.remove(container_id)
            return None
        if kind == "start":
            self.stopping.discard(container_id)
        return container_id if kind in _LOOK_AGAIN or kind == "health_status" else None

    def state(self) -> DesiredState:
        """The endpoints of every serving container, by service."""
        endpoints: dict[str, list[Endpoint]] = {}
        for container_id, serves in self.serves.items():
            if serves.endpoints and container_id not in self.stopping and self.containers[container_id].serving:
                for service, endpoint in serves.endpoints:
                    endpoints.setdefault(service, []).append(endpoint)
        return DesiredState(endpoints={name: tuple(found) for name, found in endpoints.items()})

    def describe(self, limit: int = 1_000) -> list[dict[str, Any]]:
        """The first ``limit`` labelled containers by name and what each serves (the admin API's)."""
        out: list[dict[str, Any]] = []
        for container_id, serves in sorted(self.serves.items(), key=lambda item: self.containers[item[0]].name):
            if not serves.labelled:
                continue
            if len(out) >= limit:
                break
            container = self.containers[container_id]
            out.append(
                {
                    "container": container.name,
                    "id": container_id[:12],
                    "serving": bool(serves.endpoints) and container.serving and container_id not in self.stopping,
                    "state": _state_of(container, stopping=container_id in self.stopping),
                    "endpoints": [{"service": s, "address": e.address} for s, e in serves.endpoints],
                    "problems": [str(p) for p in serves.problems],
                }
            )
        return out


def _state_of(container: Container, *, stopping: bool) -> str:
    if stopping:
        return "stopping"
    if container.paused:
        return "paused"
    return "running" if container.health is None else container.health


@dataclass(frozen=True, slots=True)
class DockerFigures:
    """What ``/metrics`` shows of one engine."""

    engine: str
    connected: bool
    containers: int
    """Running containers followed."""
    endpoints: int
    """Endpoints served now (of containers serving)."""
    bad: int
    """Containers whose labels cannot be used."""
    events: int
    listings: int


class EngineError(Exception):
    """The engine answered, but not as the API says (a status, a body too large, JSON that is not)."""


async def _read_lines(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The lines of a streamed body, each at most ``limit`` bytes (beyond: :class:`EngineError`)."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(buffer) > limit:
            raise EngineError(f"an event of more than {limit:,} bytes")


class DockerSource:
    """Follows one engine (see the module's docstring) and reports its state to ``on_state``."""

    def __init__(
        self,
        engine: DockerEngine,
        *,
        on_state: Callable[[DesiredState], None],
        on_event: Callable[..., None] | None = None,
        tls: ssl.SSLContext | None = None,
        limits: DockerLimits | None = None,
        backoff: tuple[float, float] = (0.2, 5.0),
        ping_every: float = 5.0,
    ) -> None:
        self.engine = engine
        self.limits = limits or DockerLimits()
        self.view = DockerView(engine.address, engine=engine.url, max_containers=self.limits.max_containers)
        self._on_state = on_state
        self._emit = on_event or (lambda *_, **__: None)
        self._tls = tls
        self._backoff = backoff
        self._ping_every = ping_every
        self.problem: str | None = "not contacted yet"
        """Why the engine is not being followed right now (None: it is)."""
        self.events = 0
        """Container events read."""
        self.listings = 0
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            path = self.engine.socket_path
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=path) if path is not None else aiohttp.TCPConnector(ssl=self._tls or False)
            )
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _url(self, path: str) -> str:
        scheme = "https" if self._tls is not None and self.engine.socket_path is None else "http"
        return scheme + self.engine.base.removeprefix("http") + API + path

    async def run(self) -> None:
        """Follow until cancelled; after any failure, keep the last state, wait, and start over."""
        delay = self._backoff[0]
        try:
            while True:
                try:
                    await self._follow()
                    reason = "the event stream ended"
                except (aiohttp.ClientError, OSError, EngineError, TimeoutError) as exc:
                    reason = str(exc) or type(exc).__name__
                if self.problem is None:
                    _log.warning(
                        "docker engine %s: %s; serving what it last said, and retrying", self.engine.url, reason
                    )
                    self._emit("docker_disconnected", engine=self.engine.url, reason=reason)
                    delay = self._backoff[0]
                self.problem = reason
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
        finally:
            if self._session is not None:
                await self._session.close()

    async def _follow(self) -> None:
        session = self._client()
        query = urllib.parse.quote(json.dumps({"type": ["container"]}))
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0)
        async with session.get(self._url(f"/events?filters={query}"), timeout=timeout) as events:
            if events.status != 200:
                raise EngineError(f"GET /events answered {events.status}")
            listed = await self._list()  # (after the stream opened: what happens meanwhile is in it)
            fresh = self.view.replace(listed)
            self.listings += 1
            self._report(fresh)
            self.problem = None
            self._emit(
                "docker_synced",
                engine=self.engine.url,
                containers=len(self.view.containers),
                endpoints=sum(len(s.endpoints) for s in self.view.serves.values()),
                bad=sum(1 for s in self.view.serves.values() if s.problems),
            )
            if self.view.left_out:
                _log.error(
                    "docker engine %s: %d running containers beyond the %d followed are left out",
                    self.engine.url,
                    self.view.left_out,
                    self.limits.max_containers,
                )
            self._on_state(self.view.state())
            tasks = {asyncio.ensure_future(self._read(events)), asyncio.ensure_future(self._ping_forever())}
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # (raises what ended it)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, events: aiohttp.ClientResponse) -> None:
        async for line in _read_lines(events.content, self.limits.max_event):
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise EngineError(f"an event that is not JSON: {shorten(line.decode(errors='replace'), 200)}") from None
            if isinstance(event, dict):
                await self._on_event(event)

    async def _ping_forever(self) -> None:
        """Raise once the engine stops answering (a stalled engine, a half-open connection)."""
        while True:
            await asyncio.sleep(self._ping_every)
            async with self._client().get(
                self._url("/_ping"), timeout=aiohttp.ClientTimeout(total=self._ping_every)
            ) as answer:
                if answer.status != 200:
                    raise EngineError(f"GET /_ping answered {answer.status}")

    async def _get(self, path: str, limit: int) -> Any:
        async with self._client().get(self._url(path), timeout=aiohttp.ClientTimeout(total=30.0)) as answer:
            if answer.status == 404:
                return None
            if answer.status != 200:
                raise EngineError(f"GET {path} answered {answer.status}")
            body = bytearray()
            async for chunk in answer.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise EngineError(f"GET {path}: more than {limit:,} bytes")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"GET {path}: not JSON ({exc})") from None

    async def _list(self) -> list[Container]:
        listing = await self._get("/containers/json", self.limits.max_listing)
        if not isinstance(listing, list):
            raise EngineError("GET /containers/json: not a list")
        containers = []
        for item in listing:
            try:
                containers.append(container_of_summary(item))
            except ValueError as exc:
                _log.error("docker engine %s: a container left out: %s", self.engine.url, exc)
        return containers

    async def _on_event(self, event: Mapping[str, Any]) -> None:
        self.events += 1
        view = self.view
        look = view.event(event)
        if look is None:
            if view.changed:
                self._on_state(view.state())
            return
        document = await self._get(f"/containers/{look}/json", self.limits.max_container)
        if document is None:
            view.remove(look)
        else:
            try:
                self._report(view.put(container_of_inspect(document)))
            except ValueError as exc:
                _log.error("docker engine %s: container %s left out: %s", self.engine.url, look[:12], exc)
                return
        self._on_state(view.state())

    def _report(self, fresh: list[tuple[Container, Problem]]) -> None:
        for container, problem in fresh:
            label = problem.where.removeprefix(f"container {container.name} ")
            _log.error("docker engine %s: %s; that container serves nothing", self.engine.url, problem)
            self._emit(
                "docker_bad_label",
                engine=self.engine.url,
                container=container.name,
                label=label,
                reason=problem.message,
            )

    def figures(self) -> DockerFigures:
        view = self.view
        return DockerFigures(
            engine=self.engine.url,
            connected=self.problem is None,
            containers=len(view.containers),
            endpoints=sum(len(found) for found in view.state().endpoints.values()),
            bad=sum(1 for serves in view.serves.values() if serves.problems),
            events=self.events,
            listings=self.listings,
        )

    def status(self) -> dict[str, Any]:
        """What the admin API shows of this engine."""
        return {
            "engine": self.engine.url,
            "address": self.engine.address,
            "connected": self.problem is None,
            "problem": self.problem,
            "containers": len(self.view.containers),
            "left_out": self.view.left_out,
            "events": self.events,
            "listings": self.listings,
            "labelled_containers": sum(1 for serves in self.view.serves.values() if serves.labelled),
            "labelled": self.view.describe(),
        }


def client_tls(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """The TLS context for ``tcp://`` engines (``--docker-tls-ca``, ``--docker-tls-cert``/``-key``)."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context
