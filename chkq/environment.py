"""The environment, read for library users: the one core module that reads ``os.environ``.

The core takes its settings as arguments (``open_store(url, timeouts=...)``,
``CheckpointLog(store, run, trust=..., max_checkpoint=...)``); the task,
worker and command-line layers pass values read once into
:class:`chkq.config.settings.Settings`. A program that uses the library
directly and passes none gets what the environment says, read here: the
``CHKQ_*`` variables of the core (:data:`CORE_VARIABLES`, rows of the one
settings table in :mod:`chkq.config.settings`) and the few variables of the
cloud libraries chkq reads itself.

This module sits below every module whose settings it defines: the values
made of several variables are made where their type lives
(:meth:`chkq.stores.retry.StoreTimeouts.from_env`,
:meth:`chkq.log.signing.LogTrust.from_env`, and
:class:`chkq.core_settings.CoreSettings` of them all), each reading the rows
defined here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from chkq.errors import ConfigurationError

__all__ = [
    "CORE_VARIABLES",
    "Variable",
    "aws_region",
    "environ",
    "gcs_emulator",
    "max_checkpoint_bytes",
]


def environ() -> Mapping[str, str]:
    """This process's environment (what every default of the library is read from)."""
    return os.environ


def _text(name: str, raw: str) -> str:
    return raw


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, got {raw!r}") from None


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigurationError(f"{name} must be positive, got {raw!r}")
    return value


def _bytes(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of bytes, got {raw!r}") from None
    if value <= 0:
        raise ConfigurationError(f"{name} must be positive, got {raw!r}")
    return value


def _paths(name: str, raw: str) -> tuple[str, ...]:
    return tuple(p for p in raw.split(os.pathsep) if p)


#: How a variable's text becomes its value, by the table's ``kind``.
PARSERS: dict[str, Callable[[str, str], Any]] = {
    "text": _text, "path": _text, "url": _text, "integer": _integer, "seconds": _seconds,
    "bytes": _bytes, "paths": _paths,
}


@dataclass(frozen=True)
class Variable:
    """One ``CHKQ_*`` variable: a row of the settings table.

    Attributes
    ----------
    name
        The variable (``CHKQ_STORE_READ_TIMEOUT``).
    field
        The :class:`~chkq.config.settings.Settings` attribute it sets.
    default
        Its value when unset or empty.
    kind
        How its text is read: ``text``, ``path``, ``url``, ``integer``,
        ``seconds`` (positive), ``bytes`` (positive), ``paths``
        (``:``-separated).
    help
        What it does, as the settings table in the docs shows it.
    shown
        Its default as the docs show it (``64 MiB``, ``unset: off``).
    """

    name: str
    field: str
    default: Any
    kind: str
    help: str
    shown: str

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """The variable's value in ``env`` (this process's environment if None).

        Raises
        ------
        ConfigurationError
            If its text is not of its kind, naming the variable.
        """
        raw = (environ() if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.default
        return PARSERS[self.kind](self.name, raw)


STORE_CONNECT_TIMEOUT = Variable(
    "CHKQ_STORE_CONNECT_TIMEOUT", "store_connect_timeout", 5.0, "seconds",
    "seconds S3 and GCS requests wait to connect", "5 s")
STORE_READ_TIMEOUT = Variable(
    "CHKQ_STORE_READ_TIMEOUT", "store_read_timeout", 15.0, "seconds",
    "seconds S3 and GCS requests wait for any byte of an answer (a transfer that keeps moving "
    "is never cut)", "15 s")
STORE_RETRY_SECONDS = Variable(
    "CHKQ_STORE_RETRY_SECONDS", "store_retry_seconds", 20.0, "seconds",
    "retry budget of one S3 or GCS operation (one per command for broker-less commits): an "
    "operation fails after at most this plus one attempt", "20 s")
STORE_COMPLETE_TIMEOUT = Variable(
    "CHKQ_STORE_COMPLETE_TIMEOUT", "store_complete_timeout", 300.0, "seconds",
    "how long completing an upload (S3 `CompleteMultipartUpload`, GCS compose) waits for its "
    "answer; a lost answer is asked again for up to twice that", "300 s")
LOG_SIGNING_KEY = Variable(
    "CHKQ_LOG_SIGNING_KEY", "log_signing_key", None, "path",
    "PEM file of the Ed25519 private key (mode 0600 or stricter) records and name entries are "
    "signed with; its public key is trusted", "unset")
LOG_TRUSTED_KEYS = Variable(
    "CHKQ_LOG_TRUSTED_KEYS", "log_trusted_keys", None, "path",
    "PEM file of Ed25519 public keys, or a directory of `*.pem`/`*.pub`; when set (or a signing "
    "key is), only objects signed by a trusted key are read", "unset")
LOG_MAX_CHECKPOINT_BYTES = Variable(
    "CHKQ_LOG_MAX_CHECKPOINT_BYTES", "log_max_checkpoint_bytes", 4 << 30, "bytes",
    "largest checkpoint committed or read; records declaring more are refused, nothing is "
    "decompressed beyond its record's size", "4 GiB (4294967296)")
USER_KEYS_DIR = Variable(
    "CHKQ_USER_KEYS_DIR", "user_keys_dir", None, "path",
    "directory of users' keys (`USER.key`): set on workers, jobs run only for submitters who "
    "prove who they are; set on clients, where a submitter's own key is", "unset: one party")
USER_KEY = Variable(
    "CHKQ_USER_KEY", "user_key", None, "path",
    "a client's own key file, instead of `CHKQ_USER_KEYS_DIR/USER.key`", "unset")

#: The core's variables, in the order of the settings table.
CORE_VARIABLES: tuple[Variable, ...] = (
    STORE_CONNECT_TIMEOUT, STORE_READ_TIMEOUT, STORE_RETRY_SECONDS, STORE_COMPLETE_TIMEOUT,
    LOG_SIGNING_KEY, LOG_TRUSTED_KEYS, LOG_MAX_CHECKPOINT_BYTES, USER_KEYS_DIR, USER_KEY,
)


def max_checkpoint_bytes(env: Mapping[str, str] | None = None) -> int:
    """The cap on a checkpoint's size, ``CHKQ_LOG_MAX_CHECKPOINT_BYTES``.

    Raises
    ------
    ConfigurationError
        If it is not a positive whole number of bytes.
    """
    return int(LOG_MAX_CHECKPOINT_BYTES.read(env))


def aws_region(env: Mapping[str, str] | None = None) -> str | None:
    """The region S3 clients use when none is given: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``."""
    found = environ() if env is None else env
    return found.get("AWS_REGION") or found.get("AWS_DEFAULT_REGION") or None


def gcs_emulator(env: Mapping[str, str] | None = None) -> bool:
    """Whether GCS clients talk to an emulator (``STORAGE_EMULATOR_HOST``), without credentials."""
    return bool((environ() if env is None else env).get("STORAGE_EMULATOR_HOST"))
