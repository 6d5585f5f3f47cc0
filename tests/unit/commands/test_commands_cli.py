"""The command line (pilotfish.commands.cli): flags that need other flags are refused naming them,
the admin API's address, the proxyless gRPC example validates, and an offline ``plan``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_snapshots import eds_document
from pilotfish.commands.cli import main


def test_the_example_file_validates(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "proxyless-grpc.yaml"
    assert main(["validate", str(example)]) == 0, capsys.readouterr().err


def test_serve_has_the_admin_api_on_loopback_by_default_and_off_turns_it_off() -> None:
    from pilotfish.commands.cli import _parser

    assert _parser().parse_args(["serve", "--snapshot", "s.yaml"]).admin == "127.0.0.1:18001"
    assert _parser().parse_args(["serve", "--snapshot", "s.yaml", "--admin", "off"]).admin is None
    assert _parser().parse_args(["serve", "--snapshot", "s.yaml", "--admin", "0.0.0.0:0"]).admin == "0.0.0.0:0"


def test_an_admin_client_ca_needs_tls(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from pilotfish.commands.cli import main

    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text("clusters: []\n")
    assert main(["serve", "--snapshot", str(snapshot), "--admin-client-ca", "ca.pem"]) == 2
    assert "--admin-client-ca need TLS" in capsys.readouterr().err
    assert main(["status", "--tls-cert", "c.pem", "--tls-key", "k.pem"]) == 2
    assert "give --tls-ca FILE too" in capsys.readouterr().err


def test_cli_refuses_incomplete_tls_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump({"clusters": []}))
    assert main(["serve", "--snapshot", str(snapshot), "--tls-cert", "c.pem"]) == 2
    assert "--tls-key" in capsys.readouterr().err
    assert main(["serve", "--snapshot", str(snapshot), "--client-ca", "ca.pem"]) == 2
    assert "--tls-cert" in capsys.readouterr().err
    assert main(["bootstrap", "--node-id", "n", "--tls-cert", "c.pem", "--tls-key", "k.pem"]) == 2
    assert "--tls-ca" in capsys.readouterr().err
    absent = str(tmp_path / "absent.pem")
    assert (
        main(
            [
                "serve",
                "--snapshot",
                str(snapshot),
                "--xds",
                "127.0.0.1:0",
                "--event-loop",
                "asyncio",
                "--tls-cert",
                absent,
                "--tls-key",
                absent,
            ]
        )
        == 1
    )
    assert f"{absent}: 1 problem(s)\n  no such file" in capsys.readouterr().err


def test_rollout_takes_a_reason_only_to_abort(capsys: pytest.CaptureFixture[str]) -> None:
    from pilotfish.commands.cli import _parser

    assert _parser().parse_args(["rollout"]).action == "status"
    assert main(["rollout", "promote", "--reason", "why not"]) == 2
    assert "pilotfish rollout promote: --reason is for abort" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["rollout", "rewind"])


def eds_file(path: Path, clusters: dict[str, str], **more: Any) -> Path:
    """A snapshot file of EDS clusters (name -> connect timeout), each with an endpoint."""
    path.write_text(yaml.safe_dump({**eds_document(clusters), **more}))
    return path


def test_an_offline_plan_diffs_and_validates_against_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = eds_file(tmp_path / "old.yaml", {"a": "1s", "b": "1s"})
    new = eds_file(tmp_path / "new.yaml", {"a": "2s", "c": "1s"})
    assert main(["plan", str(new), "--against", str(old)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"offline plan: {new} against {old}: the diff and the validation only")
    for line in (
        "CDS: 1 added, 1 removed, 1 changed",
        "+ c",
        "- b",
        'connect_timeout: "1s" -> "2s"',
        "would be published",
    ):
        assert line in out
    assert "guard " not in out.split("\n", 1)[1]

    assert main(["plan", str(old), "--against", str(old), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (answer["verdict"], answer["offline"], answer["guard"], answer["rollout"]) == ("no change", True, None, None)

    bad = eds_file(tmp_path / "bad.yaml", {"a": "-1s", "b": "-2s"})
    assert main(["plan", str(bad), "--against", str(old)]) == 1
    out = capsys.readouterr().out
    assert f"validation  2 problem(s) in {bad}:" in out and "REFUSED" in out

    # The same explicit version with another content: refused, as a server would.
    versioned = eds_file(tmp_path / "v1.yaml", {"a": "1s"}, version="v1")
    changed = eds_file(tmp_path / "v1b.yaml", {"a": "2s"}, version="v1")
    assert main(["plan", str(changed), "--against", str(versioned)]) == 1
    assert "version: the content changed but the version is still 'v1'" in capsys.readouterr().out

    assert main(["plan", str(new), "--against", str(bad)]) == 2
    assert f"--against {bad} cannot be built" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "absent.yaml"), "--against", str(old)]) == 2
    assert "cannot read" in capsys.readouterr().err
