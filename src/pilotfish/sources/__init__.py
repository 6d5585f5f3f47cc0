"""Sources of desired state. Each is independent of the others."""

from pilotfish.sources.file import (
    FileSignature,
    file_signature,
    load_desired,
    load_snapshot,
    watch_file,
    watch_snapshot_file,
)

__all__ = ["FileSignature", "file_signature", "load_desired", "load_snapshot", "watch_file", "watch_snapshot_file"]
