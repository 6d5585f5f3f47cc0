"""What every command's flags share (pilotfish.commands.flags): durations with units, old names
kept as aliases that warn once, help on every flag, settings-file keys as flags, and the
environment variables of the admin API's clients."""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path

import pytest
import yaml

from pilotfish.commands import flags
from pilotfish.commands.cli import _parser, _parsers, main
from pilotfish.commands.flags import (
    SettingsFileError,
    file_arguments,
    format_duration,
    parse_duration,
)
from pilotfish.commands.logs import JsonFormatter


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("1s", 1.0), ("2m", 120.0), ("1h", 3600.0), ("1.5s", 1.5), ("1m30s", 90.0), ("0s", 0.0)],
)
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "100", "1", "ms", "1 s", "1d", "1s1", "-1s", "s1", "1.s", "nan", "1e3s"])
def test_anything_else_is_refused_saying_what_a_duration_is(text: str) -> None:
    with pytest.raises(ValueError, match="give a number and a unit"):
        parse_duration(text)


def test_a_bare_number_is_seconds_only_where_seconds_were_taken_before() -> None:
    assert parse_duration("20", bare_seconds=True) == 20.0
    assert parse_duration("2m", bare_seconds=True) == 120.0
    with pytest.raises(ValueError, match="or a number of seconds"):
        parse_duration("inf", bare_seconds=True)
    assert flags.seconds("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError):
        flags.duration("100")  # --quiet 100: milliseconds or seconds? Refused.


def test_durations_are_bounded_and_zero_only_where_it_means_something() -> None:
    assert flags.duration_or_zero("0s") == 0.0
    for refused in ("0s", "0ms", "400d"):
        with pytest.raises(argparse.ArgumentTypeError):
            flags.duration(refused)
    with pytest.raises(argparse.ArgumentTypeError, match="longer than a year"):
        flags.duration("9000h")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.1, "100ms"), (1.0, "1s"), (300.0, "5m"), (3600.0, "1h"), (1.5, "1500ms")]
)
def test_a_duration_is_shown_as_the_flags_take_it(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def _every_parser(
    parser: argparse.ArgumentParser, name: str = "pilotfish"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions if choice.help}
            assert helped == set(action.choices), f"{name}: commands without help: {set(action.choices) - helped}"
            for command, sub in action.choices.items():
                found += _every_parser(sub, f"{name} {command}")
    return found


def test_every_flag_and_argument_of_every_command_has_help() -> None:
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in _every_parser(_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS or action.help.startswith("(default"))
    ]
    assert not missing, "flags without help text: " + ", ".join(missing)


def test_old_flag_names_are_aliases_that_warn_once(capsys: pytest.CaptureFixture[str]) -> None:
    flags._warned.clear()
    flags._reported.clear()
    args = _parser().parse_args(["serve", "--quiet-ms", "250", "--quiet-ms", "300", "--subset-grace-s", "30"])
    assert args.quiet == 0.3 and args.subset_grace == 30.0
    assert flags.pending_warnings() == [
        "--quiet-ms is deprecated and will be removed: give --quiet 250ms",
        "--subset-grace-s is deprecated and will be removed: give --subset-grace 30s",
    ]
    assert _parser().parse_args(["serve", "--idle-timeout-ms", "0"]).idle_timeout == 0.0
    args = _parser().parse_args(["serve", "--quiet", "2s", "--rollout-bake", "90", "--status-forget-after", "1h"])
    assert (args.quiet, args.rollout_bake, args.status_forget_after) == (2.0, 90.0, 3600.0)
    boot = _parser().parse_args(["bootstrap", "--node-id", "n", "--admin-port", "9902", "--refresh-ms", "500"])
    assert (boot.envoy_admin_port, boot.refresh) == (9902, 0.5)
    assert _parser().parse_args(["bootstrap", "--node-id", "n", "--envoy-admin-port", "9903"]).envoy_admin_port == 9903
    # Logged once the logs are set up (in their format), once each.
    logger = logging.getLogger("pilotfish.test-aliases")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        flags.report_warnings(logger)
        flags.report_warnings(logger)
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 5 and "--admin-port is deprecated and will be removed: give --envoy-admin-port 9902" in seen
    assert flags.pending_warnings() == []


def test_a_settings_files_keys_are_serves_flags() -> None:
    _, serve = _parsers()
    words = file_arguments({"xds": "0.0.0.0:18000", "guard": False, "node-group": ["a=cluster:a", "b=id:b-*"]}, serve)
    assert words == ["--xds=0.0.0.0:18000", "--guard=off", "--node-group=a=cluster:a", "--node-group=b=id:b-*"]
    assert file_arguments({"etcd-prefix": "-p/"}, serve) == ["--etcd-prefix=-p/"]  # (a value may start with '-')
    assert _parser().parse_args(["serve", *file_arguments({"etcd-prefix": "-p/"}, serve)]).etcd_prefix == "-p/"
    with pytest.raises(SettingsFileError, match=r"unknown keys 'quiet_ms', 'nope'"):
        file_arguments({"quiet_ms": 1, "xds": "x:1", "nope": 2}, serve)
    with pytest.raises(SettingsFileError, match="takes one value, not a list"):
        file_arguments({"xds": ["a:1", "b:2"]}, serve)
    assert file_arguments({"docker-tls": True, "print-settings": False}, serve) == ["--docker-tls"]
    with pytest.raises(SettingsFileError, match="true or false"):
        file_arguments({"docker-tls": "yes"}, serve)
    with pytest.raises(SettingsFileError, match="not a setting"):
        file_arguments({"help": "x"}, serve)
    with pytest.raises(SettingsFileError, match="unknown key 'config'"):
        file_arguments({"config": "other.yaml"}, serve, refused=("config",))


