"""Two ``pilotfish serve`` on one host: the second exits at once, naming each listener that
cannot bind, its address and the flag to change; the first keeps serving.

The first server takes OS-chosen ports (port 0 for xDS, registry, REST and admin) and says
which in its ``server_started`` event; the second is given one of those addresses at a time. The
default ports (18000, 18001) are exercised too, but in a network namespace of the test's own
(``unshare -n``; the second server joins it with ``nsenter --net``): its loopback is nobody
else's, so no other test (or server) on this host can hold those ports or be disturbed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .event_log import EventLog
from .processes import ProcessGroup, http_get, pilotfish, pilotfish_argv, pilotfish_env, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "examples" / "demo.yaml"


def _started(events: EventLog, process: Any) -> dict[str, Any]:
    def started() -> dict[str, Any] | None:
        if process.popen.poll() is not None:
            pytest.fail(f"the first server exited\n{process.output_tail()}", pytrace=False)
        return events.find(lambda e: e["event"] == "server_started")

    return wait_until(started, timeout=30, what="the first server's server_started event", details=process.output_tail)


def test_a_second_server_on_a_taken_address_exits_naming_the_listener_and_its_flag(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    events = EventLog(tmp_path / "first.jsonl")
    first = processes.start(
        "first",
        pilotfish_argv(
            "serve",
            "--snapshot",
            str(SNAPSHOT),
            "--event-log",
            str(events.path),
            "--xds",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--registry",
            "127.0.0.1:0",
            "--rest",
            "127.0.0.1:0",
        ),
        env=pilotfish_env(),
    )
    taken = _started(events, first)
    free = "127.0.0.1:0"
    cases = {  # the second server's flags -> the line it must print
        "--admin": f"admin API: {taken['admin']} is in use (pass --admin HOST:PORT, or --admin off)",
        "--xds": f"xDS: {taken['xds']} is in use (pass --xds HOST:PORT)",
        "--registry": f"registry API: {taken['registry']} is in use (pass --registry HOST:PORT, or leave out "
        "--registry)",
        "--rest": f"REST xDS: {taken['rest']} is in use (pass --rest HOST:PORT, or leave out --rest)",
    }
    for flag, line in cases.items():
        addresses = {
            "--xds": free,
            "--admin": free,
            "--registry": free,
            "--rest": free,
            flag: taken[flag.removeprefix("--")],
        }
        second = pilotfish(
            "serve", "--snapshot", str(SNAPSHOT), *(part for item in addresses.items() for part in item), check=False
        )
        assert second.returncode == 1, (flag, second.stdout, second.stderr)
        assert f"pilotfish: {line}" in second.stderr.splitlines(), (flag, second.stderr)
        assert "Traceback" not in second.stderr and "Errno" not in second.stderr, second.stderr
    # The first one was not disturbed.
    assert http_get(f"http://{taken['admin']}/healthz")[0] == 200
    assert first.alive()


def test_two_servers_with_the_default_ports_the_second_names_both_ports(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    assert unshare and nsenter, "this test needs unshare and nsenter (util-linux): apt-get install util-linux"
    events = EventLog(tmp_path / "first.jsonl")
    serve = " ".join(pilotfish_argv("serve", "--snapshot", str(SNAPSHOT), "--event-log", str(events.path)))
    # A network namespace of its own (root here: unshare -n), loopback up, then the first server in it.
    first = processes.start(
        "first", [unshare, "-n", "sh", "-c", f"ip link set lo up && exec {serve}"], env=pilotfish_env()
    )
    taken = _started(events, first)
    assert (taken["xds"], taken["admin"]) == ("127.0.0.1:18000", "127.0.0.1:18001")

    second = subprocess.run(
        [nsenter, f"--net=/proc/{first.pid}/ns/net", *pilotfish_argv("serve", "--snapshot", str(SNAPSHOT))],
        capture_output=True,
        text=True,
        env=pilotfish_env(),
        timeout=60,
        check=False,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    lines = second.stderr.splitlines()
    assert "pilotfish: xDS: 127.0.0.1:18000 is in use (pass --xds HOST:PORT)" in lines, second.stderr
    assert "admin API: 127.0.0.1:18001 is in use (pass --admin HOST:PORT, or --admin off)" in lines, second.stderr
    assert "Traceback" not in second.stderr, second.stderr

    # Given another xDS port, it names only the admin API.
    second = subprocess.run(
        [
            nsenter,
            f"--net=/proc/{first.pid}/ns/net",
            *pilotfish_argv("serve", "--snapshot", str(SNAPSHOT), "--xds", "127.0.0.1:0"),
        ],
        capture_output=True,
        text=True,
        env=pilotfish_env(),
        timeout=60,
        check=False,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        "pilotfish: admin API: 127.0.0.1:18001 is in use (pass --admin HOST:PORT, or --admin off)"
    ), second.stderr
    assert first.alive()
