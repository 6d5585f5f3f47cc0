"""The seed-002 lab's route table as hand-written Envoy JSON (``/marker`` answered directly,
``/slow`` to the cluster slow, the rest to pool): what the services model's ``routes`` must build
(the unit tests) and serve the same answers as (the e2e tests). A test helper shared by both,
imported by module name."""

from __future__ import annotations

from typing import Any

__all__ = ["lab_route_config"]


def lab_route_config(
    *, slow_timeout: str, rest_timeout: str | None = None, retry: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The RouteConfiguration ``edge``; ``retry``: a retry_policy on both forwarding routes."""
    slow: dict[str, Any] = {"cluster": "slow", "timeout": slow_timeout}
    rest: dict[str, Any] = {"cluster": "pool"}
    if rest_timeout is not None:
        rest["timeout"] = rest_timeout
    if retry is not None:
        slow["retry_policy"] = rest["retry_policy"] = retry
    return {
        "name": "edge",
        "virtual_hosts": [
            {
                "name": "edge",
                "domains": ["*"],
                "routes": [
                    {
                        "match": {"path": "/marker"},
                        "direct_response": {"status": 200, "body": {"inline_string": "marker\n"}},
                    },
                    {"match": {"prefix": "/slow"}, "route": slow},
                    {"match": {"prefix": "/"}, "route": rest},
                ],
            }
        ],
    }
