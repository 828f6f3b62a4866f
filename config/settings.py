"""Typed settings read from the environment.

Every knob chkq has lives here, read once from ``CHKQ_*`` variables, so that
tasks and the command line share one source of truth and tasks never reach
up into the command line for their configuration.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkq.errors import ConfigurationError

MiB = 1024 * 1024

#: URL schemes of RabbitMQ brokers (kombu's py-amqp transport) and of Redis.
AMQP_SCHEMES: tuple[str, ...] = ("amqp", "amqps", "pyamqp")
REDIS_SCHEMES: tuple[str, ...] = ("redis", "rediss", "unix", "redis+socket")


def broker_scheme(url: str | None) -> str | None:
    """The scheme of a broker or backend URL (``amqp`` of ``amqp://h/v``), or None."""
    if not url:
        return None
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else None


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, got {raw!r}") from None


@dataclass(frozen=True)
class Settings:
    """chkq's configuration.

    Attributes
    ----------
    broker_url
        URL of the broker (``CHKQ_BROKER_URL``): Redis (``redis://``) or
        RabbitMQ (``amqp://``); None selects the embedded local cluster.
    result_backend
        Redis URL of the result backend (``CHKQ_RESULT_BACKEND``), where job
        state lives, defaulting to the broker; required when the broker is
        RabbitMQ.
    block_bytes
        Bytes of rows a task holds in memory at once (``CHKQ_BLOCK_BYTES``,
        default 64 MiB).
    task_bytes
        Bytes of rows one copy or verify task handles before the planner
        splits the work into another task (``CHKQ_TASK_BYTES``).
    task_files
        Files one copy or verify task opens at most (``CHKQ_TASK_FILES``):
        small checkpoint files are batched up to this many.
    task_seconds
        Time budget of one copy or verify task in seconds
        (``CHKQ_TASK_SECONDS``; 0, the default: a quarter of the soft time
        limit, 60 s). The planner cuts units to at most ``task_bytes`` *and*
        to what the slowest node recently measured moves in this long
        (:attr:`budget_seconds`), so that a unit ends well within the time
        limits even on slow storage.
    soft_time_limit, time_limit
        Per-task time limits in seconds (``CHKQ_SOFT_TIME_LIMIT``,
        ``CHKQ_TIME_LIMIT``, default 240 and 300), the worker's: a message
        may ask for shorter ones, never longer (:mod:`chkq.config.limits`);
        clients send none.
    visibility_timeout
        Redis visibility timeout in seconds (``CHKQ_VISIBILITY_TIMEOUT``,
        default 420): an unacknowledged message is delivered again after
        this long, so it must exceed ``time_limit`` by a margin
        (:attr:`visibility_margin`): a task still running is then never
        delivered twice. It is also how long the tasks of a worker that died
        as a whole (node lost, SIGKILL of the main process) wait before
        another worker takes them over (:attr:`takeover_bound`: 462 s by
        default); a pool process that dies hands its task back at once
        (reject-on-worker-lost).
    restore_interval
        Seconds between the sweeps in which every worker hands messages past
        the visibility timeout back to their queues
        (``CHKQ_RESTORE_INTERVAL``; default a tenth of the visibility
        timeout, between 1 and 60 s). kombu 5.7 sweeps only every 10th
        10-second tick unless told otherwise (up to 100 s late); see
        :meth:`broker_transport_options`.
    result_expires
        Seconds results are kept in the backend (``CHKQ_RESULT_EXPIRES``).
    max_redeliveries
        Deliveries of one task message after which it is failed instead of
        run again (``CHKQ_MAX_REDELIVERIES``): a task that keeps killing its
        worker must not loop forever.
    allowed_roots
        Directories tasks may touch (``CHKQ_ALLOWED_ROOTS``, separated by
        ``:``); empty allows any. Set it in deployments: task messages are
        untrusted input.
    security_key, security_certificate, security_cert_store
        Message signing (``CHKQ_SECURITY_KEY``: PEM RSA private key file,
        ``CHKQ_SECURITY_CERTIFICATE``: its PEM certificate,
        ``CHKQ_SECURITY_CERT_STORE``: directory of the PEM certificates whose
        signatures workers accept). All three or none: when set, task and
        remote-control messages are signed and unsigned ones refused
        (:mod:`chkq.config.security`); off when unset.
    scratch_dir
        This worker's private working directory (``CHKQ_SCRATCH_DIR``; default
        ``chkq-scratch-UID`` in the temporary directory): where a job whose
        checkpoints are in an object store is fetched, consolidated and
        verified before its output is published to the store. Created mode
        0700; one that is a link, another user's, or open to others is refused.
    upload_part_bytes
        Bytes per part when such a job's output is published
        (``CHKQ_UPLOAD_PART_BYTES``, default 16 MiB, so that a worker process holds
        a few parts at most; S3 raises it to 5 MiB,
        and every store to a 10,000th of the output).
    broker_heartbeat
        AMQP heartbeat in seconds (``CHKQ_BROKER_HEARTBEAT``, default 20),
        used when the broker is RabbitMQ (``amqp://``): RabbitMQ closes the
        connection of a peer silent for about twice this long, handing its
        unacknowledged tasks to other workers at once, and a worker cut off
        from the broker notices as fast. 0 turns heartbeats off (a node lost
        without closing its sockets then holds its tasks until TCP gives up,
        up to hours).
    """

    broker_url: str | None = None
    result_backend: str | None = None
    block_bytes: int = 64 * MiB
    task_bytes: int = 64 * MiB
    task_files: int = 64
    task_seconds: int = 0
    soft_time_limit: int = 240
    time_limit: int = 300
    visibility_timeout: int = 420
    restore_interval: int = 0
    result_expires: int = 7 * 24 * 3600
    max_redeliveries: int = 3
    allowed_roots: tuple[str, ...] = ()
    security_key: str | None = None
    security_certificate: str | None = None
    security_cert_store: str | None = None
    scratch_dir: str | None = None
    upload_part_bytes: int = 16 * MiB
    # Several nodes: the broker's kind and how a lost peer is noticed.
    broker_heartbeat: int = 20

    @classmethod
    def from_env(cls) -> Settings:
        """Read settings from ``CHKQ_*`` environment variables."""
        broker = os.environ.get("CHKQ_BROKER_URL") or None
        settings = cls(
            broker_url=broker,
            result_backend=os.environ.get("CHKQ_RESULT_BACKEND") or broker,
            block_bytes=_int("CHKQ_BLOCK_BYTES", cls.block_bytes),
            task_bytes=_int("CHKQ_TASK_BYTES", cls.task_bytes),
            task_files=_int("CHKQ_TASK_FILES", cls.task_files),
            task_seconds=_int("CHKQ_TASK_SECONDS", cls.task_seconds),
            soft_time_limit=_int("CHKQ_SOFT_TIME_LIMIT", cls.soft_time_limit),
            time_limit=_int("CHKQ_TIME_LIMIT", cls.time_limit),
            visibility_timeout=_int("CHKQ_VISIBILITY_TIMEOUT", cls.visibility_timeout),
            restore_interval=_int("CHKQ_RESTORE_INTERVAL", cls.restore_interval),
            result_expires=_int("CHKQ_RESULT_EXPIRES", cls.result_expires),
            max_redeliveries=_int("CHKQ_MAX_REDELIVERIES", cls.max_redeliveries),
            allowed_roots=tuple(
                p for p in os.environ.get("CHKQ_ALLOWED_ROOTS", "").split(os.pathsep) if p),
            security_key=os.environ.get("CHKQ_SECURITY_KEY") or None,
            security_certificate=os.environ.get("CHKQ_SECURITY_CERTIFICATE") or None,
            security_cert_store=os.environ.get("CHKQ_SECURITY_CERT_STORE") or None,
            scratch_dir=os.environ.get("CHKQ_SCRATCH_DIR") or None,
            upload_part_bytes=_int("CHKQ_UPLOAD_PART_BYTES", cls.upload_part_bytes),
            broker_heartbeat=_int("CHKQ_BROKER_HEARTBEAT", cls.broker_heartbeat),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Refuse settings that would make tasks run twice at once or loop."""
        if self.block_bytes < 1:
            raise ConfigurationError("CHKQ_BLOCK_BYTES must be positive")
        if self.upload_part_bytes < 1:
            raise ConfigurationError("CHKQ_UPLOAD_PART_BYTES must be positive")
        if self.task_bytes < 1 or self.task_files < 1:
            raise ConfigurationError("CHKQ_TASK_BYTES and CHKQ_TASK_FILES must be positive")
        if not 0 < self.soft_time_limit <= self.time_limit:
            raise ConfigurationError(
                "CHKQ_SOFT_TIME_LIMIT must be positive and at most CHKQ_TIME_LIMIT")
        if self.restore_interval < 0:
            raise ConfigurationError("CHKQ_RESTORE_INTERVAL must be positive (0: derived)")
        if not 0 <= 2 * self.task_seconds <= self.soft_time_limit:
            raise ConfigurationError(
                "CHKQ_TASK_SECONDS must be at most half of CHKQ_SOFT_TIME_LIMIT (0: a quarter)")
        if self.visibility_timeout < self.time_limit + self.visibility_margin:
            raise ConfigurationError(
                f"CHKQ_VISIBILITY_TIMEOUT must be at least CHKQ_TIME_LIMIT + "
                f"{self.visibility_margin} s, or a task still running could be delivered "
                "again and run twice at once"
            )
        self.check_broker()
        security = (self.security_key, self.security_certificate, self.security_cert_store)
        if any(security) and not all(security):
            raise ConfigurationError(
                "message signing needs all of CHKQ_SECURITY_KEY, CHKQ_SECURITY_CERTIFICATE "
                "and CHKQ_SECURITY_CERT_STORE (or none of them)"
            )

    @property
    def broker_is_amqp(self) -> bool:
        """True when the broker is RabbitMQ (an ``amqp://``/``amqps://``/``pyamqp://`` URL)."""
        return broker_scheme(self.broker_url) in AMQP_SCHEMES

    def check_broker(self) -> None:
        """Refuse a broker and result backend chkq cannot run on.

        Job state lives in the result backend's Redis (one ``MGET`` per status,
        Lua for chords, counters of deliveries), so with RabbitMQ as the broker
        the result backend must be named and must be Redis.
        """
        scheme = broker_scheme(self.broker_url)
        if scheme is not None and scheme not in AMQP_SCHEMES + REDIS_SCHEMES:
            raise ValueError(f"CHKQ_BROKER_URL must be a redis:// or amqp:// URL, not {scheme}://")
        if self.broker_heartbeat < 0:
            raise ValueError("CHKQ_BROKER_HEARTBEAT must be 0 (off) or a number of seconds")
        if scheme in AMQP_SCHEMES:
            backend = broker_scheme(self.result_backend)
            if backend not in REDIS_SCHEMES:
                raise ValueError(
                    "CHKQ_RESULT_BACKEND must be a Redis URL (redis://, rediss:// or "
                    "unix://) when CHKQ_BROKER_URL is RabbitMQ: job state is kept in Redis"
                    + (f", not {backend}://" if backend else ", and it is not set"))

    @property
    def signing(self) -> bool:
        """True when task messages are signed and only signed ones accepted."""
        return self.security_key is not None

    @property
    def scratch_root(self) -> Path:
        """The scratch directory's path (not created: :func:`chkq.fsutil.private_directory`)."""
        if self.scratch_dir:
            return Path(self.scratch_dir).absolute()
        return Path(tempfile.gettempdir()) / f"chkq-scratch-{os.getuid()}"

    @property
    def budget_seconds(self) -> int:
        """Seconds one copy or verify unit is cut to last at the slowest measured rate."""
        return self.task_seconds or max(1, self.soft_time_limit // 4)

    @property
    def visibility_margin(self) -> int:
        """Seconds the visibility timeout must exceed the hard time limit by.

        On Redis, a message is delivered again ``visibility_timeout`` seconds
        after its delivery by the clock of the worker that sweeps, whatever
        became of its task. Its task runs at most the hard limit from its
        start, but it starts a little after the delivery (a countdown held
        by the worker, a busy event loop), is killed a little after its
        limit, and the hosts' clocks differ: a tenth of the hard limit, at
        most 60 s, covers these, so a task still running is never handed to
        another worker.
        """
        return min(60, self.time_limit // 10)

    @property
    def restore_every(self) -> int:
        """Seconds between two sweeps for messages past the visibility timeout."""
        if self.restore_interval:
            return self.restore_interval
        return max(1, min(60, self.visibility_timeout // 10))

    @property
    def takeover_bound(self) -> int:
        """Seconds after which a dead worker's messages are surely delivered again.

        A message is handed back by the first sweep after ``visibility_timeout``
        seconds since its delivery: at most this long.
        """
        return self.visibility_timeout + self.restore_every

    def broker_transport_options(self) -> dict[str, Any]:
        """kombu Redis transport options: visibility timeout and a steady restore sweep.

        kombu 5.7 scans for messages past the visibility timeout only every
        ``unacked_restore_throttle`` (10) ticks of ``unacked_restore_interval``
        (10 s): a dead worker's tasks could wait up to 100 s more. Scanning on
        every tick of ``restore_every`` seconds bounds the wait by
        :attr:`takeover_bound`.
        """
        return {
            "visibility_timeout": self.visibility_timeout,
            "unacked_restore_interval": self.restore_every,
            "unacked_restore_throttle": 1,
        }
