"""Lazy resolution of ``google.protobuf.Any`` type names.

Envoy JSON names the message inside an ``Any`` with ``@type``. The protobuf JSON parser can only
resolve it when the message's ``_pb2`` module has been imported. Importing the whole Envoy API at
start-up costs seconds and hundreds of megabytes, so we import on first use: the package part of
the type name (``envoy.extensions.filters.network.http_connection_manager.v3``) is a Python
package of xds-protos, and one of its ``_pb2`` modules defines the message.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

from google.protobuf import descriptor_pool, json_format
from google.protobuf.message import Message

__all__ = ["ensure_type", "ensure_types_in", "message_dict"]

_PREFIX = "type.googleapis.com/"
_imported_packages: set[str] = set()


def _known(full_name: str) -> bool:
    try:
        descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        return False
    return True


def _import_package(package: str) -> None:
    if package in _imported_packages:
        return
    _imported_packages.add(package)
    try:
        module = importlib.import_module(package)
    except ImportError:
        return
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if info.name.endswith("_pb2"):
            importlib.import_module(f"{package}.{info.name}")


_PROTO_ROOTS = frozenset({"envoy", "xds", "udpa", "validate", "google"})
"""The top-level packages of the message types a resource may name; nothing else is imported (the
name comes from a file, or from a plan posted to the admin API: it must not choose what runs)."""


def ensure_type(type_url_or_name: str) -> bool:
    """Import the module defining a message type; True when it is now known."""
    full_name = type_url_or_name.rsplit("/", 1)[-1]
    if _known(full_name):
        return True
    parts = full_name.split(".")
    if parts[0] not in _PROTO_ROOTS or not all(part.isidentifier() for part in parts):
        return False
    # Nested messages (pkg.Outer.Inner): try each shorter prefix as the package.
    for cut in range(len(parts) - 1, 0, -1):
        _import_package(".".join(parts[:cut]))
        if _known(full_name):
            return True
    return False


def _type_names(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "@type" and isinstance(item, str):
                yield item
            else:
                yield from _type_names(item)
    elif isinstance(value, list):
        for item in value:
            yield from _type_names(item)


def ensure_types_in(value: Any) -> list[str]:
    """Import every ``@type`` found in a JSON value; return the ones that do not exist."""
    unknown = []
    for name in _type_names(value):
        if not ensure_type(name):
            unknown.append(name)
    return unknown


_MAX_TYPE_IMPORTS = 64
"""``Any`` types one message's JSON may need imported on the way."""
_UNKNOWN_TYPE = re.compile(r"type_url: (\S+)")


def message_dict(message: Message) -> dict[str, Any]:
    """``message`` as Envoy JSON (proto field names; each ``Any`` with its ``@type``), importing
    the modules of the ``Any`` types in it as they are met."""
    for _ in range(_MAX_TYPE_IMPORTS):
        try:
            found: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
            return found
        except TypeError as exc:  # an Any whose message module is not imported yet
            match = _UNKNOWN_TYPE.search(str(exc))
            if match is None or not ensure_type(match[1]):
                raise
    raise RuntimeError(f"more than {_MAX_TYPE_IMPORTS} Any types to import for one {message.DESCRIPTOR.full_name}")
