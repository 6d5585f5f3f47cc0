"""Sources of desired state: a snapshot file (:mod:`~pilotfish.sources.file`), a prefix of etcd
(:mod:`~pilotfish.sources.etcd`) and the service registry (:mod:`~pilotfish.sources.registry`).

Sources never import each other. They may import the etcd client, ``build`` and the layers below;
never the reconciler, a service or an API (those import them).
"""

from pilotfish.sources.file import (
    FileSignature,
    file_signature,
    load_desired,
    load_snapshot,
    watch_file,
    watch_snapshot_file,
)

__all__ = ["FileSignature", "file_signature", "load_desired", "load_snapshot", "watch_file", "watch_snapshot_file"]
