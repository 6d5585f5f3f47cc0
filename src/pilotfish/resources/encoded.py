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
from pilotfish.resources.wire import any_bytes, delta_resource

__all__ = ["Resource"]


class Resource:
    """One named resource, encoded once; its message is decoded only if someone asks for it."""

    __slots__ = ("_delta", "_message", "_rtype", "_value", "encoded", "hash", "name", "version")

    def __init__(self, rtype: ResourceType, name: str, value: bytes, message: Message | None = None) -> None:
        self.name = name
        self.hash = hashlib.sha256(value).hexdigest()
        """Hex SHA-256 of the resource's encoding."""
        self.version = self.hash[:16]
        """The resource's version in incremental (delta) xDS: the start of its content hash, the
        same on every replica and after every restart."""
        self.encoded = any_bytes(rtype.url, value)
        """The resource as an encoded ``google.protobuf.Any``."""
        self._rtype = rtype
        self._value = value
        self._message = message
        self._delta: bytes | None = None

    def delta_encoded(self) -> bytes:
        """The resource as an encoded ``discovery.v3.Resource`` (name, version, Any), made once."""
        if self._delta is None:
            self._delta = delta_resource(self.name, self.version, self.encoded)
        return self._delta

    @classmethod
    def of(cls, rtype: ResourceType, message: Message) -> Resource:
        """A resource from a message (encoded deterministically)."""
        value = message.SerializeToString(deterministic=True)
        return cls(rtype, getattr(message, rtype.name_field), value, message)

    @property
    def message(self) -> Message:
        if self._message is None:
            self._message = self._rtype.message.FromString(self._value)
        return self._message

    @property
    def value(self) -> bytes:
        """The resource's own encoding (without the Any wrapper)."""
        return self._value
