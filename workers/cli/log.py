"""``chkq log ...``: commit to, read from, check and tidy a run's checkpoint log.

Every command but ``commit`` works on the store directly, in this process:
no task, no cluster. ``commit`` runs in this process too when no broker is
configured (``CHKQ_BROKER_URL`` unset), for every store, with one retry
budget (``CHKQ_STORE_RETRY_SECONDS``) for all its store operations and a
``retrying:`` line on stderr for each retry; with a broker it goes through a
commit task. On success a command prints its result and nothing else; on
failure one ``error: ...`` line (exit 1).

Read-only commands (list, heads, lineage, pull, restore's reading, verify)
never write to the store — a ``file://`` store is opened with
``must_exist`` so not even its directory is created — and a store or run
that does not exist is an error, not an empty answer.

Names and keys come from the store and run directories: every line printed
from them has its control characters escaped (:func:`chkq.log.printable`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chkq.config.settings import Settings
from chkq.errors import ChkqError, NothingToRestoreError
from chkq.log import (
    DEFAULT_GC_AGE,
    CheckpointLog,
    CheckpointRecord,
    NameEntry,
    default_writer,
    format_created,
    model_of_name,
    printable,
)
from chkq.log.seen import SeenNames
from chkq.log.signing import generate_key_pair
from chkq.log.transfer import (
    CommitOptions,
    pull_mode,
    resolve_id,
    restore_outputs,
    restore_run,
    write_output,
)
from chkq.stores import open_store
from chkq.stores.base import StoreTimeouts, overall_budget
from chkq.workers.cli.common import ProgressLine


class CommandError(ChkqError):
    """A failure the command line reports as its one ``error:`` line."""


def _clean_errors(func: Callable[[argparse.Namespace], int]
                  ) -> Callable[[argparse.Namespace], int]:
    """Turn KeyError's quoted text and OSError's ``[Errno N]`` into plain one-line errors."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KeyError as exc:
            raise CommandError(str(exc.args[0]) if exc.args else "not found") from exc
        except OSError as exc:
            if exc.strerror and exc.filename is None and type(exc).__name__ in (
                    "FileNotFoundError", "FileExistsError", "PermissionError",
                    "SymlinkInStoreError"):
                raise CommandError(exc.strerror) from exc
            raise

    return run


def seen_directory() -> Path:
    """Where this user's readers keep what they saw of signed logs (``$XDG_STATE_HOME``)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "chkq" / "seen"


def _open(args: argparse.Namespace, *, write: bool) -> CheckpointLog:
    """The run's log; for reads, a ``file://`` store's directory is never created."""
    store = open_store(args.store) if write else open_store(args.store, must_exist=True)
    return CheckpointLog(store, args.run,
                         seen=SeenNames.for_run(seen_directory(), store.url, args.run))


def _existing(args: argparse.Namespace, *, write: bool = False) -> CheckpointLog:
    """The run's log, which must exist: else a clear error naming the store or the run."""
    log = _open(args, write=write)
    if not log.exists():
        log.store.check_available()
        raise CommandError(f"run {log.run_id!r} not found in store {log.store.url}")
    return log


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _warn_malformed(log: CheckpointLog) -> None:
    for key, why in sorted(log.malformed.items()):
        print(printable(f"warning: {key}: {why}"), file=sys.stderr)


def _names_by_id(entries: list[NameEntry]) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for entry in entries:
        found = names.setdefault(entry.id, [])
        if entry.name not in found:
            found.append(entry.name)
    return names


def _line(record: CheckpointRecord, names: dict[str, list[str]] | None = None) -> str:
    fields = [
        record.id, f"step={'' if record.step is None else record.step}",
        f"label={record.label or ''}", f"kind={record.kind}", f"depth={record.depth}",
        f"size={record.full_size}", f"stored={record.stored_size}",
        f"created={format_created(record.created)}",
    ]
    fields.extend(f"name={name}" for name in (names or {}).get(record.id, []))
    return printable(" ".join(fields))


@_clean_errors
def cmd_commit(args: argparse.Namespace) -> int:
    if args.parent and args.parent_head:
        raise ValueError("give --parent ID or --parent-head, not both")
    path = Path(args.file).absolute()
    name = args.name or path.name
    options = CommitOptions(parent_head=args.parent_head, step=args.step, label=args.label,
                            name=name, model=args.model or model_of_name(name))
    if Settings.from_env().broker_url is None:
        from chkq.workers.commit_client import commit_in_process, store_retries_reported

        if not path.is_file():
            raise CommandError(f"checkpoint file {str(path)!r} does not exist")
        budget = StoreTimeouts.from_env().budget
        with store_retries_reported(_say), overall_budget(budget):
            parent = resolve_id(_open(args, write=True), args.parent) if args.parent else None
            record = commit_in_process(
                args.store, args.run, path, options, parent=parent,
                writer=f"chkq log commit@{default_writer()}", budget=budget)
        print(record.id)
        return 0
    from chkq.workers.commit_client import commit_checkpoint

    parent = resolve_id(_existing(args), args.parent) if args.parent else None
    record = commit_checkpoint(args.store, args.run, path, options, parent=parent)
    print(record.id)
    return 0


