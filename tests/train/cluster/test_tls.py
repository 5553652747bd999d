"""The federated server's per-run certificates (pipeline.train.cluster.tls); test_flower.py shows Flower's clients
accepting the server only with the run's authority."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from pipeline.train.cluster import tls


def test_the_server_certificate_names_the_loopback_and_only_the_runs_authority_signed_it() -> None:
    run, other = tls.issue(3600), tls.issue(3600)
    authority, server = x509.load_pem_x509_certificate(run.authority), x509.load_pem_x509_certificate(run.server)
    server.verify_directly_issued_by(authority)
    assert authority.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    key = serialization.load_pem_private_key(run.server_key, password=None)
    assert key.public_key() == server.public_key()
    now = datetime.datetime.now(datetime.UTC)
    assert server.not_valid_before_utc < now and server.not_valid_after_utc > now + datetime.timedelta(seconds=3600)
    with pytest.raises(InvalidSignature):  # another run's authority, of the same name, vouches for nothing here
        server.verify_directly_issued_by(x509.load_pem_x509_certificate(other.authority))
