"""A tiny HTTP upstream for the end-to-end tests, run as its own process.

``GET /`` answers with the server's name, so a test can tell which upstream Envoy picked;
``GET /slow?ms=N`` answers the same after sleeping N milliseconds, so a test can keep a request
in flight while it changes something (a hot restart, an endpoint removal). Only the standard
library is used, so that starting one costs a few tens of milliseconds.

Usage: ``python upstream.py --port N --name NAME``
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def _handler_for(name: str) -> type[BaseHTTPRequestHandler]:
    body = name.encode()

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 keeps Envoy's upstream connections alive, as a real service would.
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/slow":
                ms = int(parse_qs(url.query).get("ms", ["0"])[0])
                time.sleep(ms / 1000)
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
    # socketserver's listen backlog is 5. An endpoint added under load gets a burst of new
    # connections from Envoy at once (one per concurrent request); with a backlog of 5 the
    # kernel drops SYNs, the client retries after 1 s, and Envoy's 1 s connect timeout fires.
    request_queue_size = 256


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)

    server = _Server((args.host, args.port), _handler_for(args.name))
    server.daemon_threads = True
    # SIGTERM ends serve_forever() through KeyboardInterrupt, so the socket is closed cleanly.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
