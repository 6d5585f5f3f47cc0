"""Real HTTP load for the end-to-end tests: ``wrk`` run as a process, and its report parsed.

:class:`Wrk` starts ``wrk --latency`` in the background through the test's :class:`ProcessGroup`
(so teardown kills it by PID), and :meth:`Wrk.result` waits for it and parses what it printed
into a :class:`WrkResult`; :meth:`Wrk.stop` ends it first, once the test's changes are all made
under it (its duration is then a bound, not a wait). A test checks the load went through cleanly with
:meth:`WrkResult.problems`: no non-2xx/3xx response, no socket error, some requests at all.

wrk prints (the last two error lines only when there were any)::

    Running 22s test @ http://127.0.0.1:10000/
      2 threads and 50 connections
      Thread Stats   Avg      Stdev     Max   +/- Stdev
        Latency     3.10ms    2.01ms  40.12ms   91.30%
        Req/Sec     8.23k     1.10k   10.20k    70.45%
      Latency Distribution
         50%    2.71ms
         ...
         99%   11.02ms
      362011 requests in 22.00s, 44.19MB read
      Socket errors: connect 0, read 3, write 0, timeout 0
      Non-2xx or 3xx responses: 12
    Requests/sec:  16454.77
    Transfer/sec:      2.01MB
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

from .processes import Process, ProcessGroup, port_accepts, wait_until

__all__ = ["Wrk", "WrkResult", "parse_wrk_output", "wrk_binary"]

_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PERCENTILE = re.compile(r"^\s*(\d+(?:\.\d+)?)%\s+(\d+(?:\.\d+)?)(us|ms|s|m|h)\s*$", re.MULTILINE)
_TOTAL = re.compile(r"^\s*(\d+) requests in (\d+(?:\.\d+)?)(us|ms|s|m|h), ", re.MULTILINE)
_RATE = re.compile(r"^Requests/sec:\s+(\d+(?:\.\d+)?)\s*$", re.MULTILINE)
_SOCKET_ERRORS = re.compile(r"^\s*Socket errors: (.+)$", re.MULTILINE)
_NON_2XX = re.compile(r"^\s*Non-2xx or 3xx responses: (\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class WrkResult:
    """What one wrk run reported. Times are in seconds."""

    requests: int
    duration_s: float
    requests_per_s: float
    latency_percentiles: dict[float, float]
    """Percentile (50, 75, 90, 99) -> latency; empty unless wrk ran with ``--latency``."""
    socket_errors: dict[str, int] = field(default_factory=dict)
    """connect / read / write / timeout counts; empty when wrk printed no "Socket errors" line."""
    non_2xx_3xx: int = 0
    output: str = ""

    @property
    def p99_s(self) -> float | None:
        return self.latency_percentiles.get(99.0)

    def problems(self) -> list[str]:
        """Why this run was not clean: errors, bad statuses, or no requests at all."""
        found = []
        if self.requests <= 0:
            found.append("wrk completed no requests")
        if self.non_2xx_3xx:
            found.append(f"{self.non_2xx_3xx} responses were not 2xx/3xx")
        errors = {kind: n for kind, n in self.socket_errors.items() if n}
        if errors:
            found.append("socket errors: " + ", ".join(f"{kind} {n}" for kind, n in errors.items()))
        return found

    def summary(self) -> str:
        p99 = f"{self.p99_s * 1e3:.2f} ms" if self.p99_s is not None else "n/a"
        return f"{self.requests} requests in {self.duration_s:.2f} s, {self.requests_per_s:.0f} req/s, p99 {p99}"


def parse_wrk_output(text: str) -> WrkResult:
    """Parse wrk's report; raise ValueError naming what is missing if it is not one."""
    total = _TOTAL.search(text)
    rate = _RATE.search(text)
    if total is None or rate is None:
        raise ValueError(f"not a wrk report (no 'N requests in T' / 'Requests/sec:' line):\n{text}")
    percentiles = {float(p): float(v) * _TIME_UNITS[unit] for p, v, unit in _PERCENTILE.findall(text)}
    socket_errors: dict[str, int] = {}
    if (line := _SOCKET_ERRORS.search(text)) is not None:
        for part in line.group(1).split(","):
            kind, _, count = part.strip().partition(" ")
            socket_errors[kind] = int(count)
    non_2xx = _NON_2XX.search(text)
    return WrkResult(
        requests=int(total.group(1)),
        duration_s=float(total.group(2)) * _TIME_UNITS[total.group(3)],
        requests_per_s=float(rate.group(1)),
        latency_percentiles=percentiles,
        socket_errors=socket_errors,
        non_2xx_3xx=int(non_2xx.group(1)) if non_2xx else 0,
        output=text,
    )


