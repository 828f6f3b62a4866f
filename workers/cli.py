"""The ``chkq`` command line.

Exit status: 0 on success; 1 with one ``error: ...`` line on stderr for a
failed job or bad input; 2 for a usage error (argparse's convention);
128 + N when ended by signal N (SIGINT, SIGTERM, SIGHUP), after everything
the command started was stopped and its temporaries removed.

A fast start: only the module of the command being run is imported (Celery,
h5py and boto3 only where a command needs them); ``--version`` and
``--help`` import nothing else.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from chkq import __version__
from chkq.errors import ConfigurationError

if TYPE_CHECKING:
    from chkq.workers.client import ConsolidationJob, Progress

#: Subcommands defined in other modules: name -> (module with ``register(subparsers)``,
#: help). Only the module of the command being run is imported.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "log": ("chkq.workers.log_cli", "a run's checkpoint log: commit, list, heads, lineage, "
            "pull, restore, gc, verify"),
    "watch": ("chkq.workers.watch", "commit a running simulation's checkpoints as they "
              "complete"),
    "flower": ("chkq.workers.flower", "start Flower, the web monitor (always behind basic "
               "auth)"),
    "status": ("chkq.workers.status", "show a job's steps (done, running, failed and why), "
               "or recent jobs"),
    "cancel": ("chkq.workers.status", "cancel a job: revoke its tasks, remove its "
               "temporaries"),
    "gc": ("chkq.workers.store_gc", "abort the uploads killed publishers left unfinished "
           "under a store prefix"),
}

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


def say(message: str, stream: TextIO | None = None) -> None:
    """Print one line on stderr; a closed stream (a hung-up terminal) is not an error."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=stream or sys.stderr, flush=True)


class ProgressLine:
    """One self-rewriting line of progress on a terminal; silent elsewhere.

    Called with a job's :class:`Progress` (``chkq consolidate``), or given a
    line of its own with :meth:`show` (``chkq log verify``); lines come at
    most every ``interval`` seconds, and the last always.
    """

    def __init__(self, stream: TextIO = sys.stderr, interval: float = 0.0) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.width = 0
        self.interval = interval
        self.last = 0.0

    def __call__(self, progress: Progress) -> None:
        total = progress.total
        if total:
            line = (f"{progress.phase}: copied {progress.copied:,}/{total:,} rows, "
                    f"verified {progress.verified:,}/{total:,} rows")
        else:
            line = f"{progress.phase}..."
        self.show(line)

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


def _job_fate(job: ConsolidationJob) -> str:
    """What a cluster job does after its client stops waiting, for the user."""
    phase = "queued or running"
    try:
        from chkq.tasks.protocol import job_status

        status = job_status(job.id)
        phase = {"PENDING": "queued", "RUNNING": f"running ({status.phase})"}.get(
            status.state, status.state.lower())
    except Exception:  # noqa: BLE001 - the broker may be what went away
        pass
    return (f"job {job.id} is still {phase} on the cluster: chkq status {job.id} follows "
            f"it, chkq cancel {job.id} cancels it")


