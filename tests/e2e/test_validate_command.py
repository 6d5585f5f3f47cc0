"""``pilotfish validate`` applies Envoy's own proto rules: what Envoy would NACK is refused first."""

from __future__ import annotations

from pathlib import Path

import yaml

from .processes import pilotfish


def test_validate_refuses_connect_timeout_0s_naming_field_rule_and_value(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    cluster = {
        "name": "web",
        "type": "STATIC",
        "connect_timeout": "0s",
        "load_assignment": {
            "cluster_name": "web",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}}}}
                    ]
                }
            ],
        },
    }
    path.write_text(yaml.safe_dump({"clusters": [cluster]}))
    result = pilotfish("validate", str(path), check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (
        f"{path}: 1 problem(s)\n  clusters[0] (name 'web').connect_timeout: must be greater than 0s "
        "(validate rule duration.gt), got 0s"
    ) in result.stderr

    cluster["connect_timeout"] = "0.25s"
    path.write_text(yaml.safe_dump({"clusters": [cluster]}))
    result = pilotfish("validate", str(path), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validate_names_every_mistake_of_a_raw_resource_at_once(tmp_path: Path) -> None:
    """Three mistakes in one cluster (a misspelt field, an enum value that does not exist, a port
    out of range) are all reported by one run, each at its path: not one per round."""
    path = tmp_path / "snapshot.yaml"
    path.write_text(
        """\
clusters:
  - name: web
    type: STATIC
    conect_timeout: 1s
    lb_policy: ROUND_ROBN
    load_assignment:
      cluster_name: web
      endpoints:
        - lb_endpoints:
            - endpoint:
                address:
                  socket_address: {address: 127.0.0.1, port_value: 99999}
"""
    )
    result = pilotfish("validate", str(path), check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    at = "  clusters[0] (name 'web')."
    assert result.stderr.splitlines() == [
        f"{path}: 3 problem(s)",
        f"{at}conect_timeout: unknown field of envoy.config.cluster.v3.Cluster (did you mean 'connect_timeout'?)",
        f"{at}lb_policy: 'ROUND_ROBN' is not a value of envoy.config.cluster.v3.Cluster.LbPolicy "
        "(did you mean 'ROUND_ROBIN'?)",
        f"{at}load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value: "
        "must be less than or equal to 65535 (validate rule uint32.lte), got 99999",
    ], result.stderr