def wrk_binary() -> str:
    """The ``wrk`` on PATH; fail (never skip) saying how to get it."""
    found = shutil.which("wrk")
    if found is None:
        pytest.fail(
            "no `wrk` on PATH: the load tests need it; install the Debian package wrk (make setup does)",
            pytrace=False,
        )
    return found


@dataclass
class Wrk:
    """One wrk run in the background."""

    process: Process
    url: str
    duration_s: int

    @classmethod
    def start(
        cls,
        group: ProcessGroup,
        url: str,
        *,
        duration_s: int,
        threads: int = 2,
        connections: int = 50,
        timeout_s: int = 10,
        ready_timeout_s: float = 15.0,
    ) -> Wrk:
        """Start ``wrk -t<threads> -c<connections> -d<duration_s>s --latency``.

        ``timeout_s``: wrk counts a response slower than this as a socket error (timeout). Its
        default, 2 s, turns a request merely slowed by a busy machine into an error (p99 reached
        1.35 s on a 2-CPU machine running other work); 10 s still catches a request that hangs.

        wrk gives up at once when its first connect is refused, so this first waits (at most
        ``ready_timeout_s``) until the URL's host and port accept connections: an Envoy that has
        a cluster's endpoints may still be warming the listener (its workers open the socket only
        once it is warm).
        """
        target = urlsplit(url)
        host, port = target.hostname, target.port
        assert host is not None and port is not None, f"wrk needs a URL with a host and a port: {url}"
        wait_until(
            lambda: port_accepts(port, host),
            timeout=ready_timeout_s,
            what=f"{host}:{port} to accept connections before wrk starts on {url}",
        )
        argv = [
            wrk_binary(),
            f"-t{threads}",
            f"-c{connections}",
            f"-d{duration_s}s",
            "--latency",
            f"--timeout={timeout_s}s",
            url,
        ]
        return cls(group.start("wrk", argv), url, duration_s)

    def running(self) -> bool:
        return self.process.alive()

    def result(self, *, slack_s: float = 30.0) -> WrkResult:
        """Wait for wrk to finish (its duration plus ``slack_s`` at most) and parse its report."""
        return self._report(self.duration_s + slack_s)

    def stop(self, *, slack_s: float = 30.0) -> WrkResult:
        """End the run now and parse its report: what a test needed the load for is over, and the
        rest of ``duration_s`` (an upper bound, then) would only hold the machine busy.

        wrk takes SIGINT as the end of its duration: each thread leaves its event loop, and the
        report covers the requests answered until then (one still in flight is not counted, not
        an error). A run that already ended is only read."""
        if self.running():
            self.process.popen.send_signal(signal.SIGINT)
        return self._report(slack_s)

    def _report(self, within_s: float) -> WrkResult:
        try:
            returncode = self.process.popen.wait(within_s)
        except subprocess.TimeoutExpired:
            self.process.stop(kill=True)
            pytest.fail(f"wrk did not finish within {within_s:g}s\n{self.process.output_tail()}", pytrace=False)
        output = self.process.stdout_path.read_text(errors="replace")
        if returncode != 0:
            pytest.fail(f"wrk exited with {returncode}\n{self.process.output_tail()}", pytrace=False)
        return parse_wrk_output(output)
