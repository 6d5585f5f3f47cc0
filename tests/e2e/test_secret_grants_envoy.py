"""A real Envoy never receives an SDS secret that is not granted to it (``serve --grant-secret``).

Two Envoys on mTLS get the same configuration: besides the usual listener, a TLS listener whose
certificate is the SDS secret ``edge-cert`` (over ADS). The secret is granted to edge-1's
certificate identity only. edge-1 gets it (its listener goes active, the secret is in its
``/config_dump``); edge-2 asks for it, is answered without it (``secret_denied``), and after it
ACKed that answer, and again after the secret is rotated, its ``/config_dump`` holds no such
secret and its TLS listener is still waiting for it.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from .event_log import LDS, is_event
from .processes import Envoy, free_port, wait_until
from .test_tls_envoy import Pki, write_atomically
from .testbed import Testbed, wait_for_acks

pytestmark = pytest.mark.e2e

SDS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"


def write_snapshot(testbed: Testbed, pki: Pki, secure_port: int, *, version: str) -> None:
    """The testbed's snapshot plus the secret ``edge-cert`` (a fresh certificate from the test CA)
    and listener ``secure`` on ``secure_port``, which serves TLS with it."""
    document = testbed.snapshot_document(version=version)
    leaf = pki.ca.issue_cert(f"secure-v{version}.pilotfish.test")
    secure = copy.deepcopy(document["listeners"][0])
    secure["name"] = "secure"
    secure["address"]["socket_address"]["port_value"] = secure_port
    secure["filter_chains"][0]["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _TLS,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [
                    {"name": "edge-cert", "sds_config": {"ads": {}, "resource_api_version": "V3"}}
                ]
            },
        },
    }
    document["listeners"].append(secure)
    document["secrets"] = [
        {
            "name": "edge-cert",
            "tls_certificate": {
                "certificate_chain": {"inline_string": leaf.cert_chain_pems[0].bytes().decode()},
                "private_key": {"inline_string": leaf.private_key_pem.bytes().decode()},
            },
        }
    ]
    write_atomically(testbed.snapshot_path, yaml.safe_dump(document, sort_keys=False).encode())


def secrets(envoy: Envoy, state: str = "active") -> dict[str, Any]:
    """Envoy's dynamic SDS secrets in ``state`` (active or warming), by name."""
    dump = json.loads(envoy.admin(f"/config_dump?resource=dynamic_{state}_secrets"))
    return {item["name"]: item for item in dump.get("configs", [])}


def listener_state(envoy: Envoy, name: str) -> str | None:
    """``active`` or ``warming``: where listener ``name`` is in Envoy's config dump (None: absent)."""
    dump = json.loads(envoy.admin("/config_dump?resource=dynamic_listeners"))
    for item in dump.get("configs", []):
        if item["name"] == name:
            return "active" if "active_state" in item else "warming" if "warming_state" in item else None
    return None


