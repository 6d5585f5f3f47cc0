"""One Envoy resource, encoded once and hashed.

A :class:`Resource` is built from a message (or from bytes a builder encoded directly) and keeps
the bytes: its content hash (which versions are made of) and its ``google.protobuf.Any`` encoding
(which responses are concatenated from) are computed once, when it is made. The message is decoded
only if someone asks for it. It lives in the resources layer so that builders can make resources
without importing :mod:`pilotfish.snapshot` (docs/architecture.md, "Import layers"); snapshots hold them.
"""

from __future__ import annotations

import hashlib

from google.protobuf.message import Message

from pilotfish.resources.types import ResourceType
from pilotfish.resources.wire import RESOURCE_URL, any_bytes, delta_resource

__all__ = ["Resource"]


class Resource:
    """One named resource, encoded once; its message is decoded only if someone asks for it.

    A resource may carry a TTL (``ttl_ms``): a client that takes TTLs drops it that long after it
    was last sent or refreshed (a heartbeat) unless it is sent again. Its encodings then wrap it
    in a ``discovery.v3.Resource`` with the TTL, and its hash covers the TTL (a changed TTL is a
    new version); :meth:`plain` is the same resource without the TTL, for clients that do not
    take TTLs.
    """

    __slots__ = (
        "_delta",
        "_inner",
        "_message",
        "_plain",
        "_rtype",
        "_value",
        "encoded",
        "hash",
        "name",
        "ttl_ms",
        "version",
    )

    def __init__(
        self, rtype: ResourceType, name: str, value: bytes, message: Message | None = None, *, ttl_ms: int = 0
    ) -> None:
        self.name = name
        digest = hashlib.sha256(value)
        if ttl_ms:
            digest.update(b"\0ttl=%d" % ttl_ms)
        self.hash = digest.hexdigest()
        """Hex SHA-256 of the resource's encoding (and TTL, if it has one)."""
        self.version = self.hash[:16]
        """The resource's version in incremental (delta) xDS: the start of its content hash, the
        same on every replica and after every restart."""
        self.ttl_ms = ttl_ms
        """Its TTL in milliseconds; 0: none."""
        inner = any_bytes(rtype.url, value)
        self._inner = inner if ttl_ms else None
        self.encoded = any_bytes(RESOURCE_URL, delta_resource(name, "", inner, ttl_ms)) if ttl_ms else inner
        """The resource as an encoded ``google.protobuf.Any`` (with a TTL: of a ``discovery.v3.Resource``
        holding the resource and its TTL, as a SotW response carries it)."""
        self._rtype = rtype
        self._value = value
        self._message = message
        self._delta: bytes | None = None
        self._plain: Resource | None = None

    def delta_encoded(self) -> bytes:
        """The resource as an encoded ``discovery.v3.Resource`` (name, version, Any, TTL), made once."""
        if self._delta is None:
            inner = self._inner if self._inner is not None else self.encoded
            self._delta = delta_resource(self.name, self.version, inner, self.ttl_ms)
        return self._delta

    def heartbeat(self) -> bytes:
        """A delta heartbeat of this resource: a ``discovery.v3.Resource`` with its name, version and
        TTL and no resource (the client renews the TTL of the version it has)."""
        return delta_resource(self.name, self.version, None, self.ttl_ms)

    def plain(self) -> Resource:
        """This resource without its TTL (itself if it has none), made once."""
        if not self.ttl_ms:
            return self
        if self._plain is None:
            self._plain = Resource(self._rtype, self.name, self._value, self._message)
        return self._plain

    @classmethod
    def of(cls, rtype: ResourceType, message: Message, *, ttl_ms: int = 0) -> Resource:
        """A resource from a message (encoded deterministically)."""
        value = message.SerializeToString(deterministic=True)
        return cls(rtype, getattr(message, rtype.name_field), value, message, ttl_ms=ttl_ms)

    @property
    def message(self) -> Message:
        if self._message is None:
            self._message = self._rtype.message.FromString(self._value)
        return self._message

    @property
    def value(self) -> bytes:
        """The resource's own encoding (without the Any wrapper)."""
        return self._value
