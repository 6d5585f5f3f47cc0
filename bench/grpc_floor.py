"""The floor a grpc.aio server sets on this machine, for comparison with pilotfish's fan-out.

A bare grpc.aio server (no xDS logic at all) holds N streams, each on its own connection like a
proxy's, sends every one of them a 4 KB message and waits until each has answered; repeated a few
rounds. Whatever pilotfish spends above this per push is its own cost; what is below it no Python
gRPC server on this machine can save.

    .venv/bin/python -m bench.grpc_floor --proxies 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from bench.procs import cpu_seconds, free_port

_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
_METHOD = "StreamAggregatedResources"


async def _serve(port: int, proxies: int, rounds: int) -> None:
    resource_ = any_pb2.Any(type_url="type.googleapis.com/floor", value=b"\x00" * 4096)
    payload = discovery_pb2.DiscoveryResponse(
        version_info="1", type_url="floor", nonce="1", resources=[resource_]
    ).SerializeToString()
    streams: list[grpc.aio.ServicerContext] = []
    answered = 0
    all_answered = asyncio.Event()
    finished = asyncio.Event()

    async def handler(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        nonlocal answered
        async for request in requests:  # DiscoveryRequest (xds-protos has no type stubs)
            if request.type_url == "go":
                for number in range(rounds):
                    answered = 0
                    all_answered.clear()
                    cpu, wall = cpu_seconds(os.getpid()), time.perf_counter()
                    loop = asyncio.get_running_loop()
                    writes = [loop.create_task(stream.write(payload)) for stream in streams]
                    await all_answered.wait()
                    await asyncio.gather(*writes)
                    print(
                        f"| {proxies} | {number + 1} | {(time.perf_counter() - wall) * 1e3:.0f} | "
                        f"{cpu_seconds(os.getpid()) - cpu:.3f} |",
                        flush=True,
                    )
                finished.set()
                return
            if request.response_nonce:
                answered += 1
                if answered == proxies:
                    all_answered.set()
            else:
                streams.append(context)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                _SERVICE,
                {
                    _METHOD: grpc.stream_stream_rpc_method_handler(
                        handler, request_deserializer=discovery_pb2.DiscoveryRequest.FromString
                    ),
                },
            )
        ]
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await finished.wait()
    await server.stop(1.0)


async def _proxies(port: int, proxies: int, rounds: int) -> None:
    connected = 0

    async def proxy() -> None:
        nonlocal connected
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url="floor"))
        connected += 1
        for _ in range(rounds):
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            await call.write(discovery_pb2.DiscoveryRequest(type_url="floor", response_nonce="1"))
        # Keep the stream open until the server ends it, so the last answer is surely delivered.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.read()
        await channel.close()

    tasks = [asyncio.create_task(proxy()) for _ in range(proxies)]
    async with asyncio.timeout(120):
        while connected < proxies:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the server register the last streams
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        control = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await control.write(discovery_pb2.DiscoveryRequest(type_url="go"))
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: the server process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.proxies, args.rounds))
        return 0
    import socket

    port = free_port()
    print("| streams | round | all answered ms | server CPU s |\n|---|---|---|---|", flush=True)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.grpc_floor",
            "--serve",
            str(port),
            "--proxies",
            str(args.proxies),
            "--rounds",
            str(args.rounds),
        ]
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(_proxies(port, args.proxies, args.rounds))
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
