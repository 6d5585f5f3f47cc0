"""gRPC xDS services and the ``serve`` entry point."""

from pilotfish.server.run import ServeSettings, serve
from pilotfish.server.xds import GRPC_OPTIONS, XdsServer, start_grpc_server

__all__ = ["GRPC_OPTIONS", "ServeSettings", "XdsServer", "serve", "start_grpc_server"]
