"""Sources of desired state. Each is independent of the others."""

from pilotfish.sources.file import load_desired, load_snapshot, watch_file, watch_snapshot_file

__all__ = ["load_desired", "load_snapshot", "watch_file", "watch_snapshot_file"]
