"""A throw-away PKI for the TLS tests: a self-signed CA, a server certificate for 127.0.0.1,
a client certificate (mutual TLS), and an unrelated CA that signed nothing of ours.

Fixtures (a plugin of tests/conftest.py: every test module has them): ``pki`` (per module)
and ``tls_server``, a factory of TLS-only redis-servers with that PKI
(``tls_server(verify_clients=True)`` for mutual TLS)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.chaos.servers import RedisServer


@dataclass
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _cert(subject, issuer, key, signer, ca: bool, san=None) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key=None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return path


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca = _cert(_name("pagedq test CA"), _name("pagedq test CA"), ca_key, ca_key, True)
    other = _cert(_name("someone else"), _name("someone else"), other_key, other_key, True)
    server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(2))
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = _cert(_name("127.0.0.1"), ca.subject, server_key, ca_key, False, san)
    client = _cert(_name("pagedq worker"), ca.subject, client_key, ca_key, False)
    _write(folder / "server.crt", server, server_key)
    _write(folder / "client.crt", client, client_key)
    return PKI(_write(folder / "ca.crt", ca), folder / "server.crt", folder / "server.key",
               folder / "client.crt", folder / "client.key", _write(folder / "other.crt", other))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(tmp_path, pki):
    def start(verify_clients: bool) -> RedisServer:
        return RedisServer(tmp_path / "redis-tls", [
            "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
            "--tls-ca-cert-file", str(pki.ca),
            "--tls-auth-clients", "yes" if verify_clients else "no"], tls=True).start()

    servers = []
    yield lambda verify_clients=False: servers.append(start(verify_clients)) or servers[-1]
    for server in servers:
        server.stop()
