"""Envoy resource types, Envoy JSON/YAML -> protobuf, and the Envoy bootstrap and address parsing
(:mod:`~pilotfish.resources.bootstrap`).

May import only ``followed_file``, ``events`` and ``errors`` (and protobuf); everything above builds on it.
"""

from pilotfish.resources.parse import (
    ParsedDocument,
    ParseMemo,
    decode_document,
    parse_document,
    read_document,
    read_parsed,
)
from pilotfish.resources.types import (
    ADS_ORDER,
    CLUSTER,
    ENDPOINT,
    EXTENSION_CONFIG,
    LISTENER,
    ROUTE,
    RUNTIME,
    SECRET,
    TYPES,
    ResourceType,
    TypeUrl,
    type_by_key,
    type_by_url,
)

__all__ = [
    "ADS_ORDER",
    "CLUSTER",
    "ENDPOINT",
    "EXTENSION_CONFIG",
    "LISTENER",
    "ROUTE",
    "RUNTIME",
    "SECRET",
    "TYPES",
    "ParseMemo",
    "ParsedDocument",
    "ResourceType",
    "TypeUrl",
    "decode_document",
    "parse_document",
    "read_document",
    "read_parsed",
    "type_by_key",
    "type_by_url",
]
