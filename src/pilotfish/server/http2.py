"""The old name of :mod:`pilotfish.transport.frames` (HTTP/2 frame codecs), kept for the server,
the xDS services and the fleet simulator's client, which import it from here."""

from __future__ import annotations

from pilotfish.transport.frames import *  # noqa: F403
from pilotfish.transport.frames import __all__ as __all__
