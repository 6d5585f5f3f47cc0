"""File change -> real Envoy: pilotfish (ADS, gRPC) and Sovereign (REST polling), same config.

pilotfish: ``pilotfish serve --snapshot FILE --quiet-ms Q`` and one Envoy 1.40 bootstrapped by
``pilotfish.resources.bootstrap``. Each of ``--changes`` changes rewrites the file (temp + rename) with a
fresh endpoint in ``svc-00000``; t0 is taken just before the rename. Measured per change:

- **ACK**: the event log's ``ack`` of EDS with ``version_info`` = the new EDS version (its ``ts``,
  epoch seconds, written when pilotfish read Envoy's ACK) minus t0. The target is ``quiet + 50 ms``.
- **applied**: when Envoy's admin ``/clusters`` first lists the new endpoint (polled every 5 ms)
  minus t0. This is the number compared with Sovereign, which has no ACKs to watch.

Sovereign (``pip install sovereign`` in its own venv, bench/.venv-sovereign): a file source
(polled every ``refresh_rate`` s, 1 s at the least: the setting is whole seconds) rendered by
Python templates into the same EDS clusters and ClusterLoadAssignments, served over REST; Envoy
polls CDS and EDS with ``api_type: REST`` every ``refresh_delay``. Same changes, same "applied"
measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import REPO, EventTail, free_port, start_pilotfish, work_dir
from bench.report import fmt_ms
from bench.stats import percentile
from bench.workload import Workload, endpoint_address, service_name, write_atomically
from pilotfish.envoy import EnvoyError, EnvoySettings, start_envoy
from pilotfish.envoy import EnvoyProcess as LaunchedEnvoy

__all__ = ["ENVOY_COLUMNS", "EnvoyProcess", "PropagationResult", "run_pilotfish_envoy", "run_sovereign_envoy"]

ENVOY_COLUMNS = [
    "control plane",
    "how Envoy gets config",
    "debounce / polling",
    "changes",
    "ACK p50 ms",
    "ACK max ms",
    "target (quiet + 50 ms)",
    "applied p50 ms",
    "applied p90 ms",
    "applied max ms",
    "missed",
]
SOVEREIGN_VENV = REPO / "bench" / ".venv-sovereign"
_CLUSTER_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_CLA_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


class EnvoyProcess:
    """A real Envoy with a bootstrap (:func:`pilotfish.envoy.start_envoy`); stopped by PID."""

    def __init__(self, workdir: Path, bootstrap: dict[str, Any], name: str = "envoy") -> None:
        self.workdir, self.bootstrap, self.name = workdir, bootstrap, name
        self.launched: LaunchedEnvoy | None = None
        self.admin = ""

    def start(self, timeout: float = 30.0) -> None:
        self.launched = start_envoy(
            self.bootstrap, EnvoySettings(work_dir=self.workdir, name=self.name, log_level="warning")
        )
        try:
            self.admin = self.launched.wait_for_admin(timeout=timeout)
        except EnvoyError:
            self.stop()
            raise

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=5) as response:
            return str(response.read().decode())

    def wait_for_text(self, path: str, text: str, *, timeout: float, interval: float = 0.005) -> float | None:
        """Poll the admin ``path`` until it contains ``text``; when (epoch seconds), None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                if text in self.get(path):
                    return time.time()
            time.sleep(interval)
        return None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; removes its own shared memory (--use-dynamic-base-id leaves it)."""
        if self.launched is not None:
            self.launched.stop()


@dataclass
class PropagationResult:
    control_plane: str
    transport: str
    settings: str
    target_ms: float | None = None
    acks: list[float] = field(default_factory=list)
    applied: list[float] = field(default_factory=list)
    missed: int = 0

    def row(self) -> list[Any]:
        return [
            self.control_plane,
            self.transport,
            self.settings,
            len(self.applied) + self.missed,
            fmt_ms(percentile(self.acks, 50)) if self.acks else "n/a (REST has no ACK)",
            fmt_ms(max(self.acks)) if self.acks else "-",
            f"{self.target_ms:.0f}" if self.target_ms is not None else "-",
            fmt_ms(percentile(self.applied, 50)),
            fmt_ms(percentile(self.applied, 90)),
            fmt_ms(max(self.applied, default=float("nan"))),
            self.missed,
        ]


def _workload(services: int) -> Workload:
    # No listeners: Envoy would bind them. Clusters and endpoints are what is compared.
    return Workload(services=services, endpoints=2, listeners=0)


def _extra(i: int) -> tuple[str, int]:
    return "10.255.0.1", 9000 + i


def _visible(extra: tuple[str, int]) -> str:
    return f"{service_name(0)}::{extra[0]}:{extra[1]}::"


def _ack_of(type_url: str, version: str) -> Callable[[dict[str, Any]], bool]:
    """Matches the event log's ``ack`` record of ``version`` of ``type_url``."""

    def matches(event: dict[str, Any]) -> bool:
        return event.get("type") == type_url and event.get("version_info") == version

    return matches


