"""A rollout as it is kept across restarts: the machine's state and the baseline's content.

A restarted ``serve`` must never send a proxy a candidate that was rolled back, nor lose the
baseline while its sources still say the held candidate (docs/rollout.md, "State"). So beside
the machine's state (:meth:`~pilotfish.rollout.machine.RolloutMachine.to_dict`: the baseline's and
the candidate's change ids, the wave, the held candidates) the document keeps every resource of
the baseline, per node group, encoded as protobuf (base64 in JSON): after a restart the baseline
is served from it when the sources hold a held candidate, or a new candidate that has to start
from the baseline again. The candidate's content is not kept: it is what the sources build
(if they build something else now, that is a newer change, and it supersedes the candidate).

:func:`encode` and :func:`decode` are pure; the composition root writes the document to a file
in the state directory (``--state-dir``) when it changed, atomically.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pilotfish.cache import NodeGroup
from pilotfish.resources.encoded import Resource
from pilotfish.resources.types import type_by_url
from pilotfish.snapshot import Snapshot

__all__ = ["FORMAT", "STATE_FILE", "Stored", "decode", "decode_snapshots", "encode", "encode_snapshots"]

STATE_FILE = "pilotfish-rollout.json"
"""Its name in the state directory."""
FORMAT = 1
"""The version of the document's format."""


@dataclass(frozen=True, slots=True)
class Stored:
    """A rollout read back: the machine's state, and the baseline's snapshot per group."""

    machine: Mapping[str, Any]
    baseline: Mapping[NodeGroup, Snapshot]


def encode(machine: Mapping[str, Any], baseline: Mapping[NodeGroup, Snapshot]) -> dict[str, Any]:
    """The JSON-able document of ``machine`` (its ``to_dict()``) and the ``baseline`` snapshots."""
    return {"version": FORMAT, "machine": dict(machine), "baseline": encode_snapshots(baseline)}


def encode_snapshots(baseline: Mapping[NodeGroup, Snapshot]) -> dict[str, Any]:
    """Snapshots per group, JSON-able (every resource's protobuf encoding, in base64)."""
    groups: dict[str, Any] = {}
    for group, snapshot in sorted(baseline.items()):
        groups[group] = {
            "explicit_version": snapshot.explicit_version,
            "types": {
                url: {
                    "version": ts.version,
                    "resources": [base64.b64encode(r.value).decode() for _, r in sorted(ts.resources.items())],
                    **({"ttls": dict(ts.ttls())} if ts.ttls() else {}),
                }
                for url, ts in snapshot.types.items()
            },
        }
    return groups


def decode(document: Any, *, where: str) -> Stored:
    """A document :func:`encode` wrote; ValueError naming ``where`` and what is wrong."""
    if not isinstance(document, Mapping) or document.get("version") != FORMAT:
        version = document.get("version") if isinstance(document, Mapping) else type(document).__name__
        raise ValueError(
            f"{where}: format {version!r}, this pilotfish reads format {FORMAT}; remove it to start "
            "from the next change as every proxy's baseline"
        )
    try:
        machine = dict(document["machine"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}; it is not what this pilotfish wrote") from exc
    return Stored(machine, decode_snapshots(document.get("baseline"), where=where))


def decode_snapshots(groups: Any, *, where: str) -> dict[NodeGroup, Snapshot]:
    """What :func:`encode_snapshots` wrote; ValueError naming ``where``."""
    try:
        return {NodeGroup(str(group)): _snapshot(stored) for group, stored in dict(groups).items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}; it is not what this pilotfish wrote") from exc


def _snapshot(stored: Mapping[str, Any]) -> Snapshot:
    explicit = stored["explicit_version"]
    resources: dict[Any, list[Resource]] = {}
    versions: dict[str, str] = {}
    for url, kept in dict(stored["types"]).items():
        rtype = type_by_url(str(url))
        if rtype is None:
            raise ValueError(f"unknown type {url!r}")
        versions[rtype.url] = str(kept["version"])
        resources[rtype] = []
        ttls = {str(name): int(ms) for name, ms in dict(kept.get("ttls") or {}).items()}
        for text in kept["resources"]:
            value = base64.b64decode(str(text), validate=True)
            message = rtype.message.FromString(value)
            name = getattr(message, rtype.name_field)
            resources[rtype].append(Resource(rtype, name, value, message, ttl_ms=ttls.get(name, 0)))
    snapshot = Snapshot.build(resources, version=None if explicit is None else str(explicit))
    types = {
        url: ts if ts.version == versions.get(url, ts.version) else ts.renewed(versions[url])
        for url, ts in snapshot.types.items()
    }
    return Snapshot(types=types, explicit_version=snapshot.explicit_version)
