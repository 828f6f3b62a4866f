"""Signed log objects: who may write the records and entries a reader acts on.

Whoever can write to a store (another tenant of a shared bucket, another user
with write access to a shared directory) can plant a well-formed record,
payload and name entry.  Content is checked against its SHA-256 id on every
load, but *which* checkpoint a name stands for, and how large it says it is,
come from the record and the entry (and which file is a model's consolidated
output, from its output entry).  With signing, each record, name entry and
output entry carries an Ed25519 signature by a writer key, and a reader
configured with trusted public keys refuses (reports, never uses) any object
that is unsigned, signed by a key it does not trust, or whose signature does
not match.  Payloads, head copies and output objects need no signature: a
signed record names their content (id, declared size), a signed output entry
its object's size and SHA-256, and each is checked against it.

What is signed is the object's canonical JSON (sorted keys, no whitespace,
``signature`` left out) together with the kind of object and the run id, so
a signed record or entry cannot be replayed into another run, or as the
other kind.

Configuration (passed as ``trust``, or read by :meth:`LogTrust.from_env` through
:mod:`chkq.environment`):

``CHKQ_LOG_SIGNING_KEY``
    A PEM file holding the writer's Ed25519 private key (PKCS#8, mode 0600
    or stricter).  Its public key is trusted too.
``CHKQ_LOG_TRUSTED_KEYS``
    A PEM file of one or more Ed25519 public keys, or a directory of such
    files (``*.pem``, ``*.pub``).

With either set, reads are *enforcing*: only objects signed by a trusted key
are used.  With neither, objects are read unsigned (as before signing
existed) and restore refuses a name whose entries disagree instead of
letting one of them win.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from chkq import environment
from chkq.errors import LogKeyError
from chkq.rundir import CREATE

__all__ = [
    "SIGNATURE_FIELD",
    "LogKeyError",
    "LogTrust",
    "generate_key_pair",
    "key_id",
]

SIGNATURE_FIELD = "signature"
SIGNING_KEY_ENV = environment.LOG_SIGNING_KEY.name
TRUSTED_KEYS_ENV = environment.LOG_TRUSTED_KEYS.name
_CONTEXT = b"chkq-log-signature-v1\n"
_PEM = re.compile(rb"-----BEGIN [A-Z ]+-----.+?-----END [A-Z ]+-----", re.DOTALL)


def key_id(public: Ed25519PublicKey) -> str:
    """Short, stable name of a public key: the first 32 hex digits of SHA-256 of its raw bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def _message(obj: Mapping[str, Any], kind: str, run: str) -> bytes:
    body = {k: v for k, v in obj.items() if k != SIGNATURE_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _CONTEXT + f"{kind}\n{run}\n".encode() + canonical.encode()


def _load_private(path: Path) -> Ed25519PrivateKey:
    try:
        st = os.stat(path)
        raw = path.read_bytes()
    except OSError as exc:
        raise LogKeyError(f"log signing key {str(path)!r}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise LogKeyError(f"log signing key {str(path)!r} is readable by others "
                          f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    try:
        key = serialization.load_pem_private_key(raw, password=None)
    except (ValueError, TypeError) as exc:
        raise LogKeyError(f"log signing key {str(path)!r} is not a PEM private key: {exc}"
                          ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise LogKeyError(f"log signing key {str(path)!r} is not an Ed25519 key")
    return key


def _load_public(path: Path) -> list[Ed25519PublicKey]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LogKeyError(f"trusted log key {str(path)!r}: {exc.strerror}") from None
    blocks = _PEM.findall(raw)
    if not blocks:
        raise LogKeyError(f"trusted log key file {str(path)!r} holds no PEM public key")
    keys = []
    for block in blocks:
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError) as exc:
            raise LogKeyError(f"trusted log key file {str(path)!r}: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise LogKeyError(f"trusted log key file {str(path)!r} holds a key that is not "
                              "Ed25519")
        keys.append(key)
    return keys


@dataclass(frozen=True)
class LogTrust:
    """Which writer keys a log signs with and trusts.

    Attributes
    ----------
    signer
        The private key objects are signed with when written, if any.
    trusted
        Public keys by :func:`key_id`; when non-empty, reads accept only
        objects signed by one of them.
    """

    signer: Ed25519PrivateKey | None = None
    trusted: dict[str, Ed25519PublicKey] = field(default_factory=dict)

    @property
    def enforcing(self) -> bool:
        """Whether reads refuse objects not signed by a trusted key."""
        return bool(self.trusted)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LogTrust:
        """The trust configured by ``CHKQ_LOG_SIGNING_KEY`` and ``CHKQ_LOG_TRUSTED_KEYS``.

        Read from ``environ`` (this process's environment if None); the key
        files are loaded once per pair of paths in this process
        (:func:`trust_from_files`).

        Raises
        ------
        LogKeyError
            If a configured file cannot be used.
        """
        return trust_from_files(environment.LOG_SIGNING_KEY.read(environ),
                                environment.LOG_TRUSTED_KEYS.read(environ))

    @classmethod
    def from_files(cls, signing_key: str | Path | None,
                   trusted_keys: str | Path | None) -> LogTrust:
        """Trust from a private key file and a public key file or directory (either optional)."""
        signer = _load_private(Path(signing_key)) if signing_key else None
        trusted: dict[str, Ed25519PublicKey] = {}
        if signer is not None:
            own = signer.public_key()
            trusted[key_id(own)] = own
        if trusted_keys:
            where = Path(trusted_keys)
            if where.is_dir():
                files = sorted(p for p in where.iterdir()
                               if p.suffix in (".pem", ".pub") and p.is_file())
                if not files:
                    raise LogKeyError(f"trusted log key directory {str(where)!r} holds no "
                                      "*.pem or *.pub file")
            else:
                files = [where]
            for path in files:
                for key in _load_public(path):
                    trusted[key_id(key)] = key
        return cls(signer, trusted)

    def sign(self, obj: dict[str, Any], kind: str, run: str) -> dict[str, Any]:
        """``obj`` with its ``signature`` field (``obj`` itself when there is no signer)."""
        if self.signer is None:
            return obj
        signature = self.signer.sign(_message(obj, kind, run))
        return {**obj, SIGNATURE_FIELD: {
            "key": key_id(self.signer.public_key()),
            "ed25519": base64.b64encode(signature).decode()}}

    def refusal(self, obj: Mapping[str, Any], kind: str, run: str) -> str | None:
        """Why an object read from the store must not be used, or None if it may.

        Without trusted keys every object may be used.
        """
        if not self.enforcing:
            return None
        found = obj.get(SIGNATURE_FIELD)
        if found is None:
            return "not signed (trusted log keys are configured)"
        if not isinstance(found, dict) or not isinstance(found.get("key"), str) \
                or not isinstance(found.get("ed25519"), str):
            return "malformed signature"
        public = self.trusted.get(found["key"])
        if public is None:
            return f"signed by key {found['key'][:32]!r}, which is not trusted"
        try:
            signature = base64.b64decode(found["ed25519"], validate=True)
            public.verify(signature, _message(obj, kind, run))
        except (ValueError, InvalidSignature):
            return f"bad signature (key {found['key']})"
        return None


@functools.lru_cache(maxsize=8)
def trust_from_files(signing_key: str | None, trusted_keys: str | None) -> LogTrust:
    """:meth:`LogTrust.from_files`, loaded once per pair of paths in this process."""
    return LogTrust.from_files(signing_key, trusted_keys)


def generate_key_pair(directory: str | Path, name: str = "chkq-log") -> tuple[Path, Path, str]:
    """Write a new Ed25519 key pair: ``NAME.key`` (0600, PKCS#8 PEM) and ``NAME.pub``.

    Returns
    -------
    (private key path, public key path, key id)

    Raises
    ------
    FileExistsError
        If either file exists (a key is never overwritten).
    """
    where = Path(directory)
    private_path, public_path = where / f"{name}.key", where / f"{name}.pub"
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise FileExistsError(f"{str(path)!r} exists; not overwritten")
    flags = CREATE
    for path, data, mode in ((private_path, private, 0o600), (public_path, public, 0o644)):
        fd = os.open(path, flags, mode)
        with open(fd, "wb") as fh:
            fh.write(data)
    return private_path, public_path, key_id(key.public_key())
