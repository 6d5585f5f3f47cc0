"""Fan-out: one endpoint change, timed until every connected proxy has ACKed the new EDS version.

One run: write the snapshot file, start the server (pilotfish, or the naive baseline) in its own
process, read its RSS, connect N simulated proxies and wait until all are synced, read the RSS
again (RSS per idle stream), then make ``changes`` endpoint changes one after another. For each:

- t0 = just before the change is made (the registry API call, or the file's rename);
- the server's ``snapshot_loaded`` event names the new EDS version (and when it was published);
- each proxy's time = when it sent its ACK of that version (client side) minus t0;
- server CPU seconds = /proc/<pid>/stat utime+stime after the server has gone quiet, minus before;
- bytes per proxy = the response messages each proxy received, after the server has gone quiet,
  minus before (and at the initial sync: everything received until all were synced).

Latencies of all proxies over all changes are pooled for p50/p99/max; "failures" counts proxies
that never ACKed a change within the timeout, "stream errors" every stream that broke.

Replicas (``replicas=N`` with ``etcd``): N pilotfish processes on one etcd, each with its registry
stored there, the proxies spread evenly over them (:attr:`bench.fleet.Fleet.replicas`). A change
is written through the first replica's registry API; the version waited for is the first
replica's (every replica builds the same one from the same etcd revision); CPU and RSS are summed
over the replicas (and etcd's CPU per change is kept apart).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet import CLIENTS, EDS, XDS_VARIANTS, Fleet, FleetTls
from bench.procs import REPO, EtcdProcess, ServerProcess, start_pilotfish
from bench.report import fmt_ms
from bench.stats import load_1min, percentile
from bench.workload import Workload

__all__ = ["FANOUT_COLUMNS", "FanoutResult", "run_fanout", "start_naive", "stream_error_notes"]

FANOUT_COLUMNS = ["server", "proxies", "change", "quiet ms", "event log", "all synced s", "p50 ms", "p99 ms", "max ms",
                  "p99 after publish ms", "CPU s / push", "simulator CPU s / push", "RSS KB / idle stream", "failures",
                  "stream errors"]


@dataclass
class FanoutResult:
    server: str
    proxies: int
    change: str
    quiet_ms: int
    sync_seconds: float
    event_log: str = "all"
    """The server's ``--event-log-level`` (``-``: a server without one)."""
    latencies: list[float] = field(default_factory=list)
    after_publish: list[float] = field(default_factory=list)
    cpu_per_push: list[float] = field(default_factory=list)
    client_cpu_per_push: list[float] = field(default_factory=list)
    """CPU seconds of the simulator's processes per change (same cores as the server)."""
    rss_per_stream_kb: float = 0.0
    rss_idle_kb: int = 0
    rss_base_kb: int = 0
    failures: int = 0
    stream_errors: dict[str, int] = field(default_factory=dict)
    """Streams that broke, by gRPC status (while connecting and syncing included)."""
    errors_during_changes: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    xds: str = "sotw"
    """The proxies' xDS variant (:data:`bench.fleet.XDS_VARIANTS`)."""
    sync_bytes: list[int] = field(default_factory=list)
    """Bytes of responses each proxy received until every proxy was synced."""
    change_bytes: list[list[int]] = field(default_factory=list)
    """Per change, the bytes of responses each proxy received for it."""
    simulator_rss_kb: int = 0
    """The simulator's worker processes' RSS, summed, once all were synced."""
    replicas: int = 1
    """pilotfish processes serving the proxies (CPU and RSS are their sums)."""
    etcd_cpu_per_push: list[float] = field(default_factory=list)
    """CPU seconds of etcd per change (when the servers ran on etcd)."""
    change_p99: list[float] = field(default_factory=list)
    """Each change's own p99 (seconds), in order: one slow change shows here, not only in the pooled p99."""
    never_synced: int = 0
    """Proxies that had not synced when the changes began (``keep_going``); they count as failures."""
    indexed_seconds: float | None = None
    """On etcd: seconds from the fleet's start until etcd held every proxy's subsetting index."""

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)

    @property
    def cpu(self) -> float:
        return sum(self.cpu_per_push) / len(self.cpu_per_push) if self.cpu_per_push else float("nan")

    def row(self) -> list[object]:
        errors = sum(self.stream_errors.values())
        return [self.server, self.proxies, self.change, self.quiet_ms, self.event_log, round(self.sync_seconds, 2),
                fmt_ms(self.p(50)), fmt_ms(self.p(99)), fmt_ms(max(self.latencies, default=float("nan"))),
                fmt_ms(percentile(self.after_publish, 99)), round(self.cpu, 3),
                round(sum(self.client_cpu_per_push) / max(1, len(self.client_cpu_per_push)), 3),
                round(self.rss_per_stream_kb, 1),
                self.failures, errors if not errors else f"{errors} {self.stream_errors}"]


