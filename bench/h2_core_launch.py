"""``pilotfish`` with a chosen HTTP/2 core: ``python -m bench.h2_core_launch --core own|h2 serve ...``.

The HTTP/2 core comparison (bench/h2_core_compare.py, and the abuse suite with
``PILOTFISH_ABUSE_CORE=h2``) runs ``pilotfish serve`` exactly as the CLI builds it, with one
difference: every xDS connection's HTTP/2 core is made by the factory named by ``--core`` (``own``:
:class:`pilotfish.transport.h2.Connection`, what production runs; ``h2``:
:class:`bench.h2_package_core.H2PackageConnection`). The factory reaches the server through
``GrpcServer(connection_factory=...)``, bound here to the name ``start_xds_server`` looks up, so the
rest of ``serve`` (sources, reconciler, TLS, registry API, event log) is the CLI's own code.
Production code never reads ``--core``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

from pilotfish.transport.aio import HTTP2Core
from pilotfish.transport.h2 import Connection

__all__ = ["CORES", "core_factory", "main"]

CORES = ("own", "h2")


def core_factory(core: str) -> Callable[..., HTTP2Core]:
    """The connection factory of ``core`` (one of :data:`CORES`)."""
    if core == "own":
        return Connection
    if core == "h2":
        from bench.h2_package_core import H2PackageConnection

        return H2PackageConnection
    raise ValueError(f"unknown HTTP/2 core {core!r} (choose from {', '.join(CORES)})")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    core = "own"
    if args[:1] == ["--core"] and len(args) > 1:
        core, args = args[1], args[2:]
    factory = core_factory(core)
    if core != "own":
        from pilotfish.transport import aio as grpc_server
        from pilotfish.xds import server as xds

        setattr(xds, "GrpcServer", functools.partial(grpc_server.GrpcServer, connection_factory=factory))  # noqa: B010
    from pilotfish.commands.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
