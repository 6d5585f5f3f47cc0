"""The registry API on etcd (``serve --registry ... --etcd ...``): registrations live in etcd, not
in a replica, so any replica takes any write, every replica serves it, and no restart forgets it.

Each test runs a real etcd and two or more real ``pilotfish serve`` replicas on it; the TTL test
also a real Envoy and upstream, to see the fleet drop an instance whose lease ran out.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from .etcd import Etcd
from .event_log import is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, envoy_binary, free_port, http_json, wait_until
from .registry_client import RegistryClient
from .replicas import etcd_replicas
from .testbed import wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = "edge-1"


def get(plane: ControlPlane, path: str) -> tuple[int, Any]:
    return http_json("GET", plane.registry_url + path)


def instance_ids(plane: ControlPlane, service: str, *, revision: int | None = None) -> list[str]:
    status, answer = get(plane, f"/v1/services/{service}" + (f"?revision={revision}" if revision else ""))
    assert status == 200, answer
    return [i["id"] for i in answer["instances"]]


def test_a_write_on_one_replica_reads_on_another_and_survives_restarting_them_all(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    a, b = etcd_replicas(processes, etcd, 2)
    status, defined = http_json(
        "PUT", a.registry_url + "/v1/services/web", {"listen": f"127.0.0.1:{free_port()}", "protocol": "http"}
    )
    assert status == 200 and defined["revision"] > 0, defined
    status, registered = http_json(
        "POST", a.registry_url + "/v1/services/web/instances", {"address": "127.0.0.1", "port": 9001, "ttl": 60}
    )
    assert status == 201, registered
    revision = registered["revision"]
    assert revision > defined["revision"]
    assert etcd.get_json("/pilotfish/instances/web/127.0.0.1:9001") == {"address": "127.0.0.1", "port": 9001, "ttl": 60}

    # Read your writes: B answers once it has applied the write's revision, and says its revision.
    assert instance_ids(b, "web", revision=revision) == ["127.0.0.1:9001"]
    status, listed = get(b, "/v1/services")
    assert status == 200 and listed["revision"] >= revision
    status, health = get(b, "/healthz")
    assert status == 200 and health["etcd"]["revision"] >= revision and health["etcd"]["lag"] == 0, health
    status, health = http_json("GET", f"http://{b.admin}/healthz")  # the admin API says the same
    assert status == 200 and health["etcd"]["revision"] >= revision and health["etcd"]["lag"] == 0, health
    # A revision no replica has reached yet: 503 saying how far this one is, after the wait asked for.
    status, behind = get(b, f"/v1/services/web?revision={revision + 1000}&wait=0.2")
    assert status == 503 and f"not yet {revision + 1000}" in behind["error"], behind

    # A heartbeat through the other replica renews the lease.
    status, beat = http_json("PUT", b.registry_url + "/v1/services/web/instances/127.0.0.1:9001/heartbeat")
    assert status == 200 and 55 <= beat["expires_in"] <= 60, beat

    for plane in (a, b):
        plane.stop()
    for plane in (a, b):
        plane.start().wait_for(is_event("etcd_synced"), what="etcd listed after the restart")
    assert instance_ids(a, "web") == instance_ids(b, "web") == ["127.0.0.1:9001"]

    # Deregistering through B removes it everywhere.
    status, _ = http_json("DELETE", b.registry_url + "/v1/services/web/instances/127.0.0.1:9001")
    assert status == 204
    assert etcd.get_json("/pilotfish/instances/web/127.0.0.1:9001") is None
    wait_until(lambda: instance_ids(a, "web") == [], timeout=10, what="replica A to drop the deregistered instance")


TTL_S = 4


class Heartbeats:
    """A client's heartbeats for one instance, once a second (the first at once), in a thread,
    until :meth:`stop`. Told the instance is unknown (404: its lease ended), it registers it again
    with the same TTL, as registry clients do (Eureka's among them)."""

    def __init__(self, client: RegistryClient, service: str, instance: str) -> None:
        self.sent = 0
        self.registered_again = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._path = f"/v1/services/{service}/instances/{instance}/heartbeat"
        host, _, port = instance.rpartition(":")
        self._registration = (f"/v1/services/{service}/instances", {"address": host, "port": int(port), "ttl": TTL_S})
        self._url = client.base_url
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                status, answer = http_json("PUT", self._url + self._path)
                if status == 404:
                    path, body = self._registration
                    status, answer = http_json("POST", self._url + path, body)
                    self.registered_again += status == 201
            except OSError as exc:  # as a real client, it tries again next time
                self.failures.append(repr(exc))
            else:
                if status in (200, 201):
                    self.sent += 1
                else:
                    self.failures.append(f"{status}: {answer}")
            if self._stop.wait(1.0):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_an_instance_that_stops_heartbeating_is_dropped_by_every_envoy(processes: ProcessGroup) -> None:
    """Registered through replica A with a TTL, heartbeated through B, served to an Envoy on B;
    A is stopped for good. When the heartbeats stop, etcd ends the lease and the Envoy drops it:
    no replica had to be the one that saw it register."""
    envoy_binary()
    etcd = Etcd.start(processes)
    a, b = etcd_replicas(processes, etcd, 2)
    web = Upstream.start(processes, "web")
    stays = Upstream.start(processes, "stays")
    listen = f"127.0.0.1:{free_port()}"
    on_a, on_b = RegistryClient(a.registry_url), RegistryClient(b.registry_url)
    on_a.define("web", listen=listen, protocol="http")
    on_a.register("web", "127.0.0.1", stays.port)
    lapsing = on_a.register("web", "127.0.0.1", web.port, ttl=TTL_S)
    registered = time.monotonic()
    heartbeats = Heartbeats(on_b, "web", lapsing)  # through B, from now on
    a.stop()

    envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=b.address)
    wait_for_acks(b.events, node=NODE, what="Envoy's configuration from replica B")
    both = sorted(f"127.0.0.1:{u.port}" for u in (web, stays))
    envoy.wait_for_endpoints("web", both, timeout=10)
    wait_until(
        lambda: time.monotonic() - registered > 2 * TTL_S and heartbeats.sent >= 3,
        timeout=30,
        what="the instance to outlive its TTL on B's heartbeats",
    )
    heartbeats.stop()
    assert envoy.cluster_endpoints("web") == both, (
        f"kept alive by heartbeats through another replica (failed heartbeats: {heartbeats.failures})"
    )
    assert heartbeats.registered_again == 0, "its lease never ended while it heartbeated"
    envoy.wait_for_endpoints("web", [f"127.0.0.1:{stays.port}"], timeout=15)
    status, answer = http_json("PUT", b.registry_url + f"/v1/services/web/instances/{lapsing}/heartbeat")
    assert status == 404 and "register it again" in answer["error"], answer