def start_naive(workdir: Path, *, snapshot: Path, xds_port: int = 0, name: str = "naive") -> ServerProcess:
    """The naive baseline server (bench/naive_server.py) in its own process."""
    event_log = workdir / f"{name}-events.jsonl"
    argv = [sys.executable, "-m", "bench.naive_server", "--snapshot", str(snapshot),
            "--xds", f"127.0.0.1:{xds_port}", "--event-log", str(event_log)]
    server = ServerProcess(name=name, argv=argv, workdir=workdir, event_log=event_log)
    server.start()
    return server


class _Changer:
    """Makes one endpoint change at a time: through the registry API, or by rewriting the file."""

    def __init__(self, how: str, server: ServerProcess, workload: Workload, snapshot: Path,
                 tls: ssl.SSLContext | None = None) -> None:
        self.how, self.server, self.workload, self.snapshot = how, server, workload, snapshot
        self.count = 0
        self.registered: str | None = None
        self.tls = tls
        """The registry API is served over TLS (with the xDS port's certificate): trust this."""

    def change(self) -> None:
        self.count += 1
        if self.how == "file":
            # A fresh endpoint each time, so each change is new content.
            self.workload.write(self.snapshot, extra_endpoint=("10.255.0.1", 9000 + self.count))
            return
        scheme = "https" if self.tls is not None else "http"
        base = f"{scheme}://{self.server.registry}/v1/services/svc-00000/instances"
        if self.registered is None:
            body = json.dumps({"address": "10.255.0.1", "port": 9000 + self.count}).encode()
            request = urllib.request.Request(base, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10, context=self.tls) as response:
                self.registered = json.loads(response.read())["id"]
        else:
            request = urllib.request.Request(f"{base}/{self.registered}", method="DELETE")
            with urllib.request.urlopen(request, timeout=10, context=self.tls):
                self.registered = None


def _py_spy(pid: int, output: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
                             "--output", str(output), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)



def stream_error_notes(label: str, results: Sequence[FanoutResult]) -> list[str]:
    """One line per gRPC status the proxies of ``results`` (the runs of one variant, pooled) saw:
    how many, how many of them during the changes, and an example message. ``label`` names the
    variant (e.g. ``now TLS, 1000 proxies``)."""
    counts: dict[str, int] = {}
    during: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        for code, n in r.stream_errors.items():
            counts[code] = counts.get(code, 0) + n
            during[code] = during.get(code, 0) + r.errors_during_changes.get(code, 0)
        examples.update(r.error_examples)
    runs = f" over {len(results)} runs" if len(results) > 1 else ""
    return [f"Stream errors, {label}: {n} x {code}{runs} (during the changes: {during[code]}), e.g. "
            f"`{examples.get(code, '?')[:200]}`" for code, n in counts.items()]


