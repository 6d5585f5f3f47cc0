"""pilotfish: an Envoy control plane written in Python.

    from pilotfish import Snapshot, SnapshotCache, XdsServer, serve
"""

from pilotfish.app import ServeSettings, serve
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError, PeerError, PilotfishError, Problem
from pilotfish.reconcile import DebounceSettings, Reconciler
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.snapshot import Snapshot
from pilotfish.sources import load_snapshot
from pilotfish.xds import XdsServer

__all__ = [
    "ConfigError",
    "DebounceSettings",
    "DesiredState",
    "Endpoint",
    "PeerError",
    "PilotfishError",
    "Problem",
    "Reconciler",
    "ServeSettings",
    "ServiceSpec",
    "Snapshot",
    "SnapshotCache",
    "XdsServer",
    "load_snapshot",
    "serve",
]
__version__ = "0.1.0"
