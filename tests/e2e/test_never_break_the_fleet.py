"""Nothing invalid, empty or half-known reaches a proxy: each ordinary mistake, made on one running
``pilotfish serve`` while a real Envoy takes load from wrk, is reported and changes nothing.

After each case: Envoy's dynamic configuration (a hash of its ``/config_dump``) is what it was,
Envoy never NACKed (pilotfish caught the problem first), and pilotfish's log names the case. At
the end, wrk saw no failed request, and a valid edit is served.

A second test restarts ``serve --etcd`` while etcd is down: Envoy keeps its configuration and its
traffic, the log names etcd and the error, and etcd's state is served once it is back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from .etcd import Etcd
from .event_log import Event, EventLog, is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, http_json, wait_until
from .testbed import Testbed, wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NODE = "edge-1"
LOAD_S = 150
"""The longest a load run may take: long enough for every case on a busy 2-core machine (the test
checks that wrk still runs at the end, then ends it)."""


def dynamic_config_hash(envoy: Envoy) -> str:
    """A hash of what Envoy was configured with over xDS: clusters, endpoints, listeners, routes."""
    dump = json.loads(envoy.admin("/config_dump?include_eds"))
    dynamic = {}
    for config in dump["configs"]:
        kind = config["@type"].rsplit(".", 1)[-1]
        if kind in ("ClustersConfigDump", "EndpointsConfigDump", "ListenersConfigDump", "RoutesConfigDump"):
            dynamic[kind] = {k: v for k, v in config.items() if k.startswith("dynamic")}
    return hashlib.sha256(json.dumps(dynamic, sort_keys=True).encode()).hexdigest()


class Fleet:
    """The running testbed, and the checks made after each case."""

    def __init__(self, testbed: Testbed, envoy: Envoy) -> None:
        self.testbed = testbed
        self.envoy = envoy
        self.path = testbed.snapshot_path
        self.good_text = self.path.read_text()
        self.config = dynamic_config_hash(envoy)

    @property
    def events(self) -> EventLog:
        return self.testbed.events

    def stderr(self) -> str:
        return self.testbed.control_plane.process.stderr_path.read_text(errors="replace")

    def case(
        self, name: str, make_mistake: Callable[[], object], *, event: Callable[[Event], bool], log_says: str
    ) -> Event:
        """Make one mistake; wait until pilotfish reports it; check that nothing reached Envoy."""
        mark, logged = self.events.mark(), len(self.stderr())
        make_mistake()
        found = self.events.wait_for(event, what=f"{name}: pilotfish reports it", after=mark, timeout=15)
        wait_until(
            lambda: log_says in self.stderr()[logged:],
            timeout=10,
            what=f"{name}: the log says {log_says!r}",
            details=lambda: self.stderr()[logged:][-2000:],
        )
        assert not self.events.select(is_event("snapshot_loaded"), after=mark), f"{name}: nothing is published"
        assert not self.events.select(is_event("nack"), after=mark), f"{name}: Envoy never saw it to NACK it"
        assert dynamic_config_hash(self.envoy) == self.config, f"{name}: Envoy's configuration is unchanged"
        return found


def snapshot_error(words: str) -> Callable[[Event], bool]:
    return lambda e: e["event"] == "snapshot_error" and words in e.get("reason", "")


def test_no_mistake_reaches_a_proxy_under_load(processes: ProcessGroup) -> None:
    wrk_binary()
    testbed = Testbed.create(processes)
    testbed.control_plane.registry_port = free_port()
    envoy = testbed.start(version=None)
    fleet = Fleet(testbed, envoy)
    path, good = fleet.path, fleet.good_text
    wrk = Wrk.start(processes, f"http://127.0.0.1:{testbed.listener_port}/", duration_s=LOAD_S)
    envoy.wait_for_requests("web", at_least=100)

    fleet.case(
        "truncate to empty",
        lambda: path.write_bytes(b""),
        event=snapshot_error("the file is empty"),
        log_says="the file is empty",
    )
    fleet.case(
        "comment-only file",
        lambda: path.write_text("# moved to etcd\n# clusters: []\n"),
        event=snapshot_error("only comments"),
        log_says="only comments",
    )
    fleet.case(
        "a byte that is not UTF-8",
        lambda: path.write_bytes(good.encode() + b"# \xff\n"),
        event=snapshot_error("not UTF-8"),
        log_says="not UTF-8 (byte 0xff)",
    )

    # Half a file, then (once pilotfish has seen the half) the rest: the half is refused or held,
    # the whole is what is served already.
    half = len(good) // 2
    fleet.case(
        "half a file",
        lambda: path.write_text(good[:half]),
        event=lambda e: e["event"] in ("snapshot_error", "snapshot_held"),
        log_says=str(path),
    )
    mark = fleet.events.mark()
    with path.open("a") as file:
        file.write(good[half:])
    fleet.events.wait_for(is_event("snapshot_unchanged"), what="the completed file: nothing new", after=mark)
    assert dynamic_config_hash(envoy) == fleet.config

    def zero_connect_timeout() -> None:
        document = yaml.safe_load(good)
        document["clusters"][0]["connect_timeout"] = "0s"
        path.write_text(yaml.safe_dump(document))

    fleet.case(
        "connect_timeout: 0s", zero_connect_timeout, event=snapshot_error("connect_timeout"), log_says="connect_timeout"
    )
    path.write_text(good)

    # A registry service on the listener's address: refused (409) against the merged state.
    registry = testbed.control_plane.registry_url
    status: dict[str, Any] = {}

    def conflicting_put() -> None:
        status["code"], status["body"] = http_json(
            "PUT", f"{registry}/v1/services/web2", {"listen": f"127.0.0.1:{testbed.listener_port}"}
        )

    mark = fleet.events.mark()
    conflicting_put()
    assert status["code"] == 409, status
    assert f"127.0.0.1:{testbed.listener_port}" in json.dumps(status["body"]), "the conflict is named"
    assert http_json("GET", f"{registry}/v1/services/web2")[0] == 404, "a refused request changes nothing"
    assert not fleet.events.select(is_event("snapshot_loaded"), after=mark)

    fleet.case("delete the file", path.unlink, event=snapshot_error("deleted"), log_says="deleted")

    without_listeners = yaml.safe_load(good)
    without_listeners["listeners"] = []
    held = fleet.case(
        "remove every listener",
        lambda: path.write_text(yaml.safe_dump(without_listeners)),
        event=is_event("snapshot_held"),
        log_says="HELD",
    )
    assert held["reasons"] == ["it removes every listener (1)"]
    assert f"kill -USR1 {testbed.control_plane.process.pid}" in fleet.stderr(), "pilotfish says how to confirm"

    # After all of that, a valid edit is served.
    mark = fleet.events.mark()
    edited = yaml.safe_load(good)
    edited["routes"][0]["virtual_hosts"][0]["routes"][0]["direct_response"]["body"]["inline_string"] = "edited"
    path.write_text(yaml.safe_dump(edited))
    fleet.events.wait_for(is_event("snapshot_loaded"), what="the valid edit is published", after=mark)
    wait_until(lambda: testbed.request("/direct") == (200, "edited"), timeout=10, what="Envoy to serve the edit")
    envoy.wait_for_requests("web")  # the load goes on through the edit

    assert wrk.running(), "every case was made under load"
    result = wrk.stop()
    print(f"\nwrk during every case: {result.summary()}")
    assert result.problems() == [], result.summary()


def test_serve_restarted_while_etcd_is_down_keeps_the_fleet(processes: ProcessGroup) -> None:
    wrk_binary()
    etcd = Etcd.start(processes)
    listen = f"127.0.0.1:{free_port()}"
    upstreams = [Upstream.start(processes, name) for name in ("u0", "u1")]
    etcd.put_json("/pilotfish/services/web", {"listen": listen, "protocol": "http"})
    for upstream in upstreams:
        etcd.put_json(f"/pilotfish/instances/web/{upstream.name}", {"address": "127.0.0.1", "port": upstream.port})
    control_plane = ControlPlane(processes, None, free_port(), etcd=etcd.address)
    events = control_plane.start()
    envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=control_plane.address)
    wait_for_acks(events, node=NODE, what="the configuration from etcd")
    wait_until(
        lambda: envoy.cluster_endpoints("web") == sorted(f"127.0.0.1:{u.port}" for u in upstreams),
        timeout=10,
        what="Envoy to have both endpoints",
    )
    config = dynamic_config_hash(envoy)

    wrk = Wrk.start(processes, f"http://{listen}/", duration_s=LOAD_S)
    envoy.wait_for_requests("web", at_least=100)

    etcd.stop()
    control_plane.stop()
    events = control_plane.start()
    waiting = events.wait_for(is_event("waiting_for_sources"), what="serve says it waits for etcd", timeout=5)
    assert waiting["sources"] == ["etcd"] and etcd.address in waiting["reasons"][0], waiting
    wait_until(
        lambda: f"etcd at {etcd.address}" in control_plane.process.stderr_path.read_text(),
        timeout=5,
        what="the log to name etcd",
    )
    stream = events.wait_for(is_event("stream_open", node=NODE), what="Envoy to reconnect", timeout=15)
    assert not events.select(is_event("snapshot_loaded")), "nothing is published while etcd is unknown"
    assert not events.select(is_event("sent", node=NODE)), "the reconnected Envoy is sent nothing"
    assert dynamic_config_hash(envoy) == config, "Envoy keeps its configuration"

    # etcd returns with a change made meanwhile (u1 gone): that state is served.
    etcd.run()
    etcd.delete("/pilotfish/instances/web/u1")
    mark = events.index_of(stream)
    events.wait_for(is_event("snapshot_loaded"), what="etcd's state published once it is back", after=mark, timeout=20)
    wait_until(
        lambda: envoy.cluster_endpoints("web") == [f"127.0.0.1:{upstreams[0].port}"],
        timeout=10,
        what="Envoy to follow etcd's current state",
    )
    envoy.wait_for_requests("web")  # the load goes on through etcd's state
    assert wrk.running(), "etcd was down and back under load"
    result = wrk.stop()
    print(f"\nwrk across the restart: {result.summary()}")
    assert result.problems() == [], result.summary()
