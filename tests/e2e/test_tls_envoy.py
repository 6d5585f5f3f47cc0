"""A real Envoy reaches ``pilotfish serve`` over TLS and mTLS, with ``pilotfish bootstrap --tls-*``.

Certificates come from test CAs (trustme), written into the test's temp dir. Envoy checks
pilotfish's certificate against the CA and the name 127.0.0.1 (an IP SAN); under mTLS pilotfish
checks Envoy's against ``--client-ca`` and records its DNS SAN as the stream's identity.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .event_log import RDS, TYPE_URLS, is_event
from .processes import Envoy, StatValue, pilotfish, wait_until
from .testbed import Testbed, wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = pytest.mark.e2e

LOAD_S = 60
"""The longest the wrk run during which the server certificate is rotated may take (it is ended
once the rotation and the change after it are done)."""


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def uri_cert(ca: trustme.CA, uri: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) whose only SAN is the URI ``uri``, issued by ``ca`` (trustme
    issues DNS, IP and e-mail names only)."""
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    issuer = x509.load_pem_x509_certificate(ca.cert_pem.bytes()).subject
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy")]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # trustme's CA key is EC or RSA
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


class Pki:
    """The files of one test: a CA bundle, pilotfish's certificate and key, Envoys' certificates."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = trustme.CA()
        self.ca_path = directory / "ca.pem"
        self.ca_path.write_bytes(self.ca.cert_pem.bytes())
        self.server_cert = directory / "server.pem"
        self.server_key = directory / "server.key"
        self.install_server_cert(self.ca)

    def install_server_cert(self, ca: trustme.CA) -> None:
        """Issue pilotfish a certificate for 127.0.0.1 from ``ca`` and put it in place (key first,
        then the certificate, each by rename, as a certificate agent would)."""
        leaf = ca.issue_cert("127.0.0.1")
        write_atomically(self.server_key, leaf.private_key_pem.bytes())
        write_atomically(self.server_cert, leaf.cert_chain_pems[0].bytes())

    def client(self, name: str, identity: str, *, ca: trustme.CA | None = None) -> tuple[str, ...]:
        """``pilotfish bootstrap`` options for an Envoy presenting a certificate for ``identity``
        (a DNS name, or a SPIFFE id: a URI SAN)."""
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        if identity.startswith("spiffe://"):
            cert_pem, key_pem = uri_cert(ca or self.ca, identity)
        else:
            leaf = (ca or self.ca).issue_cert(identity)
            cert_pem, key_pem = leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        return ("--tls-ca", str(self.ca_path), "--tls-cert", str(cert), "--tls-key", str(key))

    def serve_options(self, *, mtls: bool) -> tuple[str, ...]:
        options = ("--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key), "--tls-reload-ms", "100")
        return (*options, "--client-ca", str(self.ca_path)) if mtls else options


def count(value: StatValue | None) -> int:
    """A counter's value (0 when Envoy has not created the counter yet)."""
    return int(value or 0)


