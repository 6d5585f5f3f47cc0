"""Fan-out: one endpoint change, timed until every connected proxy has ACKed the new EDS version.

One run: write the snapshot file, start the server (pilotfish, or the naive baseline) in its own
process, read its RSS, connect N simulated proxies and wait until all are synced, read the RSS
again (RSS per idle stream), then make ``changes`` endpoint changes one after another. For each:

- t0 = just before the change is made (the registry API call, or the file's rename: the new file
  is written beside it before t0);
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

import argparse
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
from bench.procs import REPO, EtcdProcess, ServerProcess, start_pilotfish, work_dir
from bench.report import fmt_ms, print_table
from bench.stats import load_1min, percentile
from bench.tls_certs import TLS_MODES, make_certs
from bench.workload import Workload

__all__ = [
    "FANOUT_COLUMNS",
    "EndpointChanger",
    "FanoutOptions",
    "FanoutResult",
    "run_fanout",
    "start_naive",
    "stream_error_notes",
    "stream_errors_cell",
]

FANOUT_COLUMNS = [
    "server",
    "proxies",
    "change",
    "quiet ms",
    "event log",
    "all synced s",
    "p50 ms",
    "p99 ms",
    "max ms",
    "p99 after publish ms",
    "CPU s / push",
    "simulator CPU s / push",
    "RSS KB / idle stream",
    "failures",
    "stream errors",
]


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
        return [
            self.server,
            self.proxies,
            self.change,
            self.quiet_ms,
            self.event_log,
            round(self.sync_seconds, 2),
            fmt_ms(self.p(50)),
            fmt_ms(self.p(99)),
            fmt_ms(max(self.latencies, default=float("nan"))),
            fmt_ms(percentile(self.after_publish, 99)),
            round(self.cpu, 3),
            round(sum(self.client_cpu_per_push) / max(1, len(self.client_cpu_per_push)), 3),
            round(self.rss_per_stream_kb, 1),
            self.failures,
            stream_errors_cell([self]),
        ]


def stream_errors_cell(results: Sequence[FanoutResult]) -> int | str:
    """The streams that broke in ``results`` (runs pooled), as a table cell: 0, or how many with a
    count per gRPC status."""
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r.stream_errors.items():
            errors[code] = errors.get(code, 0) + n
    total = sum(errors.values())
    return total if not total else f"{total} {errors}"


def start_naive(workdir: Path, *, snapshot: Path, xds_port: int = 0, name: str = "naive") -> ServerProcess:
    """The naive baseline server (bench/naive_server.py) in its own process."""
    event_log = workdir / f"{name}-events.jsonl"
    argv = [
        sys.executable,
        "-m",
        "bench.naive_server",
        "--snapshot",
        str(snapshot),
        "--xds",
        f"127.0.0.1:{xds_port}",
        "--event-log",
        str(event_log),
    ]
    server = ServerProcess(name=name, argv=argv, workdir=workdir, event_log=event_log)
    server.start()
    return server


class EndpointChanger:
    """Makes one endpoint change at a time: through the registry API, or by rewriting the file."""

    def __init__(
        self, how: str, server: ServerProcess, workload: Workload, snapshot: Path, tls: ssl.SSLContext | None = None
    ) -> None:
        self.how, self.server, self.workload, self.snapshot = how, server, workload, snapshot
        self.count = 0
        self._next = snapshot
        """The file :meth:`prepare` wrote, to be renamed over the snapshot."""
        self.registered: str | None = None
        self.tls = tls
        """The registry API is served over TLS (with the xDS port's certificate): trust this."""

    def prepare(self) -> None:
        """What comes before the change and is not the server's work: the next file written
        beside the snapshot (a large raw YAML file takes the simulator seconds to write)."""
        if self.how == "file":
            # A fresh endpoint each time, so each change is new content.
            extra = ("10.255.0.1", 9000 + self.count + 1)
            self._next = self.workload.write_beside(self.snapshot, extra_endpoint=extra)

    def change(self) -> None:
        """Make the change (:meth:`prepare` first): the file's rename, or the registry API call."""
        self.count += 1
        if self.how == "file":
            os.replace(self._next, self.snapshot)
            return
        scheme = "https" if self.tls is not None else "http"
        base = f"{scheme}://{self.server.registry}/v1/services/svc-00000/instances"
        if self.registered is None:
            body = json.dumps({"address": "10.255.0.1", "port": 9000 + self.count}).encode()
            request = urllib.request.Request(
                base, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10, context=self.tls) as response:
                self.registered = json.loads(response.read())["id"]
        else:
            request = urllib.request.Request(f"{base}/{self.registered}", method="DELETE")
            with urllib.request.urlopen(request, timeout=10, context=self.tls):
                self.registered = None


def _py_spy(pid: int, output: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen(
        [
            str(spy),
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--rate",
            str(rate),
            "--output",
            str(output),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


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
    return [
        f"Stream errors, {label}: {n} x {code}{runs} (during the changes: {during[code]}), e.g. "
        f"`{examples.get(code, '?')[:200]}`"
        for code, n in counts.items()
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class FanoutOptions:
    """One fan-out run (:func:`run_fanout`): the server, the fleet and the changes."""

    workload: Workload
    """The configuration served (clusters, endpoints, listeners)."""
    proxies: int
    """Simulated proxies, each its own stream on its own connection."""
    changes: int = 5
    """Endpoint changes made one after another, each timed until every proxy ACKed it."""
    server: str = "pilotfish"
    """``pilotfish`` or ``naive`` (bench/naive_server.py, the baseline)."""
    change: str = "registry"
    """How a change is made: ``registry`` (the registry API) or ``file`` (the snapshot file; always for naive)."""
    quiet_ms: int = 100
    """pilotfish's debounce (``--quiet-ms``)."""
    workers: int = 0
    """The simulator's client processes (0: :class:`bench.fleet.Fleet` chooses)."""
    workdir: Path | None = None
    """Keep the server's files here (None: a temporary directory)."""
    profile: Path | None = None
    """py-spy raw output of the server during the changes (None: no profile)."""
    change_timeout: float = 60.0
    """How long every proxy may take to ACK one change."""
    gap: float = 0.3
    """Seconds between one change's end and the next change."""
    client: str = "h2"
    """The simulated proxies' gRPC client (:data:`bench.fleet.CLIENTS`)."""
    xds: str = "sotw"
    """The proxies' xDS variant (:data:`bench.fleet.XDS_VARIANTS`)."""
    tls: FleetTls | None = None
    """How the proxies connect over TLS (None: plaintext); ``server_args`` gives pilotfish its certificate."""
    event_log_level: str = "all"
    """pilotfish's ``--event-log-level`` (``changes`` leaves out the lines of every request and response)."""
    core: str = "own"
    """pilotfish's HTTP/2 core (bench/h2_core_launch.py: ``own`` or ``h2``)."""
    server_env: Mapping[str, str] | None = None
    """pilotfish's environment (e.g. another checkout's ``src`` on ``PYTHONPATH``: :mod:`bench.checkout`)."""
    server_args: Sequence[str] = ()
    """More ``serve`` options (e.g. ``--tls-cert``)."""
    admin: str = "off"
    """pilotfish's admin API: ``off`` or ``HOST:PORT`` (the first replica serves it; the others none)."""
    sync_timeout: float | None = None
    """How long all proxies may take to sync (None: 60 s, or a second per 100 proxies)."""
    rate: float = 0.0
    """Proxies each client process starts per second (0: all at once; the sync time then includes the ramp)."""
    etcd: EtcdProcess | None = None
    """pilotfish runs on this etcd (``serve --etcd``: the registry API stores registrations there)."""
    replicas: int = 1
    """pilotfish processes on ``etcd``, the proxies spread evenly over them."""
    keep_going: bool = False
    """Make the changes even when some proxies never synced (they count as failures of every change)."""
    during_changes: Callable[[ServerProcess], AbstractContextManager[object]] | None = None
    """A context the changes run in (e.g. a client polling the admin API)."""
    after_changes: Callable[[ServerProcess], None] | None = None
    """Called after the last change, while every proxy is still connected."""


def run_fanout(options: FanoutOptions) -> FanoutResult:
    """One fan-out run; see the module docstring."""
    if options.replicas > 1 and (options.server != "pilotfish" or options.etcd is None):
        raise ValueError(
            "several replicas need pilotfish on etcd (FanoutOptions.etcd): only there do they share a registry"
        )
    change = "file" if options.server == "naive" else options.change  # the naive server has no registry
    with ExitStack() as stack:
        workdir = work_dir(stack, options.workdir, "pilotfish-bench-")
        snapshot = workdir / f"snapshot{options.workload.suffix}"
        options.workload.write(snapshot)
        procs: list[ServerProcess] = []
        if options.server == "pilotfish":
            on_etcd = ("--etcd", options.etcd.address) if options.etcd is not None else ()
            for n in range(options.replicas):
                procs.append(
                    start_pilotfish(
                        workdir,
                        snapshot=snapshot,
                        quiet_ms=options.quiet_ms,
                        registry=change == "registry",
                        extra=("--event-log-level", options.event_log_level, *on_etcd, *options.server_args),
                        env=options.server_env,
                        module=(
                            ("pilotfish",)
                            if options.core == "own"
                            else ("bench.h2_core_launch", "--core", options.core)
                        ),
                        admin=options.admin if n == 0 else "off",
                        name="pilotfish" if options.replicas == 1 else f"pilotfish-{n}",
                    )
                )
                stack.callback(procs[-1].stop)
        else:
            procs.append(start_naive(workdir, snapshot=snapshot))
            stack.callback(procs[-1].stop)
        proc = procs[0]
        time.sleep(0.5)
        base_rss = sum(p.rss_kb() for p in procs)
        fleet = Fleet(
            target=proc.xds,
            proxies=options.proxies,
            workers=options.workers,
            rate=options.rate,
            client=options.client,
            tls=options.tls,
            xds=options.xds,
            replicas=tuple(p.xds for p in procs[1:]),
        )
        started = time.time()
        fleet.start()
        stack.callback(fleet.close)
        sync_timeout = options.sync_timeout or max(60.0, options.proxies / 100)
        synced = fleet.wait_synced(timeout=sync_timeout)
        indexed: float | None = None  # (proxies' subsetting indices in etcd: only with subsetting, none here)
        result = FanoutResult(
            server=options.server,
            proxies=options.proxies,
            change=change,
            quiet_ms=options.quiet_ms if options.server == "pilotfish" else 0,
            sync_seconds=max(synced.latencies(started), default=float("nan")),
            event_log=options.event_log_level if options.server == "pilotfish" else "-",
            xds=options.xds,
            replicas=len(procs),
            indexed_seconds=indexed,
        )
        result.sync_bytes = fleet.bytes_received()
        result.never_synced = synced.failures
        if synced.failures and not options.keep_going:
            result.failures = synced.failures
            result.stream_errors = fleet.errors()
            result.error_examples = dict(fleet.error_examples)
            return result
        for p in procs:
            p.settle_cpu(quiet=0.3, limit=5)
        result.rss_idle_kb = sum(p.rss_kb() for p in procs)
        result.rss_base_kb = base_rss
        result.rss_per_stream_kb = (result.rss_idle_kb - base_rss) / options.proxies
        result.simulator_rss_kb = fleet.rss_kb()
        received = fleet.bytes_received()
        changes_started = time.time()
        changer = EndpointChanger(
            change,
            proc,
            options.workload,
            snapshot,
            ssl.create_default_context(cafile=options.tls.ca) if options.tls is not None else None,
        )
        assert proc.tail is not None
        spy = _py_spy(proc.pid, options.profile) if options.profile is not None else None
        context = stack.enter_context(ExitStack())
        context.enter_context(options.during_changes(proc) if options.during_changes is not None else nullcontext())
        for _ in range(options.changes):
            for p in procs:
                assert p.tail is not None
                p.tail.skip_to_end()
            cpu_before = sum(p.cpu_seconds() for p in procs)
            etcd_before = options.etcd.cpu_seconds() if options.etcd is not None else 0.0
            client_before = fleet.cpu_seconds()
            changer.prepare()
            t0 = time.time()
            changer.change()
            loaded = proc.tail.wait_for("snapshot_loaded", timeout=30, alive=proc.alive)
            acked = fleet.wait_acked(
                {EDS: loaded["versions"]["EDS"]},
                since=t0,
                timeout=options.change_timeout,
                synced_only=options.keep_going,
            )
            cpu_after = sum(p.settle_cpu() for p in procs)
            if options.etcd is not None:
                result.etcd_cpu_per_push.append(options.etcd.cpu_seconds() - etcd_before)
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
            time.sleep(options.gap)
        context.close()
        if spy is not None:
            os.kill(spy.pid, signal.SIGINT)
            spy.wait(30)
        if options.after_changes is not None:
            options.after_changes(proc)
        result.stream_errors = fleet.errors()
        result.errors_during_changes = fleet.errors(since=changes_started)
        result.error_examples = dict(fleet.error_examples)
        return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--proxies",
        type=int,
        nargs="+",
        default=[100, 1000, 10000],
        help="simulated proxies, one run per number (default: %(default)s)",
    )
    parser.add_argument("--changes", type=int, default=5, help="endpoint changes to time (default: %(default)s)")
    parser.add_argument("--services", type=int, default=100, help="clusters in the snapshot (default: %(default)s)")
    parser.add_argument("--endpoints", type=int, default=4, help="endpoints per cluster (default: %(default)s)")
    parser.add_argument(
        "--listeners", type=int, default=10, help="services with an HTTP listener + route config (default: %(default)s)"
    )
    parser.add_argument("--quiet-ms", type=int, default=100, help="pilotfish's debounce (default: %(default)s)")
    parser.add_argument(
        "--server",
        choices=("pilotfish", "naive"),
        default="pilotfish",
        help="the server: pilotfish or the naive baseline (default: %(default)s)",
    )
    parser.add_argument(
        "--change",
        choices=("registry", "file"),
        default="registry",
        help="how a change is made (naive: file only; default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="the simulator's client processes (default: one per 2,500 proxies, one per core)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the server's files here (default: a temporary directory)"
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="h2",
        help="the simulated proxies' gRPC client: bench/h2client.py or grpc.aio (default: %(default)s)",
    )
    parser.add_argument(
        "--xds",
        choices=XDS_VARIANTS,
        default="sotw",
        help="the simulated proxies' xDS: state of the world or delta (default: %(default)s)",
    )
    parser.add_argument(
        "--event-log-level",
        choices=("all", "changes"),
        default="all",
        help="pilotfish's --event-log-level (default: %(default)s)",
    )
    parser.add_argument(
        "--tls",
        choices=TLS_MODES,
        default="off",
        help="pilotfish serves xDS and the registry over TLS (mtls: with client certificates), "
        "with certificates from a throwaway CA (default: %(default)s)",
    )
    parser.add_argument(
        "--raw",
        choices=("json", "yaml"),
        default=None,
        help="write the snapshot file as raw Envoy EDS clusters and assignments in this form, no listeners "
        "(default: the services model, as JSON)",
    )
    args = parser.parse_args(argv)
    if args.tls != "off" and args.server != "pilotfish":
        parser.error("--tls needs --server pilotfish")
    if args.raw and args.change != "file":
        parser.error("--raw needs --change file (a raw file is changed by rewriting it)")
    workload = Workload(
        services=args.services,
        endpoints=args.endpoints,
        listeners=0 if args.raw else min(args.listeners, args.services),
        raw=args.raw or "",
    )
    results: list[FanoutResult] = []
    with tempfile.TemporaryDirectory(prefix="pilotfish-certs-") as tmp:
        certs = make_certs(Path(tmp))
        for n in args.proxies:
            result = run_fanout(
                FanoutOptions(
                    server=args.server,
                    proxies=n,
                    changes=args.changes,
                    workload=workload,
                    quiet_ms=args.quiet_ms,
                    change=args.change,
                    client=args.client,
                    event_log_level=args.event_log_level,
                    server_args=certs.server_args(args.tls),
                    tls=certs.fleet(args.tls),
                    xds=args.xds,
                    workers=args.workers,
                    workdir=args.workdir / str(n) if args.workdir else None,
                )
            )
            results.append(result)
            print_table(FANOUT_COLUMNS, [result.row()])
            for code, example in result.error_examples.items():
                print(f"  stream error e.g. {code}: {example}")
    print(f"\nworkload: {workload.describe()}; client: {args.client}; TLS: {args.tls}; load: {load_1min():.2f}")
    print_table(FANOUT_COLUMNS, [r.row() for r in results])
    return 0 if all(r.failures == 0 for r in results) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
