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
from collections.abc import Sequence
from typing import NoReturn

from chkq import __version__
from chkq.workers.cli.common import Interrupted, install_signal_handlers, say

#: Subcommands defined in other modules: name -> (module with ``register(subparsers)``,
#: help). Only the module of the command being run is imported.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "consolidate": ("chkq.workers.cli.consolidate",
                    "merge a run's HDF5 checkpoints into MODEL.h5"),
    "worker": ("chkq.workers.cli.worker", "start a worker (CHKQ_BROKER_URL names the broker)"),
    "demo": ("chkq.workers.cli.demo", "write a small slug-like checkpointed run to try chkq on"),
    "log": ("chkq.workers.cli.log", "a run's checkpoint log: commit, list, heads, lineage, "
            "pull, restore, gc, verify"),
    "watch": ("chkq.workers.cli.watch", "commit a running simulation's checkpoints as they "
              "complete"),
    "flower": ("chkq.workers.cli.flower", "start Flower, the web monitor (always behind basic "
               "auth)"),
    "status": ("chkq.workers.cli.status", "show a job's steps (done, running, failed and why), "
               "or recent jobs"),
    "cancel": ("chkq.workers.cli.status", "cancel a job: revoke its tasks, remove its "
               "temporaries"),
    "gc": ("chkq.workers.cli.gc", "abort the uploads killed publishers left unfinished "
           "under a store prefix"),
}


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def describe(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand of ``parser`` (and theirs) a description: its help as a sentence.

    ``chkq COMMAND --help`` then says what the command does, not only its usage.
    """
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, child in action.choices.items():
            text = helps.get(name)
            if child.description is None and text:
                child.description = text[0].upper() + text[1:] + "."
            describe(child)


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

    chosen = _command_of(argv) if argv is not None else None
    registered: set[str] = set()
    for name, (module, _help) in COMMAND_MODULES.items():
        if (argv is None or name == chosen) and module not in registered:
            importlib.import_module(module).register(sub)
            registered.add(module)
    describe(parser)
    present = set(sub.choices)
    for name, (_module, help_text) in COMMAND_MODULES.items():
        if name not in present:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


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
    if getattr(args, "check_usage", None) is not None:
        args.check_usage(parser, args)
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
