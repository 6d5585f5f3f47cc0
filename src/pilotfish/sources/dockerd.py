"""Find and start a Docker engine with no network of its own, and tell when it answers: one
launcher core for tests/e2e and bench.

Theory of operation. pilotfish never starts a Docker engine (an operator runs one), but the
end-to-end tests and the benchmarks need a real one of their own: ``dockerd`` (Debian package
docker.io, run as root) with its data root, exec root, pid file and socket in the caller's
directories, and ``--bridge=none --iptables=false --ip6tables=false --ip-forward=false
--ip-masq=false``: no bridge, no private-range address, no firewall rule is made, so containers
run with ``--network host`` only. ``--live-restore`` keeps containers running while it restarts.
:func:`dockerd_argv` is that command line (optionally with a TCP listener that verifies client
certificates); :func:`answers` pings it on its socket; :func:`image_context` writes the build
context of the one image the callers use, ``FROM scratch`` with a static busybox (Debian package
busybox-static) and its applet links, so nothing is pulled from a registry.

The caller starts the process (and stops it by its PID), and builds the image with the ``docker``
CLI, so each keeps its own process bookkeeping: the tests' process group, the benchmarks' own;
once it has stopped the engine, :func:`unmount_under` undoes what the engine left mounted.

Plain blocking code, like :mod:`pilotfish.envoy` and :mod:`pilotfish.etcd.member`.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import subprocess
from pathlib import Path

__all__ = ["IMAGE", "DockerdNotFound", "answers", "dockerd_argv", "find_dockerd", "image_context", "unmount_under"]

IMAGE = "pilotfish-busybox"
"""The tag callers give the image built from :func:`image_context`."""


class DockerdNotFound(RuntimeError):
    """No ``dockerd``, ``docker`` CLI or static busybox here; the message says what to install."""


def find_dockerd() -> tuple[str, str]:
    """``dockerd`` and the ``docker`` CLI on PATH."""
    dockerd, cli = shutil.which("dockerd"), shutil.which("docker")
    if dockerd is None or cli is None:
        raise DockerdNotFound("no dockerd or docker on PATH: apt-get install docker.io (make setup does)")
    return dockerd, cli


def _static_busybox() -> Path:
    for candidate in ("/usr/bin/busybox", "/bin/busybox"):
        path = Path(candidate)
        if path.exists():
            linked = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
            if "not a dynamic executable" in linked.stdout + linked.stderr:
                return path
    raise DockerdNotFound("no static busybox: apt-get install busybox-static (make setup does)")


def dockerd_argv(
    dockerd: str,
    *,
    root: Path,
    data_root: Path,
    tcp: tuple[int, Path, Path, Path] | None = None,
    socket_path: Path | None = None,
) -> list[str]:
    """The command line of an engine whose socket is ``socket_path`` (default ``root/docker.sock``;
    keep ``root`` short: a socket path has at most 107 bytes), its exec root and pid file in
    ``root``, its images and containers in ``data_root``; ``tcp``: (port, CA, certificate, key) of
    a listener on 127.0.0.1 that takes only clients with a certificate the CA signed."""
    argv = [
        dockerd,
        "--host",
        f"unix://{socket_path or root / 'docker.sock'}",
        "--data-root",
        str(data_root),
        "--exec-root",
        str(root / "exec"),
        "--pidfile",
        str(root / "docker.pid"),
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-forward=false",
        "--ip-masq=false",
        "--live-restore",
    ]
    if tcp is not None:
        port, ca, cert, key = tcp
        argv += ["--host", f"tcp://127.0.0.1:{port}", "--tlsverify"]
        argv += ["--tlscacert", str(ca), "--tlscert", str(cert), "--tlskey", str(key)]
    return argv


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def answers(socket_path: Path, *, timeout: float = 2.0) -> bool:
    """Whether the engine on ``socket_path`` answers ``GET /_ping``."""
    connection = _UnixConnection(socket_path, timeout)
    try:
        connection.request("GET", "/_ping")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def image_context(directory: Path) -> Path:
    """Write the build context of :data:`IMAGE` into ``directory`` (made); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(_static_busybox(), directory / "busybox")
    (directory / "Dockerfile").write_text(
        'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
    )
    return directory


def unmount_under(*directories: Path) -> None:
    """Unmount what a stopped engine left mounted under ``directories`` (deepest first): it
    bind-mounts its data root onto itself and keeps a network namespace under its exec root, and
    one stopped with containers running (``--live-restore``) leaves them. Call it once the engine
    has exited, before removing the directories."""
    ours = tuple(str(d) for d in directories)
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(ours)), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
