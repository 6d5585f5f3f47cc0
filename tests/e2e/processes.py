"""Real processes for the end-to-end tests: upstreams, ``pilotfish serve`` and Envoy.

Every process is started through a :class:`ProcessGroup`, which a fixture closes at teardown: it
kills what is still running by PID (never by name, so parallel test runs leave each other alone),
reaps it, and removes the shared-memory files of the Envoys it started (only those whose base id
it chose or was told). Each process writes its stdout and stderr to files in the test's own temp
dir; a failed wait shows their tails.

Nothing here sleeps a fixed time to let something happen: :func:`wait_until` polls a condition
with a timeout. Ports are picked by the OS (bind to port 0) and passed to the processes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pilotfish.envoy import (
    EnvoyError,
    EnvoyNotFound,
    EnvoySettings,
    envoy_shared_memory_files,
    find_envoy,
    free_port,
    start_envoy,
)

from .event_log import EventLog

__all__ = [
    "ControlPlane",
    "Envoy",
    "GrpcBackend",
    "GrpcClient",
    "Process",
    "ProcessGroup",
    "Upstream",
    "envoy_binary",
    "free_port",
    "http_get",
    "http_json",
    "pilotfish",
    "unlabelled_metrics",
    "wait_until",
    "with_hosts_file",
]

REPO = Path(__file__).resolve().parents[2]
UPSTREAM_SCRIPT = Path(__file__).with_name("upstream.py")
GRPC_BACKEND_SCRIPT = Path(__file__).with_name("grpc_backend.py")
GRPC_CLIENT_SCRIPT = Path(__file__).with_name("grpc_client.py")

T = TypeVar("T")


# -- polling and small network helpers ------------------------------------------------------------


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Exceptions raised by ``condition`` count as "not yet" (a port that refuses connections, an
    admin endpoint not up yet); the last one is shown if the wait times out. ``details`` adds
    context to the failure (a process's log tail, the events seen so far).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = condition()
        except Exception as exc:  # pytest.fail() is a BaseException: a dead process still fails at once
            last_error = exc
        else:
            if result:
                return result
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g}s waiting for {what}"
            if last_error is not None:
                message += f"\nlast error: {last_error!r}"
            if details is not None:
                message += "\n" + details()
            pytest.fail(message, pytrace=False)
        time.sleep(interval)


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# No proxy: every request of these tests goes to 127.0.0.1, whatever the environment says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, *, timeout: float = 5.0) -> tuple[int, str]:
    """GET a URL; return (status, body) for any HTTP status, raise only on connection errors."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode(errors="replace")


