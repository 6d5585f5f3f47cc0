"""The subsetting backend index tables the reconciler builds with (see docs/architecture.md,
subsetting): one :class:`~pilotfish.build.subsetting.IndexTable` per subsetted service.

Alone (a state file, or memory), the reconciler allocates them: a build gives each new backend the
lowest free index, and the tables as last published are kept (:attr:`SubsetTables.tables`, the
state file saves them when :attr:`SubsetTables.changed` moves). On etcd they are *shared*: set from
outside (:meth:`SubsetTables.set_shared`, from the keys every replica reads), never allocated here,
so every replica builds with the same ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from pilotfish.build.desired import Merged, subset_tables
from pilotfish.build.subsetting import IndexTable

__all__ = ["SubsetTables"]


class SubsetTables:
    """The tables in force. ``default_size``: the subset size of services that set none (None:
    only those that do are subsetted)."""

    def __init__(
        self, tables: Mapping[str, IndexTable] | None = None, *, shared: bool = False, default_size: int | None = None
    ) -> None:
        self.tables: Mapping[str, IndexTable] = dict(tables or {})
        """The backend indices of each subsetted service, as last published (or as etcd has them)."""
        self.shared = shared
        self.default_size = default_size
        self.changed = 0
        """Counts the times :attr:`tables` changed (whoever persists them watches it)."""

    def for_build(self, merged: Merged, tables: Mapping[str, IndexTable] | None = None) -> Mapping[str, IndexTable]:
        """The tables ``merged`` is built with: :attr:`tables` (or ``tables``, as they were read
        earlier: a plan) with new backends allocated (alone), or as they are (shared). Pure."""
        start = self.tables if tables is None else tables
        return subset_tables(merged, start, default_size=self.default_size, allocate=not self.shared)

    def published(self, tables: Mapping[str, IndexTable]) -> None:
        """A build with ``tables`` was published: they are in force (alone; shared ones come from etcd)."""
        if tables != self.tables and not self.shared:
            self.tables = tables
            self.changed += 1

    def set_shared(self, tables: Mapping[str, IndexTable]) -> bool:
        """etcd's tables changed: build with them from now on. Whether they differ."""
        if tables == self.tables:
            return False
        self.tables = dict(tables)
        self.changed += 1
        return True
