"""The operator's command line on real processes: ``serve --config`` (every key, the command line
winning, an unknown key refused), the startup block naming the ports bound for ``:0``,
``--log-format json``, the "fixed" line, ``wait`` failing with no proxy, ``status`` exiting 1 on a
real NACK (with ``-o json`` and ``PILOTFISH_ADMIN``), and ``--version``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from pilotfish.commands.cli import _parsers, version
from pilotfish.commands.flags import Deprecated

from .ads_client import AdsClient
from .event_log import CDS, is_event
from .processes import (
    ControlPlane,
    ProcessGroup,
    free_port,
    http_get,
    pilotfish,
    pilotfish_argv,
    pilotfish_env,
    port_accepts,
    wait_until,
)
from .snapshot_file import write_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Check = Callable[[dict[str, Any]], object]

# Every key of a settings file (serve's flags, without the deprecated aliases): a value other than
# its default, and where `serve --print-settings` shows it, with what it must be.
EVERY_KEY: dict[str, tuple[Any, Check, object]] = {
    "snapshot": ("snapshot.yaml", lambda s: s["snapshot"], "snapshot.yaml"),
    "registry": ("127.0.0.1:0", lambda s: s["registry"]["address"], "127.0.0.1:0"),
    "registry-tokens": ("registry-tokens.yaml", lambda s: s["registry"]["tokens"], "registry-tokens.yaml"),
    "registry-self-preservation": (False, lambda s: s["registry"]["self_preservation"]["enabled"], False),
    "registry-self-preservation-share": (0.25, lambda s: s["registry"]["self_preservation"]["share"], 0.25),
    "etcd": ("127.0.0.1:2379", lambda s: s["etcd"]["address"], "127.0.0.1:2379"),
    "etcd-prefix": ("/pf/", lambda s: s["etcd"]["prefix"], "/pf/"),
    "etcd-keepalive": ("4s", lambda s: s["etcd"]["keepalive"], 4.0),
    "docker": (
        ["unix:///run/docker.sock", "tcp://10.0.0.5:2376@10.0.0.5"],
        lambda s: s["docker"]["engines"],
        [
            "unix:///run/docker.sock",
            "tcp://10.0.0.5:2376@10.0.0.5",
        ],
    ),
    "docker-tls": (True, lambda s: s["docker"]["tls"], True),
    "docker-tls-ca": ("docker-ca.pem", lambda s: s["docker"]["tls_ca"], "docker-ca.pem"),
    "docker-tls-cert": ("docker.pem", lambda s: s["docker"]["tls_cert"], "docker.pem"),
    "docker-tls-key": ("docker.key", lambda s: s["docker"]["tls_key"], "docker.key"),
    "quiet": ("50ms", lambda s: s["debounce"]["quiet"], 0.05),
    "max-delay": ("2s", lambda s: s["debounce"]["max_delay"], 2.0),
    "max-builds-per-s": (4, lambda s: s["debounce"]["max_builds_per_s"], 4.0),
    "flap-hold": ("3s", lambda s: s["debounce"]["hold"], 3.0),
    "dns-refresh": ("3s", lambda s: s["dns"]["refresh"], 3.0),
    "validate": ("off", lambda s: s["validate_rules"], False),
    "guard": (False, lambda s: s["guard"]["enabled"], False),  # (YAML's unquoted off)
    "guard-max-removed": (0.3, lambda s: s["guard"]["max_removed_share"], 0.3),
    "guard-min-count": (7, lambda s: s["guard"]["min_count"], 7),
    "xds": ("127.0.0.1:19000", lambda s: s["xds"]["address"], "127.0.0.1:19000"),
    "lrs-interval": ("5s", lambda s: s["xds"]["lrs"]["interval"], 5.0),
    "rollout": ("canary=edge-*,50%,100%", lambda s: s["rollout"]["waves"], "canary=edge-*,50%,100%"),
    "rollout-types": ("CDS,LDS", lambda s: s["rollout"]["types"], "CDS,LDS"),
    "rollout-ack-timeout": ("45s", lambda s: s["rollout"]["ack_timeout"], 45.0),
    "rollout-bake": ("1m", lambda s: s["rollout"]["bake"], 60.0),
    "rollout-health": ("off", lambda s: s["rollout"]["health"], False),
    "rollout-min-requests": (50, lambda s: s["rollout"]["min_requests"], 50),
    "rollout-max-error-increase": (2.5, lambda s: s["rollout"]["max_error_increase"], 2.5),
    "rollout-too-little-traffic": ("pass", lambda s: s["rollout"]["too_little_traffic"], "pass"),
    "rollout-ignore-cluster": (["xds-grpc"], lambda s: s["rollout"]["ignore_clusters"], ["xds-grpc"]),
    "admin": ("127.0.0.1:0", lambda s: s["admin"]["address"], "127.0.0.1:0"),
    "admin-tokens": ("admin-tokens.yaml", lambda s: s["admin"]["tokens"], "admin-tokens.yaml"),
    "admin-grpc": ("127.0.0.1:0", lambda s: s["admin"]["grpc_address"], "127.0.0.1:0"),
    "csds-on-xds": (True, lambda s: s["xds"]["csds"], True),
    "rest": ("127.0.0.1:0", lambda s: s["rest"]["address"], "127.0.0.1:0"),
    "rest-refresh": ("2s", lambda s: s["rest"]["refresh"], 2.0),
    "event-log": ("events.jsonl", lambda s: s["events"]["log"], "events.jsonl"),
    "event-log-level": ("changes", lambda s: s["events"]["level"], "changes"),
    "subset-size": (3, lambda s: s["subsets"]["size"], 3),
    "state-dir": ("state", lambda s: s["subsets"]["state_dir"], "state"),
    "subset-grace": ("1m", lambda s: s["subsets"]["grace"], 60.0),
    "status-forget-after": ("2m", lambda s: s["status_limits"]["forget_after"], 120.0),
    "status-max-disconnected": (5, lambda s: s["status_limits"]["max_disconnected"], 5),
    "recent-events": (200, lambda s: s["events"]["recent"], 200),
    "node-group": (["canary=cluster:canary-*"], lambda s: [g["group"] for g in s["policy"]["node_groups"]], ["canary"]),
    "tls-cert": ("xds.pem", lambda s: s["tls"]["cert"], "xds.pem"),
    "tls-key": ("xds.key", lambda s: s["tls"]["key"], "xds.key"),
    "client-ca": ("ca.pem", lambda s: s["tls"]["client_ca"], "ca.pem"),
    "registry-client-ca": ("registry-ca.pem", lambda s: s["tls"]["registry_client_ca"], "registry-ca.pem"),
    "admin-client-ca": ("admin-ca.pem", lambda s: s["tls"]["admin_client_ca"], "admin-ca.pem"),
    "authorize-node": (
        ["spiffe://mesh/ns/{ns}/sa/{sa}={sa}"],
        lambda s: len(s["policy"]["authorize_nodes"]),
        1,
    ),
    "grant-secret": (["edge-*=node:edge-*"], lambda s: len(s["policy"]["secret_grants"]), 1),
    "grants-file": ("grants.yaml", lambda s: s["policy"]["grants_file"], "grants.yaml"),
    "tls-reload": ("5s", lambda s: s["tls"]["reload_every"], 5.0),
    "max-connections": (1000, lambda s: s["xds"]["connections"]["max_connections"], 1000),
    "max-connections-per-address": (100, lambda s: s["xds"]["connections"]["max_connections_per_address"], 100),
    "handshake-timeout": ("3s", lambda s: s["xds"]["connections"]["handshake_timeout"], 3.0),
    "idle-timeout": ("0s", lambda s: s["xds"]["connections"]["idle_timeout"], None),
    "registry-max-connections": (50, lambda s: s["registry"]["connections"]["max_connections"], 50),
    "registry-max-connections-per-address": (
        10,
        lambda s: s["registry"]["connections"]["max_connections_per_address"],
        10,
    ),
    "rest-max-connections": (60, lambda s: s["rest"]["connections"]["max_connections"], 60),
    "rest-max-connections-per-address": (11, lambda s: s["rest"]["connections"]["max_connections_per_address"], 11),
    "admin-max-connections": (70, lambda s: s["admin"]["connections"]["max_connections"], 70),
    "admin-max-connections-per-address": (12, lambda s: s["admin"]["connections"]["max_connections_per_address"], 12),
    "event-loop": ("asyncio", lambda s: s["event_loop"], "asyncio"),
}
NOT_SETTINGS = {"help", "config", "print-settings"}


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return pilotfish(*args, check=False, timeout=60, env=env, cwd=cwd)


def test_the_table_names_every_flag_of_serve() -> None:
    _, serve = _parsers()
    flags = {
        option[2:]
        for action in serve._actions
        if not isinstance(action, Deprecated)
        for option in action.option_strings
        if option.startswith("--")
    }
    assert flags - NOT_SETTINGS == set(EVERY_KEY)


def test_a_settings_file_sets_every_key_and_the_command_line_wins(tmp_path: Path) -> None:
    for name in ("docker-ca.pem", "docker.pem", "docker.key"):  # (serve checks that these exist)
        (tmp_path / name).write_text("")
    config = tmp_path / "pilotfish.yaml"
    config.write_text(yaml.safe_dump({key: value for key, (value, _, _) in EVERY_KEY.items()}))
    shown = run("serve", "--config", str(config), "--print-settings", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)
    wrong = {
        key: (where(settings), expected)
        for key, (_, where, expected) in EVERY_KEY.items()
        if where(settings) != expected
    }
    assert not wrong, wrong

    # Flags win: a value, and a repeatable flag (which replaces the file's list, not adds to it).
    shown = run(
        "serve",
        "--config",
        str(config),
        "--quiet",
        "20ms",
        "--node-group",
        "blue=cluster:blue",
        "--print-settings",
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)
    assert settings["debounce"]["quiet"] == 0.02 and settings["debounce"]["max_delay"] == 2.0
    assert [group["group"] for group in settings["policy"]["node_groups"]] == ["blue"]


def test_a_settings_file_with_an_unknown_key_or_a_bad_value_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "snapshot.yaml").write_text("clusters: []\n")
    config = tmp_path / "pilotfish.yaml"
    config.write_text("snapshot: snapshot.yaml\nquiet_ms: 100\n")
    refused = run("serve", "--config", str(config), cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert str(config) in refused.stderr and "'quiet_ms'" in refused.stderr, refused.stderr
    config.write_text("snapshot: snapshot.yaml\nquiet: 100\n")  # checked as the flag is: a unit is needed
    refused = run("serve", "--config", str(config), cwd=tmp_path)
    assert refused.returncode == 2 and "quiet" in refused.stderr and "give a number and a unit" in refused.stderr
    # An old key works as the old flag does, with its warning.
    config.write_text("snapshot: snapshot.yaml\nquiet-ms: 30\n")
    shown = run("serve", "--config", str(config), "--print-settings", cwd=tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["debounce"]["quiet"] == 0.03, shown.stderr
    assert shown.stderr.count("--quiet-ms is deprecated") == 1 and "give --quiet 30ms" in shown.stderr


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def test_the_startup_block_names_the_ports_bound_for_port_0_and_json_logs_parse(processes: ProcessGroup) -> None:
    workdir = processes.workdir
    write_snapshot(
        workdir / "snapshot.yaml", listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]}
    )
    config = workdir / "pilotfish.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "snapshot": "snapshot.yaml",
                "xds": "127.0.0.1:0",
                "admin": "127.0.0.1:0",
                "registry": "127.0.0.1:0",
                "rest": "127.0.0.1:0",
            }
        )
    )
    server = processes.start(
        "pilotfish",
        pilotfish_argv("--log-format", "json", "serve", "--config", str(config), "--quiet-ms", "50"),
        env=pilotfish_env(),
    )

    def started() -> dict[str, Any] | None:
        if not server.alive():
            pytest.fail(server.output_tail(), pytrace=False)
        return next((line for line in _json_lines(server.stderr_path) if line["logger"] == "pilotfish.announce"), None)

    block = wait_until(started, timeout=20, what="the startup block", details=server.output_tail)
    assert block["level"] == "INFO" and re.match(r"\d{4}-\d\d-\d\dT", block["time"]), block
    ports = {name: int(block[name].rsplit(":", 1)[1]) for name in ("xds", "admin", "registry", "rest")}
    assert all(port > 0 for port in ports.values()) and len(set(ports.values())) == 4, ports
    assert block["sources"] == [
        {"kind": "file", "at": "snapshot.yaml"},
        {"kind": "registry", "at": f"http://{block['registry']}"},
    ]
    for name, port in ports.items():
        assert port_accepts(port), name
        assert f"127.0.0.1:{port}" in block["message"], block["message"]  # the text names the same ports
    assert http_get(f"http://127.0.0.1:{ports['admin']}/healthz")[0] == 200
    # Every line on stderr is a JSON object (the registry's in-memory warning and a deprecated flag's among them).
    lines = _json_lines(server.stderr_path)
    assert any(line["level"] == "WARNING" and "memory" in line["message"] for line in lines), lines
    assert any(line["level"] == "WARNING" and "give --quiet 50ms" in line["message"] for line in lines), lines
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)


def test_a_fixed_snapshot_file_is_announced_in_one_line(processes: ProcessGroup) -> None:
    path = processes.workdir / "snapshot.yaml"
    write_snapshot(path, listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]})
    good = path.read_text()
    control_plane = ControlPlane(processes, path, free_port())
    events = control_plane.start()
    stderr = control_plane.process.stderr_path
    assert "pilotfish serve started" in stderr.read_text()  # (at the default verbosity)
    mark = events.mark()
    path.write_text("clusters: [\n")
    events.wait_for(is_event("snapshot_error"), what="the broken file to be refused", after=mark)
    assert "fixed:" not in stderr.read_text()
    write_snapshot(
        path,
        version="2",
        listener_port=free_port(),
        endpoints={"web": [free_port(), free_port()], "api": [free_port()]},
    )
    assert path.read_text() != good
    fixed = wait_until(
        lambda: [line for line in stderr.read_text().splitlines() if "fixed:" in line],
        timeout=20,
        what="the fix to be announced",
        details=control_plane.process.output_tail,
    )
    assert len(fixed) == 1 and str(path) in fixed[0] and "accepted again" in fixed[0], fixed


def _nack_clusters(client: AdsClient, node: str) -> None:
    first = discovery_pb2.DiscoveryRequest(type_url=CDS)
    first.node.id, first.node.cluster, first.node.user_agent_name = node, "pods", "envoy"
    response = client.ask(first)
    answer = discovery_pb2.DiscoveryRequest(type_url=CDS, response_nonce=response.nonce)
    answer.error_detail.CopyFrom(status_pb2.Status(code=3, message="cluster web: bad connect_timeout"))
    client.requests.put(answer)


def test_wait_fails_without_proxies_and_status_fails_on_a_nack(processes: ProcessGroup, tmp_path: Path) -> None:
    path = processes.workdir / "snapshot.yaml"
    write_snapshot(path, listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]})
    control_plane = ControlPlane(processes, path, free_port())
    events = control_plane.start()
    env = {"PILOTFISH_ADMIN": control_plane.admin}  # (no --admin: the variable says where)

    nobody = run("wait", "--timeout", "1s", cwd=tmp_path, env=env)
    assert nobody.returncode == 1, nobody.stdout + nobody.stderr
    assert "0 of at least 1 proxy connected" in nobody.stderr, nobody.stderr
    assert run("wait", "--timeout", "1s", "--min-proxies", "0", cwd=tmp_path, env=env).returncode == 0
    empty = run("status", cwd=tmp_path, env=env)
    assert empty.returncode == 0 and "no proxy is connected" in empty.stdout, empty.stdout + empty.stderr

    client = AdsClient(control_plane.address)
    try:
        _nack_clusters(client, "pod-1")
        events.wait_for(is_event("nack", node="pod-1"), what="pod-1's NACK")
        table = run("status", cwd=tmp_path, env=env)
        assert table.returncode == 1, table.stdout + table.stderr
        assert "pod-1" in table.stdout and "NACKED" in table.stdout
        assert "pod-1: CDS NACKED" in table.stderr, table.stderr
        as_json = run("status", "-o", "json", cwd=tmp_path, env=env)
        assert as_json.returncode == 1, as_json.stderr
        answer = json.loads(as_json.stdout)
        assert [proxy["node"] for proxy in answer["proxies"]] == ["pod-1"]
        assert answer["proxies"][0]["types"]["CDS"]["state"] == "NACKED"
        assert len(answer["problems"]) == 1 and answer["problems"][0].startswith("pod-1: CDS NACKED")
        # The flag wins over the variable: an admin API that is not there.
        elsewhere = run("status", "--admin", f"127.0.0.1:{free_port()}", cwd=tmp_path, env=env)
        assert elsewhere.returncode == 3, elsewhere.stdout + elsewhere.stderr
    finally:
        client.close()


def test_version_prints_the_version(tmp_path: Path) -> None:
    shown = run("--version", cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.strip() == f"pilotfish {version()}", shown.stdout + shown.stderr
    assert re.fullmatch(r"pilotfish \d+\.\d+\.\S+", shown.stdout.strip())
