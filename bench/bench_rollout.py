"""Progressive delivery at fleet scale: what load reports cost the server, how long each wave of a
rollout takes to reach its proxies, and whether a rollout in progress slows endpoint changes.

Theory of operation
-------------------
Real ``pilotfish serve`` processes (:func:`bench.procs.start_pilotfish`: the snapshot of
:class:`~bench.workload.Workload`, the registry API, the event log at ``changes``, the admin API on
for its ``/metrics``), each with a fleet of its own of ``proxies`` simulated proxies
(bench/fleet/: SotW over bench/h2client.py). Four parts, in one run:

1. **LRS ingest.** Two servers started alike (no ``--rollout``; ``--lrs-interval-ms``), a fleet on
   each. In the first window every proxy of the first fleet keeps a load reporting stream open
   (:mod:`bench.fleet.lrs`: a ``LoadStatsRequest`` with its node, then a report of a few clusters
   every interval the server asks for) while the second fleet reports nothing; in the second
   window, the other way round. Both servers' CPU (utime + stime) is read over the same
   ``lrs_seconds`` of wall time: the reporting one is *LRS on*, the other *LRS off*. The ingest
   cost is on minus off, per minute, each the mean over the two windows (each server is on once
   and off once, so what differs between the two processes cancels). A window starts once every
   stream has the server's response and reports arrive evenly (0.3 interval later, see
   :mod:`bench.fleet.lrs`); reports are counted as sent (the simulator) and as taken (the server's
   ``pilotfish_lrs_reports_total``).
2. **A CDS change in waves.** The second server is replaced by one with ``--rollout
   'canary=GLOB,5%,25%,100%'``, ``--rollout-bake`` ``bake`` s and ``--rollout-health off``, with a
   fleet of its own (no load reports in this part or the next). ``rollouts`` times, the first
   service's ``connect_timeout`` changes in both servers' snapshot files (a CDS-only change): the
   rollout server's first, timed until ``rollout_completed``, then the plain server's, timed until
   every proxy ACKed it. Per wave: its start is its ``rollout_wave_started`` event's ``ts``; its
   members are the proxies the plan puts in it (:meth:`pilotfish.rollout.waves.WavePlan.assign`
   of their node ids, checked against the event's count); each member's time is when it sent its
   ACK of the candidate's CDS version (the simulator's own clock, client side, as every fan-out
   here) minus that start: p50, p99 and max (the wave's last ACK), pooled over the rollouts. A
   member that ACKed the candidate before its wave started would be a bug, and is counted. CPU:
   the rollout server's from the change until it is idle after ``rollout_completed``, minus its
   idle rate (read before the first rollout) over that time, beside the plain server's for the
   same change pushed to every proxy at once; the difference is what the rollout adds (its
   bookkeeping: gates, the baseline and candidate snapshots, moving each wave's watches).
3. **Endpoint changes during a bake.** The rollout server is replaced by one whose bake is
   ``long_bake`` s. A CDS change starts a rollout there, whose canary wave then bakes throughout
   (checked at the end); the same change is made on the plain server. Then ``rounds`` rounds,
   interleaved, the order alternating: one endpoint change to each server (the registry API,
   :class:`bench.fanout.EndpointChanger`), timed from just before the registry call until every
   proxy ACKed the new EDS version (the baseline's and the candidate's proxies alike). Per server,
   the median over rounds of each round's p50, p99 and max, and of its server CPU; the ratio
   rollout / plain of the median p99 is the target (at most 1.10).
4. **LRS ingest with the health gate on.** A server with ``--rollout`` and ``--rollout-health on``
   (its other gate settings at their defaults) and ``--rollout-bake`` ``long_bake`` s, a fleet of
   its own: a CDS change starts a rollout whose canary wave then bakes throughout, its health
   judged from the load reports every bucket (5 s: a sixth of the bake, at most 5 s, as with the
   default 30 s bake). The plain server (no ``--rollout``) has the same change. First a quiet
   window (no fleet reports), then both fleets report at once (as in part 1) over a window of the
   same length: each server's CPU over the same wall time, reporting minus quiet per minute, is
   its ingest, plus on the rollout server the gate's reading of the load store. The rollout
   server's ``/v1/rollout`` is read at the end of the window (the gate's last verdict), and its
   canary wave must still be baking (no wave passed, failed or paused).

Health gates are off (``--rollout-health off``) in parts 2 and 3: with reports every 10 s a bake of 2 s sees none
(a report is filed in the time bucket where the interval it covers *began*, before the bake), so
every wave would pause for too little traffic; a bake that judges load needs reports a few times
per bake, i.e. bakes of a minute or more at this interval. Part 1 measures what the reports cost,
part 4 what they cost with the gate reading them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fanout import EndpointChanger
from bench.fleet import CDS, EDS, Fleet, LrsLoad
from bench.fleet.lrs import FIRST_REPORT
from bench.procs import REPO, EventTail, ServerProcess, start_pilotfish, work_dir
from bench.report import fmt_ms, print_table
from bench.stats import load_1min, percentile, ratio
from bench.workload import Workload
from pilotfish.rollout.waves import parse_waves

__all__ = [
    "BAKING",
    "EDS_COLUMNS",
    "GATED",
    "GATE_COLUMNS",
    "LRS_COLUMNS",
    "OTHER",
    "PARTS",
    "PLAIN",
    "ROLLOUT",
    "ROLLOUT_COLUMNS",
    "TARGET_RATIO",
    "WAVE_COLUMNS",
    "RolloutBench",
    "RolloutOptions",
    "main",
    "run_rollout_bench",
]

TARGET_RATIO = 1.10
"""An endpoint change's p99 during a bake may be at most this many times the p99 without a rollout."""

LRS_COLUMNS = [
    "window",
    "reporting",
    "seconds",
    "reports sent",
    "reports taken",
    "dropped",
    "reports / s",
    "CPU s / min, LRS on",
    "CPU s / min, LRS off",
    "ingest CPU s / min",
    "CPU us / report",
    "RSS + MiB, LRS on",
    "stream errors",
]
WAVE_COLUMNS = [
    "wave",
    "members",
    "rollouts",
    "start to ACK p50 ms",
    "p99 ms",
    "max ms (last ACK)",
    "start to gate passed ms",
    "ACKed before the wave started",
    "never ACKed",
]
ROLLOUT_COLUMNS = [
    "server",
    "change",
    "changes",
    "change to last ACK s",
    "server CPU s / change",
    "idle CPU subtracted s",
    "added by the rollout CPU s",
    "bytes / proxy / change",
    "failures",
]
EDS_COLUMNS = [
    "server",
    "rounds",
    "p50 ms",
    "p99 ms",
    "p99 range ms",
    "max ms",
    "CPU s / push",
    "failures",
    "p99 / plain",
]