def test_envoy_gets_its_configuration_over_tls(testbed: Testbed, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    testbed.control_plane.options = pki.serve_options(mtls=False)
    envoy = testbed.start(envoy_options={"bootstrap_options": ("--tls-ca", str(pki.ca_path))})
    assert count(envoy.stat("cluster.xds_cluster.ssl.handshake")) >= 1
    assert testbed.events.find(is_event("server_started", tls="tls"))


def test_envoy_over_mtls_is_served_and_named_and_others_are_refused(testbed: Testbed, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    testbed.control_plane.options = pki.serve_options(mtls=True)
    testbed.start(envoy_options={"bootstrap_options": pki.client("edge-1", "edge-1.pilotfish.test")})
    opened = testbed.events.find(is_event("stream_open", node="edge-1"))
    assert opened is not None and opened["identity"] == "edge-1.pilotfish.test"

    # A certificate from another CA, and no certificate at all: the handshake fails, no stream opens.
    strangers = [
        testbed.start_envoy(
            name="stranger",
            node_id="edge-2",
            bootstrap_options=pki.client("edge-2", "edge-2.pilotfish.test", ca=trustme.CA()),
        ),
        testbed.start_envoy(name="anonymous", node_id="edge-3", bootstrap_options=("--tls-ca", str(pki.ca_path))),
    ]
    for envoy in strangers:
        # pilotfish ends the handshake; Envoy counts a failed connection (no ssl.handshake).
        def failed_twice(envoy: Envoy = envoy) -> bool:
            return count(envoy.stat("cluster.xds_cluster.upstream_cx_connect_fail")) >= 2

        wait_until(
            failed_twice,
            timeout=15,
            what=f"{envoy.name}'s connections to pilotfish to fail (twice)",
            details=envoy.log_tail,
        )
        assert count(envoy.stat("cluster.xds_cluster.ssl.handshake")) == 0
        # Never configured. (Not `control_plane.connected_state`: Envoy sets it to 1 when it starts a
        # stream, before the connection under it is made, so it reads 1 during every new attempt.)
        assert count(envoy.stat("cluster_manager.cds.update_success")) == 0
        assert envoy.cluster_endpoints("web") == []
    assert not testbed.events.select(lambda e: e["event"] == "stream_open" and e["node"] != "edge-1")


def test_rotating_the_server_certificate_under_load_drops_nothing(testbed: Testbed, tmp_path: Path) -> None:
    """The server certificate is replaced twice while wrk runs through an Envoy on mTLS; the
    second time by one from a new CA (the trust bundle already holds both, as in a CA rotation).
    The Envoy's stream stays open and keeps getting changes; an Envoy started afterwards that
    trusts only the new CA gets its configuration, so the new certificate is the one served."""
    wrk_binary()
    pki = Pki(tmp_path)
    new_ca = trustme.CA()
    pki.ca_path.write_bytes(pki.ca.cert_pem.bytes() + new_ca.cert_pem.bytes())
    testbed.control_plane.options = pki.serve_options(mtls=True)
    envoy = testbed.start(envoy_options={"bootstrap_options": pki.client("edge-1", "edge-1.pilotfish.test")})
    events = testbed.events
    [opened] = events.select(is_event("stream_open", node="edge-1"))

    wrk = Wrk.start(testbed.group, f"http://127.0.0.1:{testbed.listener_port}/direct", duration_s=LOAD_S)
    wait_until(
        lambda: count(envoy.stat("http.ingress.downstream_rq_2xx")) >= 100,
        timeout=10,
        what="wrk's load to flow through Envoy",
    )
    for ca in (pki.ca, new_ca):
        mark = events.mark()
        pki.install_server_cert(ca)
        events.wait_for(
            is_event("tls_reloaded", listener="xds"), what="pilotfish to load the new certificate", after=mark
        )
    testbed.write_snapshot(direct_body="direct v2", version="2")
    wait_for_acks(  # only the routes changed: only they are sent, at the new version
        events, node="edge-1", types=[RDS], version="2", stream=opened["stream"], what="a change after the rotation"
    )
    assert wrk.running(), "the rotation took longer than the load run: it was not made under load"

    result = wrk.stop()
    print(f"server certificate rotated twice under load through Envoy (mTLS): {result.summary()}")
    assert result.problems() == [], f"{result.summary()}\n{result.output}"
    assert events.select(is_event("stream_open", node="edge-1")) == [opened]
    assert not events.select(is_event("stream_closed", stream=opened["stream"]))

    only_new = new_ca.issue_cert("edge-2.pilotfish.test")
    (tmp_path / "new-ca.pem").write_bytes(new_ca.cert_pem.bytes())
    (tmp_path / "edge-2.pem").write_bytes(only_new.cert_chain_pems[0].bytes())
    (tmp_path / "edge-2.key").write_bytes(only_new.private_key_pem.bytes())
    testbed.start_envoy(
        name="after",
        node_id="edge-2",
        bootstrap_options=(
            "--tls-ca",
            str(tmp_path / "new-ca.pem"),
            "--tls-cert",
            str(tmp_path / "edge-2.pem"),
            "--tls-key",
            str(tmp_path / "edge-2.key"),
        ),
    )
    wait_for_acks(events, node="edge-2", types=TYPE_URLS, what="an Envoy trusting only the new CA")


def test_an_envoy_claiming_a_node_id_its_certificate_is_not_granted_is_refused(
    testbed: Testbed, tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    testbed.control_plane.options = (*pki.serve_options(mtls=True), "--authorize-node", "edge-1.pilotfish.test=edge-1")
    testbed.start(envoy_options={"bootstrap_options": pki.client("edge-1", "edge-1.pilotfish.test")})
    # A valid certificate from the same CA, for another identity, claiming edge-1's node id.
    impostor = testbed.start_envoy(
        name="impostor", node_id="edge-1", bootstrap_options=pki.client("edge-2", "edge-2.pilotfish.test")
    )
    refusal = testbed.events.wait_for(
        is_event("node_refused", identity="edge-2.pilotfish.test"),
        what="pilotfish to refuse the impostor's claim to node edge-1",
    )
    assert "'edge-1'" in refusal["reason"]
    # Envoy sees gRPC status 7 (PERMISSION_DENIED) and the reason.
    wait_until(
        lambda: "closed: 7, node id 'edge-1' refused" in impostor.log_tail(200),
        timeout=10,
        what="the impostor to log the refusal",
        details=impostor.log_tail,
    )
    assert impostor.cluster_endpoints("web") == []
    assert len(testbed.events.select(is_event("stream_open", node="edge-1"))) == 1


def test_one_capture_rule_lets_each_certificate_claim_only_its_own_node_id(testbed: Testbed, tmp_path: Path) -> None:
    """``--authorize-node 'spiffe://.../sa/{sa}={sa}'``: the Envoy whose certificate names service
    account edge-a is served as node edge-a; the same certificate claiming edge-b is refused."""
    pki = Pki(tmp_path)
    testbed.write_snapshot()
    testbed.control_plane.options = (
        *pki.serve_options(mtls=True),
        "--authorize-node",
        "spiffe://pilotfish.test/ns/{ns}/sa/{sa}={sa}",
    )
    events = testbed.control_plane.start()
    edge_a = "spiffe://pilotfish.test/ns/edge/sa/edge-a"
    owner = testbed.start_envoy(name="edge-a", node_id="edge-a", bootstrap_options=pki.client("edge-a", edge_a))
    wait_for_acks(events, node="edge-a", types=TYPE_URLS, what="edge-a, claiming its own node id")
    opened = events.find(is_event("stream_open", node="edge-a"))
    assert opened is not None and opened["identity"] == edge_a
    assert owner.cluster_endpoints("web")

    impostor = testbed.start_envoy(name="impostor", node_id="edge-b", bootstrap_options=pki.client("impostor", edge_a))
    refusal = events.wait_for(
        is_event("node_refused", identity=edge_a), what="pilotfish to refuse edge-a's certificate the node id edge-b"
    )
    assert "'edge-b'" in refusal["reason"] and "'edge-a'" in refusal["reason"]  # and what it may claim
    wait_until(
        lambda: "closed: 7, node id 'edge-b' refused" in impostor.log_tail(200),
        timeout=10,
        what="the impostor to log PERMISSION_DENIED",
        details=impostor.log_tail,
    )
    assert impostor.cluster_endpoints("web") == []
    assert not events.select(is_event("stream_open", node="edge-b"))


def test_a_capture_named_twice_or_never_defined_stops_serve_at_start(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text("clusters: []\n")
    for rule, says in (
        ("spiffe://pilotfish.test/ns/{sa}/sa/{sa}={sa}", "the capture {sa} appears twice in IDENTITY"),
        ("spiffe://pilotfish.test/ns/{ns}/sa/*={sa}", "the capture {sa} in NODE is not defined"),
    ):
        result = pilotfish(
            "serve",
            "--snapshot",
            str(snapshot),
            "--xds",
            "127.0.0.1:0",
            "--admin",
            "off",
            *pki.serve_options(mtls=True),
            "--authorize-node",
            rule,
            check=False,
        )
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        assert f"argument --authorize-node: rule '{rule}': {says}" in result.stderr, result.stderr