def http_json(method: str, url: str, body: Any = None, *, timeout: float = 5.0) -> tuple[int, Any]:
    """Send ``body`` as JSON (none when None); return (status, decoded JSON body or None).

    Any HTTP status is returned, not raised: a test asserts on a 400 as readily as on a 201.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            status, raw = error.code, error.read()
    return status, json.loads(raw) if raw.strip() else None


def unlabelled_metrics(admin: str, prefix: str) -> dict[str, float]:
    """The first sample of each metric family named ``prefix...`` on ``serve --admin``'s
    ``/metrics`` (parsed by prometheus-client): ``{"pilotfish_lrs_reports": 12.0, ...}``."""
    status, text = http_get(f"http://{admin}/metrics")
    assert status == 200, text
    return {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(text)
        if f.name.startswith(prefix) and f.samples
    }


# -- processes ------------------------------------------------------------------------------------


@dataclass
class Process:
    """One started process, its output files and how to stop it."""

    name: str
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> int:
        """SIGTERM (or SIGKILL) the process and wait for it; SIGKILL it if it outlives timeout."""
        if self.alive():
            self.popen.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def output_tail(self, lines: int = 30) -> str:
        parts = []
        for path in (self.stdout_path, self.stderr_path):
            text = path.read_text(errors="replace") if path.exists() else ""
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"--- {path.name} (last {lines} lines) ---\n{tail}")
        return "\n".join(parts)


@dataclass
class ProcessGroup:
    """Every process a test started, and the Envoy base ids whose shared memory it must remove."""

    workdir: Path
    processes: list[Process] = field(default_factory=list)
    envoy_base_ids: set[int] = field(default_factory=set)

    def output_paths(self, name: str) -> tuple[Path, Path]:
        """``workdir/<name>.<n>.out`` and ``.err`` for the next process called ``name``."""
        n = sum(1 for p in self.processes if p.name == name)
        return self.workdir / f"{name}.{n}.out", self.workdir / f"{name}.{n}.err"

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> Process:
        """Start argv with stdout/stderr in ``workdir/<name>.<n>.out|err``."""
        stdout_path, stderr_path = self.output_paths(name)
        with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=env,
                cwd=self.workdir,
            )
        process = Process(name, popen, stdout_path, stderr_path)
        self.processes.append(process)
        return process

    def close(self) -> None:
        """Kill (by PID) whatever is still running, reap it, remove its Envoys' shared memory."""
        for process in reversed(self.processes):
            if process.alive():
                process.popen.kill()
        for process in self.processes:
            process.popen.wait()
        for base_id in self.envoy_base_ids:
            for path in envoy_shared_memory_files(base_id):
                path.unlink(missing_ok=True)


# -- a hosts file of a process's own ---------------------------------------------------------------


def with_hosts_file(hosts: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``hosts`` as its ``/etc/hosts``, and nobody else's: in a mount namespace of
    its own (``unshare --mount``, as root), the file is bind-mounted over ``/etc/hosts``; the
    machine's stays as it is. Each ``exec``s the next (``unshare`` does not fork), so the PID is
    the program's. Write ``hosts`` in place (``Path.write_text``; not a rename: the mount holds
    the file's inode) and its next lookup reads the change (glibc's ``getaddrinfo`` reads the file
    at each lookup; Envoy's c-ares reads it once, at its start)."""
    if shutil.which("unshare") is None:
        pytest.fail("a hosts file of a process's own needs unshare (util-linux)", pytrace=False)
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(hosts), *argv]


# -- upstream HTTP servers ------------------------------------------------------------------------


def _start_backend(
    group: ProcessGroup, script: Path, label: str, name: str, timeout: float, *more: str
) -> tuple[int, Process]:
    """Start ``script --port P --name NAME [MORE...]`` on a free port; wait until it accepts connections."""
    port = free_port()
    process = group.start(f"{label}-{name}", [sys.executable, str(script), "--port", str(port), "--name", name, *more])
    wait_until(
        lambda: port_accepts(port) or _raise_if_dead(process),
        timeout=timeout,
        what=f"{label} {name} on port {port}",
        details=process.output_tail,
    )
    return port, process


@dataclass
class Upstream:
    """A tiny HTTP server answering ``GET /`` with its name (see upstream.py)."""

    name: str
    port: int
    process: Process

    @classmethod
    def start(cls, group: ProcessGroup, name: str, *, timeout: float = 10.0, status: int | None = None) -> Upstream:
        """``status``: answer every request with it (an upstream that is up and broken)."""
        more = () if status is None else ("--status", str(status))
        return cls(name, *_start_backend(group, UPSTREAM_SCRIPT, "upstream", name, timeout, *more))

    def connections(self) -> int:
        """How many connections its clients (Envoy) hold open to it now."""
        status, body = http_get(f"http://127.0.0.1:{self.port}/connections")
        assert status == 200, body
        return int(body)

    def retire(self, *, timeout: float = 20.0) -> float:
        """Stop an upstream its proxies no longer use: wait until they have closed every connection
        to it (Envoy closes them once each worker has applied the EDS removal and their requests
        are done; its admin ``/clusters`` drops the endpoint earlier, when the main thread has it),
        then SIGTERM it (it drains, see upstream.py). Returns the seconds it waited."""
        start = time.monotonic()
        wait_until(
            lambda: self.connections() == 0,
            timeout=timeout,
            what=f"the proxies to close their connections to upstream {self.name} (port {self.port})",
            details=lambda: f"{self.connections()} still open",
        )
        waited = time.monotonic() - start
        self.process.stop()
        return waited


