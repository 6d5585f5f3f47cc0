"""The etcd source's view of its keys (pilotfish.sources.etcd.EtcdView): services, instances and
gRPC services parsed from keys, bad values reported by key."""

from __future__ import annotations

from pilotfish.sources.etcd import EtcdView


def test_etcd_defines_grpc_services_too() -> None:
    view = EtcdView("/pf/")
    assert view.put("/pf/services/echo", '{"grpc": true}') is None
    assert "grpc: expected true, false or the name" in (view.put("/pf/services/bad", '{"grpc": 7}') or "")
    assert view.state().services["echo"].grpc == "echo" and "bad" not in view.state().services


def test_etcd_view_parses_keys_and_reports_bad_values() -> None:
    view = EtcdView("/pf/")
    assert view.put("/pf/services/web", '{"listen": "127.0.0.1:10000"}') is None
    assert view.put("/pf/instances/web/a", '{"address": "127.0.0.1", "port": 9001}') is None
    assert "not valid JSON" in (view.put("/pf/instances/web/b", "{oops") or "")
    assert "port: is required" in (view.put("/pf/instances/web/c", '{"address": "127.0.0.1"}') or "")
    assert "1 to 65535" in (view.put("/pf/instances/web/d", '{"address": "127.0.0.1", "port": 70000}') or "")
    assert "unknown key" in (view.put("/pf/other", "{}") or "")
    state = view.state()
    assert state.services["web"].listen == ("127.0.0.1", 10000)
    assert [e.port for e in state.endpoints["web"]] == [9001]
    view.put("/pf/instances/web/b", '{"address": "127.0.0.1", "port": 9002}')  # fixed
    view.delete("/pf/instances/web/a")
    assert [e.port for e in view.state().endpoints["web"]] == [9002]
    assert set(view.bad) == {"/pf/instances/web/c", "/pf/instances/web/d", "/pf/other"}
