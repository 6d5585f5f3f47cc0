"""A tiny gRPC backend for the end-to-end tests, run as its own process.

One unary method, ``/pilotfish.test.Echo/Who``, registered without protos (no serializers: the
request and response are raw bytes): it answers with the backend's name, so a test can tell which
backend a proxyless client picked. With ``--fail CODE`` it fails every call with that gRPC status
instead (e.g. ``UNAVAILABLE``): a backend that is up and broken.

SIGTERM stops it gracefully: the server stops accepting new calls and gives those in flight
``--drain-s`` seconds to finish.

Usage: ``python grpc_backend.py --port N --name NAME [--drain-s S] [--fail CODE]``
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from typing import Any

import grpc

METHOD = "/pilotfish.test.Echo/Who"
SERVICE, _, NAME = METHOD[1:].partition("/")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--fail", choices=[code.name for code in grpc.StatusCode if code is not grpc.StatusCode.OK])
    args = parser.parse_args()
    answer: bytes = args.name.encode()
    fail = None if args.fail is None else grpc.StatusCode[args.fail]

    def who(request: bytes, context: Any) -> bytes:
        if fail is not None:
            context.abort(fail, f"backend {args.name} fails every call")
        return answer

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.unary_unary_rpc_method_handler(who)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {NAME: handler}),))
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    stopping.wait()
    server.stop(args.drain_s).wait()


if __name__ == "__main__":
    main()
