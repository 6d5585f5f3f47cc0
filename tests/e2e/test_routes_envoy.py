"""Routes and DNS endpoints of the services model, served to a real Envoy.

The seed-002 lab's route table (``/marker`` answered by Envoy itself, ``/slow`` to one service,
everything else to a pool) as examples/routes.yaml writes it in ``services:`` serves the answers it should,
and the same answers as the hand-written Envoy form of that table; a weighted split sends each
service its share of 2,000 requests; an endpoint written as a host name (``localhost``) serves
through the STRICT_DNS cluster Envoy resolves it in; a name that stops resolving is served by its
last good address (pilotfish looks the names up too) until it resolves again.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lab_routes import lab_route_config

from .event_log import is_event
from .name_server import NameServer, envoy_resolves_with
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, http_get, http_json, wait_until
from .snapshot_file import write_document, write_services
from .testbed import wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = "edge-1"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "routes.yaml"
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def _serving(processes: ProcessGroup, services: dict[str, Any]) -> tuple[ControlPlane, Envoy]:
    path = processes.workdir / "services.yaml"
    write_services(path, services)
    control_plane = ControlPlane(processes, path, free_port(), options=("--quiet-ms", "20"))
    control_plane.start()
    envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=control_plane.address)
    return control_plane, envoy


def _get(port: int, path: str) -> tuple[int, str]:
    return http_get(f"http://127.0.0.1:{port}{path}", timeout=10)


def _lab(listen: int, slow: Upstream, pool: list[Upstream]) -> dict[str, Any]:
    """The seed-002 lab as examples/routes.yaml writes it, on this test's ports."""
    services: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())["services"]
    services["edge"]["listen"] = f"127.0.0.1:{listen}"
    services["slow"]["endpoints"] = [f"127.0.0.1:{slow.port}"]
    services["pool"]["endpoints"] = [f"127.0.0.1:{u.port}" for u in pool]
    return services