def test_writes_while_etcd_is_down_answer_503_and_the_fleet_keeps_its_config(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    (a,) = etcd_replicas(processes, etcd, 1)
    client = RegistryClient(a.registry_url)
    client.define("web", listen=f"127.0.0.1:{free_port()}", protocol="http")
    client.register("web", "127.0.0.1", 9001)
    a.events.wait_for(is_event("snapshot_loaded"), what="the snapshot with web")

    etcd.process.stop()
    status, answer = http_json(
        "POST", a.registry_url + "/v1/services/web/instances", {"address": "127.0.0.1", "port": 9002}
    )
    assert status == 503 and f"etcd at {etcd.address}" in answer["error"], answer
    assert instance_ids(a, "web") == ["127.0.0.1:9001"], "reads keep serving the last view"
    status, health = get(a, "/healthz")
    assert status == 200 and health["etcd"]["problem"], health

    etcd.run()
    wait_until(
        lambda: (
            http_json("POST", a.registry_url + "/v1/services/web/instances", {"address": "127.0.0.1", "port": 9002})[0]
            == 201
        ),
        timeout=20,
        what="a registration to succeed once etcd is back",
    )
    wait_until(
        lambda: instance_ids(a, "web") == ["127.0.0.1:9001", "127.0.0.1:9002"],
        timeout=10,
        what="the registration made after etcd came back",
    )


def test_a_write_that_conflicts_with_the_merged_state_is_refused_and_not_stored(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    (a,) = etcd_replicas(processes, etcd, 1)
    listen = f"127.0.0.1:{free_port()}"
    RegistryClient(a.registry_url).define("web", listen=listen, protocol="http")
    status, answer = http_json("PUT", a.registry_url + "/v1/services/api", {"listen": listen, "protocol": "http"})
    assert status == 409 and "listen" in str(answer["problems"]), answer
    assert etcd.get_json("/pilotfish/services/api") is None


def leader_of(planes: list[ControlPlane]) -> ControlPlane | None:
    """The replica that says it runs the singleton duties (None: none does, right now)."""
    for plane in planes:
        if plane.process.alive():
            status, answer = get(plane, "/v1/self-preservation")
            if status == 200 and answer.get("leader"):
                return plane
    return None


def test_self_preservation_runs_on_the_elected_replica_and_moves_when_it_dies(processes: ProcessGroup) -> None:
    """Four TTL instances stop heartbeating at once (a partition): the elected replica keeps their
    leases instead of letting them end. SIGKILL it: another replica is elected and keeps them
    still. When heartbeats come back, one instance that stays silent alone ends as usual."""
    etcd = Etcd.start(processes)
    planes = etcd_replicas(processes, etcd, 2)
    client = RegistryClient(planes[0].registry_url)
    client.define("web", listen=f"127.0.0.1:{free_port()}", protocol="http")
    ids = [client.register("web", "127.0.0.1", 9001 + n, ttl=TTL_S) for n in range(4)]
    beating = [Heartbeats(client, "web", instance) for instance in ids]
    wait_until(lambda: leader_of(planes) is not None, timeout=20, what="a replica to be elected")
    first = leader_of(planes)
    assert first is not None
    follower = next(plane for plane in planes if plane is not first)

    # The partition: every heartbeat stops at once. Each lease would end after TTL_S; the leader
    # keeps them.
    for heartbeats in beating:
        heartbeats.stop()
    first.events.wait_for(
        is_event("registry_self_preservation", state="entered"),
        timeout=3 * TTL_S,
        what="self-preservation on the elected replica",
    )
    silent_since = time.monotonic()
    wait_until(lambda: time.monotonic() - silent_since > 2 * TTL_S, timeout=3 * TTL_S, what="two TTLs of silence")
    assert instance_ids(follower, "web") == sorted(ids), "the partitioned instances are kept"

    first.process.stop(kill=True)
    follower.events.wait_for(is_event("leader_elected"), timeout=20, what="the other replica to be elected")
    killed_at = time.monotonic()
    wait_until(lambda: time.monotonic() - killed_at > 2 * TTL_S, timeout=3 * TTL_S, what="two TTLs more")
    assert instance_ids(follower, "web") == sorted(ids), "the new leader keeps them too"

    # Heartbeats come back for three of them; the fourth stays silent alone and ends. (A lease
    # the guard kept may end just before its instance's first heartbeat lands: two of four lapsed
    # is no partition, so it ends with the silent one, and its client registers it again.)
    on_follower = RegistryClient(follower.registry_url)
    beating = [Heartbeats(on_follower, "web", instance) for instance in ids[:3]]
    try:
        wait_until(
            lambda: instance_ids(follower, "web") == sorted(ids[:3]),
            timeout=6 * TTL_S,
            what="the one silent instance to end once the others heartbeat again",
        )
    finally:
        for heartbeats in beating:
            heartbeats.stop()
    follower.events.wait_for(is_event("registry_self_preservation", state="exited"), what="self-preservation over")


def preservation_enabled(plane: ControlPlane) -> bool:
    status, answer = get(plane, "/v1/self-preservation")
    assert status == 200, answer
    enabled: bool = answer["enabled"]
    return enabled


def test_self_preservation_set_on_any_replica_applies_fleet_wide_and_survives_the_election_moving(
    processes: ProcessGroup,
) -> None:
    """Turned off on the elected replica, self-preservation stays off once that replica is SIGKILLed
    and another is elected: four instances that stop heartbeating at once (a partition, to
    self-preservation) are expired by the new leader. Turned on again through a replica that does
    not lead, the leader keeps the next four."""
    etcd = Etcd.start(processes)
    planes = etcd_replicas(processes, etcd, 3)
    wait_until(lambda: leader_of(planes) is not None, timeout=20, what="a replica to be elected")
    first = leader_of(planes)
    assert first is not None
    status, answer = http_json("PUT", first.registry_url + "/v1/self-preservation", {"enabled": False})
    assert status == 200 and answer["enabled"] is False, answer
    assert [preservation_enabled(plane) for plane in planes] == [False] * 3, "every replica says it is off"
    assert etcd.get_json("/pilotfish.self-preservation") == {"enabled": False}

    first.process.stop(kill=True)
    live = [plane for plane in planes if plane is not first]
    wait_until(lambda: leader_of(live) is not None, timeout=20, what="another replica to be elected")
    second = leader_of(live)
    assert second is not None
    follower = next(plane for plane in live if plane is not second)
    assert preservation_enabled(second) is False, "the new leader has the setting"

    # Four instances registered and never heartbeated: they lapse together. Off, each is expired.
    client = RegistryClient(follower.registry_url)
    client.define("web", listen=f"127.0.0.1:{free_port()}", protocol="http")
    mark = second.events.mark()
    for n in range(4):
        client.register("web", "127.0.0.1", 9001 + n, ttl=TTL_S)
    second.events.wait_for_count(
        is_event("registry_expired", service="web"),
        4,
        after=mark,
        timeout=6 * TTL_S,
        what="the new leader to expire the four lapsed instances",
    )
    assert second.events.find(is_event("registry_self_preservation", state="entered"), after=mark) is None, (
        "self-preservation is off: the new leader must not keep them"
    )
    wait_until(lambda: instance_ids(follower, "web") == [], timeout=10, what="the expired instances to go")

    # Turned on through the replica that does not lead: the leader keeps the next four.
    status, answer = http_json("PUT", follower.registry_url + "/v1/self-preservation", {"enabled": True})
    assert status == 200 and answer["enabled"] is True and answer["leader"] is False, answer
    assert preservation_enabled(second) is True
    mark = second.events.mark()
    ids = [client.register("web", "127.0.0.1", 9101 + n, ttl=TTL_S) for n in range(4)]
    second.events.wait_for(
        is_event("registry_self_preservation", state="entered"),
        after=mark,
        timeout=6 * TTL_S,
        what="self-preservation on the leader, turned on through another replica",
    )
    assert second.events.find(is_event("registry_expired"), after=mark) is None
    assert instance_ids(follower, "web") == sorted(ids), "the lapsed instances are kept"
