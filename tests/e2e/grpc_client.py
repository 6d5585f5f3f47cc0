"""A real proxyless gRPC client for the end-to-end tests, run as its own process.

It opens a channel to ``--target`` (``xds:///NAME``: grpcio's own xDS resolver, configured by the
bootstrap file that ``GRPC_XDS_BOOTSTRAP`` names) and calls the backends' ``Who`` method (see
grpc_backend.py) one call after another until SIGTERM, writing one line per call to ``--out``:
the name of the backend that answered, or ``ERROR <code> <details>`` (``--pause-ms``: a pause
after each call, to keep the rate, and the CPU it costs, down). Each line is flushed, so the
test reads the calls as they happen. It runs in its own process because grpcio keeps one xDS
client per process: a test's bootstrap must not leak into another test.

Usage: ``GRPC_XDS_BOOTSTRAP=FILE python grpc_client.py --target xds:///NAME --out FILE [--pause-ms N]``
"""

from __future__ import annotations

import argparse
import signal
import threading

import grpc

METHOD = "/pilotfish.test.Echo/Who"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline-s", type=float, default=5.0)
    parser.add_argument("--pause-ms", type=float, default=0.0)
    args = parser.parse_args()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with grpc.insecure_channel(args.target) as channel, open(args.out, "w", buffering=1) as out:
        who = channel.unary_unary(METHOD)
        # The first call waits for the xDS configuration (wait_for_ready): the client is started
        # before it has any; every later call must succeed at once.
        first = True
        while not stopping.is_set():
            try:
                answer = who(b"", timeout=args.deadline_s if not first else 30.0, wait_for_ready=first or None)
                out.write(answer.decode() + "\n")
            except grpc.RpcError as exc:
                out.write(f"ERROR {exc.code().name} {exc.details()}\n")
            first = False
            if args.pause_ms:
                stopping.wait(args.pause_ms / 1000)


if __name__ == "__main__":
    main()