def run_pilotfish_envoy(
    *, changes: int = 20, quiet_ms: int = 100, services: int = 10, workdir: str | Path | None = None, gap: float = 0.25
) -> PropagationResult:
    from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap

    result = PropagationResult("pilotfish", "ADS (gRPC, SotW)", f"quiet {quiet_ms} ms", target_ms=quiet_ms + 50)
    workload = _workload(services)
    with ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-envoy-bench-")
        snapshot = workdir / "snapshot.json"
        workload.write(snapshot)
        server = start_pilotfish(workdir, snapshot=snapshot, quiet_ms=quiet_ms, registry=False)
        stack.callback(server.stop)
        envoy = EnvoyProcess(workdir, bootstrap(BootstrapSettings(node_id="bench-envoy", xds=server.xds, admin_port=0)))
        envoy.start()
        stack.callback(envoy.stop)
        if envoy.wait_for_text("/clusters", f"{service_name(0)}::", timeout=30) is None:
            raise RuntimeError("Envoy never got the initial clusters from pilotfish")
        tail = EventTail(server.event_log)
        for i in range(1, changes + 1):
            time.sleep(gap)
            tail.skip_to_end()
            extra = _extra(i)
            t0 = time.time()
            workload.write(snapshot, extra_endpoint=extra)
            applied = envoy.wait_for_text("/clusters", _visible(extra), timeout=10)
            if applied is None:
                result.missed += 1
                continue
            result.applied.append(applied - t0)
            loaded = tail.wait_for("snapshot_loaded", timeout=10)
            eds: str = loaded["versions"]["EDS"]
            ack = tail.wait_for("ack", timeout=10, where=_ack_of(_CLA_URL, eds))
            result.acks.append(float(ack["ts"]) - t0)
    return result


# -- Sovereign -----------------------------------------------------------------------------------

_SOVEREIGN_CLUSTERS = """
def call(instances, discovery_request=None, **kwargs):
    for service in instances:
        yield {
            "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            "name": service["name"],
            "type": "EDS",
            "connect_timeout": "1s",
            "eds_cluster_config": {"eds_config": {"resource_api_version": "V3", "api_config_source": {
                "api_type": "REST", "transport_api_version": "V3", "cluster_names": ["sovereign"],
                "refresh_delay": "%(refresh)s"}}},
        }
"""

_SOVEREIGN_ENDPOINTS = """
def call(instances, discovery_request=None, **kwargs):
    for service in instances:
        yield {
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": service["name"],
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                for host, port in service["endpoints"]]}],
        }
"""


def _instances(workload: Workload, extra: tuple[str, int] | None) -> str:
    out = []
    for i in range(workload.services):
        endpoints = [list(endpoint_address(i, e)) for e in range(workload.endpoints)]
        if i == 0 and extra is not None:
            endpoints.append(list(extra))
        out.append({"name": service_name(i), "endpoints": endpoints})
    return json.dumps(out)


