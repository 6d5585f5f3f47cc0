"""pilotfish: an Envoy control plane written in Python.

    from pilotfish import Snapshot, SnapshotCache, XdsServer, serve

The public names are loaded on first use (PEP 562 ``__getattr__``): ``import pilotfish`` imports
no server, no aiohttp and no grpc, so a command that needs none of them starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pilotfish.app import ServeSettings, serve
    from pilotfish.build.desired import DesiredState
    from pilotfish.cache import SnapshotCache
    from pilotfish.errors import ConfigError, PeerError, PilotfishError, Problem
    from pilotfish.reconcile import DebounceSettings, Reconciler
    from pilotfish.resources.services import Endpoint, ServiceSpec
    from pilotfish.snapshot import Snapshot
    from pilotfish.sources import load_snapshot
    from pilotfish.xds import XdsServer

_WHERE = {
    "ConfigError": "pilotfish.errors",
    "DebounceSettings": "pilotfish.reconcile",
    "DesiredState": "pilotfish.build.desired",
    "Endpoint": "pilotfish.resources.services",
    "PeerError": "pilotfish.errors",
    "PilotfishError": "pilotfish.errors",
    "Problem": "pilotfish.errors",
    "Reconciler": "pilotfish.reconcile",
    "ServeSettings": "pilotfish.app",
    "ServiceSpec": "pilotfish.resources.services",
    "Snapshot": "pilotfish.snapshot",
    "SnapshotCache": "pilotfish.cache",
    "XdsServer": "pilotfish.xds",
    "load_snapshot": "pilotfish.sources",
    "serve": "pilotfish.app",
}
"""Where each public name lives: imported from there on first use."""

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pilotfish' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup finds it without calling here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
