"""Tables and machine facts, printed to the terminal and written into BENCHMARKS.md.

Every number in BENCHMARKS.md is read with the machine it was measured on: :func:`machine_facts`
names the cores, CPU model, memory, OS, Python, the Envoy binary's own version and the libraries
the simulator and the servers lean on; the load average is sampled by the run itself
(:mod:`bench.stats`), since another process on the machine shifts every number.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from pilotfish.envoy import find_envoy

__all__ = ["envoy_version", "fmt_loads", "fmt_ms", "load_line", "machine_facts", "markdown_table", "print_table"]


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def fmt_loads(loads: Sequence[float]) -> str:
    """Load averages read before each run, as one cell: ``2.01 / 3.47 / 2.80``."""
    return " / ".join(f"{x:.2f}" for x in loads)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(markdown_table(columns, rows), flush=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.system()


def envoy_version() -> str:
    """The version the Envoy binary the benchmarks start reports (``envoy --version``)."""
    try:
        done = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except Exception as exc:  # no Envoy: say so in the table rather than fail the run
        return f"unknown ({type(exc).__name__})"
    # "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    text = done.stdout.strip().rpartition("version:")[2].strip()
    parts = text.split("/")
    return f"{parts[1]} ({'/'.join(parts[2:])}, {parts[0][:12]})" if len(parts) >= 3 else text or "unknown"


def machine_facts() -> dict[str, str]:
    """The machine and software a run measured on, as ``name: value`` lines for the report."""
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    return {
        "cores": str(os.cpu_count()),
        "CPU model": _cpu_model(),
        "memory": f"{mem_kb / 1024 / 1024:.1f} GiB",
        "OS": f"{_os_name()}, Linux {platform.release()}",
        "Python": sys.version.split()[0],
        "Envoy": envoy_version(),
        "grpcio / protobuf": f"{_version('grpcio')} / {_version('protobuf')}",
    }


def load_line(samples: Sequence[float]) -> str:
    """The load average (1 min) over a run's samples: min, median and max."""
    if not samples:
        return "not sampled"
    ordered = sorted(samples)
    return (
        f"{ordered[0]:.2f} min, {ordered[len(ordered) // 2]:.2f} median, {ordered[-1]:.2f} max "
        f"({len(ordered)} samples, at the start and end of each section)"
    )