GATE_COLUMNS = [
    "server",
    "seconds",
    "reports sent",
    "reports taken",
    "dropped",
    "CPU s / min, reporting",
    "CPU s / min, quiet",
    "ingest CPU s / min",
    "CPU us / report",
    "health gate's last verdict",
    "LRS stream errors",
]

PLAIN, OTHER, ROLLOUT, BAKING, GATED = "plain", "second", "rollout", "baking", "gated"
"""The servers' names (their event logs and logs in the working directory)."""
PARTS = ("lrs", "waves", "eds", "gate")
"""The four parts: LRS ingest, a CDS change in waves, endpoint changes during a bake, LRS ingest
with a rollout's health gate reading the reports."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutOptions:
    """One run of the three parts (see the module docstring)."""

    proxies: int = 1000
    """Simulated proxies per server."""
    workload: Workload = field(default_factory=Workload)
    """What every server serves."""
    lrs_seconds: float = 60.0
    """Each LRS window's length."""
    lrs_interval: float = 10.0
    """The reporting interval the servers ask for (``--lrs-interval-ms``)."""
    lrs_load: LrsLoad = field(default_factory=LrsLoad)
    """What each proxy reports."""
    canary: str = "sim-0000*"
    """The canary wave's node-id glob (the fleet's ids are ``sim-00000``...: 10 of 1,000)."""
    shares: str = "5%,25%,100%"
    """The share waves after the canary."""
    bake: float = 2.0
    """``--rollout-bake`` of part 2."""
    ack_timeout: float = 30.0
    """``--rollout-ack-timeout``."""
    rollouts: int = 3
    """CDS changes rolled out in part 2 (each also pushed by the plain server)."""
    long_bake: float = 3600.0
    """``--rollout-bake`` of parts 3 and 4: the canary wave bakes throughout their rounds and windows."""
    rounds: int = 10
    """Endpoint changes per server in part 3, interleaved."""
    quiet_ms: int = 100
    """The servers' debounce (``--quiet-ms``)."""
    gap: float = 0.3
    """Seconds between one timed change and the next."""
    workers: int = 0
    """Client processes per fleet (0: :class:`bench.fleet.Fleet` chooses)."""
    workdir: Path | None = None
    """Keep the servers' files here (None: a temporary directory)."""
    parts: tuple[str, ...] = PARTS
    """Which parts run (:data:`PARTS`; the plain server runs in each)."""

    @property
    def waves(self) -> str:
        return f"canary={self.canary},{self.shares}"


@dataclass
class LrsWindow:
    """One window of part 1: one server's fleet reporting, the other's not."""

    reporting: str
    seconds: float
    cpu_on: float
    """CPU seconds of the server whose fleet reported, over the window."""
    cpu_off: float
    """...of the other server, over the same window."""
    sent: int
    taken: int
    dropped: int
    answered: int
    """Streams that had the server's response when the window began."""
    rss_before_kb: int
    rss_after_kb: int
    errors: dict[str, int] = field(default_factory=dict)
    """LRS streams that ended other than by the simulator stopping them, by gRPC status."""
    total_sent: int = 0
    """Reports the fleet sent, from its streams' start until they were closed (the window's
    ``sent`` and ``taken`` are read a moment apart, so a report in flight may count in one only)."""
    total_taken: int = 0
    """...and reports the server took in all, read after the streams were closed."""


@dataclass
class WaveRun:
    """One wave of one rollout."""

    wave: str
    index: int
    members: int
    """Proxies the plan puts in the wave."""
    announced: int
    """Its ``rollout_wave_started`` event's ``proxies`` (connected members; pooled: the fewest)."""
    latencies: list[float] = field(default_factory=list)
    """Each member's ACK of the candidate's CDS minus the wave's start, seconds."""
    gate: float = math.nan
    """``rollout_wave_acked`` minus ``rollout_wave_started`` (NaN: the wave had no member)."""
    early: int = 0
    """Members whose ACK of the candidate came before the wave started."""
    missing: int = 0
    """Members with no ACK of the candidate."""
    runs: int = 1
    """Rollouts pooled here (:meth:`RolloutBench.waves`)."""


@dataclass
class GateWindow:
    """One server's part 4: a quiet window, then one with its fleet reporting (beside the other's)."""

    server: str
    seconds: float
    """The reporting window's length."""
    cpu: float
    """The server's CPU seconds over it."""
    quiet_seconds: float
    quiet_cpu: float
    """...and over the quiet window before it."""
    sent: int
    taken: int
    dropped: int
    answered: int
    """Load reporting streams that had the server's response when the window began."""
    errors: dict[str, int] = field(default_factory=dict)
    """LRS streams that ended other than by the simulator stopping them, by gRPC status."""
    health: dict[str, Any] | None = None
    """The rollout server's ``/v1/rollout`` ``health`` at the window's end (the gate's last verdict)."""

    @property
    def per_minute(self) -> tuple[float, float, float]:
        """(CPU s / min reporting, quiet, the difference)."""
        on, off = self.cpu / self.seconds * 60, self.quiet_cpu / self.quiet_seconds * 60
        return on, off, on - off


@dataclass
class ChangeRun:
    """One timed change on one server."""

    seconds: float
    """From the change until the last proxy's ACK (a rollout: until ``rollout_completed``, if later)."""
    cpu: float
    """Server CPU seconds, idle rate subtracted."""
    idle: float
    """What was subtracted."""
    bytes_per_proxy: float
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    waves: list[WaveRun] = field(default_factory=list)
    outcome: str = ""
    """A rollout's last event (``rollout_completed``, or what ended it otherwise)."""


