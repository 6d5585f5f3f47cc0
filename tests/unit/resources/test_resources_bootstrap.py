"""Bootstraps listing several pilotfish replicas: every one an endpoint of the ``xds_cluster`` (ADS,
delta, REST), each one's name accepted under TLS, and each one an ``xds_servers`` entry for gRPC."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from pilotfish.commands.cli import main
from pilotfish.resources.bootstrap import (
    FAILOVER_OUTLIER_DETECTION,
    XDS_CLUSTER,
    BootstrapSettings,
    bootstrap,
    grpc_bootstrap,
    split_addresses,
)

REPLICAS = ("10.0.0.1:18000", "10.0.0.2:18000", "10.0.0.3:18000")


def xds_cluster(config: dict[str, Any]) -> dict[str, Any]:
    clusters: list[dict[str, Any]] = config["static_resources"]["clusters"]
    [cluster] = clusters
    assert cluster["name"] == XDS_CLUSTER
    return cluster


def endpoints(cluster: dict[str, Any]) -> list[str]:
    [locality] = cluster["load_assignment"]["endpoints"]
    return [
        f"{e['endpoint']['address']['socket_address']['address']}:"
        f"{e['endpoint']['address']['socket_address']['port_value']}"
        for e in locality["lb_endpoints"]
    ]


def san_matchers(cluster: dict[str, Any]) -> list[tuple[str, str]]:
    context = cluster["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
    return [(m["san_type"], m["matcher"]["exact"]) for m in context["match_typed_subject_alt_names"]]


@pytest.mark.parametrize("delta", [False, True])
def test_every_replica_is_an_endpoint_of_the_xds_cluster(delta: bool) -> None:
    config = bootstrap(BootstrapSettings(node_id="edge-1", xds=REPLICAS, delta=delta))
    assert config["dynamic_resources"]["ads_config"]["api_type"] == ("DELTA_GRPC" if delta else "GRPC")
    cluster = xds_cluster(config)
    assert endpoints(cluster) == list(REPLICAS)
    assert cluster["type"] == "STATIC" and cluster["connect_timeout"] == "1s"
    # A replica that died is ejected at its first failed connection: the stream's retries go elsewhere.
    assert cluster["outlier_detection"] == FAILOVER_OUTLIER_DETECTION
    assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 1
    retry = config["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["retry_policy"]
    assert retry["retry_back_off"] == {"base_interval": "0.1s", "max_interval": "1s"}


def test_one_address_gives_the_bootstrap_it_always_gave() -> None:
    cluster = xds_cluster(bootstrap(BootstrapSettings(node_id="edge-1", xds="10.0.0.1:18000")))
    assert endpoints(cluster) == ["10.0.0.1:18000"]
    assert "outlier_detection" not in cluster


def test_addresses_come_as_a_tuple_or_separated_by_commas() -> None:
    assert split_addresses("10.0.0.1:1, 10.0.0.2:2") == ("10.0.0.1:1", "10.0.0.2:2")
    assert split_addresses(("[::1]:1", "a.example:2")) == ("[::1]:1", "a.example:2")
    assert bootstrap(BootstrapSettings(node_id="n", xds=",".join(REPLICAS))) == bootstrap(
        BootstrapSettings(node_id="n", xds=REPLICAS)
    )


@pytest.mark.parametrize(
    ("xds", "problem"),
    [
        ("10.0.0.1:1,10.0.0.1:1", "given twice"),
        ("10.0.0.1:1,", "one or more HOST:PORT"),
        ((), "one or more HOST:PORT"),
        ("10.0.0.1:1,10.0.0.2", "is not HOST:PORT"),
        ("10.0.0.1:1,10.0.0.2:99999", "port must be"),
    ],
)
def test_a_bad_address_list_is_refused_naming_what_is_wrong(xds: str | tuple[str, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        BootstrapSettings(node_id="n", xds=xds)


def test_rest_pollers_reach_every_replica_too() -> None:
    config = bootstrap(BootstrapSettings(node_id="n", rest=REPLICAS[:2]))
    cluster = xds_cluster(config)
    assert endpoints(cluster) == list(REPLICAS[:2]) and cluster["outlier_detection"] == FAILOVER_OUTLIER_DETECTION
    assert "typed_extension_protocol_options" not in cluster  # HTTP/1.1


def test_tls_with_replicas_on_several_ips_accepts_each_ip_and_sends_no_sni() -> None:
    cluster = xds_cluster(bootstrap(BootstrapSettings(node_id="n", xds=REPLICAS, tls_ca="/ca.pem")))
    assert san_matchers(cluster) == [("IP_ADDRESS", "10.0.0.1"), ("IP_ADDRESS", "10.0.0.2"), ("IP_ADDRESS", "10.0.0.3")]
    tls = cluster["transport_socket"]["typed_config"]
    assert "sni" not in tls and "auto_host_sni" not in tls


def test_tls_with_replicas_by_host_name_checks_each_name_and_sends_it_as_sni() -> None:
    names = ("xds-a.example:18000", "xds-b.example:18000")
    cluster = xds_cluster(bootstrap(BootstrapSettings(node_id="n", xds=names, tls_ca="/ca.pem")))
    assert cluster["type"] == "STRICT_DNS" and cluster["dns_lookup_family"] == "V4_PREFERRED"
    assert san_matchers(cluster) == [("DNS", "xds-a.example"), ("DNS", "xds-b.example")]
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["auto_host_sni"] is True and "sni" not in tls


def test_replicas_on_one_host_are_one_name() -> None:
    local = ("127.0.0.1:18000", "127.0.0.1:18010", "127.0.0.1:18020")
    cluster = xds_cluster(bootstrap(BootstrapSettings(node_id="n", xds=local, tls_ca="/ca.pem")))
    assert san_matchers(cluster) == [("IP_ADDRESS", "127.0.0.1")]


def test_a_common_server_name_is_the_one_name_every_replica_must_carry() -> None:
    cluster = xds_cluster(
        bootstrap(BootstrapSettings(node_id="n", xds=REPLICAS, tls_ca="/ca.pem", tls_server_name="xds.example"))
    )
    assert san_matchers(cluster) == [("DNS", "xds.example")]
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["sni"] == "xds.example" and "auto_host_sni" not in tls


def test_a_grpc_bootstrap_lists_the_replicas_in_order() -> None:
    config = grpc_bootstrap(BootstrapSettings(node_id="c", xds=REPLICAS, tls_ca="ca.pem"))
    assert [s["server_uri"] for s in config["xds_servers"]] == list(REPLICAS)
    assert all(
        s["channel_creds"] == [{"type": "tls", "config": {"ca_certificate_file": "ca.pem"}}]
        and s["server_features"] == ["xds_v3"]
        for s in config["xds_servers"]
    )


def test_the_cli_takes_replicas_repeated_or_separated_by_commas(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bootstrap", "--node-id", "edge-1", "--xds", "10.0.0.1:18000,10.0.0.2:18000", "--xds", "10.0.0.3:18000"])
        == 0
    )
    assert endpoints(xds_cluster(yaml.safe_load(capsys.readouterr().out))) == list(REPLICAS)
    assert main(["bootstrap", "--node-id", "edge-1", "--rest", ",".join(REPLICAS)]) == 0
    assert endpoints(xds_cluster(yaml.safe_load(capsys.readouterr().out))) == list(REPLICAS)
    assert main(["bootstrap", "--node-id", "edge-1"]) == 0
    assert endpoints(xds_cluster(yaml.safe_load(capsys.readouterr().out))) == ["127.0.0.1:18000"]


def test_the_cli_refuses_a_replica_given_twice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bootstrap", "--node-id", "edge-1", "--xds", REPLICAS[0], "--xds", REPLICAS[0]]) == 2
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bootstrap", "--node-id", "edge-1", "--xds", "10.0.0.1:18000,nonsense"])
    assert exit_info.value.code == 2
    assert "'nonsense' is not HOST:PORT" in capsys.readouterr().err


def test_the_grpc_bootstrap_names_the_server_and_a_node_with_a_locality(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bootstrap", "--grpc", "--node-id", "client-1", "--xds", "127.0.0.1:18001", "--zone", "z1"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config == {
        "xds_servers": [
            {"server_uri": "127.0.0.1:18001", "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}
        ],
        "node": {"id": "client-1", "cluster": "pilotfish", "locality": {"region": "", "zone": "z1"}},
    }


def test_the_grpc_bootstrap_over_tls_names_the_files() -> None:
    config = grpc_bootstrap(BootstrapSettings(node_id="c", tls_ca="ca.pem", tls_cert="c.pem", tls_key="c.key"))
    assert config["xds_servers"][0]["channel_creds"] == [
        {
            "type": "tls",
            "config": {"ca_certificate_file": "ca.pem", "certificate_file": "c.pem", "private_key_file": "c.key"},
        }
    ]
    with pytest.raises(ValueError, match="server name"):
        grpc_bootstrap(BootstrapSettings(node_id="c", tls_ca="ca.pem", tls_server_name="x"))


def test_bootstrap_checks_the_server_name_and_sends_sni_for_host_names() -> None:
    by_ip = bootstrap(BootstrapSettings(node_id="n", xds="127.0.0.1:18000", tls_ca="/ca.pem"))
    socket = by_ip["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]
    assert "sni" not in socket  # SNI carries no IP addresses
    common = socket["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"] and "tls_certificates" not in common
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
    ]
    by_name = bootstrap(
        BootstrapSettings(
            node_id="n",
            xds="127.0.0.1:18000",
            tls_ca="/ca.pem",
            tls_server_name="xds.example",
            tls_cert="/c.pem",
            tls_key="/k.pem",
        )
    )
    socket = by_name["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]
    assert socket["sni"] == "xds.example"
    assert socket["common_tls_context"]["tls_certificates"] == [
        {"certificate_chain": {"filename": "/c.pem"}, "private_key": {"filename": "/k.pem"}}
    ]
    plain = bootstrap(BootstrapSettings(node_id="n"))
    assert "transport_socket" not in plain["static_resources"]["clusters"][0]


def test_lrs_reports_load_over_the_xds_cluster_and_is_refused_where_it_cannot_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bootstrap", "--lrs", "--node-id", "edge-1", "--xds", ",".join(REPLICAS)]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    # Load reports go to the very cluster ADS uses: every replica, on the xDS port (gRPC, v3).
    assert config["cluster_manager"] == {
        "load_stats_config": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
        }
    }
    assert endpoints(xds_cluster(config)) == list(REPLICAS)
    assert main(["bootstrap", "--node-id", "edge-1"]) == 0
    assert "cluster_manager" not in yaml.safe_load(capsys.readouterr().out)  # only when asked
    # REST polls have no gRPC stream to report on; a gRPC client reports where its CDS asks it to.
    assert main(["bootstrap", "--lrs", "--node-id", "edge-1", "--rest", REPLICAS[0]]) == 2
    refused = capsys.readouterr()
    assert refused.out == ""
    assert "--lrs needs a gRPC connection to the xDS port" in refused.err and "--rest" in refused.err
    assert main(["bootstrap", "--lrs", "--grpc", "--node-id", "client-1"]) == 2
    refused = capsys.readouterr()
    assert refused.out == ""
    assert "lrs_server in CDS" in refused.err and "leave out --lrs with --grpc" in refused.err


def test_runtime_layers_come_over_ads_and_the_admin_layer_stays_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert "layered_runtime" not in bootstrap(BootstrapSettings(node_id="n")), "no layers: Envoy's default runtime"
    assert main(["bootstrap", "--node-id", "n", "--runtime-layer", "flags", "--runtime-layer", "faults"]) == 0
    layers = yaml.safe_load(capsys.readouterr().out)["layered_runtime"]["layers"]
    assert [layer["name"] for layer in layers] == ["flags", "faults", "admin"]
    assert layers[0]["rtds_layer"] == {"name": "flags", "rtds_config": {"ads": {}, "resource_api_version": "V3"}}
    assert layers[-1] == {"name": "admin", "admin_layer": {}}
    with pytest.raises(ValueError, match="does not go with --rest"):
        BootstrapSettings(node_id="n", rest="127.0.0.1:1", runtime_layers=("flags",))
    assert main(["bootstrap", "--node-id", "n", "--runtime-layer", "a", "--runtime-layer", "a"]) != 0
    assert "--runtime-layer" in capsys.readouterr().err


@pytest.mark.parametrize("delta", [False, True])
def test_the_node_announces_that_envoy_takes_resource_ttls(delta: bool) -> None:
    # Envoy announces no client features of its own: without these, pilotfish sends no TTLs.
    node = bootstrap(BootstrapSettings(node_id="edge-1", xds="127.0.0.1:18000", delta=delta))["node"]
    assert node["client_features"] == ["xds.config.supports-resource-ttl", "xds.config.resource-in-sotw"]