def test_an_envoy_never_receives_a_secret_not_granted_to_it(testbed: Testbed, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    secure_port = free_port()
    write_snapshot(testbed, pki, secure_port, version="1")
    testbed.control_plane.options = (
        *pki.serve_options(mtls=True),
        "--grant-secret",
        "edge-cert=identity:edge-1.pilotfish.test",
    )
    events = testbed.control_plane.start()
    granted = testbed.start_envoy(
        name="granted", node_id="edge-1", bootstrap_options=pki.client("edge-1", "edge-1.pilotfish.test")
    )
    denied = testbed.start_envoy(
        name="denied", node_id="edge-2", bootstrap_options=pki.client("edge-2", "edge-2.pilotfish.test")
    )

    wait_for_acks(events, node="edge-1", types=(LDS, SDS), version="1", what="the granted Envoy")
    wait_until(
        lambda: listener_state(granted, "secure") == "active",
        timeout=10,
        what="the granted Envoy's TLS listener to go active with its secret",
        details=granted.log_tail,
    )
    assert secrets(granted)["edge-cert"]["version_info"] == "1"
    assert "BEGIN CERTIFICATE" in granted.admin("/config_dump?include_eds")

    refusal = events.wait_for(
        is_event("secret_denied", node="edge-2", secret="edge-cert"), what="pilotfish to deny edge-2 the secret"
    )
    assert refusal["identity"] == "edge-2.pilotfish.test"
    # edge-2 ACKed the SDS answer to its request, and that answer did not hold the secret.
    wait_for_acks(events, node="edge-2", types=(LDS, SDS), version="1", what="the denied Envoy")
    assert "edge-cert" not in secrets(denied)
    assert listener_state(denied, "secure") == "warming"

    # A new version of the secret goes to edge-1 only; edge-2 is answered without it again.
    mark = events.mark()
    write_snapshot(testbed, pki, secure_port, version="2")
    wait_for_acks(events, node="edge-1", types=(SDS,), version="2", after=mark, what="the rotated secret")
    wait_until(
        lambda: secrets(granted).get("edge-cert", {}).get("version_info") == "2",
        timeout=10,
        what="the granted Envoy to hold the rotated secret",
        details=granted.log_tail,
    )
    wait_for_acks(events, node="edge-2", types=(SDS,), version="2", after=mark, what="the denied Envoy, rotated")
    assert "edge-cert" not in secrets(denied)
    assert listener_state(denied, "secure") == "warming"
    assert "BEGIN CERTIFICATE" not in denied.admin("/config_dump?include_eds")
    # Denied once per stream and name: the second answer added no event.
    assert len(events.select(is_event("secret_denied", node="edge-2"))) == 1


def write_grants(path: Path, *grants: str) -> None:
    write_atomically(path, yaml.safe_dump({"grants": list(grants)}).encode())


def test_an_edited_grants_file_reaches_a_waiting_envoy_without_a_restart(testbed: Testbed, tmp_path: Path) -> None:
    """``serve --grants-file``: edge-2's TLS listener waits for a secret it is not granted; the
    grant is added to the file and the listener goes active, on the same stream of the same
    pilotfish. A bad edit then is reported (``grants_error``) and the last good grants stay:
    a rotated secret still reaches both Envoys."""
    pki = Pki(tmp_path)
    secure_port = free_port()
    write_snapshot(testbed, pki, secure_port, version="1")
    grants = tmp_path / "grants.yaml"
    write_grants(grants, "edge-cert=identity:edge-1.pilotfish.test")
    testbed.control_plane.options = (*pki.serve_options(mtls=True), "--grants-file", str(grants))
    events = testbed.control_plane.start()
    granted = testbed.start_envoy(
        name="granted", node_id="edge-1", bootstrap_options=pki.client("edge-1", "edge-1.pilotfish.test")
    )
    waiting = testbed.start_envoy(
        name="waiting", node_id="edge-2", bootstrap_options=pki.client("edge-2", "edge-2.pilotfish.test")
    )
    wait_until(
        lambda: listener_state(granted, "secure") == "active",
        timeout=10,
        what="the granted Envoy's TLS listener to go active",
        details=granted.log_tail,
    )
    events.wait_for(is_event("secret_denied", node="edge-2", secret="edge-cert"), what="edge-2 to be denied")
    wait_for_acks(events, node="edge-2", types=(LDS, SDS), version="1", what="the waiting Envoy")
    assert listener_state(waiting, "secure") == "warming"
    [stream] = events.select(is_event("stream_open", node="edge-2"))

    write_grants(grants, "edge-cert=identity:edge-1.pilotfish.test", "edge-cert=identity:edge-2.pilotfish.test")
    events.wait_for(is_event("grants_loaded", file=str(grants)), what="pilotfish to load the edited grants")
    wait_until(
        lambda: listener_state(waiting, "secure") == "active",
        timeout=10,
        what="edge-2's TLS listener to go active with the newly granted secret",
        details=waiting.log_tail,
    )
    assert secrets(waiting)["edge-cert"]["version_info"] == "1"
    assert events.select(is_event("stream_open", node="edge-2")) == [stream]  # the same stream
    assert len(events.select(is_event("server_started"))) == 1  # the same pilotfish

    mark = events.mark()
    write_grants(grants, "edge-cert=identity:edge-1.pilotfish.test", "edge-cert=edge-2")  # a bad edit
    error = events.wait_for(
        is_event("grants_error", file=str(grants)), after=mark, what="pilotfish to report the bad edit"
    )
    assert "grants[1]" in error["reason"]
    write_snapshot(testbed, pki, secure_port, version="2")
    for envoy in (granted, waiting):
        wait_until(
            functools.partial(lambda e: secrets(e).get("edge-cert", {}).get("version_info") == "2", envoy),
            timeout=10,
            what=f"{envoy.name} to hold the rotated secret under the last good grants",
            details=envoy.log_tail,
        )