@dataclass
class RolloutBench:
    """Everything one run measured."""

    options: RolloutOptions
    lrs: list[LrsWindow] = field(default_factory=list)
    rollouts: list[ChangeRun] = field(default_factory=list)
    plain_pushes: list[ChangeRun] = field(default_factory=list)
    eds: dict[str, list[ChangeRun]] = field(default_factory=lambda: {PLAIN: [], BAKING: []})
    still_baking: bool = False
    """Part 3's canary wave was still baking after its rounds (no wave passed or failed meanwhile)."""
    gate: list[GateWindow] = field(default_factory=list)
    """Part 4: the plain server's window, then the rollout server's (same wall time)."""
    gate_baking: bool = False
    """Part 4's canary wave baked throughout its windows (no wave passed, failed or paused)."""
    stream_errors: dict[str, int] = field(default_factory=dict)
    """ADS streams that broke, by gRPC status, over every fleet."""
    loads: list[float] = field(default_factory=list)
    """The load average (1 min) at the start of each part and at the end."""
    seconds: float = 0.0

    # -- part 1 ------------------------------------------------------------------------------

    def ingest_per_minute(self) -> tuple[float, float, float]:
        """(CPU s / min with LRS on, with it off, the difference), means over the windows."""
        on = statistics.fmean(w.cpu_on / w.seconds * 60 for w in self.lrs) if self.lrs else math.nan
        off = statistics.fmean(w.cpu_off / w.seconds * 60 for w in self.lrs) if self.lrs else math.nan
        return on, off, on - off

    def lrs_rows(self) -> list[list[Any]]:
        rows: list[list[Any]] = []
        for n, w in enumerate(self.lrs, 1):
            rows.append(_lrs_row(str(n), w.reporting, [w]))
        if len(self.lrs) > 1:
            rows.append(_lrs_row("mean", "each once", self.lrs))
        return rows

    # -- part 2 ------------------------------------------------------------------------------

    def waves(self) -> list[WaveRun]:
        """Each wave's runs pooled over the rollouts (latencies together; the gate time their median)."""
        pooled: dict[int, WaveRun] = {}
        gates: dict[int, list[float]] = {}
        for run in self.rollouts:
            for w in run.waves:
                into = pooled.get(w.index)
                if into is None:
                    into = pooled[w.index] = WaveRun(w.wave, w.index, w.members, w.announced, runs=0)
                into.latencies += w.latencies
                into.early += w.early
                into.missing += w.missing
                into.announced = min(into.announced, w.announced)
                into.runs += 1
                if not math.isnan(w.gate):
                    gates.setdefault(w.index, []).append(w.gate)
        for index, into in pooled.items():
            into.gate = statistics.median(gates[index]) if gates.get(index) else math.nan
        return [pooled[i] for i in sorted(pooled)]

    def wave_rows(self) -> list[list[Any]]:
        return [
            [
                w.wave,
                w.members,
                w.runs,
                fmt_ms(percentile(w.latencies, 50)),
                fmt_ms(percentile(w.latencies, 99)),
                fmt_ms(max(w.latencies, default=math.nan)),
                fmt_ms(w.gate),
                w.early,
                w.missing,
            ]
            for w in self.waves()
        ]

    def rollout_rows(self) -> list[list[Any]]:
        o = self.options
        plain_cpu = _median([r.cpu for r in self.plain_pushes])
        rows = []
        for name, change, runs in (
            (f"{PLAIN} (no --rollout)", "CDS, to every proxy at once", self.plain_pushes),
            (
                f"{ROLLOUT} (--rollout '{o.waves}')",
                f"CDS in waves, bake {o.bake:g} s",
                self.rollouts,
            ),
        ):
            cpu = _median([r.cpu for r in runs])
            rows.append(
                [
                    name,
                    change,
                    len(runs),
                    _round(_median([r.seconds for r in runs]), 2),
                    _round(cpu, 3),
                    _round(_median([r.idle for r in runs]), 3),
                    "-" if runs is self.plain_pushes or math.isnan(cpu - plain_cpu) else f"{cpu - plain_cpu:+.3f}",
                    _round(_median([r.bytes_per_proxy for r in runs]), 0),
                    sum(r.failures for r in runs),
                ]
            )
        return rows

    # -- part 3 ------------------------------------------------------------------------------

    def eds_p99(self, server: str) -> float:
        return _median([percentile(r.latencies, 99) for r in self.eds[server]])

    @property
    def eds_ratio(self) -> float:
        plain, baking = self.eds_p99(PLAIN), self.eds_p99(BAKING)
        return baking / plain if plain and not math.isnan(plain) and not math.isnan(baking) else math.nan

    def eds_rows(self) -> list[list[Any]]:
        rows = []
        for server, name in ((PLAIN, f"{PLAIN} (no --rollout)"), (BAKING, "rollout, its canary wave baking")):
            runs = self.eds[server]
            p99s = [percentile(r.latencies, 99) for r in runs]
            rows.append(
                [
                    name,
                    len(runs),
                    fmt_ms(_median([percentile(r.latencies, 50) for r in runs])),
                    fmt_ms(_median(p99s)),
                    f"{fmt_ms(min(p99s, default=math.nan))}-{fmt_ms(max(p99s, default=math.nan))}",
                    fmt_ms(_median([max(r.latencies, default=math.nan) for r in runs])),
                    _round(_median([r.cpu for r in runs]), 3),
                    sum(r.failures for r in runs),
                    "1.00" if server == PLAIN else ratio(self.eds_p99(BAKING), self.eds_p99(PLAIN)),
                ]
            )
        return rows

    def target(self) -> tuple[str, bool | None]:
        """The target's measured text and whether it was met (None: not measured)."""
        r = self.eds_ratio
        if math.isnan(r):
            return "not measured", None
        failures = sum(x.failures for runs in self.eds.values() for x in runs)
        return (
            f"p99 {self.eds_p99(BAKING) * 1000:.0f} ms vs {self.eds_p99(PLAIN) * 1000:.0f} ms: {r:.2f}x "
            f"(medians of {len(self.eds[BAKING])} interleaved rounds), failures {failures}",
            r <= TARGET_RATIO and failures == 0 and self.still_baking,
        )

    # -- part 4 ------------------------------------------------------------------------------

    def gate_rows(self) -> list[list[Any]]:
        o = self.options
        names = {PLAIN: f"{PLAIN} (no --rollout)", GATED: f"--rollout '{o.waves}', health gate on, canary baking"}
        rows: list[list[Any]] = []
        for w in self.gate:
            on, off, ingest = w.per_minute
            rows.append(
                [
                    names.get(w.server, w.server),
                    round(w.seconds, 1),
                    w.sent,
                    w.taken,
                    w.dropped,
                    round(on, 3),
                    round(off, 3),
                    round(ingest, 3),
                    round(ingest / 60 * w.seconds / w.sent * 1e6, 1) if w.sent else "-",
                    _verdict(w.health) if w.server == GATED else "-",
                    sum(w.errors.values()),
                ]
            )
        return rows

    def gate_notes(self) -> list[str]:
        o = self.options
        out = [
            f"A server with `--rollout '{o.waves}' --rollout-bake {o.long_bake:g} --rollout-health on` (minimum "
            "requests, error increase and too-little-traffic at their defaults) and a fleet of its own: a CDS "
            "change started a rollout whose canary wave then baked"
            + (
                " throughout"
                if self.gate_baking
                else " (**it did not bake throughout**: a wave passed, failed or paused)"
            )
            + ", its health gate reading the load store every 5 s (the store's bucket: a sixth of the bake, at "
            "most 5 s, so the same as with the default 30 s bake; the window it reads grows with the bake, here "
            "a few minutes of buckets). The plain server (no `--rollout`) had the same change. Over the same wall "
            f"time, a quiet window of {o.lrs_seconds:g} s (no fleet reports), then both fleets report at once "
            f"for {o.lrs_seconds:g} s, as in the first table ({o.lrs_load.clusters} clusters every "
            f"{o.lrs_interval:g} s from each of {o.proxies:,} proxies, each on a connection of its own). `ingest "
            "CPU s / min`: reporting minus quiet: on the rollout server the reports' ingest and the gate's reading "
            "of them (its timers and judging with no reports are in the quiet window too). The last verdict: "
            "`/v1/rollout`'s `health` at the window's end (the canary wave's requests and error ratio since its "
            "bake began vs the baseline waves')."
        ]
        if len(self.gate) == 2:
            plain, gated = (w.per_minute[2] for w in self.gate)
            quiet = self.gate[1].per_minute[1] - self.gate[0].per_minute[1]
            out.append(
                f"The rollout server's ingest with its gate: {gated:.3f} CPU s per minute vs {plain:.3f} without "
                f"`--rollout` ({ratio(gated, plain, suffix='x')}, {gated - plain:+.3f} s per minute); its quiet CPU "
                f"{quiet:+.3f} s per minute beside the plain server's (the rollout's timers and the gate judging "
                "no reports). CPU is read in clock ticks of 0.01 s: a difference of a few hundredths per minute "
                "is within one window's resolution."
            )
        return out

    def common_notes(self) -> list[str]:
        o = self.options
        out = [
            f"{o.proxies:,} simulated proxies per server (SotW, bench/h2client.py), snapshot "
            f"{o.workload.describe()}; every server runs with `--event-log-level changes`, the registry API and "
            "the admin API on. The load average (1 min) at the start of each part and at the end: "
            + " / ".join(f"{x:.2f}" for x in self.loads)
            + " (2 cores; the simulator's processes and other work share them)."
        ]
        if self.stream_errors:
            out.append(f"ADS stream errors over every fleet: {self.stream_errors}.")
        return out

    def lrs_notes(self) -> list[str]:
        o = self.options
        on, off, ingest = self.ingest_per_minute()
        reports = sum(w.sent for w in self.lrs)
        seconds = sum(w.seconds for w in self.lrs)
        load = o.lrs_load
        return [
            f"Two servers started alike (no `--rollout`, `--lrs-interval-ms {o.lrs_interval * 1000:.0f}`), a "
            "fleet each. In each window one fleet's proxies keep a load reporting stream open (a connection of "
            "its own per proxy, as bench/h2client.py carries one call per connection; Envoy puts it on its "
            f"xds_cluster connection) and report {load.clusters} clusters every interval ({load.rps:g} "
            f"requests/s each, {load.error_ratio:.1%} errors, one locality; the node on every report, as Envoy "
            "sends it), while the other fleet reports nothing; both servers' CPU (utime + stime) over the same "
            f"{o.lrs_seconds:g} s, then the other way round. `reports taken`: the server's "
            "`pilotfish_lrs_reports_total` over the window. Ingest: "
            + (
                f"{ingest:.3f} CPU s per minute for {o.proxies:,} proxies reporting every {o.lrs_interval:g} s "
                f"({on:.3f} on vs {off:.3f} off), {ingest / 60 * seconds / reports * 1e6:.0f} us per report"
                if reports
                else "no reports"
            )
            + ". `RSS + MiB`: the reporting server's RSS at the window's end minus before its streams opened "
            "(their connections and the load store)."
        ]

    def wave_notes(self) -> list[str]:
        o = self.options
        return [
            f"`--rollout '{o.waves}' --rollout-bake {o.bake:g} --rollout-ack-timeout {o.ack_timeout:g} "
            "--rollout-health off`, a fleet of its own; each change sets `connect_timeout` of `svc-00000` in the "
            "snapshot file (CDS only). A wave's time per member: its ACK of the candidate's CDS version (the "
            "simulator's clock, when the ACK was handed to the connection) minus the wave's "
            "`rollout_wave_started` `ts`; members as the plan assigns node ids, pooled over the rollouts. `start "
            "to gate passed`: `rollout_wave_acked` minus `rollout_wave_started` (median), after which the wave "
            f"bakes {o.bake:g} s. Health off: a load report is filed in the time bucket where the interval it "
            f"covers began, so a bake much shorter than the reporting interval (here {o.bake:g} s vs "
            f"{o.lrs_interval:g} s) counts next to no report and every wave would pause for too little traffic; "
            "judging load takes bakes several reporting intervals long (the LRS ingest is what the reports "
            "cost)."
        ]

    def cpu_notes(self) -> list[str]:
        return [
            "The same CDS changes, each made on the rollout server (in waves) and then on the plain server (to "
            "every proxy at once). The plain server's CPU: from the change until it is idle again. The rollout "
            "server's: from the change until it is idle after `rollout_completed`, minus its idle CPU rate "
            "(measured before the first rollout) times that span (`idle CPU subtracted`). `added by the "
            "rollout`: the median rollout's CPU minus the median plain push's: the gates, the two snapshots "
            "served side by side, each wave's watches moved to the candidate, then all of them back at the "
            "end. `change to last ACK`: a rollout's until `rollout_completed` (its bakes included). `bytes / "
            "proxy / change`: response bytes each proxy received for the change (mean)."
        ]

    def eds_notes(self) -> list[str]:
        o = self.options
        return [
            f"A rollout server with `--rollout-bake {o.long_bake:g}`: a CDS change started a rollout whose canary "
            "wave then baked throughout"
            + ("" if self.still_baking else " (**it did not**: a wave passed or failed meanwhile)")
            + f"; the plain server had the same change. {o.rounds} rounds, interleaved, the order alternating: an "
            "instance of `svc-00000` registered (or deregistered) through each server's registry API, timed from "
            "just before the call until every proxy ACKed the new EDS version (baseline and candidate proxies "
            "alike; the debounce included). Each row: medians over its rounds of the round's p50, p99, max and "
            f"server CPU per push. Target: the rollout's median p99 at most {TARGET_RATIO:.2f}x the plain "
            "server's."
        ]

    def notes(self) -> list[str]:
        """Every note, in the order of the tables."""
        return [
            *self.common_notes(),
            *self.lrs_notes(),
            *self.wave_notes(),
            *self.cpu_notes(),
            *self.eds_notes(),
            *self.gate_notes(),
        ]