def _sovereign_bootstrap(port: int, refresh: str) -> dict[str, Any]:
    rest = {"api_type": "REST", "transport_api_version": "V3", "cluster_names": ["sovereign"], "refresh_delay": refresh}
    return {
        "node": {"id": "bench-envoy", "cluster": "bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "dynamic_resources": {"cds_config": {"resource_api_version": "V3", "api_config_source": rest}},
        "static_resources": {
            "clusters": [
                {
                    "name": "sovereign",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": "sovereign",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ]
        },
    }


def run_sovereign_envoy(
    *,
    changes: int = 20,
    refresh_seconds: int = 1,
    refresh_delay: str = "1s",
    services: int = 10,
    workdir: str | Path | None = None,
    gap: float = 0.25,
) -> PropagationResult:
    python = SOVEREIGN_VENV / "bin" / "sovereign"
    if not python.exists():
        raise FileNotFoundError(
            f"Sovereign is not installed: python3 -m venv {SOVEREIGN_VENV} && "
            f"{SOVEREIGN_VENV}/bin/pip install sovereign"
        )
    result = PropagationResult(
        "Sovereign",
        "REST polling (CDS + EDS)",
        f"source refresh {refresh_seconds} s, Envoy refresh_delay {refresh_delay}",
    )
    workload = _workload(services)
    with ExitStack() as stack:
        workdir = work_dir(stack, workdir, "sovereign-envoy-bench-")
        instances = workdir / "instances.json"
        write_atomically(instances, _instances(workload, None))
        (workdir / "clusters_template.py").write_text(_SOVEREIGN_CLUSTERS % {"refresh": refresh_delay})
        (workdir / "endpoints_template.py").write_text(_SOVEREIGN_ENDPOINTS)
        config = {
            "sources": [{"type": "file", "scope": "default", "config": {"path": f"file+json://{instances}"}}],
            "source_config": {"refresh_rate": refresh_seconds},
            "matching": {"enabled": False},
            "templates": {
                "default": [
                    {
                        "type": "clusters",
                        "spec": {
                            "protocol": "python",
                            "serialization": "raw",
                            "path": str(workdir / "clusters_template.py"),
                        },
                    },
                    {
                        "type": "endpoints",
                        "spec": {
                            "protocol": "python",
                            "serialization": "raw",
                            "path": str(workdir / "endpoints_template.py"),
                        },
                    },
                ]
            },
        }
        (workdir / "sovereign.yaml").write_text(json.dumps(config))
        port = free_port()
        env = {
            **os.environ,
            "SOVEREIGN_CONFIG": f"file+json://{workdir / 'sovereign.yaml'}",
            "SOVEREIGN_HOST": "127.0.0.1",
            "SOVEREIGN_PORT": str(port),
            "SOVEREIGN_WORKERS": "1",
            "SOVEREIGN_SOURCES_REFRESH_RATE": str(refresh_seconds),
        }
        log = open(workdir / "sovereign.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(python)],
            env=env,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

        def stop_sovereign() -> None:
            # gunicorn: the master (our child) stops its workers on SIGTERM.
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the master and its workers
                    proc.wait(5)

        stack.callback(stop_sovereign)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = (workdir / "sovereign.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"Sovereign did not start ({exc}):\n{text}") from exc
                time.sleep(0.1)
        envoy = EnvoyProcess(workdir, _sovereign_bootstrap(port, refresh_delay), name="envoy-sovereign")
        envoy.start()
        stack.callback(envoy.stop)
        if envoy.wait_for_text("/clusters", f"{service_name(0)}::", timeout=60) is None:
            text = (workdir / "sovereign.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"Envoy never got the initial clusters from Sovereign:\n{text}")
        for i in range(1, changes + 1):
            time.sleep(gap)
            extra = _extra(i)
            t0 = time.time()
            write_atomically(instances, _instances(workload, extra))
            applied = envoy.wait_for_text("/clusters", _visible(extra), timeout=30)
            if applied is None:
                result.missed += 1
            else:
                result.applied.append(applied - t0)
    return result


def main(argv: list[str] | None = None) -> int:
    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_envoy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--quiet-ms", type=int, nargs="+", default=[100, 20])
    parser.add_argument("--services", type=int, default=10)
    parser.add_argument("--sovereign", action="store_true", help="also run Sovereign (its own venv)")
    args = parser.parse_args(argv)
    rows = [run_pilotfish_envoy(changes=args.changes, quiet_ms=q, services=args.services).row() for q in args.quiet_ms]
    if args.sovereign:
        rows.append(run_sovereign_envoy(changes=args.changes, services=args.services).row())
    print_table(ENVOY_COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
