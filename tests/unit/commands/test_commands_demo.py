"""``pilotfish demo``'s refusals before it starts anything (pilotfish.commands.demo): no snapshot
file, an invalid one, and ports the snapshot needs already in use, each named with what to do.
The demo running with a real Envoy: tests/e2e/test_listeners.py serves its snapshot."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pilotfish.commands import demo
from pilotfish.commands.demo import DEFAULT_SNAPSHOT, EXIT_FAILED, run_demo


def test_without_a_snapshot_file_it_says_where_to_run_it_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_demo(tmp_path / "demo.yaml") == EXIT_FAILED
    assert f"no snapshot file at {tmp_path / 'demo.yaml'} (run the demo from the repository root" in (
        capsys.readouterr().err
    )


def test_an_invalid_snapshot_is_refused_naming_its_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text("clusters:\n- name: web\n  connect_timeout: 0s\n")
    assert run_demo(path) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{path}: " in err and "connect_timeout" in err and "fix the file and start the demo again" in err


@pytest.fixture
def held() -> Iterator[list[int]]:
    """Two ports on 127.0.0.1 something else listens on."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    try:
        yield [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.mark.e2e  # it looks for the Envoy binary before it checks the ports
def test_ports_in_use_are_named_with_what_needs_them_and_nothing_starts(
    tmp_path: Path, held: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    listen, upstream = held
    path = tmp_path / "demo.yaml"
    path.write_text(f"services:\n  web:\n    listen: 127.0.0.1:{listen}\n    endpoints: ['127.0.0.1:{upstream}']\n")
    assert run_demo(path) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "ports the snapshot needs are in use; stop what uses them (`ss -ltnp` shows it)" in err
    assert f"  127.0.0.1:{listen} (Envoy listener 'web'): " in err
    assert f"  127.0.0.1:{upstream} (upstream): " in err


def test_the_packaged_demo_snapshot_is_the_checkouts_and_is_served_outside_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed pilotfish has no examples/: ``pilotfish demo`` serves a copy of the packaged one."""
    repo = Path(__file__).resolve().parents[3]
    packaged = Path(demo.__file__).with_name("demo.yaml")
    assert packaged.read_bytes() == (repo / DEFAULT_SNAPSHOT).read_bytes(), "copy examples/demo.yaml over it"
    served: list[bytes] = []

    def run(path: Path) -> int:
        served.append(path.read_bytes())
        return 0

    monkeypatch.setattr(demo, "_run_demo", run)
    monkeypatch.chdir(tmp_path)
    assert run_demo(DEFAULT_SNAPSHOT) == 0
    assert served == [packaged.read_bytes()]
    assert "serving a copy of the packaged demo snapshot" in capsys.readouterr().out