def _verdict(health: dict[str, Any] | None) -> str:
    """The gate's last verdict in a cell: ``pass: wave 35,000 requests, 0.10 % errors; baseline ...``."""
    if health is None:
        return "none yet"
    return (
        f"{health['verdict']}: wave {health['requests']:,} requests, {health['error_ratio']:.2%} errors; "
        f"baseline {health['baseline_requests']:,}, {health['baseline_error_ratio']:.2%}"
    )


def _lrs_row(label: str, reporting: str, windows: Sequence[LrsWindow]) -> list[Any]:
    seconds = sum(w.seconds for w in windows)
    on = sum(w.cpu_on for w in windows) / seconds * 60
    off = sum(w.cpu_off for w in windows) / seconds * 60
    sent = sum(w.sent for w in windows)
    per_report = (on - off) / 60 * seconds / sent * 1e6 if sent else math.nan
    errors: dict[str, int] = {}
    for w in windows:
        for code, n in w.errors.items():
            errors[code] = errors.get(code, 0) + n
    return [
        label,
        reporting,
        round(seconds / len(windows), 1),
        sent,
        sum(w.taken for w in windows),
        sum(w.dropped for w in windows),
        round(sent / seconds, 1),
        round(on, 3),
        round(off, 3),
        round(on - off, 3),
        round(per_report, 1),
        round(statistics.fmean((w.rss_after_kb - w.rss_before_kb) / 1024 for w in windows), 1),
        sum(errors.values()) or 0,
    ]


