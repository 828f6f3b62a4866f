"""Starting a ``chkq worker`` process: the one command line and environment every starter uses.

The embedded cluster, the test fixtures and the benchmarks start their
workers here, so a worker runs the same way wherever it is measured or
tested: ``python -P -m chkq.workers.cli worker`` (the worker start-up of
:mod:`chkq.workers.cli`, its log filter included), the broker's URL in the
environment (a password in it never shows on a command line), its own
session (so that its whole process group can be signalled) and its output in
one log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from chkq.config.routing import QUEUES


def python_command(module: str, *args: str) -> list[str]:
    """``python -P -m MODULE ARGS``: a child that never imports from the current directory.

    ``-m`` would put the current directory first on ``sys.path``; ``-P``
    (Python 3.11) leaves it out, so a ``chkq`` folder there (the clone's
    parent directory, say) cannot shadow the installed package.
    """
    return [sys.executable, "-P", "-m", module, *args]


def worker_command(concurrency: int, queues: Sequence[str] | str, name: str,
                   loglevel: str = "INFO", *, peers: bool = False) -> list[str]:
    """The command line of a chkq worker process.

    ``queues`` are names or a comma-separated list. A worker alone on its
    broker (``peers`` false, as the embedded cluster's) starts without gossip
    and mingle, which only serve to talk to other workers and cost a second at
    start-up; with ``peers`` it exchanges state (revoked tasks) with the
    workers already there.
    """
    listed = queues if isinstance(queues, str) else ",".join(queues)
    argv = python_command("chkq.workers.cli", "worker", "-c", str(concurrency), "-Q", listed,
                          "-n", name, "--loglevel", loglevel)
    if not peers:
        argv += ["--without-gossip", "--without-mingle"]
    return argv


def worker_environment(broker_url: str | None = None, result_backend: str | None = None,
                       extra: Mapping[str, str] | None = None,
                       base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: ``base`` (default: this process's) with the broker and ``extra``.

    ``result_backend`` defaults to ``broker_url``; with no ``broker_url``,
    ``base`` is expected to name the broker already.
    """
    env = dict(os.environ if base is None else base)
    if broker_url is not None:
        env["CHKQ_BROKER_URL"] = broker_url
        env["CHKQ_RESULT_BACKEND"] = result_backend or broker_url
    env.update(extra or {})
    return env


def launch_worker(name: str, *, log: IO[bytes] | int, env: Mapping[str, str],
                 concurrency: int = 1, queues: Sequence[str] | str = QUEUES,
                 loglevel: str = "INFO", peers: bool = False,
                 prefix: Sequence[str] = (), **popen: Any) -> subprocess.Popen[bytes]:
    """Start a worker process named ``name`` in a session of its own; its Popen.

    Its stdout and stderr go to ``log``, stdin is closed. ``prefix`` runs the
    command through another one (``ip netns exec HOST``); ``popen`` is passed
    on to :class:`subprocess.Popen` (``preexec_fn``, say).
    """
    argv = [*prefix, *worker_command(concurrency, queues, name, loglevel, peers=peers)]
    return subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, **popen)


def kill_worker(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGKILL a worker started by :func:`launch_worker` with its pool at once (a node lost)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout)


def stop_worker(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """Warm shutdown of a worker's whole group (SIGTERM); killed if not gone within ``grace``."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            kill_worker(process)
