"""examples/replicas/run.sh runs: etcd and three replicas come up, the bootstrap it prints lists all
three, they serve one version of what is put in etcd, an Envoy started from that bootstrap gets it,
and SIGTERM to the script stops every process it started."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from .etcd import etcd_binary
from .processes import (
    REPO,
    Envoy,
    ProcessGroup,
    envoy_binary,
    http_get,
    http_json,
    pilotfish_env,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SCRIPT = REPO / "examples" / "replicas" / "run.sh"
OFFSETS = (0, 1, 2, 10, 11, 12, 20, 21, 22, 79, 80, 90)
"""The ports the script uses, from its BASE_PORT (see the script)."""


def _free_block() -> int:
    """A BASE_PORT whose every port the script uses is free right now."""
    for _ in range(100):
        base = random.randrange(20_000, 32_000, 100)
        sockets = []
        try:
            for offset in OFFSETS:
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError("no free block of ports for the example")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_replicas_example_runs_and_stops_everything_it_started(processes: ProcessGroup) -> None:
    etcd_binary()
    envoy_binary()
    base = _free_block()
    env = {
        **pilotfish_env(),
        "PILOTFISH": f"{sys.executable} -m pilotfish",
        "WORK": str(processes.workdir / "work"),
        "BASE_PORT": str(base),
        "NODE_ID": "edge-1",
    }
    script = processes.start("run.sh", ["bash", str(SCRIPT)], env=env)
    try:
        wait_until(
            lambda: "ready:" in script.stderr_path.read_text() or not script.alive(),
            timeout=60,
            what="the example to be ready",
            details=script.output_tail,
        )
        assert script.alive(), script.output_tail()
        printed = script.stderr_path.read_text()
        pids = [int(line.split("pid ", 1)[1].split(",", 1)[0]) for line in printed.splitlines() if " pid " in line]
        assert len(pids) == 4, printed  # etcd and three replicas
        bootstrap = yaml.safe_load(script.stdout_path.read_text())
        [cluster] = bootstrap["static_resources"]["clusters"]
        xds = [
            f"127.0.0.1:{e['endpoint']['address']['socket_address']['port_value']}"
            for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        ]
        assert xds == [f"127.0.0.1:{base + 10 * i}" for i in range(3)]
        assert bootstrap["node"]["id"] == "edge-1"

        # A service put in etcd: every replica serves it at one version.
        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        listen = f"127.0.0.1:{base + 95}"
        service = {"listen": listen, "endpoints": [f"127.0.0.1:{base + 96}"]}
        status, _ = http_json(
            "POST",
            f"http://127.0.0.1:{base + 79}/v3/kv/put",
            {"key": b64("/pilotfish/services/web"), "value": b64(json.dumps(service))},
        )
        assert status == 200

        def labels() -> set[str]:
            found = set()
            for i in range(3):
                status, body = http_get(f"http://127.0.0.1:{base + 10 * i + 1}/v1/snapshots")
                groups = json.loads(body)["groups"] if status == 200 else {}
                found.add(json.dumps(groups.get("default", {}).get("types", {}).get("LDS", {}).get("version")))
            return found

        wait_until(
            lambda: len(labels()) == 1 and labels() != {"null"},
            timeout=15,
            what="the three replicas to serve one version of the service",
            details=lambda: str(labels()),
        )
        envoy = Envoy.start(processes, name="envoy", node_id="edge-1", xds_address=",".join(xds))
        wait_until(
            lambda: envoy.stat("listener_manager.total_listeners_active") == 1,
            timeout=15,
            what="Envoy to take the listener of the service from a replica",
            details=envoy.log_tail,
        )
    finally:
        if script.alive():
            script.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # then asserted below
                script.popen.wait(30)
    assert script.popen.returncode == 143, script.output_tail()
    assert "stopped:" in script.stderr_path.read_text()
    assert not [pid for pid in pids if _alive(pid)], "every process the example started is stopped"