def _median(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _round(value: float, digits: int) -> float | str:
    return "-" if math.isnan(value) else round(value, digits)


# -- servers and fleets ----------------------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class _Side:
    """A server, its snapshot file and its fleet."""

    server: ServerProcess
    snapshot: Path
    fleet: Fleet
    stack: ExitStack

    def close(self) -> None:
        self.stack.close()


def _side(workdir: Path, name: str, options: RolloutOptions, extra: Sequence[str] = ()) -> _Side:
    stack = ExitStack()
    try:
        snapshot = workdir / f"{name}.json"
        options.workload.write(snapshot)
        state = workdir / f"{name}-state"  # its own: a rollout server keeps its rollout there
        state.mkdir(exist_ok=True)
        for kept in state.iterdir():  # (a workdir used again: nothing of an earlier run)
            kept.unlink()
        server = start_pilotfish(
            workdir,
            snapshot=snapshot,
            quiet_ms=options.quiet_ms,
            registry=True,
            admin="127.0.0.1:0",
            name=name,
            extra=(
                "--event-log-level",
                "changes",
                "--lrs-interval-ms",
                str(round(options.lrs_interval * 1000)),
                "--state-dir",
                str(state),
                *extra,
            ),
        )
        stack.callback(server.stop)
        fleet = Fleet(target=server.xds, proxies=options.proxies, workers=options.workers)
        stack.callback(fleet.close)
        fleet.start()
        synced = fleet.wait_synced(timeout=max(60.0, options.proxies / 100))
        if synced.failures:
            raise RuntimeError(f"{name}: {synced.failures} of {options.proxies} proxies never synced")
        server.settle_cpu(quiet=0.3, limit=5)
        return _Side(server, snapshot, fleet, stack)
    except BaseException:
        stack.close()
        raise


def _lrs_metrics(server: ServerProcess) -> tuple[int, int]:
    """(reports taken, reports dropped) from the server's ``/metrics``."""
    with _OPENER.open(f"http://{server.started['admin']}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("pilotfish_lrs_reports"):
            name, _, value = line.partition(" ")
            values[name] = int(float(value))
    return values.get("pilotfish_lrs_reports_total", 0), values.get("pilotfish_lrs_reports_dropped_total", 0)


def _events_until(server: ServerProcess, ends: set[str], *, timeout: float) -> list[dict[str, Any]]:
    """Every event from the tail's position until one named in ``ends`` (included)."""
    assert server.tail is not None
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        for event in server.tail.read():
            events.append(event)
            if event["event"] in ends:
                return events
        if not server.alive():
            raise RuntimeError(f"{server.name} exited:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            seen = [e["event"] for e in events if e["event"].startswith("rollout_")]
            raise TimeoutError(f"{server.name}: none of {sorted(ends)} within {timeout:g} s (saw {seen})")
        time.sleep(0.02)


def _idle_rate(server: ServerProcess, seconds: float) -> float:
    """CPU seconds per second of an idle server (its timers, the rollout's tick)."""
    before, began = server.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    return (server.cpu_seconds() - before) / (time.monotonic() - began)


def _mean_bytes(before: Sequence[int], after: Sequence[int]) -> float:
    return statistics.fmean(b - a for a, b in zip(before, after, strict=True)) if before else math.nan


# -- part 1: LRS ingest ----------------------------------------------------------------------------


def _lrs_window(on: _Side, off: _Side, options: RolloutOptions) -> LrsWindow:
    rss_before = on.server.rss_kb()
    answered = on.fleet.lrs_start(options.lrs_load, timeout=max(60.0, options.proxies / 50))
    if answered < options.proxies:
        raise RuntimeError(f"{on.server.name}: {answered} of {options.proxies} LRS streams answered")
    time.sleep(FIRST_REPORT[0] * options.lrs_interval + 0.5)  # then reports arrive evenly
    taken0, dropped0 = _lrs_metrics(on.server)
    sent0 = on.fleet.lrs_counts().reports
    cpu_on, cpu_off, began = on.server.cpu_seconds(), off.server.cpu_seconds(), time.monotonic()
    time.sleep(options.lrs_seconds)
    cpu_on, cpu_off = on.server.cpu_seconds() - cpu_on, off.server.cpu_seconds() - cpu_off
    seconds = time.monotonic() - began
    sent = on.fleet.lrs_counts().reports - sent0
    taken, dropped = _lrs_metrics(on.server)
    rss_after = on.server.rss_kb()
    counts = on.fleet.lrs_stop()
    on.server.settle_cpu(quiet=0.3, limit=5)
    total_taken, _ = _lrs_metrics(on.server)
    return LrsWindow(
        reporting=on.server.name,
        seconds=seconds,
        cpu_on=cpu_on,
        cpu_off=cpu_off,
        sent=sent,
        taken=taken - taken0,
        dropped=dropped - dropped0,
        answered=answered,
        rss_before_kb=rss_before,
        rss_after_kb=rss_after,
        errors=counts.errors,
        total_sent=counts.reports,
        total_taken=total_taken,
    )


# -- part 2: a CDS change in waves -----------------------------------------------------------------


def _roll_out(side: _Side, options: RolloutOptions, connect_timeout: str, idle: float) -> ChangeRun:
    """One CDS change on the rollout server, timed until ``rollout_completed`` (or its end)."""
    server, fleet = side.server, side.fleet
    assert server.tail is not None
    plan = parse_waves(options.waves)
    wave_of = [plan.assign(fleet.node_id(i)) for i in range(options.proxies)]
    server.tail.skip_to_end()
    received = fleet.bytes_received()
    cpu0, began, t0 = server.cpu_seconds(), time.monotonic(), time.time()
    options.workload.write(side.snapshot, connect_timeout=connect_timeout)
    limit = len(plan) * (options.ack_timeout + options.bake) + 60
    events = _events_until(server, {"rollout_completed", "rollout_failed", "rollout_held"}, timeout=limit)
    cpu = server.settle_cpu(quiet=0.3, limit=5) - cpu0
    spent = idle * (time.monotonic() - began)
    version = next(e for e in events if e["event"] == "snapshot_loaded")["versions"]["CDS"]
    acked = fleet.wait_acked({CDS: version}, since=t0, timeout=10)
    end = events[-1]
    run = ChangeRun(
        seconds=max([float(end["ts"]) - t0, *acked.latencies(t0)]),
        cpu=cpu - spent,
        idle=spent,
        bytes_per_proxy=_mean_bytes(received, fleet.bytes_received()),
        latencies=acked.latencies(t0),
        failures=acked.failures,
        outcome=end["event"] if end["event"] == "rollout_completed" else f"{end['event']}: {end.get('reason', '')}",
    )
    gates = {e["wave"]: float(e["ts"]) for e in events if e["event"] == "rollout_wave_acked"}
    for started in (e for e in events if e["event"] == "rollout_wave_started"):
        index, start = int(started["index"]), float(started["ts"])
        times = [acked.times[i] for i in range(options.proxies) if wave_of[i] == index]
        run.waves.append(
            WaveRun(
                wave=started["wave"],
                index=index,
                members=len(times),
                announced=int(started["proxies"]),
                latencies=sorted(t - start for t in times if t is not None),
                gate=gates[started["wave"]] - start if started["wave"] in gates else math.nan,
                early=sum(1 for t in times if t is not None and t < start),
                missing=sum(1 for t in times if t is None),
            )
        )
    return run


def _push(side: _Side, *, change: Any, wait_for: str, idle: float, timeout: float = 60.0) -> ChangeRun:
    """One change on a server (``change()`` makes it), timed until every proxy ACKed the new
    version of ``wait_for`` (the type URL) that the server's ``snapshot_loaded`` names."""
    server, fleet = side.server, side.fleet
    assert server.tail is not None
    server.tail.skip_to_end()
    received = fleet.bytes_received()
    cpu0, began, t0 = server.cpu_seconds(), time.monotonic(), time.time()
    change()
    loaded = server.tail.wait_for("snapshot_loaded", timeout=30, alive=server.alive)
    acked = fleet.wait_acked({wait_for: loaded["versions"][_SHORT[wait_for]]}, since=t0, timeout=timeout)
    cpu = server.settle_cpu() - cpu0
    spent = idle * (time.monotonic() - began)
    latencies = acked.latencies(t0)
    return ChangeRun(
        seconds=max(latencies, default=math.nan),
        cpu=cpu - spent,
        idle=spent,
        bytes_per_proxy=_mean_bytes(received, fleet.bytes_received()),
        latencies=latencies,
        failures=acked.failures,
    )


_SHORT = {CDS: "CDS", EDS: "EDS"}


def _rollout_flags(options: RolloutOptions, bake: float, *, health: bool = False) -> list[str]:
    return [
        "--rollout",
        options.waves,
        "--rollout-bake",
        f"{bake:g}",
        "--rollout-ack-timeout",
        f"{options.ack_timeout:g}",
        "--rollout-health",
        "on" if health else "off",
    ]


# -- the run -------------------------------------------------------------------------------------


def run_rollout_bench(options: RolloutOptions) -> RolloutBench:
    """The parts (see the module docstring), in one run."""
    result = RolloutBench(options)
    started = time.monotonic()
    sides: list[_Side] = []

    def errors(side: _Side) -> None:
        for code, n in side.fleet.errors().items():
            result.stream_errors[code] = result.stream_errors.get(code, 0) + n

    with ExitStack() as stack:
        workdir = work_dir(stack, options.workdir, "pilotfish-bench-rollout-")

        def close_all() -> None:
            for side in reversed(sides):
                side.close()

        def retire(side: _Side) -> None:
            """A part is over: count its stream errors, stop its server and fleet."""
            errors(side)
            sides.remove(side)
            side.close()
            result.loads.append(load_1min())

        stack.callback(close_all)

        result.loads.append(load_1min())
        plain = _side(workdir, PLAIN, options)
        sides.append(plain)

        # 1. LRS ingest: two servers alike, each fleet reporting in one window.
        if "lrs" in options.parts:
            other = _side(workdir, OTHER, options)
            sides.append(other)
            for on, off in ((plain, other), (other, plain)):
                result.lrs.append(_lrs_window(on, off, options))
                print_table(LRS_COLUMNS, [_lrs_row(str(len(result.lrs)), on.server.name, result.lrs[-1:])])
            retire(other)

        # 2. CDS changes in waves, and the same changes pushed by the plain server.
        if "waves" in options.parts:
            rollout = _side(workdir, ROLLOUT, options, _rollout_flags(options, options.bake))
            sides.append(rollout)
            idle_plain, idle_rollout = _idle_rate(plain.server, 3.0), _idle_rate(rollout.server, 3.0)
            for k in range(options.rollouts):
                timeout = f"{k + 2}s"
                result.rollouts.append(_roll_out(rollout, options, timeout, idle_rollout))
                time.sleep(options.gap)
                result.plain_pushes.append(
                    _push(
                        plain,
                        change=lambda t=timeout: options.workload.write(plain.snapshot, connect_timeout=t),
                        wait_for=CDS,
                        idle=idle_plain,
                    )
                )
                time.sleep(options.gap)
                outcome = result.rollouts[-1].outcome
                print(f"rollout {k + 1}: {outcome}, {result.rollouts[-1].seconds:.2f} s", flush=True)
                if outcome != "rollout_completed":
                    break
            print_table(WAVE_COLUMNS, result.wave_rows())
            print_table(ROLLOUT_COLUMNS, result.rollout_rows())
            retire(rollout)

        # 3. Endpoint changes while a canary wave bakes, interleaved with the same on the plain server.
        if "eds" in options.parts:
            _during_a_bake(result, plain, workdir, sides)
            retire(sides[-1])

        # 4. LRS ingest beside a rollout whose health gate reads the reports.
        if "gate" in options.parts:
            _gate_windows(result, plain, workdir, sides)
            errors(sides[-1])
            result.loads.append(load_1min())
        errors(plain)
    result.seconds = time.monotonic() - started
    return result


def _during_a_bake(result: RolloutBench, plain: _Side, workdir: Path, sides: list[_Side]) -> None:
    """Part 3: a rollout whose canary wave bakes, endpoint changes to it and to ``plain`` in turn."""
    options = result.options
    baking = _side(workdir, BAKING, options, _rollout_flags(options, options.long_bake))
    sides.append(baking)
    assert baking.server.tail is not None
    baking.server.tail.skip_to_end()
    changed = f"{options.rollouts + 2}s"
    options.workload.write(baking.snapshot, connect_timeout=changed)
    _events_until(baking.server, {"rollout_wave_acked", "rollout_failed"}, timeout=options.ack_timeout + 30)
    _push(plain, change=lambda: options.workload.write(plain.snapshot, connect_timeout=changed), wait_for=CDS, idle=0)
    changers = {
        name: EndpointChanger("registry", side.server, options.workload, side.snapshot)
        for name, side in ((PLAIN, plain), (BAKING, baking))
    }
    for k in range(options.rounds):
        order = ((PLAIN, plain), (BAKING, baking)) if k % 2 == 0 else ((BAKING, baking), (PLAIN, plain))
        for name, side in order:
            result.eds[name].append(_push(side, change=changers[name].change, wait_for=EDS, idle=0.0))
            time.sleep(options.gap)
    # The canary wave baked throughout: its gate passed, and no wave passed or failed since.
    events = {e["event"] for e in EventTail(baking.server.event_log).read(b'"event":"rollout_')}
    ended = {"rollout_wave_passed", "rollout_failed", "rollout_completed", "rollout_superseded"}
    result.still_baking = "rollout_wave_acked" in events and not ended & events
    print_table(EDS_COLUMNS, result.eds_rows())


def _gate_windows(result: RolloutBench, plain: _Side, workdir: Path, sides: list[_Side]) -> None:
    """Part 4: a rollout server with its health gate on and a canary wave baking, beside ``plain``:
    a quiet window, then both fleets reporting load."""
    options = result.options
    gated = _side(workdir, GATED, options, _rollout_flags(options, options.long_bake, health=True))
    sides.append(gated)
    assert gated.server.tail is not None
    gated.server.tail.skip_to_end()
    changed = f"{options.rollouts + 3}s"
    options.workload.write(gated.snapshot, connect_timeout=changed)
    began = _events_until(gated.server, {"rollout_wave_acked", "rollout_failed"}, timeout=options.ack_timeout + 30)
    if began[-1]["event"] != "rollout_wave_acked":
        raise RuntimeError(f"{GATED}: the canary wave did not start baking: {began[-1]}")
    _push(plain, change=lambda: options.workload.write(plain.snapshot, connect_timeout=changed), wait_for=CDS, idle=0)
    pair = ((PLAIN, plain), (GATED, gated))
    for _, side in pair:
        side.server.settle_cpu(quiet=0.3, limit=5)
    cpu0, t0 = [side.server.cpu_seconds() for _, side in pair], time.monotonic()
    time.sleep(options.lrs_seconds)
    quiet = [side.server.cpu_seconds() - c for (_, side), c in zip(pair, cpu0, strict=True)]
    quiet_seconds = time.monotonic() - t0
    answered = [side.fleet.lrs_start(options.lrs_load, timeout=max(60.0, options.proxies / 50)) for _, side in pair]
    for (name, _), n in zip(pair, answered, strict=True):
        if n < options.proxies:
            raise RuntimeError(f"{name}: {n} of {options.proxies} LRS streams answered")
    time.sleep(FIRST_REPORT[0] * options.lrs_interval + 0.5)  # then reports arrive evenly
    metrics0 = [_lrs_metrics(side.server) for _, side in pair]
    sent0 = [side.fleet.lrs_counts().reports for _, side in pair]
    cpu0, t0 = [side.server.cpu_seconds() for _, side in pair], time.monotonic()
    time.sleep(options.lrs_seconds)
    cpu = [side.server.cpu_seconds() - c for (_, side), c in zip(pair, cpu0, strict=True)]
    seconds = time.monotonic() - t0
    sent = [side.fleet.lrs_counts().reports - n for (_, side), n in zip(pair, sent0, strict=True)]
    metrics = [_lrs_metrics(side.server) for _, side in pair]
    with _OPENER.open(f"http://{gated.server.started['admin']}/v1/rollout", timeout=10) as response:
        health = json.loads(response.read()).get("health")
    counts = [side.fleet.lrs_stop() for _, side in pair]
    for k, (name, _) in enumerate(pair):
        result.gate.append(
            GateWindow(
                server=name,
                seconds=seconds,
                cpu=cpu[k],
                quiet_seconds=quiet_seconds,
                quiet_cpu=quiet[k],
                sent=sent[k],
                taken=metrics[k][0] - metrics0[k][0],
                dropped=metrics[k][1] - metrics0[k][1],
                answered=answered[k],
                errors=counts[k].errors,
                health=health if name == GATED else None,
            )
        )
    # The canary wave baked throughout: no wave passed, failed or paused since its gate passed.
    events = {e["event"] for e in EventTail(gated.server.event_log).read(b'"event":"rollout_')}
    ended = {"rollout_wave_passed", "rollout_failed", "rollout_completed", "rollout_superseded", "rollout_paused"}
    result.gate_baking = "rollout_wave_acked" in events and not ended & events
    print_table(GATE_COLUMNS, result.gate_rows())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_rollout", description=__doc__.split("\n\n")[0])
    d = RolloutOptions()
    parser.add_argument("--proxies", type=int, default=d.proxies, help="proxies per server (default: %(default)s)")
    parser.add_argument("--services", type=int, default=d.workload.services, help="clusters (default: %(default)s)")
    parser.add_argument(
        "--endpoints", type=int, default=d.workload.endpoints, help="endpoints per cluster (default: %(default)s)"
    )
    parser.add_argument(
        "--listeners", type=int, default=d.workload.listeners, help="services with a listener (default: %(default)s)"
    )
    parser.add_argument(
        "--lrs-seconds", type=float, default=d.lrs_seconds, help="each LRS window's length (default: %(default)s)"
    )
    parser.add_argument(
        "--lrs-interval",
        type=float,
        default=d.lrs_interval,
        help="seconds between a proxy's load reports (the servers' --lrs-interval-ms; default: %(default)s)",
    )
    parser.add_argument(
        "--lrs-clusters", type=int, default=d.lrs_load.clusters, help="clusters per report (default: %(default)s)"
    )
    parser.add_argument("--canary", default=d.canary, help="the canary wave's node-id glob (default: %(default)s)")
    parser.add_argument("--bake", type=float, default=d.bake, help="part 2's --rollout-bake (default: %(default)s)")
    parser.add_argument(
        "--rollouts", type=int, default=d.rollouts, help="CDS changes rolled out (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=d.rounds, help="endpoint changes per server in part 3 (default: %(default)s)"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which parts run: LRS ingest, a CDS change in waves, endpoint changes during a bake, LRS ingest "
        "with a rollout's health gate on (default: all)",
    )
    parser.add_argument("--workers", type=int, default=d.workers, help="client processes per fleet (default: auto)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the servers' files here")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements here (JSON)")
    args = parser.parse_args(argv)
    options = RolloutOptions(
        proxies=args.proxies,
        workload=Workload(
            services=args.services, endpoints=args.endpoints, listeners=min(args.listeners, args.services)
        ),
        lrs_seconds=args.lrs_seconds,
        lrs_interval=args.lrs_interval,
        lrs_load=LrsLoad(clusters=args.lrs_clusters),
        canary=args.canary,
        bake=args.bake,
        rollouts=args.rollouts,
        rounds=args.rounds,
        workers=args.workers,
        workdir=args.workdir,
        parts=tuple(p for p in PARTS if p in args.parts),
    )
    result = run_rollout_bench(options)
    print()
    print_table(LRS_COLUMNS, result.lrs_rows())
    print()
    print_table(WAVE_COLUMNS, result.wave_rows())
    print()
    print_table(ROLLOUT_COLUMNS, result.rollout_rows())
    print()
    print_table(EDS_COLUMNS, result.eds_rows())
    print()
    print_table(GATE_COLUMNS, result.gate_rows())
    measured, met = result.target()
    print(
        f"\ntarget: endpoint change p99 during a bake <= {TARGET_RATIO:.2f}x without a rollout: {measured}: "
        + ("-" if met is None else "met" if met else "NOT met")
    )
    for note in result.notes():
        print(f"\n{note}")
    print(f"\n{result.seconds:.0f} s; load now {load_1min():.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(_as_json(result), indent=1))
    ok = (
        all(r.outcome == "rollout_completed" and r.failures == 0 for r in result.rollouts)
        and all(r.failures == 0 for runs in result.eds.values() for r in runs)
        and all(w.early == 0 and w.missing == 0 and w.announced == w.members for w in result.waves())
        and (not result.gate or result.gate_baking)
    )
    return 0 if ok else 1


def _as_json(result: RolloutBench) -> dict[str, Any]:
    return {
        "lrs": [vars(w) for w in result.lrs],
        "waves": [{**vars(w), "latencies": None} | {"p99": percentile(w.latencies, 99)} for w in result.waves()],
        "rollouts": [{k: v for k, v in vars(r).items() if k not in ("latencies", "waves")} for r in result.rollouts],
        "plain_pushes": [
            {k: v for k, v in vars(r).items() if k not in ("latencies", "waves")} for r in result.plain_pushes
        ],
        "eds": {
            name: [{"p50": percentile(r.latencies, 50), "p99": percentile(r.latencies, 99), "cpu": r.cpu} for r in runs]
            for name, runs in result.eds.items()
        },
        "eds_ratio": result.eds_ratio,
        "still_baking": result.still_baking,
        "gate": [vars(w) for w in result.gate],
        "gate_baking": result.gate_baking,
        "loads": result.loads,
        "stream_errors": result.stream_errors,
    }


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