def test_clusters_to_leave_out_of_the_health_gate_come_from_the_file_or_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pilotfish.yaml"
    config.write_text(yaml.safe_dump({"rollout": "canary=c-*,100%", "rollout-ignore-cluster": ["xds-grpc", "xds-b"]}))
    snapshot = ["--snapshot", str(tmp_path / "config.yaml")]
    assert main(["serve", *snapshot, "--config", str(config), "--print-settings"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["rollout"]["ignore_clusters"] == ["xds-grpc", "xds-b"]
    command = ["--rollout-ignore-cluster", "xds-c"]  # the command line's replace the file's
    assert main(["serve", *snapshot, "--config", str(config), *command, "--print-settings"]) == 0
    assert json.loads(capsys.readouterr().out)["rollout"]["ignore_clusters"] == ["xds-c"]
    assert main(["serve", *snapshot, "--rollout", "canary=c-*,100%", "--rollout-ignore-cluster", ""]) == 2
    assert "--rollout-ignore-cluster '': a cluster's name" in capsys.readouterr().err


def test_the_example_settings_file_is_the_service_units_flags(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "deploy" / "pilotfish.yaml"
    assert main(["serve", "--config", str(example), "--print-settings"]) == 0, capsys.readouterr().err
    settings = json.loads(capsys.readouterr().out)
    assert settings["etcd"]["address"] == "10.0.0.10:2379" and settings["xds"]["address"] == "0.0.0.0:18000"
    assert settings["tls"]["cert"] == "/etc/pilotfish/tls/xds.pem" and settings["events"]["level"] == "changes"
    assert settings["debounce"]["quiet"] == 0.1


def test_a_settings_file_that_is_not_a_mapping_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "pilotfish.yaml"
    config.write_text("- xds\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "must be a mapping" in err
    config.write_text("xds: [\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "line 2, column 1: invalid YAML" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: cannot read" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"guard-min-count": "ten"}))
    assert main(["serve", "--config", str(config)]) == 2
    assert "guard-min-count: 'ten' is not a positive whole number" in capsys.readouterr().err


def test_the_admin_clients_take_their_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PILOTFISH_ADMIN", "10.0.0.1:18001")
    monkeypatch.setenv("PILOTFISH_TLS_CA", "/etc/pilotfish/ca.pem")
    monkeypatch.setenv("PILOTFISH_TLS_CERT", "/etc/pilotfish/me.pem")
    monkeypatch.setenv("PILOTFISH_TLS_KEY", "/etc/pilotfish/me.key")
    monkeypatch.setenv("PILOTFISH_TOKEN_FILE", "/etc/pilotfish/token")
    for command in (["status"], ["wait"], ["confirm"], ["rollout"], ["plan", "f.yaml"]):
        args = _parser().parse_args(command)
        assert args.admin == "10.0.0.1:18001", command
        assert (args.tls_ca, args.tls_cert, args.tls_key, args.token_file) == (
            Path("/etc/pilotfish/ca.pem"),
            Path("/etc/pilotfish/me.pem"),
            Path("/etc/pilotfish/me.key"),
            Path("/etc/pilotfish/token"),
        )
    assert _parser().parse_args(["status", "--admin", "127.0.0.1:1"]).admin == "127.0.0.1:1"  # the flag wins
    monkeypatch.setenv("PILOTFISH_ADMIN", "no-port")
    with pytest.raises(SystemExit):  # checked as the flag is
        _parser().parse_args(["status"])


def test_validate_takes_the_file_by_flag_or_position(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text("clusters: []\n")
    assert main(["validate", "--snapshot", str(snapshot)]) == 0
    assert main(["validate", str(snapshot)]) == 0
    assert main(["validate"]) == 2
    assert main(["validate", str(snapshot), "--snapshot", str(snapshot)]) == 2
    assert "give the file once" in capsys.readouterr().err


def test_token_new_takes_its_name_and_scopes_as_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["token", "new", "--name", "deploy", "--write", "web", "--write", "api-*", "--read"]) == 0
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed["tokens"]["deploy"]["write"] == ["web", "api-*"] and printed["tokens"]["deploy"]["read"] is True
    assert printed["token"] not in err and "tokens file" in err
    assert main(["token", "hash", "--read"]) == 2


def test_json_log_lines_carry_the_records_fields() -> None:
    record = logging.LogRecord("pilotfish.announce", logging.INFO, "x.py", 1, "started %s", ("now",), None)
    record.fields = {"xds": "127.0.0.1:1", "message": "not this"}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "started now" and line["xds"] == "127.0.0.1:1" and line["logger"] == "pilotfish.announce"
    assert line["level"] == "INFO" and line["time"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("pilotfish", logging.ERROR, "x.py", 1, "a\nb", (), sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text and "ValueError: boom" in json.loads(text)["exception"]
    assert io.StringIO(text).read().count("{") >= 1
