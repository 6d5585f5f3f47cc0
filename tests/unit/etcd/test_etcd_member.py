"""The etcd launcher (pilotfish.etcd.member) that tests, bench and the demo start etcd with: a
single member on 127.0.0.1 from :func:`member_argv` serves its JSON gateway on its client port;
:func:`serves` says so, and says no where nothing (or something else) answers."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pilotfish.envoy import free_port
from pilotfish.etcd.member import EtcdNotFound, find_etcd, member_argv, serves


def test_without_etcd_on_path_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EtcdNotFound, match="install the Debian package etcd-server"):
        find_etcd()


@pytest.fixture
def not_etcd() -> Iterator[str]:
    """An HTTP server that answers every POST with 404: not etcd."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_serves_is_false_where_nothing_or_something_else_answers(not_etcd: str) -> None:
    assert serves(f"127.0.0.1:{free_port()}", timeout=1.0) is False
    assert serves(not_etcd, timeout=1.0) is False


@pytest.mark.e2e
def test_a_member_from_member_argv_serves_on_its_client_port(tmp_path: Path) -> None:
    client, peer = free_port(), free_port()
    argv = member_argv(find_etcd(), name="unit", data_dir=tmp_path / "data", client_port=client, peer_port=peer)
    assert argv[argv.index("--listen-client-urls") + 1] == f"http://127.0.0.1:{client}"
    assert argv[argv.index("--initial-cluster") + 1] == f"unit-{peer}=http://127.0.0.1:{peer}"
    with (tmp_path / "etcd.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not serves(f"127.0.0.1:{client}", timeout=1.0):
            assert process.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not serve within 20 s"
            time.sleep(0.05)
        assert (tmp_path / "data" / "member").is_dir()
    finally:
        process.terminate()
        process.wait(timeout=10)
