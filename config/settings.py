"""Typed settings read from the environment.

Every knob chkq has lives here, in one table (:data:`VARIABLES`: each
``CHKQ_*`` variable's name, default, kind and help), read once into
:class:`Settings`, so that tasks and the command line share one source of
truth; the core takes what it needs as arguments (:meth:`Settings.core`).
The rows of the core's own variables are defined in :mod:`chkq.environment`;
a program using the library without settings gets the same defaults from
them (:meth:`chkq.core_settings.CoreSettings.from_env`).
The settings table of ``docs/cluster.md`` is :func:`markdown_table` (checked
by a test).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chkq.environment import CORE_VARIABLES, Variable
from chkq.errors import ConfigurationError
from chkq.stores.retry import StoreTimeouts

if TYPE_CHECKING:
    from chkq.core_settings import CoreSettings
    from chkq.log.signing import LogTrust

MiB = 1024 * 1024
GiB = 1024 * MiB
#: Seconds the Redis lock of a sweep for messages past their visibility timeout is kept.
SWEEP_LOCK_SECONDS = 10

#: URL schemes of RabbitMQ brokers (kombu's py-amqp transport) and of Redis.
AMQP_SCHEMES: tuple[str, ...] = ("amqp", "amqps", "pyamqp")
REDIS_SCHEMES: tuple[str, ...] = ("redis", "rediss", "unix", "redis+socket")


def broker_scheme(url: str | None) -> str | None:
    """The scheme of a broker or backend URL (``amqp`` of ``amqp://h/v``), or None."""
    if not url:
        return None
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else None


#: Variables of the layers above the core (those of the core are in :mod:`chkq.environment`).
BROKER_URL = Variable(
    "CHKQ_BROKER_URL", "broker_url", None, "url",
    "URL of the broker: Redis (`redis://`) or RabbitMQ (`amqp://`)", "unset: embedded cluster")
RESULT_BACKEND = Variable(
    "CHKQ_RESULT_BACKEND", "result_backend", None, "url",
    "Redis URL of the job state (results, progress, the job's records); required when the "
    "broker is `amqp://`", "the broker")

#: Every ``CHKQ_*`` variable chkq reads, in the order of the settings table of the docs:
#: name, the :class:`Settings` field, default, kind, help (see :class:`Variable`).
VARIABLES: tuple[Variable, ...] = (
    BROKER_URL,
    RESULT_BACKEND,
    Variable("CHKQ_BLOCK_BYTES", "block_bytes", 64 * MiB, "integer",
             "rows a task holds in memory", "64 MiB"),
    Variable("CHKQ_MAX_DECODED_BYTES", "max_decoded_bytes", 1 << 40, "integer",
             "most bytes a job's compressed rows may decode to, all checkpoints together (read "
             "by the worker that plans)", "1 TiB"),
    Variable("CHKQ_TASK_BYTES", "task_bytes", 64 * MiB, "integer",
             "bytes of rows one copy/verify task handles at most (see `CHKQ_TASK_SECONDS`)",
             "64 MiB"),
    Variable("CHKQ_TASK_FILES", "task_files", 64, "integer",
             "files one copy/verify task opens at most", "64"),
    Variable("CHKQ_TASK_SECONDS", "task_seconds", 0, "integer",
             "time budget of one copy/verify task: units are cut to what the slowest node was "
             "measured to move in this long (at most half the soft limit)",
             "a quarter of the soft limit (60 s)"),
    Variable("CHKQ_SOFT_TIME_LIMIT", "soft_time_limit", 240, "integer",
             "per-task soft limit, the worker's: a message may ask for a shorter one, never "
             "longer", "240 s"),
    Variable("CHKQ_TIME_LIMIT", "time_limit", 300, "integer",
             "per-task hard limit, the worker's: a message may ask for a shorter one, never "
             "longer", "300 s"),
    Variable("CHKQ_VISIBILITY_TIMEOUT", "visibility_timeout", 420, "integer",
             "Redis broker: redelivery of unacknowledged messages, so also how long a lost "
             "node's tasks wait; must be at least `CHKQ_TIME_LIMIT` + a tenth of it (at most "
             "60 s), or chkq refuses to start", "420 s"),
    Variable("CHKQ_RESTORE_INTERVAL", "restore_interval", 0, "integer",
             "Redis broker: seconds between the sweeps that hand messages past the visibility "
             "timeout back", "a tenth of the visibility timeout, 1–60 s"),
    Variable("CHKQ_BROKER_HEARTBEAT", "broker_heartbeat", 20, "integer",
             "RabbitMQ broker: AMQP heartbeat; a silent peer is dropped after about twice "
             "this. 0: off", "20 s"),
    Variable("CHKQ_RESULT_EXPIRES", "result_expires", 7 * 24 * 3600, "integer",
             "seconds results are kept in the backend", "7 days"),
    Variable("CHKQ_MAX_REDELIVERIES", "max_redeliveries", 3, "integer",
             "a task that kills its worker this often fails its job", "3"),
    Variable("CHKQ_ALLOWED_ROOTS", "allowed_roots", (), "paths",
             "`:`-separated directories tasks may touch (run directories, checkpoint files, "
             "`file://` stores); set it in every deployment", "unset: anywhere"),
    Variable("CHKQ_SECURITY_KEY", "security_key", None, "path",
             "PEM RSA private key task and control messages and job records are signed with "
             "(all three `CHKQ_SECURITY_*` or none)", "unset: off"),
    Variable("CHKQ_SECURITY_CERTIFICATE", "security_certificate", None, "path",
             "its PEM certificate", "unset: off"),
    Variable("CHKQ_SECURITY_CERT_STORE", "security_cert_store", None, "path",
             "directory of the PEM certificates whose signatures workers accept", "unset: off"),
    Variable("CHKQ_SCRATCH_DIR", "scratch_dir", None, "path",
             "a worker's private directory where a store job is fetched, consolidated and "
             "verified", "`~/.cache/chkq/scratch-UID`"),
    Variable("CHKQ_UPLOAD_PART_BYTES", "upload_part_bytes", 16 * MiB, "integer",
             "bytes per part when a store job's output is published", "16 MiB"),
    Variable("CHKQ_SPREAD_BYTES", "spread_bytes", GiB, "integer",
             "a store run of at least this many bytes (or one too big for the staging worker's "
             "scratch) is spread over every node, its output assembled in the store, where "
             "the store and the run allow it (a run with compressed datasets only when it is "
             "too big for that scratch); 0: whenever they do", "1 GiB"),
    *CORE_VARIABLES,
    Variable("CHKQ_FLOWER_BASIC_AUTH", "flower_basic_auth", None, "text",
             "`user:password[,user2:password2]` for `chkq flower`; required beyond loopback",
             "unset: a password generated per run"),
)


def markdown_table() -> str:
    """The settings table of ``docs/cluster.md``, one row a variable, from :data:`VARIABLES`."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.shown} | {v.help} |" for v in VARIABLES]
    return "\n".join(rows)


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
    max_decoded_bytes
        Most bytes a job's filtered (compressed) rows may decode to, all
        checkpoints together (``CHKQ_MAX_DECODED_BYTES``, default 1 TiB):
        what a job may cost in decoding, since compressed chunks may declare
        any multiple of what they store.
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
        ``$XDG_CACHE_HOME/chkq/scratch-UID``, else ``~/.cache/chkq/scratch-UID``:
        in the user's own home, where no other user can create it first, unlike
        a name in the shared temporary directory): where a job whose
        checkpoints are in an object store is fetched, consolidated and
        verified before its output is published to the store. Created mode
        0700; one that is a link, another user's, or open to others is refused.
    upload_part_bytes
        Bytes per part when such a job's output is published
        (``CHKQ_UPLOAD_PART_BYTES``, default 16 MiB, so that a worker process holds
        a few parts at most; S3 raises it to 5 MiB,
        and every store to a 10,000th of the output).
    spread_bytes
        A store job of a run of at least this many bytes, or of one that does
        not fit in the staging worker's scratch, is spread over every node
        (``CHKQ_SPREAD_BYTES``, default 1 GiB): its output is assembled in the
        store from parts, where the store can (a local directory, S3, GCS)
        and the run's rows are all of a fixed-size type in one store (a run
        with compressed datasets only when it does not fit).
    broker_heartbeat
        AMQP heartbeat in seconds (``CHKQ_BROKER_HEARTBEAT``, default 20),
        used when the broker is RabbitMQ (``amqp://``): RabbitMQ closes the
        connection of a peer silent for about twice this long, handing its
        unacknowledged tasks to other workers at once, and a worker cut off
        from the broker notices as fast. 0 turns heartbeats off (a node lost
        without closing its sockets then holds its tasks until TCP gives up,
        up to hours).
    store_connect_timeout, store_read_timeout, store_retry_seconds, store_complete_timeout
        Waits of the network stores (``CHKQ_STORE_*``; :attr:`store_timeouts`).
    log_signing_key, log_trusted_keys, log_max_checkpoint_bytes
        The log's keys and size cap (``CHKQ_LOG_*``; :meth:`log_trust`).
    user_keys_dir, user_key
        Users' keys (``CHKQ_USER_KEYS_DIR``, ``CHKQ_USER_KEY``; :mod:`chkq.identity`).
    flower_basic_auth
        Credentials of ``chkq flower`` (``CHKQ_FLOWER_BASIC_AUTH``).

    Each attribute is a row of :data:`VARIABLES` (name, default, kind, help).
    """

    broker_url: str | None = None
    result_backend: str | None = None
    block_bytes: int = 64 * MiB
    max_decoded_bytes: int = 1 << 40
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
    spread_bytes: int = GiB
    # Several nodes: the broker's kind and how a lost peer is noticed.
    broker_heartbeat: int = 20
    store_connect_timeout: float = 5.0
    store_read_timeout: float = 15.0
    store_retry_seconds: float = 20.0
    store_complete_timeout: float = 300.0
    log_signing_key: str | None = None
    log_trusted_keys: str | None = None
    log_max_checkpoint_bytes: int = 4 << 30
    user_keys_dir: str | None = None
    user_key: str | None = None
    flower_basic_auth: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read settings from the ``CHKQ_*`` variables of :data:`VARIABLES` (``os.environ``)."""
        found = os.environ if env is None else env
        values = {v.field: v.read(found) for v in VARIABLES}
        values["result_backend"] = values["result_backend"] or values["broker_url"]
        settings = cls(**values)
        settings.check()
        return settings

    @property
    def store_timeouts(self) -> StoreTimeouts:
        """How long network stores wait (``CHKQ_STORE_*``): ``open_store(url, timeouts=...)``."""
        return StoreTimeouts(connect=self.store_connect_timeout, read=self.store_read_timeout,
                             budget=self.store_retry_seconds,
                             complete=self.store_complete_timeout)

    def log_trust(self) -> LogTrust:
        """The log keys (``CHKQ_LOG_*_KEY*``), for ``CheckpointLog(..., trust=...)``.

        Raises
        ------
        LogKeyError
            If a configured file cannot be used.
        """
        # Loaded here: the log's keys need cryptography, which a client sending a job does not.
        from chkq.log.signing import trust_from_files

        return trust_from_files(self.log_signing_key, self.log_trusted_keys)

    def core(self) -> CoreSettings:
        """What the core takes as arguments (:class:`chkq.core_settings.CoreSettings`)."""
        from chkq.core_settings import CoreSettings

        return CoreSettings(timeouts=self.store_timeouts, trust=self.log_trust(),
                            max_checkpoint=self.log_max_checkpoint_bytes)

    def check(self) -> None:
        """Refuse settings that would make tasks run twice at once or loop."""
        if self.block_bytes < 1:
            raise ConfigurationError("CHKQ_BLOCK_BYTES must be positive")
        if self.max_decoded_bytes < 1:
            raise ConfigurationError("CHKQ_MAX_DECODED_BYTES must be positive")
        if self.upload_part_bytes < 1:
            raise ConfigurationError("CHKQ_UPLOAD_PART_BYTES must be positive")
        if self.spread_bytes < 0:
            raise ConfigurationError("CHKQ_SPREAD_BYTES must be 0 or more")
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
        cache = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
        return base / "chkq" / f"scratch-{os.getuid()}"

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
        :attr:`takeover_bound`. The sweep holds a lock in Redis while it
        scans, which kombu keeps for 300 s: a worker killed while holding it
        (a node lost mid-sweep) would stop every sweep for five minutes. A
        sweep takes milliseconds, and two at once restore each message once
        (each restore is a transaction), so the lock is kept for
        :data:`SWEEP_LOCK_SECONDS` instead.
        """
        return {
            "visibility_timeout": self.visibility_timeout,
            "unacked_restore_interval": self.restore_every,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": SWEEP_LOCK_SECONDS,
        }
