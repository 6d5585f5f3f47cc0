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
