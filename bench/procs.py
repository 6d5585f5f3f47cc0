"""Processes the benchmarks start: the control plane under test, read through /proc and its event log.

The server always runs in a process of its own (never in the benchmark's), so its CPU time and
memory are its own: CPU seconds are ``utime + stime`` from ``/proc/<pid>/stat``, memory is
``VmRSS`` from ``/proc/<pid>/status``. Everything started here is stopped by its PID.

Both servers (pilotfish and the naive baseline) write the same JSON-lines events the benchmarks
need: ``server_started`` (with ``xds`` and ``registry`` addresses) and ``snapshot_loaded`` (with
``versions`` per type). :class:`EventTail` follows such a file from an offset, complete lines
only (:func:`pilotfish.events.read_lines`), so a 10,000-proxy run that writes megabytes of
``sent``/``ack`` lines is read once, incrementally.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotfish.envoy import free_port
from pilotfish.etcd.client import prefix_end
from pilotfish.etcd.member import find_etcd, member_argv, serves
from pilotfish.events import read_lines

__all__ = [
    "REPO",
    "EtcdProcess",
    "EventTail",
    "ServerProcess",
    "cpu_seconds",
    "free_port",
    "raise_fd_limit",
    "rss_kb",
    "start_etcd",
    "start_pilotfish",
    "work_dir",
]

REPO = Path(__file__).resolve().parent.parent
# Every request goes to a loopback address, whatever proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_TICKS = os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> None:
    """Raise this process's open-file limit to its hard limit (10,000 streams need 10,000 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def work_dir(stack: contextlib.ExitStack[Any], workdir: str | Path | None, prefix: str) -> Path:
    """Where a benchmark keeps its servers' files: ``workdir`` (made if missing), or a temporary
    directory named ``prefix...`` that ``stack`` removes."""
    if workdir is None:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime are fields 14 and 15


