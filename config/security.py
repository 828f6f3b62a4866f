"""Signed task messages, and the key job records are sealed with: Redis access alone runs nothing.

With ``CHKQ_SECURITY_KEY``, ``CHKQ_SECURITY_CERTIFICATE`` and
``CHKQ_SECURITY_CERT_STORE`` set, chkq uses Celery's message signing: every
task and remote-control message is serialized by the ``auth`` serializer
(JSON, signed with the private key; RSA-PSS, SHA-256), and a worker accepts
only messages whose signature verifies against a certificate of the store.
A message without a signature (plain JSON), signed by a key whose certificate
is not in the store, or signed by a key that does not match the certificate
it names, is discarded with a log line, and the worker goes on.

What stays unsigned: results (JSON in the result backend, read by clients),
task events (JSON, shown by Flower) and the message headers (task name, id,
``timelimit``, ``eta``...): Celery signs the body (arguments) only. A party
with broker access can therefore replay a captured message or re-address its
signed arguments to another task; chkq's tasks are idempotent and check their
arguments, the time limits are the worker's (:mod:`chkq.config.limits`), and
the Redis password keeps such parties off the broker in the first place.

chkq's own job records in the result backend are not Celery's to sign: they
are sealed with an HMAC under :func:`record_key`, derived from the same
private key (:mod:`chkq.jobs.sealed`).

Celery's ``auth`` deserializer decodes the signed bytes with the content type
named *beside* the signature, outside what is signed, and with ``force=True``
(no accept list). The serializer of :mod:`chkq.config.auth_serializer` accepts JSON only there, so
that a signed body can never be fed to another decoder.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.config.settings import Settings
from chkq.errors import ConfigurationError

#: What the job-record key is derived for (HKDF's ``info``): a key for nothing else.
RECORD_KEY_INFO = b"chkq job records v1"

if TYPE_CHECKING:
    from celery import Celery

#: The digest the messages are signed with.
DIGEST = "sha256"


def signing_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for signed messages, or none when signing is off.

    Task and remote-control messages are signed (Celery's control mailbox
    uses the task serializer and accept list); results and events stay JSON.
    """
    if not settings.signing:
        return {}
    return {
        "task_serializer": "auth",
        "accept_content": ["auth"],
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "security_key": settings.security_key,
        "security_certificate": settings.security_certificate,
        "security_cert_store": settings.security_cert_store,
        "security_digest": DIGEST,
    }


def _why_unreadable(path: str) -> str:
    """What an administrator needs to fix an unreadable secret: it is missing, or whose it is."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return ("it does not exist: the secrets directory (CHKQ_SECRETS in compose.yaml, "
                "./secrets by default) must hold chkq.key, chkq.pem and trusted/")
    except OSError as exc:
        return str(exc.strerror)
    return (f"it is owned by uid {found.st_uid} (gid {found.st_gid}) with mode "
            f"{stat.filemode(found.st_mode)}: make it readable by uid {os.geteuid()}, e.g. "
            "chown it to the workers' user (CHKQ_UID in compose.yaml)")


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the {what} {path!r} as uid {os.geteuid()} ({exc.strerror}): "
            f"{_why_unreadable(path)}") from None


def install_signing(app: Celery, settings: Settings) -> None:
    """Sign this process's messages and verify those it receives, if settings ask.

    Celery's ``setup_security`` checks the configuration and disables every
    serializer but JSON; then the ``auth`` serializer (process-wide, as in
    Celery) is replaced by :class:`StrictSecureSerializer`.

    Raises
    ------
    ValueError
        If the key, the certificate or the store cannot be read, the store
        holds no certificate, or the key does not match the certificate.
    """
    if not settings.signing:
        return
    # Loaded only here: cryptography and Celery's signing cost every client ~0.03 s.
    from celery.exceptions import SecurityError
    from celery.security.certificate import Certificate, FSCertStore
    from celery.security.key import PrivateKey
    from kombu.serialization import registry

    from chkq.config.auth_serializer import StrictSecureSerializer

    assert settings.security_key and settings.security_certificate
    assert settings.security_cert_store
    key_pem = _read(settings.security_key, "private key (CHKQ_SECURITY_KEY)")
    cert_pem = _read(settings.security_certificate, "certificate (CHKQ_SECURITY_CERTIFICATE)")
    store_path = settings.security_cert_store
    if not os.path.isdir(store_path) or not os.listdir(store_path):
        raise ConfigurationError(f"CHKQ_SECURITY_CERT_STORE {store_path!r} must be a directory "
                         "holding the PEM certificates of the trusted signers")
    try:
        key, cert, store = PrivateKey(key_pem), Certificate(cert_pem), FSCertStore(store_path)
    except (SecurityError, ValueError, TypeError, OSError) as exc:
        raise ConfigurationError(f"message signing is misconfigured: {exc}") from None
    if key._key.public_key().public_numbers() != cert.get_pubkey().public_numbers():
        raise ConfigurationError("CHKQ_SECURITY_KEY does not match CHKQ_SECURITY_CERTIFICATE")
    app.setup_security(allowed_serializers=["json"], digest=DIGEST, serializer="json")
    strict = StrictSecureSerializer(key, cert, store, DIGEST, serializer="json")
    registry.register("auth", strict.serialize, strict.deserialize,
                      content_type="application/data", content_encoding="utf-8")


def record_key(settings: Settings) -> bytes | None:
    """The key job records in Redis are authenticated with, or None when signing is off.

    HKDF-SHA256 of the signing private key (``CHKQ_SECURITY_KEY``, its
    PKCS#8 DER bytes), for :data:`RECORD_KEY_INFO` only: whoever holds the
    signing key can derive it, the Redis password gives nothing of it, and
    knowing it reveals nothing of the private key. Clients and workers hold
    the same signing key, so both write records the other accepts.

    Raises
    ------
    ValueError
        If the key file cannot be read or is not a PEM private key.
    """
    if not settings.signing:
        return None
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    assert settings.security_key
    pem = _read(settings.security_key, "private key (CHKQ_SECURITY_KEY)")
    try:
        private = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"CHKQ_SECURITY_KEY {settings.security_key!r} is not a PEM "
                         f"private key without a passphrase: {exc}") from None
    material = private.private_bytes(serialization.Encoding.DER,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=RECORD_KEY_INFO).derive(material)


def user_keys_dir() -> Path | None:
    """The directory of users' keys workers check submitters against, or None (one party).

    ``CHKQ_USER_KEYS_DIR`` (:mod:`chkq.identity`): with it, a worker runs a
    job only for a user who proves who they are and could do it themselves.

    Raises
    ------
    ConfigurationError
        If it is set but is not an absolute path to a directory.
    """
    from chkq.identity import KEYS_VARIABLE

    raw = os.environ.get(KEYS_VARIABLE)
    if not raw:
        return None
    path = Path(raw)
    if not path.is_absolute() or not path.is_dir():
        raise ConfigurationError(f"{KEYS_VARIABLE}={raw!r} must be an absolute path to a "
                                 "directory of users' keys (USER.key)")
    return path
