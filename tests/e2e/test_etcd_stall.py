"""An etcd that stops answering without closing anything (SIGSTOP: its sockets stay open, the
kernel still accepts connections) is noticed within ``--etcd-keepalive-s``, reported as etcd lost,
and followed again when it resumes.

Without the keepalive the watch (a long HTTP stream, silent while nothing changes) would wait on
the stalled etcd forever: nothing would be reported, and after the etcd resumed the replica would
only learn of changes if the old stream happened to still work.
"""

from __future__ import annotations

import time

import pytest

from .etcd import Etcd
from .event_log import is_event
from .processes import ProcessGroup, free_port, http_json, wait_until
from .replicas import etcd_replicas

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

KEEPALIVE_S = 3.0
SLACK_S = 2.0
"""What a busy machine may add to the keepalive (the probe's timer firing late, the log written on
the next turn of the event loop); still far below what a stall without keepalive takes: forever."""


def instance_ids(registry_url: str) -> list[str]:
    status, answer = http_json("GET", registry_url + "/v1/services/web")
    assert status == 200, answer
    return [i["id"] for i in answer["instances"]]


def test_a_stalled_etcd_is_reported_within_the_keepalive_and_followed_again_when_it_resumes(
        processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    etcd.put_json("/pilotfish/services/web", {"listen": f"127.0.0.1:{free_port()}", "protocol": "http"})
    etcd.put_json("/pilotfish/instances/web/a", {"address": "127.0.0.1", "port": 9001})
    (plane,) = etcd_replicas(processes, etcd, 1, options=("--quiet-ms", "50", "--etcd-keepalive-s", str(KEEPALIVE_S)))
    events = plane.events
    events.wait_for(is_event("snapshot_loaded"), what="the snapshot with web")
    assert instance_ids(plane.registry_url) == ["127.0.0.1:9001"]

    mark = events.mark()
    paused_at = time.time()
    etcd.pause()
    try:
        lost = events.wait_for(is_event("etcd_disconnected"), after=mark, timeout=KEEPALIVE_S + 10,
                               what="the stalled etcd to be reported")
        noticed = lost["ts"] - paused_at
        assert noticed <= KEEPALIVE_S + SLACK_S, f"noticed {noticed:.2f}s after the stall: {lost}"
        assert f"etcd at {etcd.address}" in lost["reason"], lost
        # /healthz says so too, and answers while etcd is stalled.
        status, health = http_json("GET", f"http://{plane.admin}/healthz", timeout=KEEPALIVE_S + 5)
        assert status == 200 and health["etcd"]["connected"] is False and health["etcd"]["problem"], health
        assert instance_ids(plane.registry_url) == ["127.0.0.1:9001"], "the last good state keeps serving"
    finally:
        etcd.resume()

    resumed = events.mark()
    events.wait_for(is_event("etcd_synced"), after=resumed, timeout=20, what="the replica to list etcd again")
    built = events.mark()
    revision = etcd.put_json("/pilotfish/instances/web/b", {"address": "127.0.0.1", "port": 9002})
    events.wait_for(is_event("snapshot_loaded"), after=built, timeout=10,
                    what="the change written after etcd resumed to reach the served snapshot")
    assert instance_ids(plane.registry_url) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    wait_until(lambda: http_json("GET", f"http://{plane.admin}/healthz")[1]["etcd"].get("lag") == 0, timeout=10,
               what="the replica to report itself caught up",
               details=lambda: str(http_json("GET", f"http://{plane.admin}/healthz")[1]))
    status, health = http_json("GET", f"http://{plane.admin}/healthz")
    assert health["etcd"]["connected"] is True and health["etcd"]["revision"] >= revision, health