def run_fanout(*, server: str = "pilotfish", proxies: int, changes: int = 5, workload: Workload,
               quiet_ms: int = 100, change: str = "registry", workers: int = 0, workdir: str | Path | None = None,
               profile: Path | None = None, change_timeout: float = 60.0, gap: float = 0.3,
               client: str = "h2", event_log_level: str = "all", core: str = "own",
               server_env: Mapping[str, str] | None = None, server_args: Sequence[str] = (),
               tls: FleetTls | None = None, address_cap: bool = True, xds: str = "sotw",
               sync_timeout: float | None = None, rate: float = 0.0, admin: str | None = "off",
               during_changes: Callable[[ServerProcess], AbstractContextManager[object]] | None = None,
               after_changes: Callable[[ServerProcess], None] | None = None, etcd: EtcdProcess | None = None,
               replicas: int = 1, keep_going: bool = False) -> FanoutResult:
    """One fan-out run; see the module docstring. ``profile``: py-spy raw output of the server
    during the changes; ``client``: the simulated proxies' gRPC client (:data:`bench.fleet.CLIENTS`);
    ``event_log_level``: pilotfish's ``--event-log-level`` (``changes`` leaves out the lines of
    every request and response); ``core``: pilotfish's HTTP/2 core (bench/h2_core_launch.py).
    ``server_env``, ``server_args``: pilotfish's environment (e.g. another checkout on its
    ``PYTHONPATH``) and more ``serve`` options (e.g. ``--tls-cert``); ``tls``: how the proxies
    connect over TLS (None: plaintext); ``address_cap``: False for a pilotfish from before
    ``--max-connections-per-address``; ``xds``: the proxies' xDS variant
    (:data:`bench.fleet.XDS_VARIANTS`); ``sync_timeout``: how long all may take to sync (default:
    60 s, or a second per 100 proxies); ``rate``: proxies each client process starts per second
    (0: all at once; the sync time then includes the ramp); ``admin``: pilotfish's admin API,
    ``off`` (``--admin off``; none for a server older than ``--max-connections-per-address``),
    ``HOST:PORT`` to serve it there (the bound address is ``started["admin"]``; the first replica's), or
    None for a pilotfish from before ``--admin``; ``during_changes``: a context the changes run in (e.g.
    a client polling the admin API); ``after_changes``: called after the last change, while every
    proxy is still connected; ``etcd``: pilotfish runs on it (``serve --etcd``: the registry API
    stores registrations there); ``replicas``: that many pilotfish processes on that etcd, the
    proxies spread evenly over them; ``keep_going``: make the changes even when some proxies never
    synced (only the synced ones are waited for; the others count as failures of every change)."""
    if replicas > 1 and (server != "pilotfish" or etcd is None):
        raise ValueError("several replicas need pilotfish on etcd (etcd=...): only there do they share a registry")
    if server == "naive" and change != "file":
        change = "file"  # the naive server has no registry
    with ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="pilotfish-bench-"))
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        snapshot = workdir / "snapshot.json"
        workload.write(snapshot)
        procs: list[ServerProcess] = []
        if server == "pilotfish":
            on_etcd = ("--etcd", etcd.address) if etcd is not None else ()
            for n in range(replicas):
                serve_admin = () if admin in (None, "off") or n > 0 else ("--admin", admin)
                procs.append(start_pilotfish(
                    workdir, snapshot=snapshot, quiet_ms=quiet_ms, registry=change == "registry",
                    extra=("--event-log-level", event_log_level, *serve_admin, *on_etcd, *server_args),
                    env=server_env,
                    module=("pilotfish",) if core == "own" else ("bench.h2_core_launch", "--core", core),
                    address_cap=address_cap, admin_off=address_cap and (admin == "off" or n > 0),  # older than both
                    name="pilotfish" if replicas == 1 else f"pilotfish-{n}"))
                stack.callback(procs[-1].stop)
        else:
            procs.append(start_naive(workdir, snapshot=snapshot))
            stack.callback(procs[-1].stop)
        proc = procs[0]
        time.sleep(0.5)
        base_rss = sum(p.rss_kb() for p in procs)
        fleet = Fleet(target=proc.xds, proxies=proxies, workers=workers, rate=rate, client=client, tls=tls, xds=xds,
                      replicas=tuple(p.xds for p in procs[1:]))
        started = time.time()
        fleet.start()
        stack.callback(fleet.close)
        sync_timeout = sync_timeout or max(60.0, proxies / 100)
        synced = fleet.wait_synced(timeout=sync_timeout)
        indexed: float | None = None  # (proxies' subsetting indices in etcd: only with subsetting, none here)
        result = FanoutResult(server=server, proxies=proxies, change=change,
                              quiet_ms=quiet_ms if server == "pilotfish" else 0,
                              sync_seconds=max(synced.latencies(started), default=float("nan")),
                              event_log=event_log_level if server == "pilotfish" else "-", xds=xds,
                              replicas=len(procs), indexed_seconds=indexed)
        result.sync_bytes = fleet.bytes_received()
        result.never_synced = synced.failures
        if synced.failures and not keep_going:
            result.failures = synced.failures
            result.stream_errors = fleet.errors()
            result.error_examples = dict(fleet.error_examples)
            return result
        for p in procs:
            p.settle_cpu(quiet=0.3, limit=5)
        result.rss_idle_kb = sum(p.rss_kb() for p in procs)
        result.rss_base_kb = base_rss
        result.rss_per_stream_kb = (result.rss_idle_kb - base_rss) / proxies
        result.simulator_rss_kb = fleet.rss_kb()
        received = fleet.bytes_received()
        changes_started = time.time()
        changer = _Changer(change, proc, workload, snapshot,
                           ssl.create_default_context(cafile=tls.ca) if tls is not None else None)
        assert proc.tail is not None
        spy = _py_spy(proc.pid, profile) if profile is not None else None
        context = stack.enter_context(ExitStack())
        context.enter_context(during_changes(proc) if during_changes is not None else nullcontext())
        for _ in range(changes):
            for p in procs:
                assert p.tail is not None
                p.tail.skip_to_end()
            cpu_before = sum(p.cpu_seconds() for p in procs)
            etcd_before = etcd.cpu_seconds() if etcd is not None else 0.0
            client_before = fleet.cpu_seconds()
            t0 = time.time()
            changer.change()
            loaded = proc.tail.wait_for("snapshot_loaded", timeout=30, alive=proc.alive)
            acked = fleet.wait_acked({EDS: loaded["versions"]["EDS"]}, since=t0, timeout=change_timeout,
                                     synced_only=keep_going)
            cpu_after = sum(p.settle_cpu() for p in procs)
            if etcd is not None:
                result.etcd_cpu_per_push.append(etcd.cpu_seconds() - etcd_before)
            result.client_cpu_per_push.append(fleet.cpu_seconds() - client_before)
            now_received = fleet.bytes_received()
            result.change_bytes.append([b - a for a, b in zip(received, now_received, strict=True)])
            received = now_received
            result.latencies += acked.latencies(t0)
            result.change_p99.append(percentile(acked.latencies(t0), 99))
            # snapshot_loaded is written once every proxy's response has been handed to the
            # transport (push_ms later than the publish began): measure from the beginning (of
            # the first replica's push).
            published = float(loaded["ts"]) - float(loaded.get("push_ms", 0.0)) / 1000
            for p in procs[1:]:
                assert p.tail is not None
                other = p.tail.wait_for("snapshot_loaded", timeout=5, alive=p.alive)
                published = min(published, float(other["ts"]) - float(other.get("push_ms", 0.0)) / 1000)
            result.after_publish += acked.latencies(published)
            result.failures = max(result.failures, acked.failures)
            result.cpu_per_push.append(cpu_after - cpu_before)
            time.sleep(gap)
        context.close()
        if spy is not None:
            os.kill(spy.pid, signal.SIGINT)
            spy.wait(30)
        if after_changes is not None:
            after_changes(proc)
        result.stream_errors = fleet.errors()
        result.errors_during_changes = fleet.errors(since=changes_started)
        result.error_examples = dict(fleet.error_examples)
        return result


