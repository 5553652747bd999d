"""TLS for the federated server: a certificate authority made for one run, which signs the server's certificate and
is then forgotten.

The devices reach Flower's server through their SSH connections, so the traffic is already encrypted on the network.
TLS adds what the tunnel cannot: the client on a device checks that what answers on its forwarded port is this run's
server (a process on the device that took the port first, or another run's server, is refused before the client
sends it anything), and the legs on each machine's loopback are encrypted too. The authority's private key exists
only while it signs, so no one can issue a second certificate the devices would trust; the server's key never
leaves the controller; a device gets only the authority's certificate, which is public
(docs/how-to/federated.md#security).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HOST = "127.0.0.1"
"""The address every client dials (its end of the SSH forward), which the server's certificate names."""
CLOCK_SLACK = datetime.timedelta(days=1)
"""How far a device's clock may be behind or ahead of the controller's: a camera without NTP still connects."""


@dataclass(frozen=True)
class Certificates:
    """One run's TLS material, PEM-encoded."""

    authority: bytes
    """The run's certificate authority: what a device trusts (public; it goes to every device)."""
    server: bytes
    """The server's certificate, for HOST, signed by the authority."""
    server_key: bytes
    """The server's private key (stays on the controller, in memory)."""


def issue(valid_s: float) -> Certificates:
    """A new authority and a server certificate it signed, valid for `valid_s` seconds (the run's limit) from now,
    with CLOCK_SLACK either side."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - CLOCK_SLACK, now + datetime.timedelta(seconds=valid_s) + CLOCK_SLACK
    authority_key = ec.generate_private_key(ec.SECP256R1())
    authority_name = _name("edge-pipeline federated run authority")
    authority = (
        _builder(authority_name, authority_name, authority_key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(sign_certificates=True), critical=True)
        .sign(authority_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        _builder(_name(HOST), authority_name, server_key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(sign_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False)
        .sign(authority_key, hashes.SHA256())
    )
    key_pem = server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pem = serialization.Encoding.PEM
    return Certificates(authority.public_bytes(pem), server.public_bytes(pem), key_pem)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePublicKey,
    start: datetime.datetime,
    end: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )


def _usage(*, sign_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not sign_certificates,
        key_cert_sign=sign_certificates,
        crl_sign=sign_certificates,
        encipher_only=False,
        decipher_only=False,
    )
