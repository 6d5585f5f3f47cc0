"""The reconcile loop: desired state from sources -> checked snapshot in the cache.

Sources report whole views of what they know (:meth:`Reconciler.update`). The loop
(:mod:`~pilotfish.reconcile.loop`, :class:`Reconciler`) composes small parts, each testable alone:

1. **debounces** (:mod:`~pilotfish.reconcile.debounce`), each service on its own clock: a change
   to a service that was quiet for ``quiet`` seconds is built at once; one that changes again
   within ``quiet`` is gathered and built once quiet, or ``max_delay`` after its burst's first
   change. Builds start at most ``max_builds_per_s`` times a second and never overlap; a change
   during a build is picked up right after it; a change that leaves the content as it was costs
   nothing. Worst case latency: max_delay plus the build interval plus two builds.
2. **damps flapping endpoints** (:mod:`~pilotfish.reconcile.damping`): an endpoint that
   disappears is removed at once; one that comes back soon after is re-added only once it has
   stayed for ``hold`` seconds.
3. **builds and checks** the snapshot; one that fails keeps the last good snapshot serving and
   is reported. A snapshot whose content hash equals the current one is not handed over.
4. **keeps the last good addresses of host names** (:mod:`~pilotfish.reconcile.names`): the names
   of DNS services are looked up; one that stops resolving is reported and served by the
   addresses it last resolved to, until it resolves again.
5. **waits for every source** (:mod:`~pilotfish.reconcile.readiness`) named in ``expect`` to report
   its first complete state before anything is published.
6. **guards the blast radius** (:mod:`~pilotfish.reconcile.guard`): a snapshot that would remove
   too much at once is held until the operator confirms it or a later change makes it harmless.
7. **serves every node group** its own snapshot, all built in one pass from the same merged state:
   a problem, or a held snapshot, in any group stops the whole pass.
8. **admits** (:mod:`~pilotfish.reconcile.admission`): a source's proposed state is checked
   against the others' without publishing (:meth:`Reconciler.check`).
9. **plans** (:mod:`~pilotfish.reconcile.plan`): what a source's proposed state would do, per
   group and type, field by field, and whether it would be refused or held, publishing nothing
   (:meth:`Reconciler.plan`, ``pilotfish plan``).

The subsetting backend tables it builds with are :mod:`~pilotfish.reconcile.tables`; its counters
:mod:`~pilotfish.reconcile.stats`; what readers see of it, :class:`PublishState`
(:mod:`~pilotfish.reconcile.view`). The timing parts are pure: they take ``now`` as an argument and
never sleep, so tests drive them with plain numbers.

This package may import the cache, status, the sources' data types and the layers below; never a
service, a store or an API.
"""

from __future__ import annotations

from pilotfish.reconcile.admission import Admission
from pilotfish.reconcile.damping import Damping, FlapDamper
from pilotfish.reconcile.debounce import Clock, Debouncer, DebounceSettings, MonotonicClock
from pilotfish.reconcile.guard import Guard, GuardSettings, Held, blast_radius
from pilotfish.reconcile.loop import BuildOptions, Reconciler, SubsetOptions
from pilotfish.reconcile.names import LastGoodNames, NameFigures, NameSettings, Resolver, SystemResolver
from pilotfish.reconcile.plan import Plan
from pilotfish.reconcile.readiness import Readiness, ReadinessView
from pilotfish.reconcile.stats import ReconcileStats
from pilotfish.reconcile.tables import SubsetTables
from pilotfish.reconcile.view import PublishState

__all__ = [
    "Admission",
    "BuildOptions",
    "Clock",
    "Damping",
    "DebounceSettings",
    "Debouncer",
    "FlapDamper",
    "Guard",
    "GuardSettings",
    "Held",
    "LastGoodNames",
    "MonotonicClock",
    "NameFigures",
    "NameSettings",
    "Plan",
    "PublishState",
    "Readiness",
    "ReadinessView",
    "ReconcileStats",
    "Reconciler",
    "Resolver",
    "SubsetOptions",
    "SubsetTables",
    "SystemResolver",
    "blast_radius",
]
