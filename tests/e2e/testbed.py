"""One test's deployment: upstreams, a snapshot file, ``pilotfish serve`` and its Envoys.

A :class:`Testbed` lives in the test's own temp dir and uses ports the OS picked, so tests can run
in parallel. It starts three upstreams (``web-a`` and ``web-b`` behind cluster ``web``, ``api``
behind cluster ``api``); :meth:`Testbed.start` then writes a first snapshot, starts the server and
an Envoy and waits until that Envoy has ACKed all four ADS types and serves through its listener.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .event_log import TYPE_URLS, Event, EventLog, is_event, short_type
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, http_get, wait_until
from .snapshot_file import snapshot_document, write_document

__all__ = ["WEB", "Testbed", "wait_for_acks"]

WEB = ("web-a", "web-b")
"""The upstreams of cluster ``web`` in the first snapshot."""


@dataclass
class Testbed:
    __test__ = False  # not a test class, whatever its name says to pytest

    group: ProcessGroup
    upstreams: dict[str, Upstream]
    listener_port: int
    snapshot_path: Path
    control_plane: ControlPlane
    envoys: list[Envoy] = field(default_factory=list)

    @classmethod
    def create(cls, group: ProcessGroup) -> Testbed:
        upstreams = {name: Upstream.start(group, name) for name in (*WEB, "api")}
        snapshot_path = group.workdir / "snapshot.yaml"
        control_plane = ControlPlane(group, snapshot_path, free_port())
        return cls(group, upstreams, free_port(), snapshot_path, control_plane)

    @property
    def events(self) -> EventLog:
        """The event log of the control plane's current run."""
        return self.control_plane.events

    def address_of(self, upstream: str) -> str:
        return f"127.0.0.1:{self.upstreams[upstream].port}"

    def write_snapshot(self, *, web: Sequence[str] = WEB, **params: Any) -> dict[str, Any]:
        """Replace the snapshot file (by rename) with :meth:`snapshot_document`'s document."""
        document = self.snapshot_document(web=web, **params)
        write_document(self.snapshot_path, document)
        return document

    def snapshot_document(self, *, web: Sequence[str] = WEB, **params: Any) -> dict[str, Any]:
        """The testbed's snapshot, not written: ``web`` names the upstreams of cluster web; other
        parameters go to :func:`snapshot_file.snapshot_document` (version, direct_body,
        connect_timeout, stat_prefix, reordered). A test that adds to it writes it once (a file
        written twice under one explicit version may be read in between, and its second content
        is then refused: the version did not change)."""
        endpoints = {
            "web": [self.upstreams[name].port for name in web],
            "api": [self.upstreams["api"].port],
        }
        return snapshot_document(listener_port=self.listener_port, endpoints=endpoints, **params)

    def start_envoy(self, *, name: str = "envoy", node_id: str = "edge-1", **options: Any) -> Envoy:
        envoy = Envoy.start(
            self.group,
            name=name,
            node_id=node_id,
            xds_address=self.control_plane.address,
            **options,
        )
        self.envoys.append(envoy)
        return envoy

    def start(self, *, envoy_options: dict[str, Any] | None = None, **snapshot: Any) -> Envoy:
        """Write the first snapshot, start the server and an Envoy; wait until it serves."""
        self.write_snapshot(**snapshot)
        self.control_plane.start()
        envoy = self.start_envoy(**(envoy_options or {}))
        wait_for_acks(self.events, node="edge-1", what="the first Envoy's initial configuration")
        self.wait_serving(envoy)
        return envoy

    def request(self, path: str, *, timeout: float = 5.0) -> tuple[int, str]:
        """GET through the Envoy listener."""
        return http_get(f"http://127.0.0.1:{self.listener_port}{path}", timeout=timeout)

    def wait_serving(self, envoy: Envoy, *, timeout: float = 10.0) -> None:
        """Wait until the listener routes: ``/direct`` answers 200."""
        wait_until(
            lambda: self.request("/direct")[0] == 200,
            timeout=timeout,
            what=f"{envoy.name}'s listener on port {self.listener_port} to answer /direct",
            details=lambda: envoy.log_tail(),
        )


def wait_for_acks(
    events: EventLog,
    *,
    node: str,
    what: str,
    types: Iterable[str] = TYPE_URLS,
    version: str | None = None,
    stream: Any = None,
    after: int = 0,
    timeout: float = 15.0,
) -> dict[str, Event]:
    """Wait for an ``ack`` of each type from ``node`` (and ``stream``, ``version`` when given)."""
    acks = {}
    for type_url in types:

        def matches(event: Event, type_url: str = type_url) -> bool:
            return (
                is_event("ack", node=node, type=type_url)(event)
                and (version is None or event.get("version_info") == version)
                and (stream is None or event.get("stream") == stream)
            )

        label = f"{what}: ack of {short_type(type_url)}" + (f" at version {version!r}" if version else "")
        acks[type_url] = events.wait_for(matches, what=label, after=after, timeout=timeout)
    return acks