def cmd_consolidate(args: argparse.Namespace) -> int:
    from chkq.config.celery_app import get_settings
    from chkq.workers.client import run_consolidation, submit_consolidation

    if args.no_wait:
        if not get_settings().broker_url:
            raise ConfigurationError("--no-wait needs a cluster: set CHKQ_BROKER_URL")
        if args.source is not None:
            from chkq.workers.client import submit_store_consolidation

            job = submit_store_consolidation(args.model, args.source, run=args.run,
                                             to=args.to, cleanup=args.cleanup,
                                             allow_gaps=args.allow_gaps)
        else:
            job = submit_consolidation(args.model, args.out_dir, args.cleanup,
                                       allow_gaps=args.allow_gaps)
        for warning in job.client_warnings:
            say(f"warning: {warning}")
        print(job.id)
        return 0
    line = ProgressLine()
    submitted: list[ConsolidationJob] = []
    try:
        summary = run_consolidation(
            args.model, args.out_dir, args.cleanup, workers=args.workers,
            timeout=args.timeout, allow_gaps=args.allow_gaps, source=args.source,
            run=args.run, to=args.to, on_progress=line,
            on_notice=line.notice, on_submitted=submitted.append)
    except Interrupted as exc:
        line.close()
        if get_settings().broker_url and submitted:
            say(f"error: interrupted; {_job_fate(submitted[0])}")
            exc.reported = True
        raise
    finally:
        line.close()
    for warning in summary.warnings:
        say(f"warning: {warning}")
    if args.verbose or line.enabled:
        say(summary.line())
    print(summary.output, flush=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from chkq.config.celery_app import get_app
    from chkq.config.routing import resolve_queues

    queues = resolve_queues(args.queues)
    argv = ["worker", "-Q", ",".join(queues), "--loglevel", args.loglevel, "-P", "prefork"]
    if args.concurrency:
        argv += ["-c", str(args.concurrency)]
    if args.hostname:
        argv += ["-n", args.hostname]
    if args.without_gossip:
        argv.append("--without-gossip")
    if args.without_mingle:
        argv.append("--without-mingle")
    from chkq.workers.log_filter import install_log_filter

    install_log_filter()
    no_private_tempdir()
    serve_node_queue()
    get_app().worker_main(argv=argv)
    return 0


def serve_node_queue() -> None:
    """Have the worker serve its own queue too (``chkq.node.NODENAME``), whatever ``-Q`` says.

    The steps of a job fetched from an object store into this worker's scratch
    directory are sent there.
    """
    from celery.signals import celeryd_after_setup

    from chkq.config.celery_app import get_settings
    from chkq.config.routing import node_queue

    def add(sender: str, instance: Any, **_: Any) -> None:
        instance.app.amqp.queues.select_add(
            node_queue(sender, quorum=get_settings().broker_is_amqp))

    celeryd_after_setup.connect(add, weak=False)


def no_private_tempdir() -> None:
    """Have billiard put its (at once unlinked) temporary files in the temporary directory.

    Otherwise the worker creates a ``pymp-*`` directory there that only its
    own orderly exit removes: a worker killed (SIGKILL, or with the command
    that started it) would leave one behind each time.
    """
    import multiprocessing
    import tempfile

    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    config.setdefault("tempdir", tempfile.gettempdir())


def cmd_demo(args: argparse.Namespace) -> int:
    from chkq.demo import write_demo

    files = write_demo(args.out_dir, args.model, checkpoints=args.checkpoints,
                       writers=args.writers, trials=args.trials)
    print(f"wrote {len(files)} checkpoint files of model {args.model!r} in {args.out_dir}")
    return 0


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``chkq`` parser, with the full options of the command ``argv`` runs.

    Commands of :data:`COMMAND_MODULES` other than that one get a stub that
    carries their name and help only, so that ``--help`` lists them without
    importing them. With ``argv`` None every module is imported (complete
    parser, e.g. for documentation).
    """
    parser = argparse.ArgumentParser(
        prog="chkq", description="Distributed checkpoint workers: consolidate HDF5 "
        "checkpoints, commit them to a write-once log.")
    parser.add_argument("--version", action="version", version=f"chkq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("consolidate", help="merge a run's HDF5 checkpoints into MODEL.h5")
    p.add_argument("model")
    p.add_argument("--out-dir", type=Path, help="the run's output directory (default: .)")
    p.add_argument("--from", dest="source", metavar="STORE_URL",
                   help="consolidate a run kept in an object store (s3://bucket/prefix/, "
                        "gs://..., file:///dir/): its checkpoint objects, or with --run a "
                        "checkpoint log's run; no shared filesystem needed")
    p.add_argument("--run", help="with --from: the checkpoint log's run to consolidate")
    p.add_argument("--to", metavar="URL",
                   help="with --from: the object to publish the output at (default: "
                        "MODEL.h5 beside the sources, or the log's runs/RUN/outputs/MODEL.h5)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete the checkpoints once the output is verified and linked")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="embedded cluster size (default: the CPU count, at most 4; no broker "
                   "configured)")
    p.add_argument("--allow-gaps", action="store_true",
                   help="consolidate even if checkpoint numbers are missing between the first "
                   "and the last (a warning names them); refused otherwise")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="give up waiting after this long (exit 1; a cluster job goes on)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print what the job did (rows, bytes, time) on stderr; shown "
                   "anyway on a terminal")
    p.set_defaults(func=cmd_consolidate)

    p = sub.add_parser("worker", help="start a worker (CHKQ_BROKER_URL names the broker)")
    p.add_argument("-Q", "--queues", help="queues to serve: control,copy,verify,commit "
                   "(default: all)")
    p.add_argument("-c", "--concurrency", type=positive_int,
                   help="worker processes (default: CPUs)")
    p.add_argument("-n", "--hostname", help="node name (default: celery@HOST)")
    p.add_argument("--loglevel", default="INFO")
    p.add_argument("--without-gossip", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--without-mingle", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("demo", help="write a small slug-like checkpointed run to try chkq on")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", default="demo")
    p.add_argument("--checkpoints", type=positive_int, default=4)
    p.add_argument("--writers", type=int, default=2, help="files per checkpoint (0: one file)")
    p.add_argument("--trials", type=int, default=500, help="trials per file")
    p.set_defaults(func=cmd_demo)

    chosen = _command_of(argv) if argv is not None else None
    registered: set[str] = set()
    for name, (module, _help) in COMMAND_MODULES.items():
        if (argv is None or name == chosen) and module not in registered:
            importlib.import_module(module).register(sub)
            registered.add(module)
    present = set(sub.choices)
    for name, (_module, help_text) in COMMAND_MODULES.items():
        if name not in present:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse option combinations argparse cannot express (exit 2, as usage errors)."""
    workers = getattr(args, "workers", None)
    if workers is not None and workers < 1:
        parser.error(f"argument --workers: must be at least 1, got {workers}")
    if args.command == "watch" and getattr(args, "cleanup", False) \
            and not getattr(args, "consolidate", False):
        parser.error("watch: --cleanup needs --consolidate (it deletes the checkpoints "
                     "once consolidated)")
    if args.command == "watch" and getattr(args, "wait", False) \
            and not getattr(args, "consolidate", False):
        parser.error("watch: --wait needs --consolidate")
    if args.command == "watch" and not getattr(args, "consolidate", False) \
            and (getattr(args, "from_store", False) or getattr(args, "to", None)):
        parser.error("watch: --from-store and --to need --consolidate")
    if args.command == "watch" and getattr(args, "to", None) \
            and not getattr(args, "from_store", False):
        parser.error("watch: --to needs --from-store")
    if args.command == "consolidate" and args.source is None:
        for flag, value in (("--run", args.run), ("--to", args.to)):
            if value is not None:
                parser.error(f"consolidate: {flag} needs --from (a run kept in a store)")
    if args.command == "consolidate" and args.source is not None and args.out_dir is not None:
        parser.error("consolidate: --out-dir and --from name two different runs; give one")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that exiting does not flush into a closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _release_client() -> None:
    """Drop result subscriptions a command left, while the interpreter still runs."""
    if "chkq.workers.embedded" in sys.modules:
        with contextlib.suppress(Exception):  # best effort at exit
            sys.modules["chkq.workers.embedded"].drop_result_subscriptions()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    check_usage(parser, args)
    previous = install_signal_handlers()
    try:
        status = int(args.func(args))
        sys.stdout.flush()
        return status
    except Interrupted as exc:
        if not exc.reported:
            say(f"error: interrupted ({signal.Signals(exc.signum).name})")
        return 128 + exc.signum
    except KeyboardInterrupt:
        say("error: interrupted")
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (``chkq status | head``): nothing to say, as a C tool.
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except Exception as exc:  # noqa: BLE001 - the CLI's contract: one line, exit 1
        lines = (str(exc) or type(exc).__name__).splitlines()
        say(f"error: {lines[0]}")
        return 1
    finally:
        _release_client()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run() -> NoReturn:
    """The ``chkq`` command (and ``python -m chkq.workers.cli``): exit with :func:`main`'s status.

    The process ends as the interpreter would end it (output flushed,
    non-daemon threads joined, exit handlers run: logging, HDF5 closing
    its files), but without tearing down every module one by one, which
    takes about 0.05 s once Celery, kombu and redis are loaded: a tenth of
    a short command's time.
    """
    status = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        status = 128 + signal.SIGPIPE
    sys.stderr.flush()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    os._exit(status)


if __name__ == "__main__":
    run()
