"""``import pilotfish`` is light: the public names load on first use, so a command that needs no
server (``pilotfish validate``, ``status``) does not pay for aiohttp, grpc and the server at start."""

from __future__ import annotations

import json
import subprocess
import sys

import pilotfish

_HEAVY = ["aiohttp", "grpc", "pilotfish.app", "pilotfish.xds", "pilotfish.api"]


def _loaded_after(code: str) -> dict[str, bool]:
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps({{m: m in sys.modules for m in {_HEAVY!r}}}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_importing_pilotfish_loads_no_server_aiohttp_or_grpc() -> None:
    assert _loaded_after("import pilotfish") == dict.fromkeys(_HEAVY, False)


def test_a_public_name_loads_on_first_use() -> None:
    loaded = _loaded_after("import pilotfish\npilotfish.serve")
    assert loaded["pilotfish.app"] and loaded["aiohttp"]


def test_every_public_name_resolves_and_unknown_names_fail() -> None:
    for name in pilotfish.__all__:
        assert getattr(pilotfish, name).__name__ == name
    try:
        pilotfish.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
