"""The Docker source without an engine: the engine flag, the labels (every documented one, and
malformed ones), the engine's JSON as it sends it, and the list-then-follow logic against event
sequences recorded from dockerd 20.10 (including events that arrive between the list and the
follow). The source against a real engine: tests/e2e/test_docker_discovery.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pilotfish.resources.services import Endpoint
from pilotfish.sources.docker import (
    Container,
    DockerView,
    container_of_inspect,
    container_of_summary,
    parse_engine,
    read_labels,
)

ID = "82dc5c93a978239915ba6f9256177f94900b63e08ba6ee6fe73ed7d778121f77"


def container(labels: dict[str, str], **kw: Any) -> Container:
    fields: dict[str, Any] = {
        "id": ID,
        "name": "web-1",
        "labels": labels,
        "running": True,
        "paused": False,
        "health": None,
        "host_network": True,
        "published": {},
    }
    return Container(**(fields | kw))


def event(action: str, container_id: str = ID, **attributes: str) -> dict[str, Any]:
    """An event as dockerd sends it (the fields the source reads, and a few it does not)."""
    return {
        "status": action,
        "id": container_id,
        "from": "pilotfish-e2e-busybox",
        "Type": "container",
        "Action": action,
        "Actor": {"ID": container_id, "Attributes": {"image": "pilotfish-e2e-busybox", "name": "web-1", **attributes}},
        "scope": "local",
        "time": 1796241151,
        "timeNano": 1796241151790393958,
    }


# -- the engine flag ------------------------------------------------------------------------------


def test_an_engine_is_a_socket_or_a_tcp_address_with_the_address_its_containers_are_reached_at() -> None:
    local = parse_engine("unix:///var/run/docker.sock")
    assert (local.url, local.address, local.socket_path) == (
        "unix:///var/run/docker.sock",
        "127.0.0.1",
        "/var/run/docker.sock",
    )
    assert local.source == "docker:unix:///var/run/docker.sock"
    remote = parse_engine("tcp://10.0.0.5:2376")
    assert (remote.address, remote.base) == ("10.0.0.5", "http://10.0.0.5:2376")
    assert parse_engine("tcp://docker-host:2376@10.0.0.7").address == "10.0.0.7"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("/var/run/docker.sock", "expected unix:///PATH or tcp://HOST:PORT"),
        ("unix://docker.sock", "unix:///ABSOLUTE/PATH"),
        ("tcp://10.0.0.5", "tcp://HOST:PORT"),
        ("tcp://10.0.0.5:99999", "tcp://HOST:PORT"),
        ("tcp://docker-host:2376", "tcp://docker-host:2376@ADDRESS"),
        ("unix:///var/run/docker.sock@localhost", "not an IP address"),
    ],
)
def test_a_bad_engine_flag_says_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--docker") as raised:
        parse_engine(text)
    assert says in str(raised.value)


# -- labels ---------------------------------------------------------------------------------------


def test_pilotfishs_labels_give_services_ports_weight_zone_and_metadata() -> None:
    labels = {
        "pilotfish.service": "web:8080, admin:9090,api",
        "pilotfish.port": "7070",
        "pilotfish.weight": "3",
        "pilotfish.zone": "eu-1a",
        "pilotfish.metadata.version": "v2",
        "other": "ignored",
    }
    serves = read_labels(container(labels), "127.0.0.1")
    assert not serves.problems
    metadata = (("container", "web-1"), ("version", "v2"))
    assert serves.endpoints == (
        ("web", Endpoint("127.0.0.1", 8080, 3, metadata, "eu-1a")),
        ("admin", Endpoint("127.0.0.1", 9090, 3, metadata, "eu-1a")),
        ("api", Endpoint("127.0.0.1", 7070, 3, metadata, "eu-1a")),
    )


def test_each_endpoint_names_the_engine_and_the_container_it_came_from() -> None:
    """What /v1/config shows of a Docker endpoint: its metadata says which engine and container."""
    view = DockerView("127.0.0.1", engine="unix:///var/run/docker.sock")
    view.replace([container({"pilotfish.service": "web:8080", "pilotfish.metadata.version": "v2"})])
    (endpoint,) = view.state().endpoints["web"]
    assert endpoint.metadata == (
        ("container", "web-1"),
        ("engine", "unix:///var/run/docker.sock"),
        ("version", "v2"),
    )


def test_a_published_port_is_reached_at_the_host_port_on_the_engines_address() -> None:
    bridged = container({"pilotfish.service": "web:80"}, host_network=False, published={80: 32768})
    assert read_labels(bridged, "10.0.0.5").endpoints[0][1][:2] == ("10.0.0.5", 32768)
    unpublished = read_labels(replace(bridged, published={}), "10.0.0.5")
    assert not unpublished.endpoints
    assert "container port 80 is not published" in str(unpublished.problems[0])


def test_sidecars_labels_give_the_service_and_keep_its_service_port() -> None:
    serves = read_labels(
        container({"ServiceName": "nginx", "ServicePort_80": "9500"}, host_network=False, published={80: 32770}),
        "127.0.0.1",
    )
    assert serves.endpoints == (
        ("nginx", Endpoint("127.0.0.1", 32770, 1, (("container", "web-1"), ("service_port", "9500")))),
    )
    both = read_labels(
        container({"ServiceName": "nginx", "ServicePort_80": "9500", "pilotfish.service": "web:80"}), "h"
    )
    assert [service for service, _ in both.endpoints] == ["web"]  # pilotfish's labels win


def test_a_container_without_a_service_label_is_not_ours() -> None:
    serves = read_labels(container({"com.example.team": "payments"}), "127.0.0.1")
    assert (serves.endpoints, serves.problems, serves.labelled) == ((), (), False)


@pytest.mark.parametrize(
    ("labels", "where", "says"),
    [
        ({"pilotfish.service": "web:http"}, "label pilotfish.service", "expected NAME:PORT"),
        ({"pilotfish.service": "web:0"}, "label pilotfish.service", "expected NAME:PORT"),
        ({"pilotfish.service": "web"}, "label pilotfish.service", "'web' has no port"),
        ({"pilotfish.service": "web/v2:80"}, "label pilotfish.service", "not a service name"),
        ({"pilotfish.service": "", "pilotfish.port": "80"}, "label pilotfish.service", "not a service name"),
        ({"pilotfish.service": "web", "pilotfish.port": "eighty"}, "label pilotfish.port", "expected a port"),
        ({"pilotfish.service": "web:80", "pilotfish.weight": "0"}, "label pilotfish.weight", "1-128"),
        ({"pilotfish.service": "web:80", "pilotfish.weight": "heavy"}, "label pilotfish.weight", "1-128"),
        ({"pilotfish.service": "web:80", "pilotfish.zone": "eu 1"}, "label pilotfish.zone", "not a zone"),
        ({"pilotfish.service": "web:80", "pilotfish.metadata.": "x"}, "label pilotfish.metadata.", "names its key"),
        ({"pilotfish.service": "web:80", "pilotfish.metadata.k": "v" * 5000}, "labels pilotfish.metadata.*", "4096"),
        ({"ServiceName": "nginx"}, "label ServiceName", "needs a ServicePort_"),
        ({"ServiceName": "nginx", "ServicePort_http": "9500"}, "label ServicePort_http", "ServicePort_<port>"),
        ({"ServiceName": "ng inx", "ServicePort_80": "9500"}, "label ServiceName", "not a service name"),
    ],
)
def test_a_malformed_label_names_the_container_and_the_label_and_serves_nothing(
    labels: dict[str, str], where: str, says: str
) -> None:
    serves = read_labels(container(labels), "127.0.0.1")
    assert serves.endpoints == () and serves.labelled
    assert [p.where for p in serves.problems] == [f"container web-1 {where}"], serves.problems
    assert says in serves.problems[0].message


# -- the engine's JSON ----------------------------------------------------------------------------


def test_a_listing_entry_and_a_description_say_the_same_of_a_container() -> None:
    listed = container_of_summary(
        {
            "Id": ID,
            "Names": ["/web-1"],
            "Image": "pilotfish-e2e-busybox",
            "Labels": {"pilotfish.service": "web:80"},
            "State": "running",
            "Status": "Up 11 minutes (healthy)",
            "Ports": [
                {"IP": "0.0.0.0", "PrivatePort": 80, "PublicPort": 32768, "Type": "tcp"},
                {"IP": "::", "PrivatePort": 80, "PublicPort": 32768, "Type": "tcp"},
                {"PrivatePort": 443, "Type": "tcp"},  # exposed, not published
                {"IP": "0.0.0.0", "PrivatePort": 53, "PublicPort": 5353, "Type": "udp"},
            ],
            "HostConfig": {"NetworkMode": "default"},
        }
    )
    described = container_of_inspect(
        {
            "Id": ID,
            "Name": "/web-1",
            "State": {"Status": "running", "Running": True, "Paused": False, "Health": {"Status": "healthy"}},
            "Config": {"Labels": {"pilotfish.service": "web:80"}},
            "HostConfig": {"NetworkMode": "default"},
            "NetworkSettings": {
                "Ports": {
                    "80/tcp": [{"HostIp": "0.0.0.0", "HostPort": "32768"}, {"HostIp": "::", "HostPort": "32768"}],
                    "443/tcp": None,
                    "53/udp": [{"HostIp": "0.0.0.0", "HostPort": "5353"}],
                }
            },
        }
    )
    assert (
        listed
        == described
        == container({"pilotfish.service": "web:80"}, health="healthy", host_network=False, published={80: 32768})
    )


@pytest.mark.parametrize(
    ("status", "health"),
    [("Up 3 seconds (health: starting)", "starting"), ("Up 1 minute (unhealthy)", "unhealthy"), ("Up 2 hours", None)],
)
def test_a_listing_entry_says_its_health_in_its_status(status: str, health: str | None) -> None:
    entry = {"Id": ID, "Names": ["/x"], "State": "running", "Status": status, "HostConfig": {"NetworkMode": "host"}}
    assert container_of_summary(entry).health == health


def test_what_is_not_a_container_is_refused_with_a_value_error() -> None:
    for bad in (
        {},
        {"Id": ID, "Labels": ["a"]},
        {"Id": ID, "Ports": [{"PrivatePort": "x", "PublicPort": 1, "Type": "tcp"}]},
    ):
        with pytest.raises(ValueError):
            container_of_summary(bad)
    with pytest.raises(ValueError):
        container_of_inspect({"Id": ID})


def test_a_container_serves_while_running_unpaused_and_healthy_if_checked() -> None:
    assert container({}).serving
    assert container({}, health="healthy").serving
    for state in ({"health": "starting"}, {"health": "unhealthy"}, {"paused": True}, {"running": False}):
        assert not container({}, **state).serving


# -- the list, then the events --------------------------------------------------------------------


def web(port: int, container_id: str = ID, **kw: Any) -> Container:
    return container({"pilotfish.service": f"web:{port}"}, id=container_id, name=f"web-{port}", **kw)


def served(view: DockerView) -> list[int]:
    return sorted(e.port for e in view.state().endpoints.get("web", ()))


def test_docker_stop_removes_the_container_on_the_kill_before_it_exits_and_start_brings_it_back() -> None:
    view = DockerView("127.0.0.1")
    view.replace([web(8081), web(8082, "b" * 64)])
    assert served(view) == [8081, 8082]
    # `docker restart`, as dockerd 20.10 reports it: kill 15 (stop's TERM), kill 9, die, stop, start, restart
    assert view.event(event("kill", signal="15")) is None and view.changed
    assert served(view) == [8082], "gone at the TERM, while it still runs and drains"
    assert view.event(event("kill", signal="9")) is None and not view.changed
    assert view.event(event("die", exitCode="137")) is None and view.changed
    assert view.event(event("stop")) is None
    assert served(view) == [8082]
    assert view.event(event("start")) == ID  # (looked at again: the engine says what it is now)
    view.put(web(8081))
    assert view.event(event("restart")) == ID
    assert served(view) == [8081, 8082]


def test_a_signal_that_does_not_stop_a_container_changes_nothing() -> None:
    view = DockerView("127.0.0.1")
    view.replace([web(8081)])
    assert view.event(event("kill", signal="1")) is None and not view.changed  # docker kill -s HUP
    assert served(view) == [8081]


def test_health_and_pause_are_read_from_the_container_looked_at_again() -> None:
    view = DockerView("127.0.0.1")
    view.replace([web(8081, health="starting")])
    assert served(view) == []
    assert view.event(event("health_status: healthy")) == ID
    view.put(web(8081, health="healthy"))
    assert served(view) == [8081]
    assert view.event(event("pause")) == ID
    view.put(web(8081, health="healthy", paused=True))
    assert served(view) == []
    assert view.event(event("unpause")) == ID
    view.put(web(8081, health="healthy"))
    assert served(view) == [8081]
    for noise in ("exec_create: /bin/sh -c true", "exec_start: /bin/sh -c true", "create", "attach"):
        assert view.event(event(noise)) is None and not view.changed


def test_events_that_arrived_between_the_list_and_the_follow_are_applied_to_the_list() -> None:
    """The stream is opened, then the engine listed: a container killed meanwhile is listed as
    running (it drains) and its kill is read after the list; one started meanwhile is listed
    already and its start only makes the source look again; one that died meanwhile is not
    listed, and its die changes nothing."""
    view = DockerView("127.0.0.1")
    view.replace([web(8081), web(8082, "b" * 64)])
    for late in (event("kill", signal="15"), event("start", "b" * 64), event("die", "c" * 64)):
        looked = view.event(late)
        if looked is not None:
            view.put(web(8082, looked))
    assert served(view) == [8082]


def test_a_listing_replaces_the_view_and_keeps_a_stopping_container_stopping() -> None:
    view = DockerView("127.0.0.1")
    view.replace([web(8081), web(8082, "b" * 64)])
    view.event(event("kill", signal="15"))
    view.replace([web(8081), web(8083, "c" * 64)])  # relisted after a reconnect: 8082 went, 8083 came
    assert served(view) == [8083]
    view.replace([web(8083, "c" * 64)])
    assert served(view) == [8083] and not view.stopping


def test_label_problems_are_reported_once_per_container_and_problem() -> None:
    view = DockerView("127.0.0.1")
    bad = container({"pilotfish.service": "web:http"}, id="d" * 64)
    assert [p.where for _, p in view.replace([bad])] == ["container web-1 label pilotfish.service"]
    assert view.put(replace(bad, health="healthy")) == []  # looked at again: said already
    assert view.replace([bad]) == []
    assert view.describe()[0]["serving"] is False and view.describe()[0]["problems"]


def test_containers_beyond_the_bound_are_left_out_and_counted() -> None:
    view = DockerView("127.0.0.1", max_containers=2)
    view.replace([web(8000 + i, str(i) * 64) for i in range(1, 5)])
    assert len(view.containers) == 2 and view.left_out == 2
    view.put(web(8009, "9" * 64))
    assert len(view.containers) == 2 and view.left_out == 3
