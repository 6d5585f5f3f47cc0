"""The xDS services over the stream state machines of :mod:`pilotfish.protocol`: gRPC SotW and delta
(:mod:`~pilotfish.xds.server`) and REST xDS (:mod:`~pilotfish.xds.rest`), which share one
:class:`~pilotfish.xds.server.XdsPolicy` and see the cache through the Protocols of
:mod:`pilotfish.cache` (``ConfigWatcher``, ``ConfigFetcher``).

May import ``policy``, ``subsets`` and every layer below (the transport for bytes, the cache for
snapshots); never ``api``, ``app`` or ``commands``.
"""

from pilotfish.xds.rest import RestXds, start_rest_server
from pilotfish.xds.server import GrantsInForce, XdsPolicy, XdsServer, start_xds_server

__all__ = ["GrantsInForce", "RestXds", "XdsPolicy", "XdsServer", "start_rest_server", "start_xds_server"]
