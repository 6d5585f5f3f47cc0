"""The server under attack: a real ``pilotfish serve`` process, and a well-behaved proxy beside it.

Theory of operation
-------------------
Each abuse test gets its own ``pilotfish serve`` (a small snapshot file, an event log, an
OS-chosen port; killed by PID at teardown) and a :class:`GoodClient`: a grpcio ADS stream that
subscribed to clusters and ACKs what it gets, as a proxy would. The test then attacks from raw
sockets (:mod:`.wire`), and in the middle of the attack changes the snapshot
(:meth:`Target.change_snapshot`). :meth:`Target.harm` then says what the attack did to the
server, as a list of problems (empty: it held):

- the good client did not get the change (it must keep being served, whatever the attacker does);
- the server's memory grew by more than :data:`RSS_BOUND` (peak resident set, from
  ``/proc/PID/status``, against the resident set just before the attack);
- the server wrote a traceback to stderr, or died.

The numbers (memory growth, CPU seconds, wall time) are written to the file named by the
environment variable ``PILOTFISH_ABUSE_REPORT`` when it is set, one JSON line per test: the table
of what holds and what does not.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from pilotfish.envoy import free_port

from .wire import RawClient, wait

__all__ = ["CDS", "EDS", "RSS_BOUND", "GoodClient", "Target", "discovery_request"]

REPO = Path(__file__).resolve().parents[2]
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
MIB = 1024 * 1024
RSS_BOUND = 64 * MIB
"""How much an attack may grow the server's memory (peak RSS over the RSS before it)."""
SERVED_TIMEOUT = 15.0
"""How long the good client may wait for the change made during an attack."""
CLUSTERS = 20
"""Clusters in the snapshot: a CDS response of a few KB."""


def discovery_request(type_url: str = CDS, node_id: str = "attacker", **fields: object) -> bytes:
    request = discovery_pb2.DiscoveryRequest(type_url=type_url, **fields)
    request.node.id = node_id
    encoded: bytes = request.SerializeToString()
    return encoded


def write_snapshot(path: Path, version: int) -> None:
    """``CLUSTERS`` static clusters; the version (explicit, so every type carries it) and a
    timeout change with ``version``. Replaced by rename, so the server never reads half a file."""
    clusters = [
        {
            "name": f"cluster-{i:03d}",
            "type": "STATIC",
            "connect_timeout": f"{version}s",
            "load_assignment": {
                "cluster_name": f"cluster-{i:03d}",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 9000 + i}}
                                }
                            }
                        ]
                    }
                ],
            },
        }
        for i in range(CLUSTERS)
    ]
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps({"version": f"v{version}", "clusters": clusters}))
    os.replace(temp, path)


