"""Extension configs (ECDS) with a real Envoy: an HTTP filter's config changes without the listener.

The listener's HTTP connection manager has a Lua filter that takes its config from ECDS by name
(``config_discovery``); the snapshot file's ``extension_configs`` section holds the script, which
adds a response header. Changing the script reaches Envoy with no listener update: no listener
drains, and a keep-alive connection opened before the change serves the next request with the new
header. A script Envoy cannot compile passes pilotfish's checks, is NACKed and reported, and the
previous script goes on serving.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from .event_log import TYPE_URLS, is_event
from .processes import ProcessGroup, wait_until
from .snapshot_file import snapshot_document, write_document
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ECDS = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"


def script(tag: str) -> str:
    return f'function envoy_on_response(handle)\n  handle:headers():add("x-pilotfish-script", "{tag}")\nend\n'


def document(bed: Testbed, version: str, source: str) -> dict[str, Any]:
    doc = snapshot_document(
        listener_port=bed.listener_port,
        endpoints={
            "web": [bed.upstreams[name].port for name in ("web-a", "web-b")],
            "api": [bed.upstreams["api"].port],
        },
        version=version,
    )
    manager = doc["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"].insert(
        0,
        {
            "name": "script",
            "config_discovery": {"config_source": {"ads": {}, "resource_api_version": "V3"}, "type_urls": [_LUA]},
        },
    )
    doc["extension_configs"] = [
        {"name": "script", "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": source}}}
    ]
    return doc


class KeepAlive:
    """One HTTP/1.1 connection to the listener, kept open across requests."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buffer = b""

    def __enter__(self) -> KeepAlive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def header(self, name: str) -> str | None:
        """GET /direct on this connection; the response's ``name`` header (it must be a 200)."""
        self.sock.sendall(b"GET /direct HTTP/1.1\r\nHost: e2e\r\n\r\n")
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the listener closed the keep-alive connection")
            self.buffer += chunk
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the listener closed the keep-alive connection")
            rest += chunk
        self.buffer = rest[length:]
        assert lines[0].split()[1] == "200", lines[0]
        return headers.get(name)


def test_a_filter_config_changed_over_ecds_applies_without_the_listener_and_a_rejected_one_changes_nothing(
    processes: ProcessGroup,
) -> None:
    bed = Testbed.create(processes)
    write_document(bed.snapshot_path, document(bed, "1", script("v1")))
    bed.control_plane.start()
    envoy = bed.start_envoy()
    wait_for_acks(bed.events, node="edge-1", what="Envoy's configuration", types=(*TYPE_URLS, ECDS))
    bed.wait_serving(envoy)
    with KeepAlive(bed.listener_port) as connection:
        _change_and_reject(bed, envoy, connection)


def _change_and_reject(bed: Testbed, envoy: Any, connection: KeepAlive) -> None:
    assert connection.header("x-pilotfish-script") == "v1"
    modified = envoy.stat("listener_manager.listener_modified")

    mark = len(bed.events.read())
    write_document(bed.snapshot_path, document(bed, "2", script("v2")))
    wait_for_acks(bed.events, node="edge-1", what="the new script", types=(ECDS,), version="2", after=mark)
    wait_until(
        lambda: connection.header("x-pilotfish-script") == "v2",
        timeout=10,
        what="the keep-alive connection's next response to carry the new script's header",
    )
    assert envoy.stat("listener_manager.total_listeners_draining") == 0
    assert envoy.stat("listener_manager.listener_modified") == modified  # the listener was not replaced
    sent = [e for e in bed.events.read()[mark:] if is_event("sent", node="edge-1")(e)]
    assert sent and {e["type"] for e in sent} == {ECDS}, "only the extension config was sent"

    mark = len(bed.events.read())
    write_document(bed.snapshot_path, document(bed, "3", "function envoy_on_response(handle"))  # no Lua
    nack = bed.events.wait_for(is_event("nack", node="edge-1", type=ECDS), what="Envoy's NACK", after=mark)
    assert nack.get("version_info") == "2"  # what it still runs
    assert connection.header("x-pilotfish-script") == "v2"
    with KeepAlive(bed.listener_port) as fresh:
        assert fresh.header("x-pilotfish-script") == "v2"  # new connections too