def main() -> int:
    import argparse

    from bench.report import print_table
    from bench.tls_certs import TLS_MODES, make_certs

    parser = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    parser.add_argument("--quiet-ms", type=int, default=100)
    parser.add_argument("--server", choices=("pilotfish", "naive"), default="pilotfish")
    parser.add_argument("--change", choices=("registry", "file"), default="registry")
    parser.add_argument("--client", choices=CLIENTS, default="h2",
                        help="the simulated proxies' gRPC client: bench/h2client.py or grpc.aio (default: %(default)s)")
    parser.add_argument("--xds", choices=XDS_VARIANTS, default="sotw",
                        help="the simulated proxies' xDS: state of the world or delta (default: %(default)s)")
    parser.add_argument("--event-log-level", choices=("all", "changes"), default="all",
                        help="pilotfish's --event-log-level (default: %(default)s)")
    parser.add_argument("--tls", choices=TLS_MODES, default="off",
                        help="pilotfish serves xDS and the registry over TLS (mtls: with client certificates), "
                             "with certificates from a throwaway CA (default: %(default)s)")
    args = parser.parse_args()
    if args.tls != "off" and args.server != "pilotfish":
        parser.error("--tls needs --server pilotfish")
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pilotfish-certs-") as tmp:
        certs = make_certs(Path(tmp))
        for n in args.proxies:
            result = run_fanout(server=args.server, proxies=n, changes=args.changes, workload=workload,
                                quiet_ms=args.quiet_ms, change=args.change, client=args.client,
                                event_log_level=args.event_log_level, server_args=certs.server_args(args.tls),
                                tls=certs.fleet(args.tls), xds=args.xds)
            rows.append(result.row())
            print_table(FANOUT_COLUMNS, [rows[-1]])
    print(f"\nworkload: {workload.describe()}; client: {args.client}; TLS: {args.tls}; "
          f"load: {load_1min():.2f}")
    print_table(FANOUT_COLUMNS, rows)
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