@dataclass
class GrpcBackend:
    """A tiny gRPC server answering ``/pilotfish.test.Echo/Who`` with its name (see grpc_backend.py)."""

    name: str
    port: int
    process: Process

    @classmethod
    def start(cls, group: ProcessGroup, name: str, *, timeout: float = 10.0, fail: str | None = None) -> GrpcBackend:
        """``fail``: fail every call with this gRPC status code name (``UNAVAILABLE``)."""
        more = () if fail is None else ("--fail", fail)
        return cls(name, *_start_backend(group, GRPC_BACKEND_SCRIPT, "grpc-backend", name, timeout, *more))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class GrpcClient:
    """A real proxyless grpcio client calling ``target`` (``xds:///NAME``) in a loop, one line per
    call in ``out`` (see grpc_client.py)."""

    out: Path
    process: Process

    @classmethod
    def start(
        cls, group: ProcessGroup, name: str, *, target: str, bootstrap: Path, pause_ms: float = 0.0
    ) -> GrpcClient:
        """``pause_ms``: a pause after each call (keeps a long run's rate and CPU down)."""
        out = group.workdir / f"{name}.calls"
        env = {**os.environ, "GRPC_XDS_BOOTSTRAP": str(bootstrap)}
        argv = [sys.executable, str(GRPC_CLIENT_SCRIPT), "--target", target, "--out", str(out)]
        if pause_ms:
            argv += ["--pause-ms", str(pause_ms)]
        return cls(out, group.start(name, argv, env=env))

    def calls(self) -> list[str]:
        """Every call so far: the backend that answered, or ``ERROR ...``."""
        if not self.process.alive():
            pytest.fail(f"{self.process.name} exited\n{self.process.output_tail()}", pytrace=False)
        text = self.out.read_text() if self.out.exists() else ""
        return text.splitlines()[: text.count("\n")]  # whole lines only


def _raise_if_dead(process: Process) -> bool:
    if not process.alive():
        pytest.fail(
            f"{process.name} exited with {process.popen.returncode}\n{process.output_tail()}",
            pytrace=False,
        )
    return False


# -- pilotfish ------------------------------------------------------------------------------------


def pilotfish_env() -> dict[str, str]:
    """The environment for running ``python -m pilotfish`` from this checkout.

    ``src`` goes first on PYTHONPATH so the tests run the code next to them even when the
    package is not (or not editably) installed in the venv.
    """
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pilotfish_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pilotfish", *args]


