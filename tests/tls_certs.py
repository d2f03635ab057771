"""Throwaway TLS material for tests: a CA, a server certificate for 127.0.0.1/localhost and client
certificates with a chosen common name, written as PEM files (``cryptography``, no openssl CLI).

EC P-256 keys: generated in about a millisecond, where RSA-2048 takes tens.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost",)
SERVER_IPS = ("127.0.0.1",)


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Paths of one certificate (PEM) and its unencrypted private key (PEM)."""

    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class Pki:
    """A CA and the certificates it signed, as files under one directory. ``other_ca`` is an
    unrelated CA (for "signed by someone else" cases)."""

    ca: str
    server: CertFiles
    clients: dict[str, CertFiles]
    other_ca: str


class _Authority:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            _builder(self.name, self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, subject: x509.Name, usage: x509.ObjectIdentifier,
        san: x509.SubjectAlternativeName | None = None,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(subject, self.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def make_pki(
    directory: Path, client_names: Sequence[str] = ("client",), *,
    client_sans: Mapping[str, Sequence[str]] | None = None,
) -> Pki:
    """Write ``ca.pem``, ``server.pem``/``server-key.pem`` (SAN DNS localhost, IP 127.0.0.1),
    one ``client-<cn>.pem``/``client-<cn>-key.pem`` per name in ``client_names`` (subject
    ``CN=<name>, O=kvcoord-tests``) and ``other-ca.pem`` into ``directory``; returns the paths.
    ``client_sans`` gives a client subject alternative names: a URI when it has ``://``
    (``spiffe://kvcoord/worker/0``), else a DNS name."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _Authority("kvcoord test CA")
    ca_path = _write(directory / "ca.pem", _cert_pem(ca.cert))
    other_path = _write(directory / "other-ca.pem", _cert_pem(_Authority("someone else").cert))
    san = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in SERVER_NAMES]
        + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_IPS]
    )
    server = _write_pair(directory, "server", *ca.issue(
        _subject("kvcoord test server"), ExtendedKeyUsageOID.SERVER_AUTH, san))
    sans = client_sans or {}
    clients = {
        name: _write_pair(directory, f"client-{name}", *ca.issue(
            _subject(name), ExtendedKeyUsageOID.CLIENT_AUTH, _client_san(sans.get(name, ()))))
        for name in client_names
    }
    return Pki(ca=ca_path, server=server, clients=clients, other_ca=other_path)


def _client_san(names: Sequence[str]) -> x509.SubjectAlternativeName | None:
    if not names:
        return None
    return x509.SubjectAlternativeName([
        x509.UniformResourceIdentifier(n) if "://" in n else x509.DNSName(n) for n in names
    ])


def _subject(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvcoord-tests"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between processes
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_pair(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertFiles:
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return CertFiles(cert=_write(directory / f"{stem}.pem", _cert_pem(cert)),
                     key=_write(directory / f"{stem}-key.pem", key_pem))


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)
