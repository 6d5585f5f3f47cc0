"""The same GrpcServer adapter on either HTTP/2 core (the HTTP/2 core comparison): a grpcio client is served
alike by pilotfish's own core and by the `h2` package baseline (bench/h2_package_core.py).

What the comparison relies on: through ``GrpcServer(connection_factory=...)`` each core answers
real gRPC calls whole and in order (messages larger than a frame and than the default windows
included), ends them with the right status, and holds the message size limit.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.h2_core_launch import CORES, core_factory  # noqa: E402

from pilotfish.transport.aio import Call, GrpcServer  # noqa: E402
from pilotfish.transport.h2 import Limits  # noqa: E402

_PATH = "/test.Echo/Stream"


class _Echo:
    def __init__(self, call: Call) -> None:
        self.call = call

    def on_message(self, data: bytes) -> None:
        self.call.send(data[:1], data[1:])  # two parts, as the xDS server sends (prefix, nonce)

    def on_half_close(self) -> None:
        pass

    def on_closed(self, reason: str) -> None:
        pass


async def _serve(core: str, limits: Limits | None = None) -> tuple[GrpcServer, str]:
    server = GrpcServer({_PATH: _Echo}, limits=limits, connection_factory=core_factory(core))
    port = await server.start("127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


async def _echo(address: str, messages: list[bytes]) -> tuple[list[bytes], grpc.StatusCode]:
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        method = channel.stream_stream(_PATH)

        async def requests() -> AsyncIterator[bytes]:
            for message in messages:
                yield message

        call = method(requests())
        answers = []
        try:
            async for answer in call:
                answers.append(bytes(answer))
        except grpc.aio.AioRpcError as exc:
            return answers, exc.code()
        return answers, await call.code()


@pytest.mark.parametrize("core", CORES)
async def test_either_core_answers_every_message_whole_and_in_order(core: str) -> None:
    server, address = await _serve(core)
    try:
        messages = [b"one", bytes(range(256)) * 400, b"x" * 3_000_000, b"", b"last"]
        answers, code = await _echo(address, messages)
        assert answers == messages
        assert code == grpc.StatusCode.OK
    finally:
        await server.stop(1.0)


@pytest.mark.parametrize("core", CORES)
async def test_either_core_refuses_a_message_over_the_size_limit(core: str) -> None:
    server, address = await _serve(core, Limits(max_message_size=10_000))
    try:
        answers, code = await _echo(address, [b"small", b"y" * 20_000])
        assert answers == [b"small"]
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(1.0)
