"""Sealed values in Redis: every job record is written and read through one verifier.

A record is ``chkq1 CODE JSON``. With a key (message signing configured), ``CODE``
is an HMAC-SHA256 over the record's Redis key, its hash field (a unit number, or
none) and its bytes: a value written by someone who has the Redis password but
not the key, or moved to another key, job or unit, is refused with
:class:`ForgedRecordError` naming the key. Without a key ``CODE`` is ``-`` and
Redis access alone writes job state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from chkq.errors import ForgedRecordError

#: The first word of every record: the format, so that a value of another kind is refused.
SEAL_FORMAT = b"chkq1"
_UNSEALED = b"-"


def shown(key: str, field: str) -> str:
    """A record's key (and hash field) as messages name it."""
    return f"{key}[{field}]" if field else key


class SealedStore:
    """Sealed JSON values in one Redis database.

    Parameters
    ----------
    client
        A ``redis.Redis`` client (or fakeredis).
    secret
        The record key (bytes), or None when message signing is off.
    ttl
        Seconds every record is kept (the result backend's expiry).
    """

    def __init__(self, client: Any, secret: bytes | None, ttl: int | None) -> None:
        self.client = client
        self.secret = secret
        self.ttl = ttl

    @property
    def authenticated(self) -> bool:
        """True when records are sealed with a key."""
        return self.secret is not None

    def _code(self, key: str, field: str, payload: bytes) -> bytes:
        assert self.secret is not None
        message = b"\0".join((SEAL_FORMAT, key.encode(), field.encode(), payload))
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, field: str, payload: str) -> bytes:
        """``payload`` (JSON text) as stored under ``key`` (and hash field ``field``)."""
        data = payload.encode()
        code = _UNSEALED if self.secret is None else self._code(key, field, data)
        return SEAL_FORMAT + b" " + code + b" " + data

    def unseal(self, key: str, field: str, raw: bytes | str) -> str:
        """The JSON text of a record read from ``key`` (``field``), once its seal is checked.

        Raises
        ------
        ForgedRecordError
            If the value is not a sealed record, or (with a key) its code does not
            match: it was written without the key, or copied from another key,
            job or unit.
        """
        data = raw if isinstance(raw, bytes) else raw.encode()
        head, _, rest = data.partition(b" ")
        code, space, payload = rest.partition(b" ")
        where = shown(key, field)
        if head != SEAL_FORMAT or not space:
            raise ForgedRecordError(f"job record {where} is not a record chkq wrote: refused")
        if self.secret is not None and not hmac.compare_digest(
                code, self._code(key, field, payload)):
            raise ForgedRecordError(
                f"job record {where} does not carry this deployment's authentication code: it "
                "was written by someone with access to Redis but without the signing key "
                "(CHKQ_SECURITY_KEY), or moved from another key, and is refused as not the "
                "job's own")
        try:
            return payload.decode()
        except UnicodeDecodeError:
            raise ForgedRecordError(f"job record {where} is not UTF-8 text: refused") from None

    @staticmethod
    def parse(key: str, field: str, text: str) -> Any:
        """``text`` read from a record, as JSON."""
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            raise ForgedRecordError(f"job record {shown(key, field)} is not valid JSON: "
                                    "refused") from None

    def get(self, key: str) -> Any:
        """The value recorded under ``key`` (checked), or None if there is none."""
        raw = self.client.get(key)
        return None if raw is None else self.parse(key, "", self.unseal(key, "", raw))

    def get_many(self, keys: list[str]) -> list[Any | ForgedRecordError]:
        """The values recorded under ``keys`` (one ``MGET``), each checked as :meth:`get`.

        A value that is refused is given as its :class:`ForgedRecordError`, in its
        place, so that one planted record does not hide the others.
        """
        if not keys:
            return []
        values: list[Any | ForgedRecordError] = []
        for key, raw in zip(keys, self.client.mget(keys), strict=True):
            try:
                values.append(None if raw is None
                              else self.parse(key, "", self.unseal(key, "", raw)))
            except ForgedRecordError as exc:
                values.append(exc)
        return values

    def get_text(self, key: str) -> str | None:
        """The checked JSON text recorded under ``key``, or None."""
        raw = self.client.get(key)
        return self.unseal(key, "", raw) if raw else None

    def set(self, key: str, value: Any, *, nx: bool = False) -> bool:
        """Record ``value`` (JSON-ready) under ``key``; with ``nx`` only if absent."""
        return self.set_text(key, json.dumps(value), nx=nx)

    def set_text(self, key: str, text: str, *, nx: bool = False) -> bool:
        """Record JSON ``text`` under ``key``; with ``nx`` only if absent (then: if set)."""
        return bool(self.client.set(key, self.seal(key, "", text), nx=nx, ex=self.ttl))

    def hset(self, key: str, fields: dict[str, Any]) -> None:
        """Record each of ``fields`` (name -> JSON-ready value) in the hash ``key``."""
        if not fields:
            return
        self.client.hset(key, mapping={name: self.seal(key, name, json.dumps(value))
                                       for name, value in fields.items()})
        if self.ttl:
            self.client.expire(key, self.ttl)

    def hgetall_units(self, key: str) -> dict[int, Any]:
        """Every unit's record of the hash ``key`` (each checked), by unit number."""
        records: dict[int, Any] = {}
        for raw_field, raw in self.client.hgetall(key).items():
            name = raw_field.decode() if isinstance(raw_field, bytes) else str(raw_field)
            if not name.isdigit() or name != str(int(name)):
                raise ForgedRecordError(f"job record {shown(key, name)} names no unit: refused")
            records[int(name)] = self.parse(key, name, self.unseal(key, name, raw))
        return records
