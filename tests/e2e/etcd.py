"""A real single-member etcd for the end-to-end tests, and writes to it through its JSON gateway.

:class:`Etcd` runs the ``etcd`` binary (Debian package etcd-server) on OS-chosen client and peer
ports with its data dir in the test's temp dir, through the test's :class:`ProcessGroup` (killed by
PID at teardown); the command line and the readiness check are :mod:`pilotfish.etcd.member`'s, which
bench/ uses too. :meth:`Etcd.restart` stops it and starts it again on the same data dir and
ports, as a restarted member would come back: its keys and revision survive. :meth:`Etcd.pause`
and :meth:`Etcd.resume` stall it (SIGSTOP) and let it go on (SIGCONT).

Keys are written with etcd's v3 JSON gateway (``POST /v3/kv/put``, ``/v3/kv/deleterange``; keys
and values base64), the same API pilotfish reads, so the tests need no etcd client library.
"""

from __future__ import annotations

import base64
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pilotfish.etcd.member import EtcdNotFound, find_etcd, member_argv, serves

from .processes import Process, ProcessGroup, free_port, http_json, port_accepts, wait_until

__all__ = ["Etcd", "etcd_binary"]


def etcd_binary() -> str:
    """The ``etcd`` on PATH; fail (never skip) saying how to get it."""
    try:
        return find_etcd()
    except EtcdNotFound as exc:
        pytest.fail(f"the etcd tests need a real etcd: {exc}", pytrace=False)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@dataclass
class Etcd:
    """One etcd member; ``runs`` holds each start of it (a restart adds one)."""

    group: ProcessGroup
    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    runs: list[Process] = field(default_factory=list)

    @classmethod
    def start(cls, group: ProcessGroup, *, name: str = "etcd", timeout: float = 20.0) -> Etcd:
        etcd = cls(group, name, group.workdir / f"{name}.data", free_port(), free_port())
        etcd.run(timeout=timeout)
        return etcd

    @property
    def address(self) -> str:
        """``host:port`` of the client API (what ``pilotfish serve --etcd`` takes)."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def process(self) -> Process:
        return self.runs[-1]

    def _argv(self) -> list[str]:
        # On a restart the data dir already holds the membership and etcd ignores the --initial-* flags.
        return member_argv(
            etcd_binary(),
            name=self.name,
            data_dir=self.data_dir,
            client_port=self.client_port,
            peer_port=self.peer_port,
            token="pilotfish-e2e",
        )

    def run(self, *, timeout: float = 20.0) -> None:
        """Start (or start again) and wait until the JSON gateway answers a read."""
        if self.runs and self.process.alive():
            raise RuntimeError(f"{self.name} is already running")
        process = self.group.start(self.name, self._argv())
        self.runs.append(process)

        def ready() -> bool:
            if not process.alive():
                pytest.fail(
                    f"{self.name} exited with {process.popen.returncode}\n{process.output_tail()}", pytrace=False
                )
            return serves(self.address)

        wait_until(ready, timeout=timeout, what=f"{self.name} to serve on {self.address}", details=process.output_tail)

    def stop(self) -> None:
        """SIGTERM and wait until its client port is closed."""
        self.process.stop()
        wait_until(
            lambda: not port_accepts(self.client_port),
            timeout=10,
            what=f"{self.name}'s client port {self.client_port} to close",
        )

    def pause(self) -> None:
        """SIGSTOP: the process stays, its sockets stay open and the kernel still accepts
        connections, but nothing answers (a stalled etcd: a hung disk, a paused VM)."""
        self.process.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused etcd goes on where it stopped."""
        self.process.popen.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop, then start again on the same data dir and ports."""
        self.stop()
        self.run()

    # -- keys ---------------------------------------------------------------------------------

    def put(self, key: str, value: str) -> int:
        """Write a raw value; return the revision it was written at."""
        answer = self._post_ok("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
        return int(answer["header"]["revision"])

    def put_json(self, key: str, value: Any) -> int:
        return self.put(key, json.dumps(value))

    def get_json(self, key: str) -> Any:
        """The JSON value of ``key`` (None: no such key)."""
        kvs = self._post_ok("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    def delete(self, key: str) -> int:
        """Delete one key; return how many keys were deleted (0 or 1)."""
        answer = self._post_ok("/v3/kv/deleterange", {"key": _b64(key)})
        return int(answer.get("deleted", 0))

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return http_json("POST", f"http://{self.address}{path}", body)

    def _post_ok(self, path: str, body: dict[str, Any]) -> Any:
        status, answer = self._post(path, body)
        if status != 200:
            raise RuntimeError(f"etcd {path} answered {status}: {answer}")
        return answer
