"""Endpoints come and go under real load, and no request fails.

A service ``web`` is served by ``pilotfish serve`` (from a ``services:`` file, the registry API or
etcd) to a real Envoy, whose listener for it takes load from ``wrk`` while the test adds and
removes endpoints. The rules a deployment follows, and these tests follow too:

- **add**: start the upstream, then register it; it serves once Envoy lists it;
- **remove**: deregister, wait until Envoy no longer lists it and has closed its connections to it
  (:meth:`Upstream.retire`), only then stop the upstream, which drains on SIGTERM. Requests already
  in flight to it finish (Envoy does not reset them on an EDS removal).

Under those rules every request must succeed: no non-2xx, no socket error. Further tests check
what the reconciler promises without load: a no-op change pushes nothing, a burst is one push, a
flapping endpoint makes a bounded number of pushes, TTLs expire, bad etcd values are reported and
left out, and a restarted control plane sends a reconnecting Envoy nothing it already has.

wrk's numbers (requests, rate, p99) are printed (``pytest -s`` shows them); they are measured,
never asserted: only correctness is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from .etcd import Etcd
from .event_log import TYPE_URLS, EventLog, Predicate, is_event, is_registry_change, short_type, wait_until_built
from .processes import (
    ControlPlane,
    Envoy,
    ProcessGroup,
    Upstream,
    envoy_binary,
    free_port,
    http_get,
    wait_until,
)
from .registry_client import RegistryClient
from .snapshot_file import write_services
from .testbed import wait_for_acks
from .wrk import Wrk, WrkResult, parse_wrk_output, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = "edge-1"
SERVICE = "web"
PREFIX = "/pilotfish/"

LOAD_S = 60
"""The longest the wrk runs during which endpoints change may take: each is stopped once its last
endpoint set has carried load as long as the others (:class:`Pacer`)."""
CHANGE_EVERY_S = 2.5
"""Changes under load are paced at most this often, so each endpoint set carries load a while."""
CHANGE_TIMEOUT_S = 5.0
"""How long Envoy may take to show an endpoint change: one debounce window (at most 1 s), a push
and Envoy applying it take well under 2 s; the rest is slack for a machine busy with wrk."""
MAX_DELAY_S = 1.0
"""The server's default debounce max delay: a change is built at most this long after it arrived."""
SLOW_MS = 10_000
"""The request kept in flight across the removal of its endpoint: longer than adding an endpoint,
starting wrk and removing one take on a busy machine, shorter than the route's 15 s timeout."""


def address(upstream: Upstream) -> str:
    return f"127.0.0.1:{upstream.port}"


# -- the deployment -------------------------------------------------------------------------------


