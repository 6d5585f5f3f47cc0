"""Docker discovery under a burst: how long until Envoy has every container started (or none of
those stopped), and how many builds it took, beside the same burst through the registry API.

Theory of operation
-------------------
One ``dockerd`` of the benchmark's own (:mod:`pilotfish.sources.dockerd`: no network of its own,
containers on the host network, the busybox image built locally), one ``pilotfish serve`` with the
snapshot file (``web``'s listener, no endpoints), ``--docker`` on that engine and the registry API,
and one real Envoy (:func:`pilotfish.envoy.start_envoy`) on it. ``rounds`` times, interleaved:

- **docker**: ``containers`` containers are created and started at once (the Engine API over its
  socket, ``concurrency`` requests in flight), each labelled ``pilotfish.service=web:<port>`` and
  running ``sleep`` (an endpoint need not answer to be listed); timed from the first request until
  Envoy's ``/clusters`` lists all of them for ``web`` (*up*). Then all are stopped at once
  (``POST /containers/{id}/stop?t=1``: TERM, which ``sleep`` as PID 1 ignores, then KILL), timed until
  Envoy lists none (*down*): the endpoints leave at the TERM's ``kill`` event, not at the exit.
- **registry**: the same number of instances registered at once through the registry API (the same
  concurrency), timed until Envoy lists all; then deregistered, timed until it lists none.

Per phase: the time to Envoy (median over rounds), how long the engine (or the registry) took to
take the requests, the builds pilotfish made (``snapshot_loaded`` events in the phase: the debounce
coalesces a burst), and pilotfish's CPU seconds. Each phase uses fresh ports: an address that left
a moment ago is flap-damped when it comes back. The blast-radius guard is off: it would (rightly)
hold the snapshot that removes every endpoint of ``web`` at once until an operator confirms it.
The engine's own cost (dockerd and containerd starting the containers) is most of the docker
column; what pilotfish adds is the difference between the engine's time and Envoy's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.bench_envoy import EnvoyProcess
from bench.procs import ServerProcess, start_pilotfish, work_dir
from bench.report import print_table
from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap
from pilotfish.sources.dockerd import IMAGE, answers, dockerd_argv, find_dockerd, image_context, unmount_under

COLUMNS = [
    "source",
    "phase",
    "endpoints",
    "to Envoy (median s)",
    "taken (median s)",
    "builds (median)",
    "CPU s (median)",
]


@dataclass
class Dockerd:
    """The benchmark's engine, stopped by PID (its containers removed first)."""

    root: Path
    data_root: Path
    proc: subprocess.Popen[bytes] | None = None
    cli: str = ""

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    def start(self) -> None:
        dockerd, self.cli = find_dockerd()
        log = (self.root / "dockerd.log").open("wb")
        self.proc = subprocess.Popen(
            dockerd_argv(dockerd, root=self.root, data_root=self.data_root),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not answers(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: see {self.root / 'dockerd.log'}")
            time.sleep(0.1)
        context = image_context(self.root / "image")
        self.docker("build", "--quiet", "--tag", IMAGE, str(context))

    def docker(self, *args: str) -> str:
        env = {"DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.root / "cli"), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [self.cli, "--host", f"unix://{self.socket}", *args], capture_output=True, text=True, env=env, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {done.stderr}")
        return done.stdout

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(RuntimeError):
            listed = self.docker("ps", "--all", "--quiet").split()
            if listed:
                self.docker("rm", "--force", *listed)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        unmount_under(self.data_root, self.root)


async def _burst(
    requests: Sequence[Callable[[aiohttp.ClientSession], Any]], session: aiohttp.ClientSession, concurrency: int
) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(request: Callable[[aiohttp.ClientSession], Coroutine[Any, Any, None]]) -> None:
        async with gate:
            await request(session)

    await asyncio.gather(*(one(r) for r in requests))


def _engine_session(socket: Path) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket)))


async def _checked(answer: aiohttp.ClientResponse) -> Any:
    async with answer:
        if answer.status >= 300:
            raise RuntimeError(f"{answer.method} {answer.url}: {answer.status} {await answer.text()}")
        return await answer.json() if answer.content_type == "application/json" else None


async def start_containers(socket: Path, ports: Sequence[int], concurrency: int) -> list[str]:
    ids: list[str] = []

    async def create(port: int, session: aiohttp.ClientSession) -> None:
        body = {
            "Image": IMAGE,
            "Cmd": ["sleep", "3600"],
            "Labels": {"pilotfish.service": f"web:{port}"},
            "HostConfig": {"NetworkMode": "host"},
        }
        made = await _checked(await session.post("http://docker/v1.41/containers/create", json=body))
        await _checked(await session.post(f"http://docker/v1.41/containers/{made['Id']}/start"))
        ids.append(made["Id"])

    async with _engine_session(socket) as session:
        await _burst([functools.partial(create, p) for p in ports], session, concurrency)
    return ids


async def stop_containers(socket: Path, ids: Sequence[str], concurrency: int, *, remove: bool = False) -> None:
    async def stop(container: str, session: aiohttp.ClientSession) -> None:
        if remove:
            await _checked(await session.delete(f"http://docker/v1.41/containers/{container}?force=1"))
        else:
            await _checked(await session.post(f"http://docker/v1.41/containers/{container}/stop?t=1"))

    async with _engine_session(socket) as session:
        await _burst([functools.partial(stop, c) for c in ids], session, concurrency)


