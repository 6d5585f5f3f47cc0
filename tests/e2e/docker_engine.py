"""A real Docker engine for the end-to-end tests, with no network of its own.

:class:`DockerDaemon` runs ``dockerd`` (Debian package docker.io; the tests run as root, as CI does)
through the test's :class:`ProcessGroup`, with its own data root, exec root, pid file and socket,
and no network of its own: every container runs with ``--network host`` and listens on 127.0.0.1
only. ``--live-restore`` keeps containers running while the daemon restarts
(:meth:`DockerDaemon.restart`), as a production engine configured for upgrades does. Run
``unseen``, it listens on another socket (and no TCP port): its clients (pilotfish) cannot reach
it, while the test works with it (:meth:`DockerDaemon.cli` speaks to the socket it listens on).

The command line, the readiness ping and the one image's build context are
:mod:`pilotfish.sources.dockerd`'s, which bench/ uses too: ``FROM scratch``, a static busybox
(Debian package busybox-static) and its applet links; nothing is pulled.
:meth:`DockerDaemon.run_httpd` starts a container serving HTTP on a port of 127.0.0.1 whose
answers name it, with the labels given, optionally a HEALTHCHECK (healthy while a file exists:
:meth:`DockerDaemon.set_healthy`), and a stop that drains: on SIGTERM it keeps serving
``drain_s`` seconds, then exits (what a well-behaved service does).

At teardown every container is removed (``docker rm -f``), then the daemon is stopped with SIGTERM
and waited for (SIGKILL after 20 s), and what it left mounted under its directories is unmounted,
so no container, shim or mount outlives the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pilotfish.sources.dockerd import (
    IMAGE,
    DockerdNotFound,
    answers,
    dockerd_argv,
    find_dockerd,
    image_context,
    unmount_under,
)

from .processes import Process, ProcessGroup, free_port, wait_until

__all__ = ["DockerDaemon", "TlsFiles"]

_DRAINING_HTTPD = (
    # PID 1 gets SIGTERM only with a handler: the trap keeps httpd serving a while, then stops it.
    'mkdir -p /www && echo "$NAME" > /www/index.html && '
    'httpd -f -p "127.0.0.1:$PORT" -h /www & pid=$!; '
    'trap "sleep $DRAIN; kill $pid; exit 0" TERM; wait $pid'
)


def _binaries() -> tuple[str, str]:
    """``dockerd`` and ``docker``; fail (never skip) saying how to get them."""
    try:
        return find_dockerd()
    except DockerdNotFound as exc:
        pytest.fail(f"the Docker tests need a real engine: {exc}", pytrace=False)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA both sides trust, and one side's certificate and key."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class DockerDaemon:
    """One ``dockerd``; ``runs`` holds each start of it (a restart adds one)."""

    group: ProcessGroup
    root: Path
    """A short directory of its own (socket paths are limited to 107 bytes): exec root, socket."""
    data_root: Path
    runs: list[Process] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    tls: TlsFiles | None = None
    """With TLS files, it also listens on ``tcp://127.0.0.1:<tcp_port>``, verifying clients."""
    tcp_port: int = 0
    listening: Path | None = None
    """The socket the running daemon listens on (:attr:`socket`, or another one when unseen)."""

    @classmethod
    def start(
        cls, group: ProcessGroup, *, name: str = "docker", tls: TlsFiles | None = None, timeout: float = 60.0
    ) -> DockerDaemon:
        root = Path(tempfile.mkdtemp(prefix="pfdk", dir="/tmp"))
        daemon = cls(group, root, group.workdir / f"{name}-data", tls=tls, tcp_port=free_port() if tls else 0)
        daemon.run(timeout=timeout)
        daemon._build_image()
        return daemon

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def url(self) -> str:
        """What ``pilotfish serve --docker`` takes."""
        return f"unix://{self.socket}"

    @property
    def tcp_url(self) -> str:
        """Its TLS listener, as ``pilotfish serve --docker`` takes it."""
        return f"tcp://127.0.0.1:{self.tcp_port}"

    @property
    def process(self) -> Process:
        return self.runs[-1]

    def _argv(self, socket_path: Path, *, unseen: bool) -> list[str]:
        tcp = None if self.tls is None or unseen else (self.tcp_port, self.tls.ca, self.tls.cert, self.tls.key)
        return dockerd_argv(_binaries()[0], root=self.root, data_root=self.data_root, tcp=tcp, socket_path=socket_path)

    def run(self, *, timeout: float = 60.0, unseen: bool = False) -> None:
        """Start (or start again) and wait until it answers; ``unseen``: on a socket of another
        name and no TCP port, so that nothing that knows :attr:`url` reaches it."""
        if self.runs and self.process.alive():
            raise RuntimeError("dockerd is already running")
        listening = self.root / "unseen.sock" if unseen else self.socket
        process = self.group.start("dockerd", self._argv(listening, unseen=unseen))
        self.runs.append(process)
        self.listening = listening

        def ready() -> bool:
            if not process.alive():
                pytest.fail(f"dockerd exited with {process.popen.returncode}\n{process.output_tail()}", pytrace=False)
            return answers(listening)

        wait_until(ready, timeout=timeout, what=f"dockerd to answer on {listening}", details=process.output_tail)

    def stop(self) -> None:
        """SIGTERM and wait (its containers go on running: ``--live-restore``)."""
        self.process.stop(timeout=20.0)
        if self.listening is not None:
            self.listening.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.run()

    def _cli_env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.root / "cli")}

    def cli(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [_binaries()[1], "--host", f"unix://{self.listening or self.socket}", *args],
            capture_output=True,
            text=True,
            env=self._cli_env(),
            timeout=timeout,
        )
        if check and result.returncode != 0:
            pytest.fail(f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stderr}", pytrace=False)
        return result

    def _build_image(self) -> None:
        try:
            context = image_context(self.root / "image")
        except DockerdNotFound as exc:
            pytest.fail(f"the Docker tests need a static busybox: {exc}", pytrace=False)
        self.cli("build", "--quiet", "--tag", IMAGE, str(context), timeout=120)

    def run_httpd(
        self,
        name: str,
        port: int,
        labels: dict[str, str],
        *,
        health: bool = False,
        drain_s: float = 1.0,
    ) -> str:
        """Start a container ``name`` answering its name over HTTP on 127.0.0.1:``port``; with
        ``health``, a HEALTHCHECK that passes while :meth:`set_healthy` says so (unhealthy at first).
        Returns its id."""
        argv = ["run", "--detach", "--name", name, "--network", "host", "--stop-timeout", "20"]
        argv += ["--env", f"NAME={name}", "--env", f"PORT={port}", "--env", f"DRAIN={drain_s:g}"]
        for key, value in labels.items():
            argv += ["--label", f"{key}={value}"]
        if health:
            argv += ["--health-cmd", "test -f /www/healthy", "--health-interval", "1s", "--health-retries", "1"]
            argv += ["--health-start-period", "0s", "--health-timeout", "1s"]
        argv += [IMAGE, "sh", "-c", _DRAINING_HTTPD]
        container = self.cli(*argv).stdout.strip()
        self.containers.append(container)
        return container

    def cli_in_background(self, *args: str) -> subprocess.Popen[bytes]:
        """A docker command that may take a while (``stop`` waits for the container to exit)."""
        return subprocess.Popen(
            [_binaries()[1], "--host", f"unix://{self.listening or self.socket}", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._cli_env(),
        )

    def running(self, name: str) -> bool:
        return self.cli("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true"

    def set_healthy(self, name: str, healthy: bool) -> None:
        self.cli("exec", name, "sh", "-c", "touch /www/healthy" if healthy else "rm -f /www/healthy")

    def health(self, name: str) -> str:
        return self.cli("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip()

    def close(self) -> None:
        """Remove every container, stop the daemon, remove its directory."""
        if self.containers and self.runs and not self.process.alive():
            with contextlib.suppress(BaseException):  # (containers live on without it: --live-restore)
                self.run(timeout=30.0)
        with contextlib.suppress(subprocess.SubprocessError):
            if self.runs and self.process.alive():
                listed = self.cli("ps", "--all", "--quiet", check=False).stdout.split()
                if listed:
                    self.cli("rm", "--force", *listed, check=False)
        if self.runs:
            self.process.stop(timeout=20.0)
        unmount_under(self.data_root, self.root)
        shutil.rmtree(self.root, ignore_errors=True)