@dataclass
class Deployment:
    """Upstreams, ``pilotfish serve`` and an Envoy whose listener for ``web`` is on ``listen_port``.

    ``serving`` is what ``web`` should have; :meth:`add` and :meth:`remove` change it the way a
    deployment must (see the module docstring), through ``apply``, which tells the source.
    """

    group: ProcessGroup
    control_plane: ControlPlane
    listen_port: int
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    serving: list[str] = field(default_factory=list)
    envoy: Envoy | None = None
    changes: list[str] = field(default_factory=list)
    """What changed, with when, for the report and failure messages."""
    _started: float = field(default_factory=time.monotonic)

    @property
    def listen(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    @property
    def url(self) -> str:
        return f"http://{self.listen}/"

    @property
    def events(self) -> EventLog:
        return self.control_plane.events

    def upstream(self, name: str) -> Upstream:
        """The upstream called ``name``, started now if it is not running yet."""
        if name not in self.upstreams:
            self.upstreams[name] = Upstream.start(self.group, name)
        return self.upstreams[name]

    def start_envoy(self) -> Envoy:
        self.envoy = Envoy.start(self.group, name="envoy", node_id=NODE, xds_address=self.control_plane.address)
        wait_for_acks(self.events, node=NODE, what="Envoy's initial configuration")
        return self.envoy

    def expected(self) -> list[str]:
        return sorted(address(self.upstreams[name]) for name in self.serving)

    def wait_for_envoy(self, *, timeout: float = CHANGE_TIMEOUT_S) -> float:
        """Wait until Envoy lists exactly the serving endpoints; return how long that took."""
        assert self.envoy is not None
        start = time.monotonic()
        self.envoy.wait_for_endpoints(SERVICE, self.expected(), timeout=timeout)
        return time.monotonic() - start

    def add(self, name: str, apply: Callable[[Upstream], None]) -> None:
        """Start the upstream (if it is not running yet), tell the source, wait until Envoy lists it."""
        assert self.envoy is not None
        upstream = self.upstream(name)
        apply(upstream)
        self.serving.append(name)
        took = self.wait_for_envoy()
        self.note(f"added {name} (Envoy listed it after {took:.2f}s)")

    def remove(
        self, name: str, apply: Callable[[Upstream], None], *, before_stop: Callable[[], None] | None = None
    ) -> None:
        """Tell the source, wait until Envoy no longer lists it, then stop the upstream."""
        upstream = self.upstreams[name]
        apply(upstream)
        self.serving.remove(name)
        took = self.wait_for_envoy()
        if before_stop is not None:
            before_stop()
        # Stopped only once Envoy has closed its connections to it (every worker has the removal),
        # and gracefully (it drains).
        unused = upstream.retire()
        self.note(f"removed {name} (Envoy dropped it after {took:.2f}s and closed its connections {unused:.2f}s later)")

    def wait_for_traffic_to(self, name: str, *, at_least: int = 20) -> None:
        """Wait until Envoy has sent ``at_least`` requests to upstream ``name`` (it carries load)."""
        assert self.envoy is not None
        envoy, target = self.envoy, address(self.upstreams[name])
        wait_until(
            lambda: envoy.host_requests(SERVICE).get(target, 0) >= at_least,
            timeout=CHANGE_TIMEOUT_S,
            what=f"Envoy to send {at_least} requests to {name} ({target})",
            details=lambda: f"per endpoint: {envoy.host_requests(SERVICE)}",
        )

    def note(self, what: str) -> None:
        """Record a change (with the time since the deployment began) for the report."""
        self.changes.append(f"t={time.monotonic() - self._started:6.2f}s {what}")


def services_deployment(group: ProcessGroup, **control_plane: Any) -> Deployment:
    """A deployment whose control plane is not started yet; ``control_plane`` selects sources."""
    envoy_binary()  # fail before starting anything when Envoy is not installed
    snapshot_path = control_plane.pop("snapshot_path", None)
    return Deployment(group, ControlPlane(group, snapshot_path, free_port(), **control_plane), free_port())


class InFlightRequest:
    """One GET through Envoy in a thread of its own, so the test can act while it is in flight."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._result: tuple[int, str] | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"GET {url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = http_get(self.url, timeout=30)
        except BaseException as exc:  # handed to the test thread in result()
            self._result = exc

    def in_flight(self) -> bool:
        return self._thread.is_alive()

    def result(self, *, timeout: float = 15.0) -> tuple[int, str]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"GET {self.url} did not complete within {timeout:g}s", pytrace=False)
        if isinstance(self._result, BaseException):
            raise AssertionError(f"GET {self.url} failed: {self._result!r}") from self._result
        assert self._result is not None
        return self._result


@dataclass
class Pacer:
    """Spreads changes over a load run: the n-th change starts no earlier than n * every."""

    every: float
    start: float = field(default_factory=time.monotonic)
    count: int = 0

    def next(self) -> None:
        self.count += 1
        delay = self.start + self.count * self.every - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the schedule, not waiting for something to happen


ENVOY_ERROR_STATS = (
    r"(cluster\.web\.(upstream_rq_(5xx|503|504|pending_overflow|timeout|per_try_timeout|retry.*|rx_reset|tx_reset)"
    r"|upstream_cx_(connect_fail|connect_timeout|destroy_remote_with_active_rq|destroy_local_with_active_rq|overflow)"
    r"|retry_or_shadow_abandoned)|http\..*downstream_rq_[45]xx)$"
)
"""Envoy's counters that say why a request failed: shown when a load run was not clean."""


def check_clean(result: WrkResult, label: str, changes: list[str], envoy: Envoy) -> None:
    print(f"\n{label}: {result.summary()}")
    for change in changes:
        print(f"  {change}")
    problems = result.problems()
    if problems:
        counters = {name: value for name, value in envoy.stats(ENVOY_ERROR_STATS).items() if value}
        pytest.fail(
            f"{label}: {'; '.join(problems)}\nchanges:\n"
            + "\n".join(changes)
            + f"\nEnvoy's error counters: {counters}\n"
            + result.output,
            pytrace=False,
        )


# -- wrk's report ---------------------------------------------------------------------------------

WRK_REPORT_CLEAN = """\
Running 22s test @ http://127.0.0.1:10000/
  2 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.10ms    2.01ms  40.12ms   91.30%
    Req/Sec     8.23k     1.10k   10.20k    70.45%
  Latency Distribution
     50%    2.71ms
     75%    3.50ms
     90%  820.00us
     99%    1.02s
  362011 requests in 22.00s, 44.19MB read
Requests/sec:  16454.77
Transfer/sec:      2.01MB
"""

WRK_REPORT_ERRORS = """\
Running 5s test @ http://127.0.0.1:10000/
  2 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20ms  300.00us   9.00ms   80.00%
    Req/Sec     9.00k   500.00    10.00k    75.00%
  45000 requests in 5.00s, 5.50MB read
  Socket errors: connect 0, read 3, write 0, timeout 2
  Non-2xx or 3xx responses: 12
Requests/sec:   9000.00
Transfer/sec:      1.10MB
"""


def test_wrk_report_parser() -> None:
    clean = parse_wrk_output(WRK_REPORT_CLEAN)
    assert (clean.requests, clean.duration_s, clean.requests_per_s) == (362011, 22.0, 16454.77)
    assert clean.latency_percentiles == pytest.approx({50.0: 2.71e-3, 75.0: 3.5e-3, 90.0: 820e-6, 99.0: 1.02})
    assert clean.socket_errors == {} and clean.non_2xx_3xx == 0
    assert clean.problems() == []

    errors = parse_wrk_output(WRK_REPORT_ERRORS)
    assert errors.requests == 45000 and errors.p99_s is None  # run without --latency
    assert errors.socket_errors == {"connect": 0, "read": 3, "write": 0, "timeout": 2}
    assert errors.non_2xx_3xx == 12
    assert errors.problems() == ["12 responses were not 2xx/3xx", "socket errors: read 3, timeout 2"]

    assert parse_wrk_output(WRK_REPORT_CLEAN.replace("362011 requests", "0 requests")).problems() == [
        "wrk completed no requests"
    ]
    with pytest.raises(ValueError, match="not a wrk report"):
        parse_wrk_output("unable to connect to 127.0.0.1:1 Connection refused\n")


# -- under load: the registry ---------------------------------------------------------------------


def test_registry_endpoint_changes_under_load(processes: ProcessGroup) -> None:
    """Four upstreams, endpoints added and removed through the registry API while wrk runs.

    The service is defined in the snapshot file; its instances come from the registry (sources
    merge). One removal happens while a slow request is in flight to that very endpoint: it was
    the only endpoint when the request started, so Envoy had to send it there.
    """
    wrk_binary()
    snapshot = processes.workdir / "services.yaml"
    deployment = services_deployment(processes, snapshot_path=snapshot, registry_port=free_port())
    write_services(snapshot, {SERVICE: {"listen": deployment.listen, "protocol": "http"}})
    for name in ("u0", "u1", "u2", "u3"):
        deployment.upstream(name)
    deployment.control_plane.start()
    registry = RegistryClient(deployment.control_plane.registry_url)
    envoy = deployment.start_envoy()

    def register(upstream: Upstream) -> None:
        registry.register(SERVICE, "127.0.0.1", upstream.port)

    def deregister(upstream: Upstream) -> None:
        registry.deregister(SERVICE, address(upstream))

    # u0 alone, and a slow request pinned to it by being its only choice.
    deployment.add("u0", register)
    slow = InFlightRequest(f"http://{deployment.listen}/slow?ms={SLOW_MS}")
    wait_until(
        lambda: int(envoy.stat(f"cluster.{SERVICE}.upstream_rq_active") or 0) >= 1,
        timeout=5,
        what="the slow request to reach u0",
    )
    deployment.add("u1", register)

    wrk = Wrk.start(processes, deployment.url, duration_s=LOAD_S)
    envoy.wait_for_requests(SERVICE)
    pacer = Pacer(CHANGE_EVERY_S)

    def slow_request_survives() -> None:
        assert slow.in_flight(), (
            f"the {SLOW_MS} ms request finished before its endpoint was removed: the test proved nothing"
        )
        assert slow.result() == (200, "u0"), "a request in flight to a removed endpoint must complete"

    deployment.remove("u0", deregister, before_stop=slow_request_survives)
    pacer.next()
    deployment.add("u2", register)
    deployment.wait_for_traffic_to("u2")
    pacer.next()
    deployment.remove("u1", deregister)
    pacer.next()
    deployment.add("u3", register)
    deployment.wait_for_traffic_to("u3")
    pacer.next()
    deployment.add("u4", register)  # started only now: start, then register
    deployment.wait_for_traffic_to("u4")
    pacer.next()
    deployment.remove("u2", deregister)
    pacer.next()  # the last endpoint set carries load as long as the others
    assert wrk.running(), "the changes took longer than the load run: they were not all made under load"

    check_clean(wrk.stop(), "registry under load", deployment.changes, envoy)
    assert envoy.cluster_endpoints(SERVICE) == deployment.expected()
    assert len(deployment.changes) >= 6


# -- under load: etcd -----------------------------------------------------------------------------


def instance_key(name: str) -> str:
    return f"{PREFIX}instances/{SERVICE}/{name}"


def test_etcd_endpoint_changes_under_load_across_an_etcd_restart(processes: ProcessGroup) -> None:
    """Endpoints added and removed by writing and deleting etcd keys while wrk runs; etcd restarts
    in the middle of it. The relist after the restart finds the same state, so it changes nothing,
    and the watch resumes: the next change reaches Envoy."""
    wrk_binary()
    etcd = Etcd.start(processes)
    deployment = services_deployment(processes, etcd=etcd.address)
    etcd.put_json(f"{PREFIX}services/{SERVICE}", {"listen": deployment.listen, "protocol": "http"})

    def put(upstream: Upstream) -> None:
        etcd.put_json(instance_key(upstream.name), {"address": "127.0.0.1", "port": upstream.port})

    def delete(upstream: Upstream) -> None:
        assert etcd.delete(instance_key(upstream.name)) == 1

    for name in ("u0", "u1"):
        put(deployment.upstream(name))
        deployment.serving.append(name)
    events = deployment.control_plane.start()
    events.wait_for(is_event("etcd_synced"), what="the first list of etcd")
    envoy = deployment.start_envoy()
    deployment.wait_for_envoy()

    wrk = Wrk.start(processes, deployment.url, duration_s=LOAD_S)
    envoy.wait_for_requests(SERVICE)
    pacer = Pacer(CHANGE_EVERY_S)

    deployment.add("u2", put)
    deployment.wait_for_traffic_to("u2")
    pacer.next()
    deployment.remove("u0", delete)
    pacer.next()

    # etcd restarts on the same data dir and ports: the watch breaks, pilotfish lists again.
    mark = events.mark()
    etcd.restart()
    resynced = events.wait_for(is_event("etcd_synced"), what="etcd_synced after the etcd restart", after=mark)
    assert events.find(is_event("etcd_disconnected"), after=mark), "the broken watch is reported"
    assert resynced["keys"] == 3 and resynced["bad"] == 0, resynced  # the service, u1, u2
    assert envoy.cluster_endpoints(SERVICE) == deployment.expected(), "nothing was lost across the restart"
    deployment.note("etcd restarted and listed again")
    pacer.next()

    before_u3 = events.mark()
    deployment.add("u3", put)  # the watch resumed after the relist
    # u3's is the only snapshot since the restart: the relist found nothing to push (had it pushed,
    # that would be logged before u3's snapshot).
    u3 = events.wait_for(is_event("snapshot_loaded"), what="the snapshot with u3", after=before_u3)
    loaded = events.select(is_event("snapshot_loaded"), after=mark)
    assert loaded == [u3], "the relist found nothing new to push\n" + events.describe(after=mark)
    deployment.wait_for_traffic_to("u3")
    pacer.next()
    deployment.remove("u1", delete)
    pacer.next()
    deployment.add("u4", put)
    deployment.wait_for_traffic_to("u4")
    pacer.next()
    assert wrk.running(), "the changes took longer than the load run: they were not all made under load"

    check_clean(wrk.stop(), "etcd under load", deployment.changes, envoy)
    assert envoy.cluster_endpoints(SERVICE) == deployment.expected()


# -- under load: the control plane is killed ------------------------------------------------------


def test_control_plane_sigkill_under_load_then_restart_sends_nothing(processes: ProcessGroup) -> None:
    """SIGKILL pilotfish while wrk runs: Envoy keeps proxying on what it has. Restarted on the
    same file and port, pilotfish gets Envoy's reconnect requests carrying the versions Envoy has;
    versions are content hashes, so they are current and nothing is sent."""
    wrk_binary()
    snapshot = processes.workdir / "services.yaml"
    deployment = services_deployment(processes, snapshot_path=snapshot)
    for name in ("u0", "u1", "u2"):  # u2 for the marker change, started early: the load run is short
        deployment.upstream(name)
    deployment.serving += ["u0", "u1"]

    def write_file(upstream: Upstream | None = None) -> None:
        serving = [*(deployment.upstreams[name] for name in deployment.serving), *([upstream] if upstream else [])]
        write_services(
            snapshot,
            {SERVICE: {"listen": deployment.listen, "protocol": "http", "endpoints": [address(u) for u in serving]}},
        )

    write_file()
    control_plane = deployment.control_plane
    first = control_plane.start()
    envoy = deployment.start_envoy()
    deployment.wait_for_envoy()
    acked = {short_type(t): first.select(is_event("ack", node=NODE, type=t))[-1]["version_info"] for t in TYPE_URLS}

    wrk = Wrk.start(processes, deployment.url, duration_s=LOAD_S)
    envoy.wait_for_requests(SERVICE)
    control_plane.stop(kill=True)
    wait_until(
        lambda: envoy.stat("control_plane.connected_state") == 0,
        timeout=5,
        what="Envoy to notice the control plane is gone",
    )
    envoy.wait_for_requests(SERVICE)  # Envoy keeps proxying without its control plane

    second = control_plane.start()
    requests = {}
    for type_url in TYPE_URLS:
        requests[short_type(type_url)] = second.wait_for(
            is_event("request", node=NODE, type=type_url),
            what=f"Envoy's reconnect request for {short_type(type_url)}",
            timeout=10,
        )
    wait_until(lambda: envoy.stat("control_plane.connected_state") == 1, timeout=5, what="Envoy to be connected again")
    assert {kind: r["version_info"] for kind, r in requests.items()} == acked, (
        "Envoy reconnects with the versions it ACKed before"
    )
    # A marker change, made after Envoy's reconnect requests were logged: whatever the new server
    # (wrongly) sent in answer to them is logged before the marker's own pushes, and carries a
    # version Envoy already had.
    mark = second.mark()
    deployment.add("u2", write_file)
    second.wait_for(is_event("snapshot_loaded"), what="the marker change (u2 added)", after=mark)
    assert wrk.running(), "the restart took longer than the load run"
    sent = second.select(is_event("sent"))
    resent = [e for e in sent if e["version"] == acked[short_type(e["type"])]]
    assert resent == [], "a restarted server re-sent what Envoy already had:\n" + second.describe()
    assert [short_type(e["type"]) for e in sent] == ["EDS"], (
        "only the marker's endpoints were pushed\n" + second.describe()
    )
    assert not second.select(is_event("nack"))
    deployment.wait_for_traffic_to("u2")  # the load went on through the restarted server's change

    check_clean(wrk.stop(), "control plane SIGKILL under load", [], envoy)
    assert envoy.cluster_endpoints(SERVICE) == deployment.expected()


# -- the registry without Envoy: no-ops, bursts, flapping -----------------------------------------


def start_registry_only(processes: ProcessGroup, *options: str) -> tuple[RegistryClient, EventLog, str]:
    """pilotfish with only the registry as source and service ``web`` defined through it, and
    served: the definition's snapshot is loaded."""
    control_plane = ControlPlane(processes, None, free_port(), registry_port=free_port(), options=options)
    events = control_plane.start()
    registry = RegistryClient(control_plane.registry_url)
    listen = f"127.0.0.1:{free_port()}"
    mark = events.mark()
    registry.define(SERVICE, listen=listen, protocol="http")
    wait_until_built(events, changes=1, after=mark, what="the service definition")
    return registry, events, listen


@pytest.fixture
def registry_only(processes: ProcessGroup) -> tuple[RegistryClient, EventLog, str]:
    """The registry-only control plane with the default debounce."""
    return start_registry_only(processes)


def wait_for_server_clock(
    events: EventLog, poke: Callable[[], object], poked: Predicate, *, past: float, what: str, timeout: float = 15.0
) -> None:
    """Repeat ``poke`` (an action that logs one event matching ``poked``, one request at a time)
    until pilotfish stamps that event at or after ``past`` (its own ``time.time()``), then poke
    twice more.

    For showing that something did NOT happen when the server's right answer is silence, so no
    event of its own can say it is past the point. A timer of the server due before ``past`` has
    fired on the turn of its event loop after the one that logged a poke at ``past`` at the latest,
    and the task it wakes runs on the turn after that; a request sent once the answer to the next
    poke is back is handled later still. So anything the server had due before ``past`` is logged
    before the last poke's event. The server's clock, not the test's, decides: a server starved of
    CPU is waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        mark = events.mark()
        poke()
        event = events.wait_for(poked, what=f"{what}: the poke's event", after=mark)
        if event["ts"] >= past:
            break
        if time.monotonic() >= deadline:
            pytest.fail(
                f"timed out after {timeout:g}s waiting for {what}: pilotfish's clock did not reach "
                f"{past:.3f} (last event at {event['ts']:.3f})",
                pytrace=False,
            )
        time.sleep(0.1)  # the poll interval: each poke is a request to the server
    for _ in range(2):
        mark = events.mark()
        poke()
        events.wait_for(poked, what=f"{what}: the last pokes' events", after=mark)


def test_the_same_endpoints_again_push_nothing(registry_only: tuple[RegistryClient, EventLog, str]) -> None:
    registry, events, listen = registry_only
    mark = events.mark()
    registry.register(SERVICE, "127.0.0.1", 9001)
    registry.register(SERVICE, "127.0.0.1", 9002, weight=2)
    wait_until_built(events, changes=2, after=mark, what="the two instances")

    mark = events.mark()
    registry.define(SERVICE, listen=listen, protocol="http")  # the same definition
    registry.register(SERVICE, "127.0.0.1", 9002, weight=2)  # the same instances, other order
    registry.register(SERVICE, "127.0.0.1", 9001)
    first = events.wait_for_count(is_registry_change, 3, what="the three registry changes", after=mark)[0]
    # Had they started a build, it would run within the max delay of the first of them. The right
    # answer is to do nothing, which logs nothing, so wait until the server's own clock is past
    # that (with a margin), re-registering 9001 (one more no-op) to see its clock.
    wait_for_server_clock(
        events,
        lambda: registry.register(SERVICE, "127.0.0.1", 9001),
        is_event("registry_registered", instance="127.0.0.1:9001"),
        past=first["ts"] + MAX_DELAY_S + 0.5,
        what="the debounce's max delay to pass on pilotfish's clock",
    )
    assert not events.select(is_event("snapshot_loaded"), after=mark), events.describe(after=mark)

    # A real change is pushed: the silence above was not a reconciler that had stopped.
    changed = events.mark()
    registry.register(SERVICE, "127.0.0.1", 9003)
    loaded = wait_until_built(events, changes=1, after=changed, what="a new instance")
    assert events.select(is_event("snapshot_loaded"), after=mark) == [loaded], events.describe(after=mark)


async def register_concurrently(base_url: str, ports: list[int]) -> tuple[list[int], float]:
    """POST one instance per port, all at once on connections opened beforehand; return the
    statuses and how long the POSTs took from the first sent to the last answered."""
    connector = aiohttp.TCPConnector(limit=len(ports))
    async with aiohttp.ClientSession(base_url, connector=connector) as session:

        async def healthz() -> None:
            async with session.get("/healthz") as response:
                await response.read()

        await asyncio.gather(*(healthz() for _ in ports))  # open the connections first

        async def register(port: int) -> int:
            body = {"address": "127.0.0.1", "port": port}
            async with session.post(f"/v1/services/{SERVICE}/instances", json=body) as response:
                await response.read()
                return response.status

        start = time.monotonic()
        statuses = await asyncio.gather(*(register(port) for port in ports))
        return list(statuses), time.monotonic() - start


def test_a_burst_of_registrations_is_one_snapshot(processes: ProcessGroup) -> None:
    # A quiet period wider than the burst: on a loaded 2-core machine 100 concurrent requests can
    # take a few hundred ms to arrive, and this test is about batching, not about this machine's
    # speed (the 50 ms case runs on a fake clock in tests/unit/test_reconciler.py).
    registry, events, _ = start_registry_only(processes, "--quiet-ms", "1500", "--max-delay-ms", "5000")
    mark = events.mark()

    statuses, took = asyncio.run(register_concurrently(registry.base_url, list(range(20000, 20100))))
    assert statuses == [201] * 100
    # The 201s can arrive before the server has written the events of the last registrations.
    registered = events.wait_for_count(is_event("registry_registered"), 100, what="the 100 registrations", after=mark)
    spread = registered[-1]["ts"] - registered[0]["ts"]
    print(
        f"\n100 registrations: {took * 1e3:.0f} ms on the client, {spread * 1e3:.0f} ms between the first "
        "and last registered on the server"
    )

    burst = events.wait_for(is_event("snapshot_loaded"), what="the burst's snapshot", after=mark)
    assert events.index_of(burst) > events.index_of(registered[-1]), (
        f"the first snapshot after the burst holds all 100 registrations (spread over {spread * 1e3:.0f} ms)\n"
        + events.describe(after=mark)
    )
    # A marker registration after the burst: no snapshot but the burst's comes before its own.
    marker_mark = events.mark()
    registry.register(SERVICE, "127.0.0.1", 20100)
    marker = wait_until_built(events, changes=1, after=marker_mark, what="the marker registration")
    loaded = events.select(is_event("snapshot_loaded"), after=mark)
    assert loaded == [burst, marker], "one burst, one snapshot\n" + events.describe(after=mark)


FLAP_SECONDS = 5.0
FLAP_PERIOD_S = 0.1
"""One deregister and one register per period: ten flaps a second."""
FLAP_PUSH_BOUND = 2
"""The most snapshots a flapping endpoint may cause, and why:

- the first deregistration starts a burst; as changes keep coming every 50 ms the debounce
  builds at its max delay (1 s). The endpoint is absent then, or back but held (it returned within
  the flap window, and the hold needs 1 s without a break): either way it is removed. Push 1:
  traffic stops going to a flapping endpoint.
- every later build while it flaps (one per max delay) finds it absent or held again: the content
  is unchanged, nothing is pushed;
- the flapping ends with a registration; 1 s (the hold) later it is re-added. Push 2.

So 2, independent of how long it flaps or how fast: not 5 s x 10 flips."""


def test_a_flapping_endpoint_makes_a_bounded_number_of_pushes(
    registry_only: tuple[RegistryClient, EventLog, str],
) -> None:
    registry, events, _ = registry_only
    mark = events.mark()
    registry.register(SERVICE, "127.0.0.1", 9001)
    flapping = registry.register(SERVICE, "127.0.0.1", 9002)
    stable = wait_until_built(events, changes=2, after=mark, what="the two instances")["versions"]

    mark = events.mark()
    start = time.monotonic()
    flips = round(FLAP_SECONDS / FLAP_PERIOD_S)
    for flip in range(flips):
        for half, action in enumerate((registry.deregister, None)):
            delay = start + (flip + half / 2) * FLAP_PERIOD_S - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # keeping the flapping schedule
            if action is not None:
                action(SERVICE, flapping)
            else:
                registry.register(SERVICE, "127.0.0.1", 9002)
    flapped_for = time.monotonic() - start

    # Once it has stayed for the hold, the endpoint is back: the very content from before.
    back = events.wait_for(
        lambda e: e["event"] == "snapshot_loaded" and e["versions"] == stable,
        what="the endpoint re-added after the hold",
        after=mark,
        timeout=5,
    )
    # A marker registration once the endpoint is back: nothing the flapping caused comes after it.
    marker_mark = events.mark()
    registry.register(SERVICE, "127.0.0.1", 9003)
    marker = wait_until_built(events, changes=1, after=marker_mark, what="the marker registration")
    loaded = events.select(is_event("snapshot_loaded"), after=mark)
    assert loaded[-1] is marker, events.describe(after=mark)
    loaded = loaded[:-1]
    print(
        f"\nflapping {flips} times in {flapped_for:.2f}s: {len(loaded)} snapshots pushed "
        f"({len(events.select(is_event('snapshot_unchanged'), after=mark))} builds changed nothing)"
    )
    assert 1 <= len(loaded) <= FLAP_PUSH_BOUND, events.describe(after=mark)
    assert loaded[0]["versions"] != stable, "the first push removes the flapping endpoint"
    assert loaded[-1] is back, "nothing was pushed after the endpoint came back"


# -- TTL ------------------------------------------------------------------------------------------


def test_an_instance_without_heartbeats_leaves_envoy_when_its_ttl_lapses(processes: ProcessGroup) -> None:
    deployment = services_deployment(processes, registry_port=free_port())
    lasting, lapsing = deployment.upstream("u0"), deployment.upstream("u1")
    events = deployment.control_plane.start()
    registry = RegistryClient(deployment.control_plane.registry_url)
    registry.define(SERVICE, listen=deployment.listen, protocol="http")
    registry.register(SERVICE, "127.0.0.1", lasting.port)
    envoy = deployment.start_envoy()
    envoy.wait_for_endpoints(SERVICE, [address(lasting)])

    registry.register(SERVICE, "127.0.0.1", lapsing.port, ttl=1)
    # Seen in Envoy first (within a debounce window; polled fast, as the TTL is only 1 s) ...
    wait_until(
        lambda: address(lapsing) in envoy.cluster_endpoints(SERVICE),
        timeout=5,
        interval=0.02,
        what="the TTL instance to reach Envoy",
    )
    # ... then gone, with no heartbeat.
    events.wait_for(
        is_event("registry_expired", service=SERVICE, instance=address(lapsing)),
        what="the TTL instance to expire",
        timeout=5,
    )
    envoy.wait_for_endpoints(SERVICE, [address(lasting)], timeout=CHANGE_TIMEOUT_S)
    assert http_get(f"http://{deployment.listen}/") == (200, "u0")


# -- bad etcd values ------------------------------------------------------------------------------


def test_bad_etcd_values_are_reported_and_left_out(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    deployment = services_deployment(processes, etcd=etcd.address)
    good = [deployment.upstream(name) for name in ("u0", "u1")]
    etcd.put_json(f"{PREFIX}services/{SERVICE}", {"listen": deployment.listen, "protocol": "http"})
    etcd.put(instance_key("cut-short"), '{"address": "127.0.0.1", "port": ')  # found by the first list
    etcd.put_json(instance_key("u0"), {"address": "127.0.0.1", "port": good[0].port})

    events = deployment.control_plane.start()
    synced = events.wait_for(is_event("etcd_synced"), what="the first list of etcd")
    assert (synced["keys"], synced["bad"]) == (3, 1), synced
    envoy = deployment.start_envoy()
    envoy.wait_for_endpoints(SERVICE, [address(good[0])])

    # Written while pilotfish watches: two bad instances alongside a good one.
    mark = events.mark()
    etcd.put_json(instance_key("no-port"), {"address": "127.0.0.1"})
    etcd.put_json(instance_key("port-70000"), {"address": "127.0.0.1", "port": 70000})
    etcd.put_json(instance_key("u1"), {"address": "127.0.0.1", "port": good[1].port})
    envoy.wait_for_endpoints(SERVICE, [address(u) for u in good], timeout=CHANGE_TIMEOUT_S)

    for name in ("no-port", "port-70000"):
        events.wait_for(is_event("etcd_bad_value", key=instance_key(name)), what=f"{name} reported", after=mark)
    bad = {e["key"]: e["reason"] for e in events.select(is_event("etcd_bad_value"))}
    assert set(bad) == {instance_key(k) for k in ("cut-short", "no-port", "port-70000")}, bad
    assert "JSON" in bad[instance_key("cut-short")]
    assert "port" in bad[instance_key("no-port")] and "required" in bad[instance_key("no-port")]
    assert "port" in bad[instance_key("port-70000")] and "70000" in bad[instance_key("port-70000")]
    assert not events.select(is_event("snapshot_error"), after=mark), "a bad value is left out, not an error"
    replies = {http_get(deployment.url)[1] for _ in range(10)}
    assert replies == {"u0", "u1"}, replies