@_clean_errors
def cmd_list(args: argparse.Namespace) -> int:
    log = _existing(args)
    records = log.manifest()
    names = _names_by_id(log.entries(records))
    for record in records:
        print(_line(record, names))
    for output in log.outputs():
        print(output.line())
    _warn_malformed(log)
    return 0


@_clean_errors
def cmd_heads(args: argparse.Namespace) -> int:
    log = _existing(args)
    heads = log.heads()
    names = _names_by_id(log.entries())
    for record in heads:
        print(_line(record, names))
    _warn_malformed(log)
    return 0


@_clean_errors
def cmd_lineage(args: argparse.Namespace) -> int:
    if (args.id is None) == (args.output is None):
        raise CommandError("give a checkpoint ID or --output MODEL, one of them")
    log = _existing(args)
    if args.output is not None:
        output = log.output(args.output)
        if output is None:
            recorded = ", ".join(e.model for e in log.outputs()) or "none"
            raise CommandError(printable(f"run {log.run_id!r} has no recorded output of model "
                                         f"{args.output!r} (its outputs: {recorded})"))
        print(output.line())
        for checkpoint, name in zip(output.checkpoints, output.names, strict=True):
            try:
                print(_line(log.record(checkpoint), {checkpoint: [name]}))
            except KeyError:
                print(printable(f"{checkpoint} missing name={name}"))
        return 0
    checkpoint = resolve_id(log, args.id)
    for record in log.lineage(checkpoint):
        print(_line(record))
    for output, position in log.outputs_of(checkpoint):
        print(printable(f"{output.line()} made-from={position + 1}/{len(output.checkpoints)}"
                        f" name={output.names[position]}"))
    _warn_malformed(log)
    return 0


@_clean_errors
def cmd_pull(args: argparse.Namespace) -> int:
    log = _existing(args)
    checkpoint = resolve_id(log, args.id)
    data = log.load(checkpoint)
    log.files()
    for why in log.rollbacks.values():
        print(printable(f"warning: {why}"), file=sys.stderr)
    if str(args.output) == "-":
        sys.stdout.buffer.write(data)
        return 0
    print(printable(str(write_output(args.output, data, mode=pull_mode(log, checkpoint),
                                     force=args.force))))
    return 0


@_clean_errors
def cmd_restore(args: argparse.Namespace) -> int:
    log = _existing(args)
    restore = restore_outputs if args.outputs else restore_run
    try:
        result = restore(log, args.out_dir, args.model,
                         on_file=lambda path: print(printable(str(path)), flush=True),
                         on_kept=lambda path: None)
    except NothingToRestoreError:
        _warn_malformed(log)
        raise
    _warn_malformed(log)
    for name, why in result.failed:
        print(printable(f"warning: not restored: {name}: {why}"), file=sys.stderr)
    print(printable(result.summary()), file=sys.stderr)
    if result.failed:
        name, why = result.failed[0]
        raise CommandError(printable(
            f"{len(result.failed)} file(s) not restored (first: {name}: {why})"))
    return 0