def _lab_raw(listen: int, slow: Upstream, pool: list[Upstream]) -> dict[str, Any]:
    """The same table as hand-written Envoy resources (what the lab needed before ``routes``)."""
    assert [r.get("timeout") for r in _lab(listen, slow, pool)["edge"]["routes"]] == [None, "1s", None]

    def cluster(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "type": "EDS",
            "connect_timeout": "1s",
            "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        }

    def assignment(name: str, upstreams: list[Upstream]) -> dict[str, Any]:
        return {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": u.port}}}}
                        for u in upstreams
                    ]
                }
            ],
        }

    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "edge",
        "rds": {"route_config_name": "edge", "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "clusters": [cluster("edge"), cluster("slow"), cluster("pool")],  # (edge: as the services form has)
        "endpoints": [assignment("edge", []), assignment("slow", [slow]), assignment("pool", pool)],
        "listeners": [
            {
                "name": "edge",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [
                    {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
                ],
            }
        ],
        "routes": [lab_route_config(slow_timeout="1s")],
    }


def _answers(port: int) -> dict[str, Any]:
    """What the lab answers: per path, the statuses and bodies seen (the pool's by set)."""
    pool = {_get(port, "/") for _ in range(20)}
    return {
        "/marker": _get(port, "/marker"),
        "/marker/x": _get(port, "/marker/x")[0],  # exact: not the marker, the pool (which has no /marker/x)
        "/slow": _get(port, "/slow?ms=10"),
        "/slow too slow": _get(port, "/slow?ms=3000")[0],  # the route's 1 s timeout
        "/": pool,
    }


def test_the_lab_route_table_in_services_serves_what_its_raw_form_serves(processes: ProcessGroup) -> None:
    slow = Upstream.start(processes, "slow")
    pool = [Upstream.start(processes, "pool-a"), Upstream.start(processes, "pool-b")]
    listen = free_port()
    control_plane, envoy = _serving(processes, _lab(listen, slow, pool))
    wait_until(
        lambda: _get(listen, "/marker") == (200, "marker\n") and _get(listen, "/")[0] == 200,
        timeout=20,
        what="Envoy to serve the lab's routes",
        details=envoy.log_tail,
    )
    answers = _answers(listen)
    assert answers == {
        "/marker": (200, "marker\n"),
        "/marker/x": 404,
        "/slow": (200, "slow"),
        "/slow too slow": 504,
        "/": {(200, "pool-a"), (200, "pool-b")},
    }

    # The hand-written form of the same table: the same answers.
    assert control_plane.snapshot_path is not None
    mark = control_plane.events.mark()
    write_document(control_plane.snapshot_path, _lab_raw(listen, slow, pool))
    wait_for_acks(control_plane.events, node=NODE, what="the raw form", types=[CDS, RDS], after=mark)
    assert _answers(listen) == answers


def test_a_weighted_split_sends_each_service_its_share(processes: ProcessGroup) -> None:
    pool = [Upstream.start(processes, "pool-a"), Upstream.start(processes, "pool-b")]
    canary = Upstream.start(processes, "canary")
    listen = free_port()
    _, envoy = _serving(
        processes,
        {
            "edge": {"listen": f"127.0.0.1:{listen}", "routes": [{"to": {"pool": 3, "canary": 1}}]},
            "pool": {"endpoints": [f"127.0.0.1:{u.port}" for u in pool]},
            "canary": {"endpoints": [f"127.0.0.1:{canary.port}"]},
        },
    )
    wait_until(
        lambda: {_get(listen, "/")[1] for _ in range(40)} == {"pool-a", "pool-b", "canary"},
        timeout=20,
        what="Envoy to send requests to both services of the split",
        details=envoy.log_tail,
    )
    total = 2000
    counts = Counter(_get(listen, "/") for _ in range(total))
    assert set(counts) == {(200, "pool-a"), (200, "pool-b"), (200, "canary")}, counts
    pool_share = (counts[200, "pool-a"] + counts[200, "pool-b"]) / total
    canary_share = counts[200, "canary"] / total
    # 3:1 -> 75 % and 25 %, each within 5 percentage points (one sigma over 2,000 is about 1).
    assert abs(pool_share - 0.75) <= 0.05 and abs(canary_share - 0.25) <= 0.05, counts


def test_an_endpoint_named_localhost_serves_through_a_dns_cluster(processes: ProcessGroup) -> None:
    named = Upstream.start(processes, "named")
    listen = free_port()
    _, envoy = _serving(
        processes,
        {
            "edge": {"listen": f"127.0.0.1:{listen}", "routes": [{"prefix": "/gone", "to": "gone"}, {"to": "named"}]},
            "named": {"endpoints": [f"localhost:{named.port}"]},
            "gone": {"endpoints": ["no-such-host.invalid:80"]},  # a name nothing resolves (RFC 2606)
        },
    )
    wait_until(
        lambda: _get(listen, "/") == (200, "named"),
        timeout=20,
        what="Envoy to serve through the endpoint it resolves (localhost)",
        details=envoy.log_tail,
    )
    assert envoy.cluster_endpoints("named") == [f"127.0.0.1:{named.port}"], "localhost resolved, IPv4 first"
    dump = envoy.admin("/config_dump?resource=dynamic_active_clusters")
    assert dump.count('"type": "STRICT_DNS"') == 2, dump[:2000]
    # A name that does not resolve leaves its cluster without hosts: its route answers 503, the
    # others serve on.
    wait_until(
        lambda: int(envoy.stat("cluster.gone.update_attempt") or 0) >= 1,
        timeout=20,
        what="Envoy's first lookup of no-such-host.invalid",
    )
    assert _get(listen, "/gone") == (503, "no healthy upstream")
    assert _get(listen, "/") == (200, "named")


def _request(port: int, path: str, headers: dict[str, str]) -> tuple[int, str, str | None]:
    """GET with headers, redirects not followed: (status, body, Location)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode(), response.getheader("Location")
    finally:
        connection.close()


def test_host_header_and_regex_matchers_and_a_redirect_route_as_written(processes: ProcessGroup) -> None:
    a, b, c = (Upstream.start(processes, name) for name in ("a", "b", "c"))
    listen = free_port()
    _, envoy = _serving(
        processes,
        {
            "edge": {
                "listen": f"127.0.0.1:{listen}",
                "routes": [
                    {"prefix": "/old/", "redirect": {"prefix": "/new/", "code": 308}},
                    {"host": ["API.example.com", "*.internal"], "to": "a"},
                    {"headers": {"x-canary": "1", "x-debug": False}, "to": "b"},
                    {"regex": "/s[a-z]ow", "to": "c"},  # the whole path: /slow, not /slow/x
                    {"direct_response": {"status": 404, "body": "no route"}},
                ],
            },
            "a": {"endpoints": [f"127.0.0.1:{a.port}"]},
            "b": {"endpoints": [f"127.0.0.1:{b.port}"]},
            "c": {"endpoints": [f"127.0.0.1:{c.port}"]},
        },
    )
    wait_until(
        lambda: _request(listen, "/", {})[:2] == (404, "no route"),
        timeout=20,
        what="Envoy to serve the routes",
        details=envoy.log_tail,
    )
    cases = {
        ("/old/x?y=1", ()): (308, "", "http://localhost/new/x?y=1"),
        ("/", (("Host", f"api.example.com:{listen}"),)): (200, "a", None),
        ("/", (("Host", "API.EXAMPLE.COM"),)): (200, "a", None),
        ("/", (("Host", "db.eu.internal"),)): (200, "a", None),
        ("/", (("Host", "example.com"),)): (404, "no route", None),
        ("/", (("x-canary", "1"),)): (200, "b", None),
        ("/", (("x-canary", "1"), ("x-debug", "on"))): (404, "no route", None),
        ("/slow", ()): (200, "c", None),
        ("/slow/x", ()): (404, "no route", None),
    }
    seen = {case: _request(listen, case[0], {"Host": "localhost", **dict(case[1])}) for case in cases}
    assert seen == cases


def _dns_cluster(envoy: Envoy, name: str) -> tuple[str, list[str]]:
    """The type of Envoy's active cluster ``name`` and the addresses written in it (names or IPs)."""
    dump = json.loads(envoy.admin("/config_dump?resource=dynamic_active_clusters"))
    for entry in dump.get("configs", []):
        cluster = entry["cluster"]
        if cluster["name"] == name:
            written = [
                f"{e['endpoint']['address']['socket_address']['address']}:"
                f"{e['endpoint']['address']['socket_address']['port_value']}"
                for group in cluster.get("load_assignment", {}).get("endpoints", [])
                for e in group.get("lb_endpoints", [])
            ]
            return cluster.get("type", ""), written
    return "", []


def _also_bare(name: str, port: int) -> Callable[[dict[str, Any]], None]:
    """A bootstrap edit: a static STRICT_DNS cluster ``bare`` of ``name``, which pilotfish does not
    serve: it shows what Envoy's own lookups make of the name (every second)."""

    def edit(bootstrap: dict[str, Any]) -> None:
        address = {"socket_address": {"address": name, "port_value": port}}
        bootstrap["static_resources"]["clusters"].append(
            {
                "name": "bare",
                "type": "STRICT_DNS",
                "connect_timeout": "1s",
                "dns_refresh_rate": "1s",
                "dns_lookup_family": "V4_PREFERRED",
                "load_assignment": {
                    "cluster_name": "bare",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                },
            }
        )

    return edit


def test_a_name_that_stops_resolving_is_served_by_its_last_good_address_until_it_resolves_again(
    processes: ProcessGroup,
) -> None:
    """``backend.test`` resolves, is deleted, and comes back, for pilotfish and for Envoy alike:
    pilotfish reads a hosts file of the test's own as its /etc/hosts (a mount namespace of its
    own; the machine's is untouched, and glibc reads it at each lookup), and Envoy asks a DNS
    server of the test's own (c-ares reads /etc/hosts only once, so a hosts file cannot take a
    name away from it), which then answers NXDOMAIN. Envoy's own lookups empty a cluster of the
    name (``bare``); the service pilotfish serves keeps the name's last good address in its place
    and serves on; once the name resolves again it is served as the name again."""
    named = Upstream.start(processes, "named")
    dns = NameServer.start({"backend.test": ["127.0.0.1"]})
    try:
        hosts = processes.workdir / "hosts"
        with_name = "127.0.0.1 localhost\n127.0.0.1 backend.test\n"
        hosts.write_text(with_name)
        listen = free_port()
        path = processes.workdir / "services.yaml"
        write_services(path, {"api": {"listen": f"127.0.0.1:{listen}", "endpoints": [f"backend.test:{named.port}"]}})
        options = ("--quiet", "20ms", "--dns-refresh", "200ms")
        control_plane = ControlPlane(processes, path, free_port(), options=options, hosts_file=hosts)
        control_plane.start()

        def edit(bootstrap: dict[str, Any]) -> None:
            envoy_resolves_with(dns)(bootstrap)
            _also_bare("backend.test", named.port)(bootstrap)

        envoy = Envoy.start(
            processes, name="envoy", node_id=NODE, xds_address=control_plane.address, bootstrap_edit=edit
        )
        wait_until(
            lambda: _get(listen, "/") == (200, "named"),
            timeout=20,
            what="Envoy to serve through backend.test",
            details=envoy.log_tail,
        )
        assert _dns_cluster(envoy, "api") == ("STRICT_DNS", [f"backend.test:{named.port}"])
        wait_until(lambda: _dns_names(control_plane).get("resolving") == 1, timeout=20, what="pilotfish's lookup")

        mark = control_plane.events.mark()
        hosts.write_text("127.0.0.1 localhost\n")  # (in place: the mount holds this very file)
        del dns.names["backend.test"]
        said = control_plane.events.wait_for(
            is_event("dns_unresolved"), after=mark, what="the name reported", timeout=20
        )
        assert (said["name"], said["services"], said["kept"]) == ("backend.test", ["api"], ["127.0.0.1"]), said
        # Served in the name's place: its last good address, in a cluster still STRICT_DNS.
        wait_until(
            lambda: _dns_cluster(envoy, "api") == ("STRICT_DNS", [f"127.0.0.1:{named.port}"]),
            timeout=20,
            what="Envoy to be served the last good address of backend.test",
            details=lambda: str(_dns_cluster(envoy, "api")),
        )
        # Envoy's own lookups of the name now find nothing (the static cluster empties); once it has
        # looked the service's hosts up again since, the service still serves.
        wait_until(lambda: envoy.cluster_endpoints("bare") == [], timeout=20, what="Envoy's own lookup to empty bare")
        attempts = int(envoy.stat("cluster.api.update_attempt") or 0)
        wait_until(
            lambda: int(envoy.stat("cluster.api.update_attempt") or 0) >= attempts + 2,
            timeout=20,
            what="Envoy to look the service's hosts up again",
        )
        assert _get(listen, "/") == (200, "named")
        status, config = http_json("GET", f"http://{control_plane.admin}/v1/config?node={NODE}")
        assert status == 200, config
        (cluster,) = [c for c in config["types"]["CDS"]["resources"] if c["name"] == "api"]
        (kept,) = [e for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
        assert kept["metadata"]["filter_metadata"]["pilotfish"] == {"unresolved_name": "backend.test"}, kept
        assert _dns_names(control_plane)["kept"] == 1
        status, looked_up = http_json("GET", f"http://{control_plane.admin}/v1/dns")
        assert looked_up["names"] == [
            {
                "name": "backend.test",
                "services": ["api"],
                "resolves": False,
                "last_good": ["127.0.0.1"],
                "served": ["127.0.0.1"],
            }
        ], looked_up

        mark = control_plane.events.mark()
        dns.names["backend.test"] = ["127.0.0.1"]
        hosts.write_text(with_name)
        back = control_plane.events.wait_for(is_event("dns_resolved"), after=mark, what="the name back", timeout=20)
        assert (back["name"], back["addresses"]) == ("backend.test", ["127.0.0.1"]), back
        wait_until(
            lambda: _dns_cluster(envoy, "api") == ("STRICT_DNS", [f"backend.test:{named.port}"]),
            timeout=20,
            what="Envoy to be served the name again",
        )
        wait_until(lambda: _get(listen, "/") == (200, "named"), timeout=20, what="the service through the name again")
    finally:
        dns.close()


def _dns_names(control_plane: ControlPlane) -> dict[str, float]:
    """``pilotfish_dns_names`` by state, from /metrics."""
    status, text = http_get(f"http://{control_plane.admin}/metrics")
    assert status == 200, text
    return {
        sample.labels["state"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pilotfish_dns_names"
    }
