"""Immutable snapshots of the configuration to serve.

A :class:`Snapshot` holds, per resource type, every resource with its content hash and its
encoded ``Any`` bytes, and the type's version. Versions are content hashes unless the user set
one: identical content gives identical versions across restarts and replicas, so a proxy that
reconnects is not pushed what it already has. Encoded responses are memoized per subscribed
name set, so N streams cost one serialization.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from google.protobuf.message import Message

from pilotfish.resources import TYPES, ResourceType, TypeUrl, type_by_url
from pilotfish.resources.encoded import Resource  # re-exported: resources/ encodes, snapshots hold
from pilotfish.resources.wire import discovery_response

__all__ = ["EncodedResponse", "Resource", "Snapshot", "TypeSnapshot", "with_kept"]


@dataclass(frozen=True, slots=True)
class EncodedResponse:
    """A DiscoveryResponse body shared by every stream that needs it; streams add a nonce."""

    type_url: TypeUrl
    version: str
    names: frozenset[str]
    """Names of the resources it carries."""
    body: bytes


@dataclass(frozen=True, slots=True, eq=False)
class TypeSnapshot:
    """The resources of one type and their version."""

    rtype: ResourceType
    version: str
    resources: Mapping[str, Resource]
    content_hash: str = ""
    """Hash of the resources alone (equal to ``version`` unless the user set a version)."""
    _memo: dict[frozenset[str] | None, EncodedResponse] = field(default_factory=dict, repr=False)

    def response(self, names: frozenset[str] | None) -> EncodedResponse:
        """The encoded response carrying ``names`` (those that exist), or everything for None."""
        cached = self._memo.get(names)
        if cached is not None:
            return cached
        if names is None:
            chosen = sorted(self.resources)
        else:
            chosen = sorted(n for n in names if n in self.resources)
        body = discovery_response(self.version, self.rtype.url, (self.resources[n].encoded for n in chosen))
        # Keep the caller's set when it is exactly what was sent: streams can then compare by identity.
        carried = names if names is not None and len(chosen) == len(names) else frozenset(chosen)
        encoded = EncodedResponse(self.rtype.url, self.version, carried, body)
        self._memo[names] = encoded
        return encoded


def with_kept(current: TypeSnapshot, kept: Mapping[str, Resource]) -> TypeSnapshot:
    """``current`` plus resources ``kept`` from an earlier snapshot, versioned by content."""
    merged = {**kept, **current.resources}
    content = _content_version(merged)
    return TypeSnapshot(current.rtype, content, MappingProxyType(merged), content)


def _content_version(resources: Mapping[str, Resource]) -> str:
    digest = hashlib.sha256()
    for name in sorted(resources):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(resources[name].hash.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything to serve to one group of proxies, at one moment. Never changes once built."""

    types: Mapping[TypeUrl, TypeSnapshot]
    explicit_version: str | None = None

    @classmethod
    def build(
        cls, resources: Mapping[ResourceType, Iterable[Message | Resource]], *, version: str | None = None
    ) -> Snapshot:
        """Encode and hash ``resources``; ``version`` (if given) becomes every type's version."""
        types: dict[TypeUrl, TypeSnapshot] = {}
        for rtype in TYPES:
            by_name = {}
            for item in resources.get(rtype, ()):
                resource = item if isinstance(item, Resource) else Resource.of(rtype, item)
                by_name[resource.name] = resource
            content = _content_version(by_name)
            type_version = version if version is not None else content
            types[rtype.url] = TypeSnapshot(rtype, type_version, MappingProxyType(by_name), content)
        return cls(types=MappingProxyType(types), explicit_version=version)

    def same_content(self, other: Snapshot) -> bool:
        """Whether both hold exactly the same resources (whatever their versions say)."""
        return all(
            other.types.get(url) is not None and other.types[url].content_hash == ts.content_hash
            for url, ts in self.types.items()
        )

    def get(self, type_url: str) -> TypeSnapshot | None:
        return self.types.get(TypeUrl(type_url))

    def version(self, type_url: str) -> str | None:
        ts = self.types.get(TypeUrl(type_url))
        return ts.version if ts is not None else None

    def versions(self) -> dict[str, str]:
        """Version per type, keyed by the short type name (CDS, EDS...)."""
        out = {}
        for url, ts in self.types.items():
            rtype = type_by_url(url)
            out[rtype.short if rtype else url] = ts.version
        return out

    def label(self) -> str:
        """One string naming this snapshot in logs: the explicit version, or the type hashes."""
        if self.explicit_version is not None:
            return self.explicit_version
        return hashlib.sha256("".join(sorted(ts.version for ts in self.types.values())).encode()).hexdigest()[:16]