@_clean_errors
def cmd_gc(args: argparse.Namespace) -> int:
    from chkq.stores.publish import sweep_uploads

    log = _existing(args, write=True)
    young: list[tuple[str, float]] = []
    removed = log.gc(older_than=args.older_than, young=young)
    for key in removed:
        print(printable(key))
    aborted = sweep_uploads(log.store, log.root, older_than=args.older_than)
    for stray in aborted:
        print(printable(f"{stray.key} (unfinished upload {stray.upload_id})"))
    for key, age in young:
        print(printable(f"kept {key}: unreferenced but {age:,.0f} s old, younger than "
                        f"--older-than {args.older_than:,.0f} s (a commit may still be "
                        "recording it)"), file=sys.stderr)
    kept = (f"; kept {counted(len(young), 'unreferenced payload')} for "
            f"{'its' if len(young) == 1 else 'their'} age (removed by a gc once older than "
            f"{args.older_than:,.0f} s)" if young else "")
    print(f"removed {len(removed)} unreferenced payload(s) and {len(aborted)} unfinished "
          f"upload(s){kept}", file=sys.stderr)
    return 0


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``1 head copy``, ``2 head copies``: a count with its noun in the right number."""
    return f"{count:,} {singular if count == 1 else plural or singular + 's'}"


@_clean_errors
def cmd_verify(args: argparse.Namespace) -> int:
    log = _existing(args)
    line = ProgressLine(interval=0.1)
    try:
        report = log.verify(read_data=args.read_data, progress=lambda phase, done, total:
                            line.show(f"verify: {phase} {done}/{total}", final=done == total))
    finally:
        line.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for key, why in report.problems:
            print(printable(f"problem {key}: {why}"))
        for key in report.orphans:
            print(printable(f"orphan {key}"))
        for key in report.unrecorded_outputs:
            print(printable(f"unrecorded output {key}"))
        decoded = (f", {report.decoded} rebuilt ({report.decoded_bytes} bytes)"
                   if report.read_data else "")
        outputs = (f" ({report.outputs_read} read, {report.output_bytes} bytes)"
                   if report.read_data and report.outputs else "")
        print(f"{'ok' if report.ok else 'FAILED'}: {counted(report.records, 'checkpoint')}"
              f"{decoded}, {counted(report.names, 'name')}, "
              f"{counted(report.head_copies, 'head copy', 'head copies')}, "
              f"{counted(report.outputs, 'output')}{outputs}, "
              f"{counted(len(report.problems), 'problem')}, "
              f"{counted(len(report.orphans), 'orphan')}")
    if not report.ok:
        raise CommandError(f"verify found {len(report.problems)} problem(s) in run "
                           f"{log.run_id!r} of {log.store.url}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    private, public, ident = generate_key_pair(args.directory, args.name)
    print(f"{private}\n{public}")
    print(f"key {ident}: set CHKQ_LOG_SIGNING_KEY={private} where checkpoints are committed, "
          f"and give {public.name} to readers (CHKQ_LOG_TRUSTED_KEYS)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``chkq log`` and its subcommands."""
    log = sub.add_parser("log", help="the checkpoint log on an object store")
    cmds = log.add_subparsers(dest="log_command", required=True)

    def command(name: str, help: str, func: Any) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help)
        p.add_argument("store", help="file:///abs/dir, s3://bucket/prefix, gs://bucket/prefix "
                                     "or memory://name")
        p.add_argument("run", help="the run's id in the store")
        p.set_defaults(func=func)
        return p

    p = command("commit", "commit a checkpoint file; prints its id", cmd_commit)
    p.add_argument("file", type=Path, help="the checkpoint file to commit (its bytes)")
    p.add_argument("--parent", help="id (or unique prefix) of the parent checkpoint")
    p.add_argument("--parent-head", action="store_true",
                   help="commit on the run's one head")
    p.add_argument("--step", type=int, help="the simulation's step number, kept in the "
                   "checkpoint's record (shown by log list)")
    p.add_argument("--label", help="a free-form label kept in the checkpoint's record (shown "
                   "by log list)")
    p.add_argument("--name", help="name `chkq log restore` gives the file, relative to the "
                   "run directory (default: the file's name)")
    p.add_argument("--model", help="the model the file belongs to (default: the one a "
                   "MODEL_chkNNNNN name says, if any)")
    command("list", "every checkpoint, oldest first, then every consolidated output",
            cmd_list)
    command("heads", "checkpoints nothing was committed on", cmd_heads)
    p = command("lineage", "a checkpoint's ancestry, root first, and the outputs made from "
                "it; or, with --output, the checkpoints an output was made from", cmd_lineage)
    p.add_argument("id", nargs="?", help="id (or unique prefix) of a checkpoint")
    p.add_argument("--output", metavar="MODEL",
                   help="the checkpoints MODEL's consolidated output was made from, in run "
                   "order, with their names")
    p = command("pull", "write a checkpoint's verified bytes to a file", cmd_pull)
    p.add_argument("id", help="id (or unique prefix, 6+ hex digits) of the checkpoint")
    p.add_argument("-o", "--output", required=True, help="file to write ('-': stdout); an "
                   "existing file is kept if it has the same bytes and refused otherwise")
    p.add_argument("--force", action="store_true",
                   help="replace an existing file at --output whatever it holds")
    p = command("restore", "bring a run's files back under their names", cmd_restore)
    p.add_argument("out_dir", type=Path, help="directory to restore the files into")
    p.add_argument("model", nargs="?", help="only this model's files")
    p.add_argument("--outputs", action="store_true",
                   help="the consolidated outputs instead, as OUT_DIR/MODEL.h5, each checked "
                   "against its recorded size and SHA-256 as it streams in")
    p = command("gc", "delete payloads no record points to, and uploads a killed "
                "publisher left unfinished", cmd_gc)
    p.add_argument("--older-than", type=float, default=DEFAULT_GC_AGE, metavar="SECONDS",
                   help=f"only payloads older than this (default {DEFAULT_GC_AGE:.0f})")
    p = command("verify", "check that every checkpoint and output of the run can be "
                "restored; exit 1 with a line per problem", cmd_verify)
    p.add_argument("--read-data", action="store_true",
                   help="also rebuild every checkpoint along its delta chain and check its id, "
                   "and read every output and check its size and SHA-256")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p = cmds.add_parser("keygen", help="make an Ed25519 key pair for signed log objects")
    p.add_argument("directory", type=Path, help="where NAME.key (0600) and NAME.pub go")
    p.add_argument("--name", default="chkq-log", help="file name stem (default chkq-log)")
    p.set_defaults(func=_clean_errors(cmd_keygen))
