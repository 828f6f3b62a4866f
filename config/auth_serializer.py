"""Celery's ``auth`` (signing) serializer, refusing signed payloads that are not JSON.

Installed by :func:`chkq.config.security.install_signing` when message
signing is configured (the module docstring there says what is signed).
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import SecurityError
from celery.security.serialization import SecureSerializer
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import padding
from kombu.serialization import loads

#: Content type of the JSON that a signed message carries, and its encoding.
_INNER = ("application/json", "utf-8")


class StrictSecureSerializer(SecureSerializer):
    """Celery's signing serializer, refusing signed payloads that are not JSON.

    It also verifies signatures itself: Celery 5.7's ``Certificate.verify``
    turns a bad signature into ``TypeError('catching classes that do not
    inherit from BaseException...')`` (its ``reraise_errors`` is given the
    ``cryptography.exceptions`` module as the exception class). The message
    is refused either way, but the log should say why.
    """

    def deserialize(self, data: Any) -> Any:
        """Verify ``data``'s signature and decode its JSON body.

        Raises
        ------
        celery.exceptions.SecurityError
            If ``data`` is not a signed message, names an inner content type
            other than JSON, its signer's certificate is not in the store (or
            expired), or its signature does not verify.
        """
        try:
            payload = self._unpack(data)
        except Exception as exc:  # noqa: BLE001 - any garbage is a security error here
            raise SecurityError(f"not a signed message: {exc!r}") from None
        inner = (payload["content_type"], payload["content_encoding"].lower())
        if inner != _INNER:
            raise SecurityError(f"signed message carries {inner[0]!r}, not JSON")
        certificate = self._cert_store[payload["signer"]]  # SecurityError if unknown
        if certificate.has_expired():
            raise SecurityError(f"expired certificate: {certificate.get_id()!r}")
        try:
            certificate.get_pubkey().verify(
                payload["signature"], payload["body"],
                padding.PSS(mgf=padding.MGF1(self._digest), salt_length=padding.PSS.MAX_LENGTH),
                self._digest)
        except InvalidSignature:
            raise SecurityError(
                f"bad signature: not signed by the key of {certificate.get_id()!r}") from None
        return loads(payload["body"], *_INNER, force=True)
