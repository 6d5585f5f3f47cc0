"""A worker process of the fleet: some proxies, driven by commands from the coordinator.

Started by the coordinator as ``python -m bench.fleet.worker FD`` (a fresh interpreter; FD is its
end of a socketpair). Each command (``start``, ``wait``, ``errors``, ``bytes``, ``churn``,
``churned``, ``streams``, ``lrs_start``, ``lrs_stop``, ``lrs_counts``, ``stop``) is a ``cmd_``
coroutine; a wait is answered by counting down ACKs (:class:`_Waiter`), or load reporting streams
answered, never by polling the proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import sys
import time
from collections import Counter
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from bench.fleet.lrs import LoadReporter
from bench.fleet.messages import ChurnCounts, ErrorReport, FleetTls, LrsCounts, LrsLoad, StreamReport
from bench.fleet.proxy import DeltaHoldings, DeltaProxy, Names, SotwProxy, envoy_like_node
from bench.procs import raise_fd_limit

__all__ = ["main"]


class _Waiter:
    """Counts down proxies until each has ACKed ``versions`` (or is synced, when None)."""

    def __init__(self, versions: dict[str, str] | None, since: float, proxies: Iterable[SotwProxy]) -> None:
        self.versions = versions
        self.since = since
        self.remaining = {p.index for p in proxies if not self.done(p)}
        self.event = asyncio.Event()
        if not self.remaining:
            self.event.set()

    def done(self, proxy: SotwProxy) -> bool:
        return self.time_of(proxy) is not None

    def time_of(self, proxy: SotwProxy) -> float | None:
        # Called for every ACK (and every proxy, twice per wait): plain loops, no temporaries.
        if self.versions is None:
            return proxy.synced_at
        latest = self.since
        for type_url, version in self.versions.items():
            at = proxy.acks.get(type_url, {}).get(version)
            if at is None or at < self.since:
                return None
            latest = max(latest, at)
        return latest

    def on_ack(self, proxy: SotwProxy) -> None:
        if proxy.index in self.remaining and self.done(proxy):
            self.remaining.discard(proxy.index)
            if not self.remaining:
                self.event.set()


class _Worker:
    """A worker process: some proxies, driven by commands from the coordinator's pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.proxies: list[SotwProxy] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.names = Names()
        self.holdings = DeltaHoldings()
        self.waiters: list[_Waiter] = []
        self.error_details: dict[str, str] = {}
        """One example message per gRPC status seen."""
        self._tls_context: ssl.SSLContext | None = None
        self.churn = ChurnCounts()
        self._churn_task: asyncio.Task[None] | None = None
        self.targets: list[str] = []
        """The servers the proxies connect to (proxy i: ``targets[i % len(targets)]``)."""
        self.client = "h2"
        self.tls: FleetTls | None = None
        self.reporters: list[tuple[LoadReporter, asyncio.Task[None]]] = []
        """The proxies' load reporting streams (``lrs_start``), until ``lrs_stop``."""
        self.lrs_done = LrsCounts()
        """Counts of the reporters ``lrs_stop`` ended."""
        self._lrs_waiting: asyncio.Event | None = None

    def tls_context(self, tls: FleetTls) -> ssl.SSLContext:
        """The worker's one client TLS context (ALPN h2), built from ``tls``'s files on first use."""
        if self._tls_context is None:
            from bench.h2client import client_context

            self._tls_context = client_context(ca=tls.ca, cert=tls.cert, key=tls.key)
        return self._tls_context

    def on_ack(self, proxy: SotwProxy) -> None:
        for waiter in self.waiters:
            waiter.on_ack(proxy)
        if proxy.on_synced is not None and proxy.synced_at is not None:
            proxy.on_synced.set()

    def on_lrs_answered(self, reporter: LoadReporter) -> None:
        if self._lrs_waiting is not None and all(r.answered for r, _ in self.reporters):
            self._lrs_waiting.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        def receive() -> None:
            try:
                inbox.put_nowait(self.conn.recv())
            except (EOFError, OSError):  # the coordinator is gone: stop
                loop.remove_reader(self.conn.fileno())
                inbox.put_nowait(("stop", {}))

        loop.add_reader(self.conn.fileno(), receive)
        while True:
            command, args = await inbox.get()
            try:
                if command == "stop":
                    await self.stop()
                    with contextlib.suppress(OSError):
                        self.conn.send(("ok", None))
                    return
                result = await getattr(self, "cmd_" + command)(**args)
                self.conn.send(("ok", result))
            except Exception as exc:
                self.conn.send(("error", f"{type(exc).__name__}: {exc}"))

    async def cmd_start(
        self,
        targets: list[str],
        ids: list[tuple[int, str]],
        rate: float,
        client: str,
        tls: dict[str, str | None] | None = None,
        xds: str = "sotw",
        runtime_layers: tuple[str, ...] = (),
    ) -> int:
        """Start proxies ``ids`` (index, node id), proxy i connecting to ``targets[i % len(targets)]``;
        ``rate`` proxies per second (0: all at once); ``client``: ``h2`` or ``grpc``; ``tls``: a
        :class:`FleetTls` as a dict (None: plaintext); ``xds``: ``sotw`` or ``delta``;
        ``runtime_layers``: RTDS layers each proxy asks for (announcing that it takes TTLs)."""
        settings = FleetTls(**tls) if tls is not None else None  # type: ignore[arg-type]
        kind = DeltaProxy if xds == "delta" else SotwProxy
        self.targets, self.client, self.tls = targets, client, settings

        async def launch() -> None:
            for n, (index, node_id) in enumerate(ids):
                proxy = kind(index, node_id, self)
                if runtime_layers:
                    proxy.subscribe_runtime(tuple(runtime_layers))
                self.proxies.append(proxy)
                target = targets[index % len(targets)]
                self.tasks.append(asyncio.create_task(proxy.run(target, client, settings)))
                if rate > 0 and n % 50 == 49:
                    await asyncio.sleep(50 / rate)

        await launch()
        return len(ids)

    async def cmd_wait(
        self, versions: dict[str, str] | None, since: float, timeout: float, synced_only: bool = False
    ) -> list[tuple[int, float | None]]:
        """Wait until every proxy (``synced_only``: every proxy that has synced) ACKed ``versions``
        at or after ``since`` (None: is synced); (index, when) per proxy."""
        waiter = _Waiter(
            versions, since, [p for p in self.proxies if p.synced_at is not None] if synced_only else self.proxies
        )
        self.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self.waiters.remove(waiter)
        return [(p.index, waiter.time_of(p)) for p in self.proxies]

    async def cmd_errors(self, since: float) -> ErrorReport:
        """Errors (by gRPC status) of streams opened since ``since`` (epoch seconds), over all proxies."""
        counts: Counter[str] = Counter()
        for proxy in self.proxies:
            counts.update(code for at, code in proxy.errors if at >= since)
        return {"counts": dict(counts), "examples": self.error_details}

    async def cmd_bytes(self) -> list[tuple[int, int]]:
        """(index, bytes of responses received so far) per proxy."""
        return [(p.index, p.bytes_received) for p in self.proxies]

    async def cmd_churn(
        self,
        targets: list[str],
        ids: list[str],
        rate: float,
        client: str,
        xds: str = "sotw",
        envoy_node: bool = False,
        sync_timeout: float = 30.0,
        max_active: int = 0,
        node_every_request: bool = False,
    ) -> None:
        """Start churning in the background: proxies ``ids`` connect one after another, ``rate`` per
        second, and each leaves for good (its stream and connection closed) once it is synced, or
        after ``sync_timeout`` s; ``envoy_node``: their node is as large as Envoy's (see
        :func:`envoy_like_node`); ``node_every_request``: each request carries it (Envoy's default),
        not only a stream's first; ``max_active``: at most that many connected at once (0: no limit;
        the next waits, so a server slowed down by other work is not buried in connections).
        :meth:`cmd_churned` says how far it got."""
        if self._churn_task is not None:
            raise RuntimeError("this worker churns already")
        kind = DeltaProxy if xds == "delta" else SotwProxy
        counts = self.churn

        async def one(node_id: str, target: str) -> None:
            proxy = kind(-1, node_id, self)
            if envoy_node:
                proxy.node = envoy_like_node(node_id)
            proxy.node_every_request = node_every_request
            proxy.on_synced = asyncio.Event()
            task = asyncio.create_task(proxy.run(target, client, None))
            counts.active += 1
            try:
                await asyncio.wait_for(proxy.on_synced.wait(), sync_timeout)
                counts.synced += 1
            except TimeoutError:
                counts.never_synced += 1
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                counts.active -= 1
                counts.departed += 1

        slots = asyncio.Semaphore(max_active) if max_active > 0 else None

        async def run() -> None:
            lives: set[asyncio.Task[None]] = set()
            begin = time.monotonic()
            try:
                for n, node_id in enumerate(ids):
                    delay = begin + n / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if slots is not None:
                        await slots.acquire()
                    life = asyncio.create_task(one(node_id, targets[n % len(targets)]))
                    lives.add(life)
                    life.add_done_callback(lives.discard)
                    if slots is not None:
                        life.add_done_callback(lambda _: slots.release())
                    counts.started += 1
                while lives:
                    await asyncio.wait(set(lives))
            finally:
                for life in lives:
                    life.cancel()
                await asyncio.gather(*lives, return_exceptions=True)

        self._churn_task = asyncio.create_task(run())

    async def cmd_churned(self) -> dict[str, int]:
        """How far the churn got (:class:`ChurnCounts` as a dict)."""
        return dataclasses.asdict(self.churn)

    async def cmd_streams(self) -> StreamReport:
        return {"streams": sum(p.streams for p in self.proxies), "proxies": len(self.proxies)}

    async def cmd_lrs_start(self, load: dict[str, float], timeout: float) -> int:
        """Every proxy opens a load reporting stream to its server and reports ``load`` (an
        :class:`LrsLoad` as a dict) as the server asks (:mod:`bench.fleet.lrs`); answers once every
        stream has the server's response, or after ``timeout`` s: how many have."""
        if self.client != "h2":
            raise RuntimeError(f"load reports are simulated over the h2 client only, not {self.client!r}")
        if self.reporters:
            raise RuntimeError("this worker's proxies report load already (lrs_stop first)")
        settings = LrsLoad(**load)  # type: ignore[arg-type]
        tls = self.tls
        context = self.tls_context(tls) if tls is not None else None
        self._lrs_waiting = asyncio.Event()
        for proxy in self.proxies:
            reporter = LoadReporter(proxy, settings, self)
            target = self.targets[proxy.index % len(self.targets)]
            task = asyncio.create_task(reporter.run(target, context, tls.server_name if tls is not None else None))
            self.reporters.append((reporter, task))
        if not self.reporters:
            self._lrs_waiting.set()
        try:
            await asyncio.wait_for(self._lrs_waiting.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._lrs_waiting = None
        return sum(1 for r, _ in self.reporters if r.answered)

    async def cmd_lrs_stop(self) -> dict[str, Any]:
        """Close every load reporting stream (as an Envoy restarted without LRS); the counts so far."""
        reporters, self.reporters = self.reporters, []
        for _, task in reporters:
            task.cancel()
        await asyncio.gather(*(t for _, t in reporters), return_exceptions=True)
        for reporter, _ in reporters:
            self.lrs_done.add(self._counts_of([reporter]))
        self.lrs_done.reporting = self.lrs_done.answered = 0
        return await self.cmd_lrs_counts()

    async def cmd_lrs_counts(self) -> dict[str, Any]:
        """The load reporting counts (:class:`LrsCounts` as a dict): of the streams ``lrs_stop``
        ended and of those still open."""
        total = self._counts_of([r for r, _ in self.reporters])
        total.add(self.lrs_done)
        return dataclasses.asdict(total)

    @staticmethod
    def _counts_of(reporters: list[LoadReporter]) -> LrsCounts:
        counts = LrsCounts(reporting=len(reporters))
        errors: Counter[str] = Counter()
        for r in reporters:
            counts.answered += r.answered
            counts.streams += r.streams
            counts.reports += r.reports
            counts.report_bytes += r.report_bytes
            errors.update(r.errors)
        counts.errors = dict(errors)
        return counts

    async def stop(self) -> None:
        tasks = [
            *self.tasks,
            *(t for _, t in self.reporters),
            *([self._churn_task] if self._churn_task is not None else []),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(fd: int) -> None:
    raise_fd_limit()
    # asyncio's own loop: uvloop made no measurable difference to the workers' CPU (1,000 proxies,
    # h2 client: 0.11-0.12 CPU s per push either way; most of it is protobuf and socket syscalls).
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_Worker(Connection(fd)).run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
