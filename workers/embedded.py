"""The embedded local cluster: a private broker and local worker processes.

With no ``CHKQ_BROKER_URL``, ``chkq consolidate`` (and ``chkq log commit``)
run inside one of these: the same canvas and the same worker code as a real
cluster, against a broker started for the length of the command.

Nothing outlives the command, whatever ends it:

- a normal exit stops the worker (warm shutdown: it is idle by then), then
  the broker;
- an exception, Ctrl-C, SIGTERM or SIGHUP (which the command line turns into
  an exception) abandons the job: the worker's whole process group is killed
  at once, the job's temporaries are removed (:meth:`EmbeddedCluster.on_abandon`),
  then the broker stops;
- SIGKILL of the command (or a crash) leaves the kernel to do it: the worker's
  main process and redis-server are started with ``PR_SET_PDEATHSIG``
  (:func:`chkq.workers.broker.die_with_parent`), and Celery gives its pool
  processes the same, so the whole tree goes with its parent; the reaper
  (:mod:`chkq.workers.runtime.reaper`), which holds a lifeline to the command,
  then removes the job's temporaries and exits.

The worker's log goes to an anonymous temporary file and the broker's
private directory (its socket) is removed when it stops, by the reaper
after a SIGKILL, so nothing is left on disk either.

The broker is its owner's only (:class:`~chkq.workers.broker.PrivateRedis`
in Unix-socket mode: a 0700 directory, no TCP port, a random password); the
worker gets its URL, password included, in its environment, never on its
command line. Child processes are started with ``python -P``, so that a
``chkq`` directory in the current directory is never imported in place of
the installed package.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import IO, Any

from celery import Celery
from celery.result import AsyncResult

from chkq.config.celery_app import close_app, get_app, get_settings, make_app, use_app
from chkq.config.routing import QUEUES
from chkq.consolidation.temporaries import JobFiles, discard_job_files
from chkq.errors import EmbeddedClusterError, WaitTimeoutError
from chkq.workers.broker import PrivateRedis, die_with_parent
from chkq.workers.runtime.launch import (  # noqa: F401 (worker_command re-exported)
    launch_worker,
    python_command,
    worker_command,
    worker_environment,
)

#: Seconds an idle worker gets for a warm shutdown before its group is killed.
STOP_GRACE_SECONDS = 10.0

#: Most worker processes the embedded cluster starts unless asked for more.
DEFAULT_WORKERS_CAP = 4


def default_workers() -> int:
    """Processes of an embedded cluster by default: the CPU count, at most 4.

    The embedded cluster runs beside other work (a login node, a simulation
    that wants its CPUs); a consolidation is mostly I/O, and four processes
    keep a copy and a verify stream going on each side of a local disk.
    ``--workers`` asks for more.
    """
    return max(1, min(DEFAULT_WORKERS_CAP, os.cpu_count() or 1))


def drop_result_subscriptions() -> None:
    """Close the client's result subscriptions while its broker still answers.

    Celery subscribes to a task's result when it sends it and unsubscribes
    when the AsyncResult is collected, which may be after the broker is
    gone, or at interpreter shutdown: the unsubscription would then fail
    noisily at exit (``Exception ignored in: AsyncResult.__del__``).
    """
    consumer = getattr(get_app().backend, "result_consumer", None)
    if consumer is None:
        return
    consumer.subscribed_to.clear()
    pending = getattr(consumer, "_pending_unsubscribe", None)
    if pending is not None:
        pending.clear()
    with contextlib.suppress(Exception):
        consumer.stop()


class EmbeddedCluster:
    """A private Redis and one worker with ``workers`` processes, for a ``with`` block.

    ``workers`` defaults to :func:`default_workers`.
    """

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or default_workers())
        self.broker = PrivateRedis(unix_socket=True)
        self.log: IO[bytes] = tempfile.TemporaryFile(prefix="chkq-embedded-")  # noqa: SIM115
        self.process: subprocess.Popen[bytes] | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        self._abandon_hooks: list[Callable[[], Any]] = []
        self.app: Celery | None = None
        self._previous_app: Celery | None = None

    def __enter__(self) -> EmbeddedCluster:
        try:
            self.broker.start()
            # An app of its own for the private broker; the process's settings otherwise.
            self.app = make_app(replace(get_settings(), broker_url=self.broker.url,
                                        result_backend=self.broker.url))
            self._previous_app = use_app(self.app)
            self.process = launch_worker(
                f"embedded-{uuid.uuid4().hex[:8]}@%h", log=self.log,
                env=worker_environment(self.broker.url), concurrency=self.workers,
                queues=QUEUES, preexec_fn=die_with_parent(signal.SIGKILL),
            )
            self.reaper = subprocess.Popen(
                python_command("chkq.workers.runtime.reaper", str(self.process.pid),
                               str(self.broker.private_dir)),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            self.close(abandon=True)
            raise
        return self

    def guard(self, files: JobFiles) -> None:
        """Remove ``files``' temporaries if the job is cut short, even by SIGKILL of this process.

        An exception or signal runs an abandon hook; a SIGKILL leaves it to the
        reaper (:mod:`chkq.workers.runtime.reaper`), told of the job over its lifeline.
        """
        self.on_abandon(lambda: discard_job_files(files))
        if self.reaper is not None and self.reaper.stdin is not None:
            with contextlib.suppress(OSError):
                self.reaper.stdin.write(f"{files.out_dir}\t{files.model}\t{files.job_id}\n"
                                        .encode())
                self.reaper.stdin.flush()

    def _release_reaper(self) -> None:
        """Tell the reaper the command ends normally (its own cleanup ran), and let it go."""
        reaper, self.reaper = self.reaper, None
        if reaper is None or reaper.stdin is None:
            return
        with contextlib.suppress(OSError):
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(5)

    def on_abandon(self, hook: Callable[[], Any]) -> None:
        """Run ``hook`` if the cluster is abandoned, after its workers are dead.

        For removing the temporaries of a job that was cut short: no task can
        still be writing them by then.
        """
        self._abandon_hooks.append(hook)

    def log_tail(self, lines: int = 10) -> list[str]:
        """The worker's last log lines."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace").splitlines()[-lines:]

    def check_alive(self) -> None:
        """Raise RuntimeError, with the worker's last log lines, if the worker died."""
        if self.process is not None and self.process.poll() is not None:
            raise EmbeddedClusterError(
                f"the embedded worker exited with status {self.process.returncode}: "
                + " | ".join(self.log_tail())
            )

    def wait(self, result: AsyncResult, timeout: float | None = None) -> Any:
        """``result.get()``, but raising at once if the worker dies meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not result.ready():
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeoutError(f"task {result.id} did not finish within {timeout} s")
            time.sleep(0.05)
        return result.get()

    def _kill_group(self) -> None:
        """SIGKILL the worker's process group (main process and pool), then reap the main."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop_workers(self, *, abandon: bool) -> None:
        """Stop the worker: warm shutdown, or (``abandon``) kill its whole group at once."""
        process = self.process
        if process is None:
            return
        if process.poll() is None and not abandon:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_SECONDS)
        # Pool processes a dead main left behind share its process group.
        self._kill_group()
        self.process = None

    def close(self, *, abandon: bool) -> None:
        """Stop everything; when ``abandon``, run the abandon hooks between workers and broker."""
        try:
            self.stop_workers(abandon=abandon)
            if abandon:
                for hook in self._abandon_hooks:
                    with contextlib.suppress(Exception):
                        hook()
            drop_result_subscriptions()
        finally:
            self._release_reaper()
            if self.app is not None:
                use_app(self._previous_app)
                close_app(self.app)
                self.app = None
            self.broker.close()
            self.log.close()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abandon=exc_type is not None)
