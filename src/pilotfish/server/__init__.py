"""gRPC xDS services and the ``serve`` entry point."""

from pilotfish.server.run import ServeSettings, serve
from pilotfish.server.xds import XdsServer, start_xds_server

__all__ = ["ServeSettings", "XdsServer", "serve", "start_xds_server"]
