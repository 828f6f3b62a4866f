"""Retries and budgets of the network stores: bounded waits, one retry layer.

Every request has a connect and a read timeout (:class:`StoreTimeouts`), the
client libraries' own retries are off, and one retry budget in seconds covers
each whole operation (:func:`retry_transient`), or every operation of a block
(:func:`overall_budget`), so that a store that stops answering fails with an
error naming the store and the key in well under a minute instead of hanging a
client for many (library retries nested inside chkq's).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from chkq import environment
from chkq.backoff import Backoff
from chkq.errors import TransientStoreError

__all__ = ["RETRY_LOGGER", "StoreTimeouts", "overall_budget", "retry_transient"]

RETRY_LOGGER = "chkq.stores.retry"
"""Logger of the "transient error, retrying" lines (INFO), one per retry."""

log = logging.getLogger(RETRY_LOGGER)

T = TypeVar("T")


@dataclass(frozen=True)
class StoreTimeouts:
    """How long a network store waits, per request and per operation.

    Attributes
    ----------
    connect
        Seconds to establish a connection (``CHKQ_STORE_CONNECT_TIMEOUT``,
        default 5).
    read
        Seconds to wait for any byte of an answer
        (``CHKQ_STORE_READ_TIMEOUT``, default 15); a transfer that keeps
        moving is never cut.
    budget
        Seconds one store operation may spend on retries of transient
        failures (``CHKQ_STORE_RETRY_SECONDS``, default 20): no attempt
        starts after it is spent, so an operation fails after at most
        ``budget + connect + read`` seconds (40 by default).
    complete
        Seconds to wait for the answer to a request that assembles an object
        from its parts (an S3 ``CompleteMultipartUpload``, a GCS compose;
        ``CHKQ_STORE_COMPLETE_TIMEOUT``, default 300): a store takes time to
        assemble a large object (S3 allows minutes; moto took 23 s for
        1.5 GB), and an answer given up for lost makes its outcome unknown.
        A completion whose answer is lost anyway is asked again for as long
        again, until the store says what became of it.
    """

    connect: float = 5.0
    read: float = 15.0
    budget: float = 20.0
    complete: float = 300.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreTimeouts:
        """The waits the ``CHKQ_STORE_*`` variables set (defaults for those unset).

        Parameters
        ----------
        env
            Where the variables are read (this process's environment if None).

        Raises
        ------
        ConfigurationError
            If one is not a positive number (a ``ValueError``), naming the variable.
        """
        return cls(connect=environment.STORE_CONNECT_TIMEOUT.read(env),
                   read=environment.STORE_READ_TIMEOUT.read(env),
                   budget=environment.STORE_RETRY_SECONDS.read(env),
                   complete=environment.STORE_COMPLETE_TIMEOUT.read(env))

    @property
    def worst_case(self) -> float:
        """Longest an operation can take before it fails: the budget plus one attempt."""
        return self.budget + self.connect + self.read


@dataclass
class _SharedBudget:
    """The retry budget of an :func:`overall_budget` block, started by its first operation."""

    seconds: float
    outer: _SharedBudget | None
    deadline: float | None = None

    def started(self, now: float) -> float:
        """The monotonic time after which no operation of the block starts a retry."""
        if self.deadline is None:
            self.deadline = now + self.seconds
        return self.deadline if self.outer is None else min(self.deadline,
                                                            self.outer.started(now))


_SHARED: contextvars.ContextVar[_SharedBudget | None] = contextvars.ContextVar(
    "chkq_store_budget", default=None)


@contextlib.contextmanager
def overall_budget(seconds: float) -> Iterator[None]:
    """Make every store operation inside the block share one retry budget of ``seconds``.

    Each operation otherwise has a budget of its own, and a command of many
    operations against a store that keeps failing would wait for their sum.
    Inside the block an operation retries only until the block's deadline;
    past it, it makes its one attempt and fails on a transient error. The
    deadline is counted from the block's first store operation, so that
    work before it (opening the store, reading a checkpoint) takes none of
    the budget. A block nested in another ends no later than the outer one.
    """
    token = _SHARED.set(_SharedBudget(seconds, _SHARED.get()))
    try:
        yield
    finally:
        _SHARED.reset(token)


def retry_transient(
    operation: Callable[[], T],
    *,
    is_transient: Callable[[BaseException], bool],
    what: str,
    attempts: int = 8,
    budget: float | None = None,
    initial_delay: float = 0.1,
    max_delay: float = 4.0,
) -> T:
    """Call ``operation`` and retry it with exponential backoff on transient errors.

    This is the only retry layer: the stores turn the client libraries' own
    retries off, so the patience of one operation is bounded here, by both
    a number of attempts and a time budget, and a store that is briefly
    unreachable, throttling or answering 409 ConditionalRequestConflict does
    not fail a commit while one that stopped answering fails in bounded
    time.  Every store operation is idempotent or a conditional create that
    recognises its own earlier success, so re-running it is safe.

    Parameters
    ----------
    operation
        A zero-argument callable performing one attempt (whose requests
        have their own connect and read timeouts).
    is_transient
        Classifies an exception: True means "retry", False means "re-raise now".
    what
        Human-readable description (store, operation and key) for messages.
    attempts
        Maximum number of calls.
    budget
        Seconds after the first call within which a retry may start (None:
        no time bound); the wait before a retry never runs past it, nor past
        the deadline of an enclosing :func:`overall_budget`.
    initial_delay, max_delay
        Backoff bounds in seconds; each wait is drawn with jitter from
        ``[delay / 2, delay]`` and ``delay`` doubles up to ``max_delay``.

    Raises
    ------
    TransientStoreError
        When every attempt failed transiently, or the budget is spent
        (chained to the last error); the message says what, how many
        attempts and how long.
    """
    backoff = Backoff(initial_delay, max_delay, jitter=True)
    start = time.monotonic()
    shared = _SHARED.get()
    if shared is not None:
        remaining = max(0.0, shared.started(start) - start)
        budget = remaining if budget is None else min(budget, remaining)
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            wait = backoff.wait(attempt - 1)
            out_of_time = budget is not None and elapsed + wait >= budget
            if attempt == attempts or out_of_time:
                limit = f"retry budget {budget:.3g} s" if out_of_time else f"{attempts} attempts"
                raise TransientStoreError(
                    f"{what}: no success after {attempt} attempt(s) in {elapsed:.1f} s "
                    f"({limit}): {_one_line(exc)}"
                ) from exc
            log.info("%s: transient error (attempt %d/%d): %s", what, attempt, attempts, exc)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