def pilotfish(
    *args: str,
    check: bool = True,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a short pilotfish command (bootstrap, validate) and return its result (``env``: variables
    set on top of :func:`pilotfish_env`; ``cwd``: where it runs)."""
    result = subprocess.run(
        pilotfish_argv(*args),
        capture_output=True,
        text=True,
        env={**pilotfish_env(), **(env or {})},
        timeout=timeout,
        check=False,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"`pilotfish {' '.join(args)}` exited with {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}",
            pytrace=False,
        )
    return result


@dataclass
class ControlPlane:
    """``pilotfish serve`` on a fixed port, which can be stopped and started again on it.

    Its admin API listens on ``admin_port`` (chosen free when the control plane is made, kept
    across restarts). Its sources are the snapshot file (``snapshot_path``), the registry API (served on
    ``registry_port``) and etcd (``etcd``, ``host:port``), any of them or several; ``options`` are
    further ``serve`` arguments (``--quiet 50ms``, ...). A restart keeps all of them, ports
    included, as a restarted deployment would.

    Each run writes its own event log (``events.<run>.jsonl``), so a test reads what the current
    run saw without caring whether the server appends to or truncates an existing file.
    """

    group: ProcessGroup
    snapshot_path: Path | None
    port: int
    registry_port: int | None = None
    etcd: str | None = None
    options: tuple[str, ...] = ()
    runs: list[tuple[Process, EventLog]] = field(default_factory=list)
    admin_port: int = field(default_factory=free_port)
    name: str = "pilotfish"
    """Names its process and event log files: several control planes of one test (replicas) need
    their own."""
    hosts_file: Path | None = None
    """Its own ``/etc/hosts`` (:func:`with_hosts_file`); None: the machine's."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        """The admin API's ``host:port`` (what ``pilotfish status --admin`` takes)."""
        return f"127.0.0.1:{self.admin_port}"

    @property
    def registry_url(self) -> str:
        """The registry API's base URL (``http://127.0.0.1:<registry_port>``)."""
        if self.registry_port is None:
            raise RuntimeError("this control plane serves no registry API (no registry_port)")
        return f"http://127.0.0.1:{self.registry_port}"

    def _argv(self, event_log: Path) -> list[str]:
        args = ["serve", "--xds", self.address, "--admin", self.admin, "--event-log", str(event_log)]
        if self.snapshot_path is not None:
            args += ["--snapshot", str(self.snapshot_path)]
        if self.registry_port is not None:
            args += ["--registry", f"127.0.0.1:{self.registry_port}"]
        if self.etcd is not None:
            args += ["--etcd", self.etcd]
        argv = pilotfish_argv(*args, *self.options)
        return argv if self.hosts_file is None else with_hosts_file(self.hosts_file, argv)

    @property
    def process(self) -> Process:
        return self.runs[-1][0]

    @property
    def events(self) -> EventLog:
        """The event log of the current (latest) run."""
        return self.runs[-1][1]

    def start(self, *, timeout: float = 20.0) -> EventLog:
        """Start a run and wait until its port accepts connections and it logged server_started."""
        if self.runs and self.process.alive():
            raise RuntimeError("pilotfish serve is already running")
        prefix = "events" if self.name == "pilotfish" else f"events.{self.name}"
        events = EventLog(self.group.workdir / f"{prefix}.{len(self.runs)}.jsonl")
        process = self.group.start(self.name, self._argv(events.path), env=pilotfish_env())
        self.runs.append((process, events))
        wait_until(
            lambda: (
                (port_accepts(self.port) or _raise_if_dead(process))
                and events.find(lambda e: e["event"] == "server_started")
            ),
            timeout=timeout,
            what=f"pilotfish serve ({self.name}) to listen on {self.address} and log server_started",
            details=lambda: process.output_tail() + "\n" + events.describe(),
        )
        return events

    def stop(self, *, kill: bool = False) -> None:
        self.process.stop(kill=kill)
        # A stopped server must release its port before a test restarts it on the same one.
        wait_until(
            lambda: not port_accepts(self.port),
            timeout=10,
            what=f"port {self.port} to close after stopping pilotfish",
        )


# -- Envoy ----------------------------------------------------------------------------------------


def front_listener(port: int, service: str, *, rds: bool = True) -> Callable[[dict[str, Any]], None]:
    """A bootstrap edit (``Envoy.start(bootstrap_edit=...)``): a static listener of this Envoy's own
    on 127.0.0.1:``port``, so several Envoys can take load for one service side by side (sharing
    the service's own listen port, SO_REUSEPORT would split connections between them). Its routes
    are ``service``'s route configuration, fetched over ADS like the fleet's own; or, with ``rds``
    False (a service without a listener has no routes), one route to the cluster ``service``,
    retrying connect failures and refused streams as pilotfish's built routes do."""
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": f"front_{service}",
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    if rds:
        manager["rds"] = {"route_config_name": service, "config_source": {"ads": {}, "resource_api_version": "V3"}}
    else:  # the cluster comes over CDS later: not checked when the listener loads
        manager["route_config"] = {
            "validate_clusters": False,
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": service,
                                "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": 2},
                            },
                        }
                    ],
                }
            ],
        }

    def edit(bootstrap: dict[str, Any]) -> None:
        bootstrap.setdefault("static_resources", {}).setdefault("listeners", []).append(
            {
                "name": f"front-{service}-{port}",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [
                    {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
                ],
            }
        )

    return edit


def envoy_binary() -> str:
    """The Envoy binary (:func:`pilotfish.envoy.find_envoy`); fail the test if there is none."""
    try:
        return find_envoy()
    except EnvoyNotFound as exc:
        pytest.fail(f"the e2e tests need a real Envoy: {exc}", pytrace=False)


def random_base_id() -> int:
    """A base id for a hot-restart pair, unlikely to be used by anyone else on this machine."""
    while True:
        base_id = random.randint(1_000_000, 400_000_000)
        if not envoy_shared_memory_files(base_id):
            return base_id


StatValue = int | float | str


@dataclass
class Envoy:
    """A running Envoy (started by :func:`pilotfish.envoy.start_envoy`) and its admin API."""

    name: str
    process: Process
    admin_port: int
    base_id: int
    log_path: Path
    bootstrap_path: Path

    @classmethod
    def start(
        cls,
        group: ProcessGroup,
        *,
        name: str,
        node_id: str,
        xds_address: str,
        cluster: str = "e2e",
        base_id: int | None = None,
        restart_epoch: int = 0,
        drain_time_s: int = 1,
        parent_shutdown_time_s: int = 3,
        bootstrap_options: tuple[str, ...] = (),
        bootstrap_edit: Callable[[dict[str, Any]], None] | None = None,
        timeout: float = 20.0,
    ) -> Envoy:
        """Start Envoy from ``pilotfish bootstrap`` and wait until its admin API answers.

        Without ``base_id`` Envoy picks one (``--use-dynamic-base-id``), so teardown knows which
        shared-memory file is its own. A hot-restart child passes the parent's base id and
        ``restart_epoch`` + 1. The admin API listens on a port the OS picks. ``bootstrap_options``
        are further ``pilotfish bootstrap`` arguments (``--tls-ca FILE``, ...); ``bootstrap_edit``
        changes the bootstrap (parsed) before Envoy reads it (a static listener of its own, ...).
        """
        binary = envoy_binary()
        bootstrap = pilotfish(
            "bootstrap",
            "--node-id", node_id,
            "--cluster", cluster,
            "--xds", xds_address,
            "--envoy-admin-port", "0",
            *bootstrap_options,
        ).stdout  # fmt: skip
        if bootstrap_edit is not None:
            document = yaml.safe_load(bootstrap)
            bootstrap_edit(document)
            bootstrap = yaml.safe_dump(document, sort_keys=False)
        bootstrap_path = group.workdir / f"{name}.bootstrap.yaml"
        bootstrap_path.write_text(bootstrap)
        if base_id is not None:
            group.envoy_base_ids.add(base_id)
        stdout_path, stderr_path = group.output_paths(name)
        settings = EnvoySettings(
            work_dir=group.workdir,
            name=name,
            base_id=base_id,
            restart_epoch=restart_epoch,
            drain_time_s=drain_time_s,
            parent_shutdown_time_s=parent_shutdown_time_s,
            concurrency=1,
            stdout=stdout_path,
            stderr=stderr_path,
            binary=binary,
        )
        launched = start_envoy(bootstrap_path, settings)
        process = Process(name, launched.popen, stdout_path, stderr_path)
        group.processes.append(process)
        try:
            address = launched.wait_for_admin(timeout=timeout)
        except EnvoyError as exc:
            pytest.fail(str(exc), pytrace=False)
        finally:  # teardown removes its shared memory even when it failed to come up
            if launched.base_id is not None:
                group.envoy_base_ids.add(launched.base_id)
        chosen = launched.base_id
        assert chosen is not None  # wait_for_admin returns once it is known
        port = int(address.rsplit(":", 1)[1])
        return cls(name, process, port, chosen, launched.log_path, bootstrap_path)

    # admin API

    def admin(self, path: str) -> str:
        status, body = http_get(f"http://127.0.0.1:{self.admin_port}{path}")
        if status != 200:
            raise RuntimeError(f"admin {path} answered {status}: {body[:200]}")
        return body

    def stats(self, pattern: str) -> dict[str, StatValue]:
        """Stats whose name matches the regex ``pattern``: counters, gauges and text readouts."""
        query = urllib.parse.urlencode({"filter": pattern, "format": "json"})
        data = json.loads(self.admin(f"/stats?{query}"))
        # Histograms come as {"histograms": ...} entries without a plain value; skip them.
        return {s["name"]: s["value"] for s in data.get("stats", []) if "name" in s and "value" in s}

    def stat(self, name: str) -> StatValue | None:
        """One stat's value by exact name, or None when Envoy has no such stat."""
        return self.stats(f"^{re.escape(name)}$").get(name)

    def cluster_endpoints(self, cluster: str) -> list[str]:
        """``host:port`` of every endpoint Envoy has for a cluster (admin /clusters)."""
        data = json.loads(self.admin("/clusters?format=json"))
        for status in data.get("cluster_statuses", []):
            if status["name"] == cluster:
                hosts = status.get("host_statuses", [])
                return sorted(
                    f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}"
                    for h in hosts
                )
        return []

    def host_requests(self, cluster: str) -> dict[str, int]:
        """``host:port`` -> requests Envoy sent to that endpoint of ``cluster`` (admin /clusters)."""
        data = json.loads(self.admin("/clusters?format=json"))
        counts: dict[str, int] = {}
        for status in data.get("cluster_statuses", []):
            if status["name"] != cluster:
                continue
            for host in status.get("host_statuses", []):
                address = host["address"]["socket_address"]
                stats = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
                counts[f"{address['address']}:{address['port_value']}"] = stats.get("rq_total", 0)
        return counts

    def wait_for_requests(self, cluster: str, *, at_least: int = 200, timeout: float = 15.0) -> None:
        """Wait until ``at_least`` more requests than now went through this Envoy to ``cluster``
        (load flows: a load run reached it, or went on after a change)."""
        self.wait_for_more(f"cluster.{cluster}.upstream_rq_total", at_least=at_least, timeout=timeout)

    def wait_for_more(self, counter: str, *, at_least: int, timeout: float = 15.0) -> None:
        """Wait until Envoy's ``counter`` (a stat's name) has grown by ``at_least`` from now."""

        def value() -> int:
            return int(self.stat(counter) or 0)

        before = value()
        wait_until(
            lambda: value() >= before + at_least,
            timeout=timeout,
            what=f"{self.name}'s {counter} to grow by {at_least}",
        )

    def wait_for_endpoints(self, cluster: str, expected: Iterable[str], *, timeout: float = 10.0) -> None:
        """Wait until Envoy's /clusters lists exactly ``expected`` (``host:port``) for ``cluster``."""
        want = sorted(expected)
        seen: list[list[str]] = [[]]

        def matches() -> bool:
            seen[0] = self.cluster_endpoints(cluster)
            return seen[0] == want

        wait_until(
            matches,
            timeout=timeout,
            what=f"{self.name}'s cluster {cluster!r} to have endpoints {want}",
            details=lambda: f"last seen: {seen[0]}\n--- envoy log tail ---\n{self.log_tail()}",
        )

    def is_live(self) -> bool:
        status, _ = http_get(f"http://127.0.0.1:{self.admin_port}/ready")
        return status == 200

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