class GoodClient:
    """A well-behaved proxy: a grpcio ADS stream subscribed to every cluster, ACKing each response."""

    def __init__(self, address: str, node_id: str = "good-proxy") -> None:
        self.node_id = node_id
        self._channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel)
        self._requests: queue.Queue[discovery_pb2.DiscoveryRequest | None] = queue.Queue()
        self.versions: list[str] = []
        self.error: str | None = None
        self._cond = threading.Condition()
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id = node_id
        self._requests.put(first)
        self._call = stub.StreamAggregatedResources(iter(self._requests.get, None))
        self._thread = threading.Thread(target=self._read, name=f"good-client-{node_id}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._requests.put(
                    discovery_pb2.DiscoveryRequest(
                        type_url=response.type_url, version_info=response.version_info, response_nonce=response.nonce
                    )
                )
                with self._cond:
                    self.versions.append(response.version_info)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self.error = f"{exc.code().name}: {exc.details()}"
                self._cond.notify_all()

    def wait_for_version(self, version: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: version in self.versions or self.error is not None, timeout) and (
                version in self.versions
            )

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self._channel.close()
        self._thread.join(5.0)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class Target:
    """``pilotfish serve`` on a small snapshot, its good client, and the measures of an attack."""

    def __init__(
        self,
        workdir: Path,
        *,
        nofile: int | None = None,
        nofile_hard: int | None = None,
        serve_args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.snapshot = workdir / "snapshot.json"
        self.version = 1
        write_snapshot(self.snapshot, self.version)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.event_log = workdir / "events.jsonl"
        self.stdout = workdir / "pilotfish.out"
        self.stderr = workdir / "pilotfish.err"
        # PILOTFISH_ABUSE_CORE=h2 runs the same server on the `h2` package's state machine
        # (bench/h2_core_launch.py), for the side-by-side comparison of the two HTTP/2 cores; unset: the CLI itself.
        core = os.environ.get("PILOTFISH_ABUSE_CORE", "")
        launcher = ["bench.h2_core_launch", "--core", core] if core else ["pilotfish"]
        argv = [
            sys.executable,
            "-m",
            *launcher,
            "serve",
            "--snapshot",
            str(self.snapshot),
            "--xds",
            self.address,
            "--event-log",
            str(self.event_log),
            "--quiet",
            "10ms",
            "--max-delay",
            "100ms",
            "--admin",
            "off",
            *serve_args,
        ]
        if nofile is not None:  # the usual soft descriptor limit of a service: prlimit execs, same PID
            hard = nofile_hard or resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # serve raises soft to hard
            prlimit = shutil.which("prlimit")
            if prlimit is None:
                raise RuntimeError("the descriptor test needs prlimit (Debian package util-linux)")
            argv = [prlimit, f"--nofile={nofile}:{hard}", "--", *argv]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), str(REPO) if core else "", env.get("PYTHONPATH")) if p
        )
        env["PYTHONUNBUFFERED"] = "1"
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=workdir
            )
        self.pid = self.process.pid
        self.good: GoodClient | None = None
        self.extra_clients: list[GoodClient] = []
        self.raw_clients: list[RawClient] = []
        self._rss_before = 0
        self._peak_before = 0
        self._cpu_before = 0.0
        self._started = 0.0
        self._stderr_offset = 0
        self._changed = False
        self.numbers: dict[str, object] = {}

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> Target:
        """Wait until the server listens and the good client has its first snapshot; take the
        measures from which the attack's are counted."""
        started = wait(lambda: not self.alive() or b'"server_started"' in self._read(self.event_log), timeout=20)
        if not started or not self.alive():
            raise RuntimeError(f"pilotfish serve did not start:\n{self.stderr_text()[-3000:]}")
        self.good = GoodClient(self.address)
        if not self.good.wait_for_version("v1", 10):
            raise RuntimeError(f"the good client got no first response: {self.good.error}\n{self.stderr_text()}")
        return self.begin()

    def begin(self) -> Target:
        """Take the measures an attack is counted from (a server shared by several tests calls it
        before each): memory, CPU, time, how much stderr there is already."""
        self.numbers = {}
        for client in self.raw_clients:  # the previous test's, on a shared server
            client.close()
        self.raw_clients.clear()
        self._rss_before = self.rss()
        self._peak_before = self.peak_rss()
        self._cpu_before = self.cpu_seconds()
        self._stderr_offset = len(self._read(self.stderr))
        self._started = time.monotonic()
        self._changed = False
        return self

    def healthy(self) -> bool:
        """Whether a shared server can serve the next test: alive, no traceback, memory as it was."""
        return self.alive() and "Traceback" not in self.stderr_text() and self.rss() < self._rss_before + 16 * MIB

    def attacker(self, **options: object) -> RawClient:
        """A raw connection to the server, closed at teardown."""
        client = RawClient(self.port, **options)  # type: ignore[arg-type]
        self.raw_clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.raw_clients:
            client.close()
        for good in (self.good, *self.extra_clients):
            if good is not None:
                good.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    # -- measures -------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss(self) -> int:
        return _status_kib(self.pid, "VmRSS") * 1024

    def peak_rss(self) -> int:
        return _status_kib(self.pid, "VmHWM") * 1024

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cpu_used(self) -> float:
        """CPU seconds the server spent since the attack began."""
        return self.cpu_seconds() - self._cpu_before

    def open_descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stderr_text(self) -> str:
        return self._read(self.stderr).decode(errors="replace")

    def stderr_lines(self, containing: str = "") -> list[str]:
        """The lines the server wrote to stderr since the attack began (with ``containing``)."""
        text = self._read(self.stderr)[self._stderr_offset :].decode(errors="replace")
        return [line for line in text.splitlines() if containing in line]

    def event_log_size(self) -> int:
        return self.event_log.stat().st_size if self.event_log.exists() else 0

    @staticmethod
    def _read(path: Path) -> bytes:
        return path.read_bytes() if path.exists() else b""

    # -- the good client's proof of service -----------------------------------------------------

    def change_snapshot(self) -> None:
        """Change what is served (call it during the attack): the good client must get it."""
        self.version += 1
        self._changed = True
        write_snapshot(self.snapshot, self.version)

    def harm(self, *, rss_bound: int = RSS_BOUND, served_timeout: float = SERVED_TIMEOUT) -> list[str]:
        """What the attack did that it must not: each problem as a sentence (empty: it held)."""
        problems = []
        if not self._changed:
            self.change_snapshot()  # an attack that never called it: the change comes after it
        assert self.good is not None
        served = self.good.wait_for_version(f"v{self.version}", served_timeout if self.alive() else 0)
        elapsed = time.monotonic() - self._started
        if not self.alive():
            problems.append(f"the server died (exit code {self.process.returncode})")
            peak = growth = 0
        else:
            growth = self.rss() - self._rss_before
            # The peak since the attack began: VmHWM when the attack raised it, else what is resident now.
            high = self.peak_rss()
            peak = high - self._rss_before if high > self._peak_before else growth
            self.numbers.update(cpu_s=round(self.cpu_used(), 2))
        self.numbers.update(
            peak_rss_growth_mib=round(peak / MIB, 1), rss_growth_mib=round(growth / MIB, 1), seconds=round(elapsed, 2)
        )
        if not served:
            problems.append(
                f"the good client did not get snapshot v{self.version} within {served_timeout:g} s "
                f"(it has {self.good.versions}, error {self.good.error})"
            )
        if peak > rss_bound:
            problems.append(
                f"server memory grew by {peak / MIB:.0f} MiB at its peak ({growth / MIB:.0f} MiB now), "
                f"over the bound of {rss_bound / MIB:.0f} MiB"
            )
        stderr = self._read(self.stderr)[self._stderr_offset :].decode(errors="replace")
        if "Traceback" in stderr:
            start = stderr.index("Traceback")
            problems.append(f"traceback in the server's stderr:\n{stderr[start : start + 1500]}")
        return problems

    def conclude(
        self,
        name: str,
        problems: list[str],
        *,
        served_timeout: float = SERVED_TIMEOUT,
        rss_bound: int = RSS_BOUND,
        **numbers: object,
    ) -> None:
        """Fail with every problem of the attack (its own checks and :meth:`harm`), after
        recording its numbers."""
        problems = problems + self.harm(served_timeout=served_timeout, rss_bound=rss_bound)
        self.numbers.update(numbers)
        self.report(name, problems)
        assert not problems, f"{name}: " + "\n".join(problems) + f"\nnumbers: {self.numbers}"

    def report(self, name: str, problems: list[str]) -> None:
        path = os.environ.get("PILOTFISH_ABUSE_REPORT")
        if path:
            with open(path, "a") as out:
                out.write(
                    json.dumps(
                        {"test": name, "held": not problems, **self.numbers, "problems": [p[:300] for p in problems]}
                    )
                    + "\n"
                )
