"""The registry API with a tokens file, over real HTTP: who may write which service, read, and
change self-preservation; the file followed as it changes; a bad file at start refused."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import io
import json
import logging
import os
import string
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess import Running as InProcess
from inprocess import serving as serve_in_process

from pilotfish.api.registry import RegistryApi
from pilotfish.api.tokens import TokenFile, hash_token
from pilotfish.app import ServeSettings
from pilotfish.app.settings import RegistrySettings
from pilotfish.cache import SnapshotCache
from pilotfish.events import read_events
from pilotfish.reconcile import Reconciler
from pilotfish.sources.registry import Registry

TIMEOUT = 10.0
WEB, API, READER, ADMIN = "web-token-4f1c9a", "api-token-77d2e0", "reader-token-0b3e51", "admin-token-9a6c3d"
SCOPES: dict[str, dict[str, Any]] = {
    "deploy-web": {"token": WEB, "write": ["web", "web-*"]},
    "deploy-api": {"token": API, "write": ["api"], "read": True},
    "dashboard": {"token": READER, "read": True},
    "ops": {"token": ADMIN, "admin": True},
}


def tokens_document(reads: str = "scoped", drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "reads": reads,
        "tokens": {
            name: {"sha256": hash_token(scope["token"]), **{k: v for k, v in scope.items() if k != "token"}}
            for name, scope in SCOPES.items()
            if name not in drop
        },
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Running:
    """The server (:class:`inprocess.Running`) and its tokens file."""

    server: InProcess
    tokens: Path

    @property
    def registry(self) -> str:
        return self.server.registry

    @property
    def events(self) -> Path:
        return self.server.events

    def url(self, path: str) -> str:
        return self.server.url(path)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, reads: str = "scoped") -> AsyncIterator[Running]:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(json.dumps(tokens_document(reads)))  # JSON is YAML
    async with serve_in_process(tmp_path, ServeSettings(registry=RegistrySettings(tokens=tokens))) as server:
        yield Running(server, tokens)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with serving(tmp_path) as server:
        yield server


def events_named(log: Path, name: str) -> list[dict[str, Any]]:
    return [event for event in read_events(log)[0] if event["event"] == name]


async def refused(response: aiohttp.ClientResponse, status: int) -> str:
    """Check a refusal's status, challenge and error shape; its message."""
    assert response.status == status, await response.text()
    assert response.headers["WWW-Authenticate"].startswith('Bearer realm="pilotfish registry"')
    body = await response.json()
    assert set(body) == {"error", "problems"} and body["problems"][0]["field"] == "Authorization"
    return str(body["error"])


