"""Message signing for tests: a throwaway CA, the deployment's key and certificate.

Also the workers that sign and verify, waited for with signed pings.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery.security.certificate import Certificate
from celery.security.key import PrivateKey
from celery.security.serialization import SecureSerializer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from support.plugins.cluster import WorkerProcess

CLI_TIMEOUT = 120


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "chkq test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, issuer: str, public_key: Any, signing_key: Any, serial: int,
                 ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(_name(subject)).issuer_name(_name(issuer))
            .public_key(public_key).serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(signing_key, hashes.SHA256()))


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class Signer:
    """A private key and the certificate it signs as (PEM text)."""

    key: str
    cert: str

    def serializer(self) -> SecureSerializer:
        return SecureSerializer(PrivateKey(self.key), Certificate(self.cert), None, "sha256")


@dataclass
class Secrets:
    """The deployment's files (what compose.yaml mounts) and two attackers' signers."""

    key_file: Path
    cert_file: Path
    store: Path
    trusted: Signer
    rogue: Signer
    impostor: Signer

    def env(self) -> dict[str, str]:
        return {"CHKQ_SECURITY_KEY": str(self.key_file),
                "CHKQ_SECURITY_CERTIFICATE": str(self.cert_file),
                "CHKQ_SECURITY_CERT_STORE": str(self.store)}


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    """A CA, the workers' key and CA-signed certificate, and two keys that are not trusted.

    The impostor's certificate has the trusted one's issuer and serial number,
    which is what Celery looks a signer up by: only the signature tells them apart.
    """
    directory = tmp_path_factory.mktemp("secrets")
    ca_key, key, rogue_key, impostor_key = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(4))
    ca = _certificate("chkq test CA", "chkq test CA", ca_key.public_key(), ca_key, 1, ca=True)
    cert = _certificate("chkq workers", "chkq test CA", key.public_key(), ca_key, 1001)
    rogue = _certificate("rogue", "rogue", rogue_key.public_key(), rogue_key, 7)
    impostor = _certificate("chkq workers", "chkq test CA", impostor_key.public_key(),
                            impostor_key, 1001)
    store = directory / "trusted"
    store.mkdir()
    (directory / "ca.pem").write_bytes(_cert_pem(ca))
    (store / "workers.pem").write_bytes(_cert_pem(cert))
    key_file, cert_file = directory / "workers.key", directory / "workers.pem"
    key_file.write_bytes(_key_pem(key))
    key_file.chmod(0o600)
    cert_file.write_bytes(_cert_pem(cert))
    return Secrets(
        key_file, cert_file, store,
        trusted=Signer(_key_pem(key).decode(), _cert_pem(cert).decode()),
        rogue=Signer(_key_pem(rogue_key).decode(), _cert_pem(rogue).decode()),
        impostor=Signer(_key_pem(impostor_key).decode(), _cert_pem(impostor).decode()),
    )


def signed_ping(name: str, env: dict[str, str]) -> bool:
    """The compose health check: ``celery inspect ping``, signed, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "chkq.config.celery_app:app", "inspect",
         "ping", "-d", name, "--timeout", "2"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    return done.returncode == 0 and "pong" in done.stdout


class SignedWorker(WorkerProcess):
    """A ``chkq worker`` that signs and verifies, waited for with signed pings."""

    client_env: dict[str, str]

    def __init__(self, url: str, log_dir: Path, env: dict[str, str]) -> None:
        self.client_env = {**env, "CHKQ_BROKER_URL": url, "CHKQ_RESULT_BACKEND": url}
        super().__init__(url, "control,copy,verify,commit", 2, log_dir, env)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log()[-2000:]}")
            if signed_ping(self.name, self.client_env):
                return
        raise RuntimeError(f"worker {self.name} did not answer ping within {timeout} s")