async def register(registry: str, ports: Sequence[int], concurrency: int) -> list[str]:
    ids: list[str] = []

    async def one(port: int, session: aiohttp.ClientSession) -> None:
        answer = await session.post(
            f"http://{registry}/v1/services/web/instances", json={"address": "127.0.0.1", "port": port}
        )
        ids.append((await _checked(answer))["id"])

    async with aiohttp.ClientSession() as session:
        await _burst([functools.partial(one, p) for p in ports], session, concurrency)
    return ids


async def deregister(registry: str, ids: Sequence[str], concurrency: int) -> None:
    async def one(instance: str, session: aiohttp.ClientSession) -> None:
        await _checked(await session.delete(f"http://{registry}/v1/services/web/instances/{instance}"))

    async with aiohttp.ClientSession() as session:
        await _burst([functools.partial(one, i) for i in ids], session, concurrency)


def envoy_hosts(envoy: EnvoyProcess) -> int:
    with urllib.request.urlopen(f"http://{envoy.admin}/clusters?format=json", timeout=5) as response:
        data = json.loads(response.read())
    for status in data.get("cluster_statuses", []):
        if status["name"] == "web":
            return len(status.get("host_statuses", []))
    return 0


def wait_hosts(envoy: EnvoyProcess, count: int, *, timeout: float = 300.0) -> float:
    """Poll until Envoy lists ``count`` hosts for ``web``; when (monotonic)."""
    deadline = time.monotonic() + timeout
    while envoy_hosts(envoy) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy did not reach {count} hosts for web (has {envoy_hosts(envoy)})")
        time.sleep(0.01)
    return time.monotonic()


@dataclass
class Phase:
    source: str
    phase: str
    endpoints: int
    to_envoy: list[float] = field(default_factory=list)
    taken: list[float] = field(default_factory=list)
    builds: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def row(self) -> list[Any]:
        return [
            self.source,
            self.phase,
            self.endpoints,
            f"{statistics.median(self.to_envoy):.2f}",
            f"{statistics.median(self.taken):.2f}",
            f"{statistics.median(self.builds):.0f}",
            f"{statistics.median(self.cpu):.2f}",
        ]


def _builds(server: ServerProcess) -> int:
    assert server.tail is not None
    return sum(1 for line in server.event_log.read_text().splitlines() if '"snapshot_loaded"' in line)


def measure(phase: Phase, server: ServerProcess, envoy: EnvoyProcess, act: Callable[[], Any], hosts: int) -> Any:
    builds, cpu = _builds(server), server.cpu_seconds()
    started = time.monotonic()
    result = act()
    taken = time.monotonic()
    reached = wait_hosts(envoy, hosts)
    phase.to_envoy.append(reached - started)
    phase.taken.append(taken - started)
    time.sleep(0.5)  # (a trailing build of the burst counts in it)
    phase.builds.append(_builds(server) - builds)
    phase.cpu.append(server.settle_cpu() - cpu)
    return result


def _run(work: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(work)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--containers", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight to the engine or registry")
    parser.add_argument("--workdir", help="keep logs here (default: a temp dir, removed)")
    args = parser.parse_args(argv)

    def ports(round_: int, source: int) -> list[int]:
        """Fresh endpoints each time (flap damping would hold back an address that just left)."""
        first = 20_000 + (2 * round_ + source) * args.containers
        return list(range(first, first + args.containers))

    phases = {
        key: Phase(source, phase, args.containers)
        for key, (source, phase) in {
            "docker-up": ("docker", "start"),
            "docker-down": ("docker", "stop"),
            "registry-up": ("registry", "register"),
            "registry-down": ("registry", "deregister"),
        }.items()
    }
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, args.workdir, "bench-docker-")
        root = Path(tempfile.mkdtemp(prefix="pfdkb", dir="/tmp"))
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        engine = Dockerd(root, workdir / "docker-data")
        stack.callback(engine.stop)
        engine.start()
        snapshot = workdir / "services.yaml"
        snapshot.write_text(yaml.safe_dump({"services": {"web": {"listen": "127.0.0.1:31999"}}}))
        server = start_pilotfish(
            workdir,
            snapshot=snapshot,
            extra=["--docker", f"unix://{engine.socket}", "--guard", "off"],
            admin="127.0.0.1:0",
        )
        stack.callback(server.stop)
        assert server.registry is not None
        config = bootstrap(BootstrapSettings(node_id="bench-docker", xds=server.xds, admin_port=0))
        envoy = EnvoyProcess(workdir, config)
        stack.callback(envoy.stop)
        envoy.start()
        wait_hosts(envoy, 0)
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr)
            ids = measure(
                phases["docker-up"],
                server,
                envoy,
                functools.partial(_run, start_containers(engine.socket, ports(round_, 0), args.concurrency)),
                args.containers,
            )
            measure(
                phases["docker-down"],
                server,
                envoy,
                functools.partial(_run, stop_containers(engine.socket, ids, args.concurrency)),
                0,
            )
            asyncio.run(stop_containers(engine.socket, ids, args.concurrency, remove=True))
            registry = server.registry
            assert registry is not None
            instances = measure(
                phases["registry-up"],
                server,
                envoy,
                functools.partial(_run, register(registry, ports(round_, 1), args.concurrency)),
                args.containers,
            )
            measure(
                phases["registry-down"],
                server,
                envoy,
                functools.partial(_run, deregister(registry, instances, args.concurrency)),
                0,
            )
    print(f"\n{args.containers} endpoints in a burst, {args.rounds} rounds, {args.concurrency} requests in flight")
    print_table(COLUMNS, [p.row() for p in phases.values()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
