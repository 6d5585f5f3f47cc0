"""A tiny HTTP upstream for the end-to-end tests, run as its own process.

``GET /`` answers with the server's name, so a test can tell which upstream Envoy picked;
``GET /slow?ms=N`` answers the same after sleeping N milliseconds, so a test can keep a request
in flight while it changes something (a hot restart, an endpoint removal). Only the standard
library is used, so that starting one costs a few tens of milliseconds.

``GET /status/NNN`` answers with that status code (and the name), so a test can make a route that
is valid and wrong: one that rewrites to ``/status/503`` sends every request to a failure. With
``--status N`` every ``GET /`` (and any other path but ``/connections``) answers N: an upstream
that is up and broken, for a route moved to a cluster that fails.

``GET /connections`` answers how many *other* connections are open (as a number), so a test can
tell when Envoy has stopped using this upstream: Envoy closes its connections to an endpoint once
every worker has applied the EDS update that removed it and the requests on them are done, while
its admin ``/clusters`` drops the endpoint as soon as the main thread has it (a worker may still
send to it a moment longer). A removed upstream is stopped only once that count is 0
(:meth:`processes.Upstream.retire`).

SIGTERM stops it gracefully, as a real service stops: it stops accepting (connections the kernel
had already accepted are still served, not reset), then waits (at most ``--drain-s`` seconds) until
its clients have closed their connections, so a request in flight still gets its answer, then
exits. Stopping at once instead would reset requests Envoy sent just before the removal (503s
under load, counted as ``upstream_cx_destroy_remote_with_active_rq``). A second SIGTERM ends the
drain.

Usage: ``python upstream.py --port N --name NAME [--drain-s S] [--status N]``
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


def _handler_for(name: str, status: int | None = None) -> type[BaseHTTPRequestHandler]:
    body = name.encode()

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 keeps Envoy's upstream connections alive, as a real service would.
        protocol_version = "HTTP/1.1"
        # The headers and the body go out in two writes: with Nagle's algorithm the body waits for
        # the ACK of the headers, which the peer delays (40 ms on Linux), so each connection
        # answered about 23 requests a second and the load tests ran at a fortieth of their rate.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if status is not None and url.path != "/connections":
                self._reply(status, body)
                return
            if url.path == "/slow":
                ms = int(parse_qs(url.query).get("ms", ["0"])[0])
                time.sleep(ms / 1000)
            elif url.path.startswith("/status/") and url.path[8:].isdigit() and 200 <= int(url.path[8:]) <= 599:
                self._reply(int(url.path[8:]), body)
                return
            elif url.path == "/connections":
                server = self.server
                assert isinstance(server, _Server)
                self._reply(200, str(server.open_connections() - 1).encode())
                return
            elif url.path != "/":
                self._reply(404, b"not found\n")
                return
            self._reply(200, body)

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the tests read Envoy's and pilotfish's logs, not this one

    return Handler


class _Server(ThreadingHTTPServer):
    """A thread per connection, counting open connections so a stop can wait for them."""

    # socketserver's listen backlog is 5. An endpoint added under load gets a burst of new
    # connections from Envoy at once (one per concurrent request); with a backlog of 5 the
    # kernel drops SYNs, the client retries after 1 s, and Envoy's 1 s connect timeout fires.
    request_queue_size = 256
    daemon_threads = True  # a connection still open after the drain must not keep the process

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open = 0
        self._changed = threading.Condition()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._changed:  # counted before its thread starts: a drain cannot miss it
            self._open += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._changed:
                self._open -= 1
                self._changed.notify_all()

    def open_connections(self) -> int:
        with self._changed:
            return self._open

    def serve_queued(self) -> None:
        """Serve the connections the kernel accepted that the loop has not taken yet (closing the
        listening socket would reset them, with the requests their clients already sent)."""
        self.socket.setblocking(False)
        while True:
            try:
                request, client_address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            request.setblocking(True)
            self.process_request(request, client_address)

    def drain(self, timeout: float) -> bool:
        """Wait until every connection is closed; False if some are still open after timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._open == 0, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--drain-s", type=float, default=5.0, help="on SIGTERM, wait at most this long for open connections to close"
    )
    parser.add_argument("--status", type=int, choices=range(200, 600), metavar="N", help="answer every request with N")
    args = parser.parse_args(argv)

    # SIGTERM is taken by this thread (sigwait), never delivered while the server thread is
    # between accepting a connection and handing it to its handler; then the loop is stopped
    # cleanly, what the kernel queued is served, the listening socket closed (no new
    # connections) and the open ones are given time to finish.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (inherited by the server thread)
    server = _Server((args.host, args.port), _handler_for(args.name, args.status))
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    signal.sigwait({signal.SIGTERM})
    server.shutdown()
    server.serve_queued()
    server.server_close()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a second SIGTERM ends the drain
    server.drain(args.drain_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