async def test_a_token_writes_the_services_its_scope_covers_and_no_others(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        # Every write of the web token's services goes through...
        for name in ("web", "web-canary"):
            defined = await http.put(running.url(f"/v1/services/{name}"), json={}, headers=bearer(WEB))
            assert defined.status == 200, await defined.text()
        instances = running.url("/v1/services/web/instances")
        created = await http.post(
            instances, json={"address": "127.0.0.1", "port": 9001, "ttl": 30}, headers=bearer(WEB)
        )
        assert created.status == 201
        beat = await http.put(running.url("/v1/services/web/instances/127.0.0.1:9001/heartbeat"), headers=bearer(WEB))
        assert beat.status == 200
        # ...while another token's service, and any write without a token, are refused and change nothing.
        message = await refused(await http.put(running.url("/v1/services/api"), json={}, headers=bearer(WEB)), 403)
        assert "'deploy-web' may not write service 'api'" in message and WEB not in message
        await refused(
            await http.post(
                running.url("/v1/services/webx/instances"),
                json={"address": "127.0.0.1", "port": 9002},
                headers=bearer(WEB),
            ),
            403,
        )
        message = await refused(await http.post(instances, json={"address": "127.0.0.1", "port": 9003}), 401)
        assert "Authorization: Bearer <token>" in message
        await refused(await http.delete(running.url("/v1/services/web"), headers=bearer("web-token-4f1c9b")), 401)
        await refused(
            await http.delete(running.url("/v1/services/web/instances/127.0.0.1:9001"), headers=bearer(READER)), 403
        )
        await refused(
            await http.put(
                running.url("/v1/services/web/instances/127.0.0.1:9001/heartbeat"),
                headers={"Authorization": f"Basic {WEB}"},
            ),
            401,
        )
        listing = await (await http.get(running.url("/v1/services"), headers=bearer(READER))).json()
        assert sorted(listing["services"]) == ["web", "web-canary"]
        assert [i["port"] for i in listing["services"]["web"]["instances"]] == [9001]
        # The api token writes its own service.
        assert (await http.put(running.url("/v1/services/api"), json={}, headers=bearer(API))).status == 200
        assert (await http.delete(running.url("/v1/services/web"), headers=bearer(WEB))).status == 204
        # The token gate's refusals are counted with the registry's own, by status.
        async with http.get(f"http://{running.server.admin}/metrics") as response:
            metrics = await response.text()
        assert 'pilotfish_registry_refused_requests_total{code="401"} 3.0' in metrics
        assert 'pilotfish_registry_refused_requests_total{code="403"} 3.0' in metrics
        assert "pilotfish_registry_registrations_total 1.0" in metrics
    denied = events_named(running.events, "registry_denied")
    assert denied and denied[0]["status"] == 403 and denied[0]["token"] == "deploy-web"


async def test_scoped_reads_need_a_read_token_and_health_needs_none(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        assert (await http.get(running.url("/healthz"))).status == 200
        for path in ("/v1/services", "/v1/services/web", "/v1/self-preservation"):
            await refused(await http.get(running.url(path)), 401)
            await refused(await http.get(running.url(path), headers=bearer(WEB)), 403)  # write is not read
            assert (await http.get(running.url(path), headers=bearer(READER))).status in (200, 404)
        assert (await http.get(running.url("/v1/services"), headers=bearer(API))).status == 200
        assert (await http.head(running.url("/v1/services"))).status == 401


async def test_open_reads_need_no_token_but_writes_still_do(tmp_path: Path) -> None:
    async with serving(tmp_path, reads="open") as running, aiohttp.ClientSession() as http:
        assert (await http.get(running.url("/v1/services"))).status == 200
        assert (await http.get(running.url("/v1/self-preservation"))).status == 200
        await refused(await http.put(running.url("/v1/services/web"), json={}), 401)


async def test_self_preservation_is_changed_only_with_an_admin_token(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        url = running.url("/v1/self-preservation")
        await refused(await http.put(url, json={"enabled": False}), 401)
        for token in (WEB, READER):
            message = await refused(await http.put(url, json={"enabled": False}, headers=bearer(token)), 403)
            assert "admin: true" in message
        assert (await (await http.get(url, headers=bearer(READER))).json())["enabled"] is True
        changed = await http.put(url, json={"enabled": False}, headers=bearer(ADMIN))
        assert changed.status == 200 and (await changed.json())["enabled"] is False
        seen = await http.get(url, headers=bearer(ADMIN))  # an admin token reads what it changes
        assert seen.status == 200 and (await seen.json())["enabled"] is False


async def test_the_token_is_checked_before_the_body_is_read(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        big = await http.put(
            running.url("/v1/services/web"),
            data=io.BytesIO(b"x" * (2 << 20)),
            headers={"Content-Type": "application/json"},
        )
        await refused(big, 401)  # not 413: an unauthenticated body is not looked at
        bad = await http.put(running.url("/v1/services/web"), data=b"{not json", headers=bearer(WEB))
        assert bad.status == 400  # with a token, it is


async def wait_for_status(http: aiohttp.ClientSession, method: str, url: str, status: int, **kw: Any) -> float:
    """Repeat a request until it gets ``status``; how long that took."""
    start = time.monotonic()
    async with asyncio.timeout(TIMEOUT):
        while True:
            async with http.request(method, url, **kw) as response:
                if response.status == status:
                    return time.monotonic() - start
            await asyncio.sleep(0.05)


async def test_the_file_is_followed_revoking_tokens_and_a_bad_version_keeps_the_last_good(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    async with aiohttp.ClientSession() as http:
        url = running.url("/v1/services/web")
        assert (await http.put(url, json={}, headers=bearer(WEB))).status == 200
        # A broken edit: reported with the file and field; the last good tokens stay in force.
        running.tokens.write_text("reads: scoped\ntokens:\n  deploy-web:\n    sha256: not-a-digest\n")
        async with asyncio.timeout(TIMEOUT):
            while not (errors := events_named(running.events, "registry_tokens_error")):
                await asyncio.sleep(0.05)
        assert errors[0]["file"] == str(running.tokens) and "tokens.deploy-web.sha256" in errors[0]["reason"]
        assert any(str(running.tokens) in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
        assert (await http.put(url, json={}, headers=bearer(WEB))).status == 200
        # Revoking the web token (and opening reads) takes effect within about a second.
        running.tokens.write_text(json.dumps(tokens_document("open", drop=("deploy-web",))))
        took = await wait_for_status(http, "PUT", url, 401, json={}, headers=bearer(WEB))
        assert (await http.get(running.url("/v1/services"))).status == 200
        assert (await http.put(running.url("/v1/services/api"), json={}, headers=bearer(API))).status == 200
    loaded = events_named(running.events, "registry_tokens_loaded")
    assert loaded[-1]["tokens"] == 3 and loaded[-1]["reads"] == "open"
    print(f"revocation took effect after {took:.2f} s")


async def test_refusals_are_logged_at_most_once_per_interval(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    async with aiohttp.ClientSession() as http:
        for i in range(50):
            async with http.put(running.url(f"/v1/services/s{i}"), json={}, headers=bearer(f"guess-{i}")) as response:
                assert response.status == 401
    most = 1 + int((time.monotonic() - start) // 10)  # one per 10 s (a slow machine may take longer than 10 s)
    assert 1 <= len([r for r in caplog.records if "registry API refused" in r.getMessage()]) <= most
    assert 1 <= len(events_named(running.events, "registry_denied")) <= most


def test_serve_refuses_to_start_with_a_bad_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("reads: scoped\ntokens:\n  ci:\n    sha256: my-secret-token\n    write: [web]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pilotfish",
            "serve",
            "--registry",
            "127.0.0.1:0",
            "--xds",
            "127.0.0.1:0",
            "--registry-tokens",
            str(tokens),
            "--event-loop",
            "asyncio",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 1, done
    assert str(tokens) in done.stderr and "tokens.ci.sha256" in done.stderr
    assert "the token itself never goes in the file" in done.stderr


# -- property: whatever the header, a write outside the token's scope never succeeds -------------


SERVICES = ["web", "web-1", "web-", "webx", "xweb", "api", "api2", "a.b", "web-*", "we%62"]
KNOWN = [s["token"] for s in SCOPES.values()]
PRINTABLE = st.text(string.ascii_letters + string.digits + string.punctuation + " ", max_size=30)
KNOWN_TOKENS = st.sampled_from(KNOWN)
WELL_FORMED = st.builds(
    "{}{}{}{}".format,
    st.sampled_from(["", " "]),
    st.sampled_from(["Bearer", "bearer", "BEARER"]),
    st.sampled_from([" ", "  "]),
    KNOWN_TOKENS,
)
WRONG_SCHEME = st.builds(
    "{} {}".format, st.sampled_from(["Basic", "Token", "Bearer:", "Bearerx", "", "Bearer Bearer"]), KNOWN_TOKENS
)
NEAR_MISS = st.builds(lambda t, cut, extra: f"Bearer {t[:cut]}{extra}", KNOWN_TOKENS, st.integers(0, 20), PRINTABLE)
HEADERS = st.one_of(WELL_FORMED, WELL_FORMED, WRONG_SCHEME, NEAR_MISS, PRINTABLE, st.none())
WRITES = st.one_of(
    st.tuples(st.just("PUT"), st.sampled_from(SERVICES).map("/v1/services/{}".format), st.just({})),
    st.tuples(st.just("DELETE"), st.sampled_from(SERVICES).map("/v1/services/{}".format), st.none()),
    st.tuples(
        st.just("POST"),
        st.sampled_from(SERVICES).map("/v1/services/{}/instances".format),
        st.just({"address": "127.0.0.1", "port": 9001}),
    ),
    st.tuples(
        st.just("PUT"),
        st.sampled_from(SERVICES).map("/v1/services/{}/instances/127.0.0.1:9001/heartbeat".format),
        st.none(),
    ),
    st.tuples(
        st.just("DELETE"), st.sampled_from(SERVICES).map("/v1/services/{}/instances/127.0.0.1:9001".format), st.none()
    ),
    st.tuples(
        st.just("PUT"), st.just("/v1/self-preservation"), st.sampled_from([{"enabled": True}, {"enabled": False}])
    ),
)


def covered(header: str | None, path: str) -> bool:
    """The oracle: whether ``header`` is exactly a bearer token whose scope covers the write."""
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    scope = next((s for s in SCOPES.values() if s["token"] == token.strip()), None)
    if scheme.lower() != "bearer" or scope is None:
        return False
    if path == "/v1/self-preservation":
        return bool(scope.get("admin"))
    service = unquote(path.split("/")[3])
    return any(fnmatch.fnmatchcase(service, pattern) for pattern in scope.get("write", []))


class FakeTime:
    time = 1000.0

    def __call__(self) -> float:
        return self.time


async def play(tokens: Path, requests: list[tuple[tuple[str, str, Any], str | None]]) -> None:
    registry = Registry(clock=FakeTime())
    api = RegistryApi(registry, Reconciler(SnapshotCache()), tokens=TokenFile(tokens))
    runner = web.AppRunner(api.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as http:
            for (method, path, body), header in requests:
                before = (registry.describe(), registry.self_preservation)
                headers = {} if header is None else {"Authorization": header}
                async with http.request(method, f"http://{host}:{port}{path}", json=body, headers=headers) as response:
                    if covered(header, path):
                        assert response.status not in (401, 403), (method, path, header, await response.text())
                    else:
                        assert response.status in (401, 403), (method, path, header, await response.text())
                        assert response.headers["WWW-Authenticate"].startswith("Bearer")
                        assert (registry.describe(), registry.self_preservation) == before
    finally:
        await runner.cleanup()


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(requests=st.lists(st.tuples(WRITES, HEADERS), min_size=1, max_size=12))
def test_no_header_makes_a_write_outside_its_scope_succeed(
    tmp_path: Path, requests: list[tuple[tuple[str, str, Any], str | None]]
) -> None:
    tokens = tmp_path / "tokens.json"
    if not tokens.exists():
        tokens.write_text(json.dumps(tokens_document()))
    asyncio.run(play(tokens, requests))
