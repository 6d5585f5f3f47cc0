"""Find and start a single-member etcd, and tell when it serves: one launcher core for tests/e2e and bench.

Theory of operation. pilotfish never starts etcd itself (an operator runs it), but the end-to-end
tests and the benchmarks need a real one of their own: the ``etcd`` binary (Debian package
etcd-server) on client and peer ports the caller chose, with its data dir in the caller's temp dir.
:func:`member_argv` is that command line; the member name and cluster token carry the peer port,
so two members started side by side never take each other for peers. Started again on the same
data dir, etcd ignores the ``--initial-*`` flags and comes back with its keys and revision.

:func:`serves` asks etcd's v3 JSON gateway (the API pilotfish reads) for a range: etcd serves once
it answers. The caller starts the process (and stops it by its PID), so each keeps its own process
bookkeeping: the tests' process group, the benchmarks' own.

Plain blocking code, like :mod:`pilotfish.envoy`: no asyncio, grpc or aiohttp.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["EtcdNotFound", "find_etcd", "member_argv", "serves"]

# Every request goes to a loopback address, whatever proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdNotFound(Exception):
    """No ``etcd`` binary on PATH."""


def find_etcd() -> str:
    """The ``etcd`` binary on PATH."""
    found = shutil.which("etcd")
    if found is None:
        raise EtcdNotFound("no `etcd` on PATH: install the Debian package etcd-server (make setup does)")
    return found


def member_argv(
    binary: str, *, name: str, data_dir: Path, client_port: int, peer_port: int, token: str = "pilotfish"
) -> list[str]:
    """A single-member etcd on 127.0.0.1 (see the module docstring); ``token`` prefixes the cluster token."""
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    member = f"{name}-{peer_port}"
    return [
        binary,
        "--name", member,
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{member}={peer}",
        "--initial-cluster-token", f"{token}-{peer_port}",
        "--initial-cluster-state", "new",
    ]  # fmt: skip


def serves(address: str, *, timeout: float = 2.0) -> bool:
    """Whether etcd at ``host:port`` answers a read through its JSON gateway."""
    body = json.dumps({"key": base64.b64encode(b"/").decode()}).encode()
    request = urllib.request.Request(
        f"http://{address}/v3/kv/range", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status == 200 and "header" in json.loads(response.read())
    except (OSError, ValueError, urllib.error.HTTPError):
        return False