def rss_kb(pid: int) -> int:
    """Resident set size in KiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class EventTail:
    """Follows a JSON-lines event log from where it was last read.

    Lines read from the file but not yet consumed (those after an event :meth:`wait_for` returned)
    are kept for the next call, so events that arrive in one read are never lost.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._pending: list[bytes] = []

    def _fill(self) -> None:
        lines, self._offset = read_lines(self.path, self._offset)
        self._pending.extend(lines)

    def skip_to_end(self) -> None:
        """Forget everything written so far."""
        self._fill()
        self._pending.clear()

    def read(self, contains: bytes | None = None) -> list[dict[str, Any]]:
        """Every line not consumed yet (only those containing ``contains``), parsed; consumes them all."""
        self._fill()
        lines, self._pending = self._pending, []
        return [json.loads(line) for line in lines if contains is None or contains in line]

    def wait_for(
        self,
        event: str,
        *,
        timeout: float,
        where: Callable[[dict[str, Any]], bool] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """The next event named ``event`` (matching ``where``), consuming the lines up to it;
        TimeoutError after ``timeout`` seconds."""
        needle = f'"event":"{event}"'.encode()
        deadline = time.monotonic() + timeout
        scanned = 0
        while True:
            self._fill()
            for index in range(scanned, len(self._pending)):
                line = self._pending[index]
                if needle in line:
                    record: dict[str, Any] = json.loads(line)
                    if where is None or where(record):
                        del self._pending[: index + 1]
                        return record
            scanned = len(self._pending)
            if alive is not None and not alive():
                raise RuntimeError(f"the server exited while waiting for {event!r} in {self.path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {event!r} event in {self.path} within {timeout}s")
            time.sleep(0.005)


@dataclass
class ServerProcess:
    """A control plane running in its own process, stopped by PID."""

    name: str
    argv: list[str]
    workdir: Path
    event_log: Path
    xds: str = ""
    registry: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    started: dict[str, Any] = field(default_factory=dict)
    tail: EventTail | None = None
    env: Mapping[str, str] | None = None
    """The process's environment (None: this one's)."""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, timeout: float = 60.0) -> None:
        """Start the process and wait for its ``server_started`` event."""
        self.tail = EventTail(self.event_log)
        self.tail.skip_to_end()
        log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        # The child inherits the raised limit. (Not a preexec_fn: that runs Python between fork and
        # exec in a process whose gRPC threads are running, which can break the child.)
        raise_fd_limit()
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=self.env
        )
        log.close()
        try:
            self.started = self.tail.wait_for("server_started", timeout=timeout, alive=self.alive)
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from exc
        self.xds = self.started["xds"]
        self.registry = self.started.get("registry")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_kb(self) -> int:
        return rss_kb(self.pid)

    def settle_cpu(self, *, quiet: float = 0.15, limit: float = 3.0) -> float:
        """Wait until the process has used no CPU for ``quiet`` seconds (at most ``limit``); its CPU seconds."""
        deadline = time.monotonic() + limit
        last = self.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(quiet)
            now = self.cpu_seconds()
            if now - last < 1.5 / _TICKS:
                return now
            last = now
        return last

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / f"{self.name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start_pilotfish(
    workdir: Path,
    *,
    snapshot: Path | None,
    quiet_ms: int = 100,
    xds_port: int = 0,
    registry: bool = True,
    extra: Sequence[str] = (),
    name: str = "pilotfish",
    python: str = sys.executable,
    wrapper: Sequence[str] = (),
    module: Sequence[str] = ("pilotfish",),
    env: Mapping[str, str] | None = None,
    admin: str = "off",
) -> ServerProcess:
    """``python -m pilotfish serve`` with an event log in ``workdir``; started and ready.

    ``wrapper`` prefixes the command (e.g. a profiler that takes ``python -m ...``); ``module`` is
    what ``-m`` runs (bench/h2_core_launch.py runs the CLI with another HTTP/2 core); ``env``: the
    server's environment (e.g. a ``PYTHONPATH`` naming another checkout's ``src``);
    ``admin``: ``--admin`` (``off`` by default, which leaves port 18001 to other servers; a
    ``HOST:PORT``, e.g. ``127.0.0.1:0``, serves it: its address is in ``started["admin"]``).
    """
    event_log = workdir / f"{name}-events.jsonl"
    # Every simulated proxy connects from 127.0.0.1: lift the per-address cap (default 4,096).
    argv = [
        *wrapper,
        python,
        "-m",
        *module,
        "serve",
        "--xds",
        f"127.0.0.1:{xds_port}",
        "--event-log",
        str(event_log),
        "--quiet-ms",
        str(quiet_ms),
        "--max-connections-per-address",
        "1000000",
        "--admin",
        admin,
        *extra,
    ]
    if snapshot is not None:
        argv += ["--snapshot", str(snapshot)]
    if registry:
        argv += ["--registry", "127.0.0.1:0"]
    server = ServerProcess(name=name, argv=argv, workdir=workdir, event_log=event_log, env=env)
    server.start()
    return server


@dataclass
class EtcdProcess:
    """A single-member etcd of the benchmark's own (:mod:`pilotfish.etcd.member`), stopped by PID."""

    address: str
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix`` (through the JSON gateway)."""
        body = {
            "key": base64.b64encode(prefix.encode()).decode(),
            "range_end": base64.b64encode(prefix_end(prefix).encode("latin-1")).decode(),
            "count_only": True,
        }
        request = urllib.request.Request(
            f"http://{self.address}/v3/kv/range",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with _OPENER.open(request, timeout=10) as response:
            return int(json.loads(response.read()).get("count", 0))

    def wait_count(self, prefix: str, count: int, *, timeout: float) -> bool:
        """Poll until at least ``count`` keys start with ``prefix``; False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.count(prefix) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, *, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_etcd(workdir: Path, *, name: str = "etcd", timeout: float = 30.0) -> EtcdProcess:
    """etcd on free ports with its data dir in ``workdir``; started and serving."""
    client_port, peer_port = free_port(), free_port()
    while peer_port == client_port:
        peer_port = free_port()
    argv = member_argv(
        find_etcd(),
        name=name,
        data_dir=workdir / f"{name}.data",
        client_port=client_port,
        peer_port=peer_port,
        token="pilotfish-bench",
    )
    with open(workdir / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    etcd = EtcdProcess(f"127.0.0.1:{client_port}", proc)
    deadline = time.monotonic() + timeout
    while not serves(etcd.address, timeout=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            etcd.stop()
            log_tail = "\n".join((workdir / f"{name}.log").read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"etcd did not serve on {etcd.address} (exit code {proc.returncode}):\n{log_tail}")
        time.sleep(0.05)
    return etcd
