"""What every ``chkq`` command shares: how it stops, how it speaks, what its numbers are."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from chkq.workers.client import Progress

#: Signals that end a command cleanly (its children and temporaries go with it).
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

class Interrupted(KeyboardInterrupt):
    """The command was asked to stop by signal ``signum`` (SIGINT, SIGTERM or SIGHUP).

    Raised from the signal handler in the main thread, so that every ``with``
    block on the way out (the embedded cluster, its broker) stops what it
    started. A KeyboardInterrupt, so code that treats Ctrl-C specially
    treats the others the same.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.reported = False


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    # Once is enough: later signals must not cut the clean-up short.
    for sig in ENDING_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def install_signal_handlers() -> dict[int, Any]:
    """Turn SIGINT, SIGTERM and SIGHUP into :class:`Interrupted`; return the old handlers.

    A signal the command was started with ignored (``nohup``, ``cmd &``) stays
    ignored.
    """
    previous: dict[int, Any] = {}
    for sig in ENDING_SIGNALS:
        old = signal.getsignal(sig)
        if old is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, _raise_interrupted)
    return previous


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def say(message: str, stream: TextIO | None = None) -> None:
    """Print one line on stderr; a closed stream (a hung-up terminal) is not an error."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=stream or sys.stderr, flush=True)


#: How often a progress line is written where it cannot rewrite itself (a batch job's log).
LOG_SECONDS = 10.0


def percent(done: int, total: int) -> str:
    """``done`` out of ``total`` as a whole percentage, 100% only once all is done."""
    return f"{100 if done >= total else min(99, 100 * done // total)}%"


class ProgressLine:
    """Progress: one self-rewriting line on a terminal; plain lines in a log, on request.

    Called with a job's :class:`Progress` (``chkq consolidate``), or given a
    line of its own with :meth:`show` (``chkq log verify``). On a terminal,
    lines come at most every ``interval`` seconds, and the last always.
    Elsewhere nothing is shown unless ``log`` is set (``-v``): then a line is
    written whenever the phase changes and at most every ``LOG_SECONDS``
    within a phase, so that a batch job's log shows where it stands at a rate
    a log can take.
    """

    def __init__(self, stream: TextIO = sys.stderr, interval: float = 0.0,
                 log: bool = False) -> None:
        self.stream = stream
        self.terminal = stream.isatty()
        self.log = log and not self.terminal
        self.enabled = self.terminal
        self.width = 0
        self.interval = interval
        self.last = 0.0
        self.logged = ("", -LOG_SECONDS)

    def __call__(self, progress: Progress) -> None:
        total = progress.total
        if total and progress.records:
            line = (f"{progress.phase}: copied {percent(progress.copied, total)}, verified "
                    f"{percent(progress.verified, total)} of {progress.records:,} rows")
        elif total:
            line = (f"{progress.phase}: copied {progress.copied:,}/{total:,} rows, "
                    f"verified {progress.verified:,}/{total:,} rows")
        else:
            line = f"{progress.phase}..."
        if self.log:
            self._log(progress.phase, line)
        self.show(line)

    def _log(self, phase: str, line: str) -> None:
        now = time.monotonic()
        if phase == self.logged[0] and now - self.logged[1] < LOG_SECONDS:
            return
        self.logged = (phase, now)
        say(line, self.stream)

    def show(self, line: str, final: bool = True) -> None:
        """Rewrite the line as ``line``; one that is not ``final`` may be skipped (throttled)."""
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < self.interval):
            return
        self.last = now
        self.width = max(self.width, len(line))
        try:
            print("\r" + line.ljust(self.width), end="", file=self.stream, flush=True)
        except OSError:
            self.enabled = False

    def close(self) -> None:
        """Erase the line, and a ``^C`` the terminal echoed after it (CR, erase to the end)."""
        if self.enabled and self.width:
            with contextlib.suppress(OSError):
                print("\r\x1b[K", end="", file=self.stream, flush=True)
            self.width = 0

    def notice(self, message: str) -> None:
        """A ``warning:`` line, on its own line even while progress is shown."""
        self.close()
        say(f"warning: {message}", self.stream)
