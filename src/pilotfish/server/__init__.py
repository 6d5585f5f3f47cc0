"""xDS services (gRPC and REST) and the ``serve`` entry point."""

from pilotfish.server.rest import RestXds, start_rest_server
from pilotfish.server.run import ServeSettings, serve
from pilotfish.server.xds import XdsServer, start_xds_server

__all__ = ["RestXds", "ServeSettings", "XdsServer", "serve", "start_rest_server", "start_xds_server"]
