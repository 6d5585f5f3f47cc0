"""The composition root: :func:`~pilotfish.app.serve.serve` builds the sources, the reconciler, the
xDS services, the HTTP APIs and the stores from :class:`~pilotfish.app.settings.ServeSettings` (one
dataclass per part), and runs them as components (:mod:`pilotfish.app.components`: started in
order, stopped in reverse; the concrete ones in :mod:`pilotfish.app.parts`).

May import every package below ``commands``; only ``commands`` (and the root's lazy names) import it.
"""

from pilotfish.app.serve import serve
from pilotfish.app.settings import ServeSettings

__all__ = ["ServeSettings", "serve"]
