"""The composition root: :func:`~pilotfish.app.serve.serve` wires the sources, the reconciler, the
xDS services, the HTTP APIs and the stores into one process, from :class:`~pilotfish.app.settings.ServeSettings`.

May import every package below ``commands``; only ``commands`` (and the root's lazy names) import it.
"""

from pilotfish.app.serve import serve
from pilotfish.app.settings import ServeSettings

__all__ = ["ServeSettings", "serve"]
