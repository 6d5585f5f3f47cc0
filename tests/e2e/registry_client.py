"""A client of pilotfish's registry HTTP API, as a service or deploy tool would use it.

Each call checks the status the API documents for success (200, 201, 204) and fails the test
with the API's own error body otherwise, so a test reads as the steps it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from .processes import http_json

__all__ = ["RegistryClient"]


@dataclass(frozen=True)
class RegistryClient:
    base_url: str
    """``http://host:port`` of ``pilotfish serve --registry``."""

    def define(self, service: str, **spec: Any) -> Any:
        """PUT a service definition (listen, protocol, ...)."""
        return self._expect(200, "PUT", f"/v1/services/{service}", spec)

    def register(self, service: str, address: str, port: int, **fields: Any) -> str:
        """Register an instance (weight, metadata, ttl in ``fields``); return its id."""
        body = {"address": address, "port": port, **fields}
        answer = self._expect(201, "POST", f"/v1/services/{service}/instances", body)
        instance_id: str = answer["id"]
        return instance_id

    def heartbeat(self, service: str, instance_id: str) -> Any:
        return self._expect(200, "PUT", f"/v1/services/{service}/instances/{instance_id}/heartbeat")

    def deregister(self, service: str, instance_id: str) -> None:
        self._expect(204, "DELETE", f"/v1/services/{service}/instances/{instance_id}")

    def service(self, service: str) -> Any:
        return self._expect(200, "GET", f"/v1/services/{service}")

    def _expect(self, status: int, method: str, path: str, body: Any = None) -> Any:
        got, answer = http_json(method, self.base_url + path, body)
        if got != status:
            pytest.fail(f"registry {method} {path} answered {got} (expected {status}): {answer}", pytrace=False)
        return answer
