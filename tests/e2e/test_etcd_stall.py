"""An etcd that stops answering without closing anything (SIGSTOP: its sockets stay open, the
kernel still accepts connections) is noticed within ``--etcd-keepalive-s``, reported as etcd lost,
and followed again when it resumes. A watch connection that goes dead while etcd is fine (a
middlebox dropped it, telling neither end) is noticed by the first change it fails to deliver.

Without the keepalive the watch (a long HTTP stream, silent while nothing changes) would wait on
the stalled etcd forever: nothing would be reported, and after the etcd resumed the replica would
only learn of changes if the old stream happened to still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from pilotfish.sources.etcd import EtcdSource

from .etcd import Etcd
from .event_log import is_event
from .processes import ProcessGroup, free_port, http_json, wait_until
from .replicas import etcd_replicas

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

KEEPALIVE_S = 3.0
SLACK_S = 2.0
"""What a busy machine may add to the keepalive (the probe's timer firing late, the log written on
the next turn of the event loop); still far below what a stall without keepalive takes: forever."""


def instance_ids(registry_url: str) -> list[str]:
    status, answer = http_json("GET", registry_url + "/v1/services/web")
    assert status == 200, answer
    return [i["id"] for i in answer["instances"]]


def test_a_stalled_etcd_is_reported_within_the_keepalive_and_followed_again_when_it_resumes(
    processes: ProcessGroup,
) -> None:
    etcd = Etcd.start(processes)
    etcd.put_json("/pilotfish/services/web", {"listen": f"127.0.0.1:{free_port()}", "protocol": "http"})
    etcd.put_json("/pilotfish/instances/web/a", {"address": "127.0.0.1", "port": 9001})
    (plane,) = etcd_replicas(processes, etcd, 1, options=("--quiet-ms", "50", "--etcd-keepalive-s", str(KEEPALIVE_S)))
    events = plane.events
    events.wait_for(is_event("snapshot_loaded"), what="the snapshot with web")
    assert instance_ids(plane.registry_url) == ["127.0.0.1:9001"]

    mark = events.mark()
    paused_at = time.time()
    etcd.pause()
    try:
        lost = events.wait_for(
            is_event("etcd_disconnected"), after=mark, timeout=KEEPALIVE_S + 10, what="the stalled etcd to be reported"
        )
        noticed = lost["ts"] - paused_at
        assert noticed <= KEEPALIVE_S + SLACK_S, f"noticed {noticed:.2f}s after the stall: {lost}"
        assert f"etcd at {etcd.address}" in lost["reason"], lost
        # /healthz says so too, and answers while etcd is stalled.
        status, health = http_json("GET", f"http://{plane.admin}/healthz", timeout=KEEPALIVE_S + 5)
        assert status == 200 and health["etcd"]["connected"] is False and health["etcd"]["problem"], health
        assert instance_ids(plane.registry_url) == ["127.0.0.1:9001"], "the last good state keeps serving"
        # Marked before the resume: a listing in flight at the stall is answered the moment etcd
        # goes on, and its event can be written before a mark taken after SIGCONT.
        resumed = events.mark()
    finally:
        etcd.resume()

    events.wait_for(is_event("etcd_synced"), after=resumed, timeout=20, what="the replica to list etcd again")
    built = events.mark()
    revision = etcd.put_json("/pilotfish/instances/web/b", {"address": "127.0.0.1", "port": 9002})
    events.wait_for(
        is_event("snapshot_loaded"),
        after=built,
        timeout=10,
        what="the change written after etcd resumed to reach the served snapshot",
    )
    assert instance_ids(plane.registry_url) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    wait_until(
        lambda: http_json("GET", f"http://{plane.admin}/healthz")[1]["etcd"].get("lag") == 0,
        timeout=10,
        what="the replica to report itself caught up",
        details=lambda: str(http_json("GET", f"http://{plane.admin}/healthz")[1]),
    )
    status, health = http_json("GET", f"http://{plane.admin}/healthz")
    assert health["etcd"]["connected"] is True and health["etcd"]["revision"] >= revision, health


class SilentMiddlebox:
    """A TCP relay to etcd that can drop its watch connections the way a middlebox (a NAT, a load
    balancer) does when it forgets them: the bytes stop in both directions, and neither end is told
    (no FIN, no RST). A fake, named so: the real thing needs root (iptables) on this machine."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.dropped = 0
        self._watches: list[dict[str, bool]] = []
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        """Every connection's both ends, closed at :meth:`stop` (left to the garbage collector, a
        writer of a closed loop warns in whatever test runs next)."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for writer in self._writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._server is not None:
            await self._server.wait_closed()

    def drop_watches(self) -> None:
        """From now on, nothing more passes on the watch connections open now."""
        for state in self._watches:
            state["dropped"] = True
            self.dropped += 1

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.append(client_writer)
        etcd_reader, etcd_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers.append(etcd_writer)
        state = {"dropped": False}
        first = await client_reader.read(65536)
        if first.startswith(b"POST /v3/watch"):
            self._watches.append(state)
        etcd_writer.write(first)
        await asyncio.gather(
            self._pipe(client_reader, etcd_writer, state), self._pipe(etcd_reader, client_writer, state)
        )

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not state["dropped"]:
                    writer.write(data)
                    await writer.drain()
        writer.close()


def test_a_watch_connection_dropped_silently_is_made_again_by_the_first_change_it_misses(
    processes: ProcessGroup,
) -> None:
    etcd = Etcd.start(processes)
    asyncio.run(_dropped_watch(etcd))


async def _dropped_watch(etcd: Etcd) -> None:
    middlebox = SilentMiddlebox(etcd.client_port)
    await middlebox.start()
    events: list[tuple[str, dict[str, Any]]] = []
    source = EtcdSource(
        f"127.0.0.1:{middlebox.port}",
        "/pilotfish/",
        on_state=lambda _: None,
        on_event=lambda name, **fields: events.append((name, fields)),
        keepalive=KEEPALIVE_S,
    )
    following = asyncio.create_task(source.run())

    async def seen(key: str, timeout: float) -> float:
        start = time.monotonic()
        async with asyncio.timeout(timeout):
            while key not in source.view.raw:
                await asyncio.sleep(0.02)
        return time.monotonic() - start

    try:
        await asyncio.to_thread(etcd.put_json, "/pilotfish/instances/web/a", {"address": "127.0.0.1", "port": 9001})
        await seen("/pilotfish/instances/web/a", 20)  # listed, or through the watch
        await asyncio.to_thread(etcd.put_json, "/pilotfish/instances/web/b", {"address": "127.0.0.1", "port": 9002})
        await seen("/pilotfish/instances/web/b", 10)  # through the watch: it works
        assert [name for name, _ in events] == ["etcd_synced"], events

        middlebox.drop_watches()
        assert middlebox.dropped == 1
        await asyncio.to_thread(etcd.put_json, "/pilotfish/instances/web/c", {"address": "127.0.0.1", "port": 9003})
        took = await seen("/pilotfish/instances/web/c", KEEPALIVE_S + 10)
        lost = [fields for name, fields in events if name == "etcd_disconnected"]
        assert lost and "did not deliver the change" in lost[0]["reason"], events
        assert [name for name, _ in events][-2:] == ["etcd_disconnected", "etcd_synced"], events
        assert took <= KEEPALIVE_S + SLACK_S, f"the missed change arrived {took:.2f}s after it was written"
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await middlebox.stop()
