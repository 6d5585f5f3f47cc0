"""The admin API with tokens (``serve --admin-tokens FILE``), against a real ``pilotfish serve``:
who may read the proxies' status and configuration, who may confirm a held snapshot, and the
``status`` / ``wait`` / ``confirm`` commands sending a token (``--token-file``, or
``PILOTFISH_ADMIN_TOKEN``).

The tokens file is the registry's format: ``dashboard`` may read, ``ops`` may read and confirm,
``deploy-web`` may only write a registry service (nothing on the admin API).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from pilotfish.api.tokens import hash_token

from .processes import ControlPlane, ProcessGroup, free_port, pilotfish_argv, pilotfish_env, wait_until
from .snapshot_file import write_services

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

READER, OPS, WRITER = "reader-token-5e1f0c", "ops-token-c03b77", "writer-token-9d2a41"
NAMES = [f"svc-{i}" for i in range(10)]


def services(*names: str) -> dict[str, dict[str, Any]]:
    """Services without listeners: a cluster each, with one endpoint."""
    return {name: {"endpoints": ["127.0.0.1:9001"]} for name in names}


def request(admin: str, path: str, *, method: str = "GET", token: str | None = None) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of a request to the admin API, with ``token`` as a bearer token."""
    req = urllib.request.Request(f"http://{admin}{path}", method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read()), error.headers


def command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        pilotfish_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**pilotfish_env(), **(env or {})},
    )


@pytest.fixture
def served(processes: ProcessGroup, tmp_path: Path) -> tuple[ControlPlane, Path]:
    snapshot = tmp_path / "snapshot.yaml"
    write_services(snapshot, services(*NAMES))
    tokens = tmp_path / "admin-tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": {
                    "dashboard": {"sha256": hash_token(READER), "read": True},
                    "ops": {"sha256": hash_token(OPS), "admin": True},
                    "deploy-web": {"sha256": hash_token(WRITER), "write": ["web"]},
                }
            }
        )
    )
    for name, token in (("reader", READER), ("ops", OPS)):
        (tmp_path / f"{name}.token").write_text(token + "\n")
    control_plane = ControlPlane(processes, snapshot, free_port(), options=("--admin-tokens", str(tokens)))
    control_plane.start()
    return control_plane, snapshot


def test_confirm_needs_an_admin_token_and_reads_a_read_token(served: tuple[ControlPlane, Path]) -> None:
    control_plane, _ = served
    admin = control_plane.admin
    # Probes and the status page need no token.
    for path in ("/healthz", "/readyz"):
        assert request(admin, path)[0] == 200, path

    # Reads: 401 without a token (or with an unknown one), 403 with one that may not read, 200 with a reader.
    for path in ("/v1/proxies", "/v1/snapshots", "/v1/config?node=edge-1", "/v1/held", "/v1/fleet", "/metrics"):
        status, body, headers = request(admin, path)
        assert status == 401, (path, body)
        assert headers["WWW-Authenticate"].startswith('Bearer realm="pilotfish admin"'), headers
        assert "needs a token" in body["error"] and body["problems"][0]["field"] == "Authorization"
        assert request(admin, path, token="not-a-token")[0] == 401, path
        status, body, _ = request(admin, path, token=WRITER)
        assert status == 403 and "'deploy-web' may not read" in body["error"], (path, body)
    assert request(admin, "/v1/snapshots", token=READER)[0] == 200
    assert request(admin, "/v1/snapshots", token=OPS)[0] == 200  # admin: true reads too

    # Confirming: 401 without a token, 403 with a read-only one; an admin token gets through (nothing held: 404).
    status, body, headers = request(admin, "/v1/held/confirm", method="POST")
    assert status == 401 and "needs a token" in body["error"], body
    status, body, headers = request(admin, "/v1/held/confirm", method="POST", token=READER)
    assert status == 403, body
    assert "token 'dashboard' may not confirm a held snapshot (admin: true)" in body["error"], body
    assert 'error="insufficient_scope"' in headers["WWW-Authenticate"]
    status, body, _ = request(admin, "/v1/held/confirm", method="POST", token=OPS)
    assert (status, body) == (404, {"error": "no snapshot is held: nothing to confirm"})
    denied = control_plane.events.find(lambda e: e["event"] == "admin_denied")
    assert denied is not None and denied["status"] == 401, denied


def test_status_wait_and_confirm_send_a_token(served: tuple[ControlPlane, Path], tmp_path: Path) -> None:
    control_plane, snapshot = served
    admin = control_plane.admin
    reader_file, ops_file = str(tmp_path / "reader.token"), str(tmp_path / "ops.token")
    no_token = {"PILOTFISH_ADMIN_TOKEN": ""}

    refused = command("status", "--admin", admin, env=no_token)
    assert refused.returncode == 2 and "GET /v1/proxies needs a token" in refused.stderr, refused.stderr
    shown = command("status", "--admin", admin, env={"PILOTFISH_ADMIN_TOKEN": READER})
    assert shown.returncode == 0 and "no proxy is connected" in shown.stdout, shown.stdout + shown.stderr
    assert command("status", "--admin", admin, "--token-file", reader_file, env=no_token).returncode == 0

    refused = command("wait", "--admin", admin, "--timeout", "20", env=no_token)
    assert refused.returncode == 2 and "GET /v1/snapshots needs a token" in refused.stderr, refused.stderr
    waited = command(
        "wait", "--admin", admin, "--timeout", "20", "--min-proxies", "0", "--token-file", reader_file, env=no_token
    )
    assert waited.returncode == 0, waited.stdout + waited.stderr

    # A change the guard holds (9 of 10 clusters removed): a reader may not confirm it, ops may.
    write_services(snapshot, services("svc-0"))

    def held() -> Any:
        return request(admin, "/v1/held", token=READER)[1]["held"]

    shown_held = wait_until(held, timeout=20, what="the guard to hold the snapshot")
    assert "--token-file FILE" in shown_held["confirm"], shown_held
    refused = command("confirm", "--admin", admin, "--token-file", reader_file, env=no_token)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "may not confirm a held snapshot (admin: true)" in refused.stderr, refused.stderr
    assert held() is not None  # still held
    confirmed = command("confirm", "--admin", admin, env={"PILOTFISH_ADMIN_TOKEN": OPS})
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert confirmed.stdout.startswith(f"published {shown_held['version']}"), confirmed.stdout
    assert held() is None
    assert command("confirm", "--admin", admin, "--token-file", ops_file, env=no_token).returncode == 1  # nothing held
