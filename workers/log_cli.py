"""``chkq log ...``: commit to, read from and tidy a run's checkpoint log.

``commit`` goes through a commit task (the embedded cluster when no broker
is configured); the other commands read or tidy the store directly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from chkq.commits import resolve_id, restore_run
from chkq.fsutil import write_durably
from chkq.log import DEFAULT_GC_AGE, CheckpointLog, CheckpointRecord
from chkq.stores import open_store


def _log(args: argparse.Namespace) -> CheckpointLog:
    return CheckpointLog(open_store(args.store), args.run)


def _line(record: CheckpointRecord) -> str:
    created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    name = record.meta.get("name", "") if record.meta else ""
    fields = [
        record.id, f"step={'' if record.step is None else record.step}",
        f"label={record.label or ''}", f"kind={record.kind}", f"depth={record.depth}",
        f"size={record.full_size}", f"stored={record.stored_size}", f"created={created}Z",
    ]
    if name:
        fields.append(f"name={name}")
    return " ".join(fields)


def cmd_commit(args: argparse.Namespace) -> int:
    from chkq.workers.commits import commit_checkpoint

    if args.parent and args.parent_head:
        raise ValueError("give --parent ID or --parent-head, not both")
    parent = resolve_id(_log(args), args.parent) if args.parent else None
    path = Path(args.file).absolute()
    options: dict[str, Any] = {"parent": parent, "parent_head": args.parent_head,
                               "step": args.step, "label": args.label}
    options["name"] = args.name or path.name
    record = commit_checkpoint(args.store, args.run, path, **options)
    print(record.id)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    for record in _log(args).manifest():
        print(_line(record))
    return 0


def cmd_heads(args: argparse.Namespace) -> int:
    for record in _log(args).heads():
        print(_line(record))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    log = _log(args)
    for record in log.lineage(resolve_id(log, args.id)):
        print(_line(record))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    log = _log(args)
    data = log.load(resolve_id(log, args.id))
    target = Path(args.output)
    if str(target) == "-":
        sys.stdout.buffer.write(data)
        return 0
    write_durably(target, data)
    print(target)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    for path in restore_run(_log(args), args.out_dir, args.model):
        print(path)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    removed = _log(args).gc(older_than=args.older_than)
    for key in removed:
        print(key)
    print(f"removed {len(removed)} unreferenced payload(s)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``chkq log`` and its subcommands."""
    log = sub.add_parser("log", help="the checkpoint log on an object store")
    cmds = log.add_subparsers(dest="log_command", required=True)

    def command(name: str, help: str, func: Any) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help)
        p.add_argument("store", help="file:///abs/dir, s3://bucket/prefix, gs://bucket/prefix")
        p.add_argument("run", help="the run's id in the store")
        p.set_defaults(func=func)
        return p

    p = command("commit", "commit a checkpoint file; prints its id", cmd_commit)
    p.add_argument("file", type=Path)
    p.add_argument("--parent", help="id (or unique prefix) of the parent checkpoint")
    p.add_argument("--parent-head", action="store_true",
                   help="commit on the run's one head")
    p.add_argument("--step", type=int)
    p.add_argument("--label")
    p.add_argument("--name", help="name `chkq log restore` gives the file, relative to the "
                   "run directory (default: the file's name)")
    command("list", "every checkpoint, oldest first", cmd_list)
    command("heads", "checkpoints nothing was committed on", cmd_heads)
    p = command("lineage", "a checkpoint's ancestry, root first", cmd_lineage)
    p.add_argument("id")
    p = command("pull", "write a checkpoint's verified bytes to a file", cmd_pull)
    p.add_argument("id")
    p.add_argument("-o", "--output", required=True, help="file to write ('-': stdout)")
    p = command("restore", "bring a run's checkpoints back under their names", cmd_restore)
    p.add_argument("out_dir", type=Path)
    p.add_argument("model", nargs="?", help="only this model's checkpoints")
    p = command("gc", "delete payloads no record points to", cmd_gc)
    p.add_argument("--older-than", type=float, default=DEFAULT_GC_AGE, metavar="SECONDS",
                   help=f"only payloads older than this (default {DEFAULT_GC_AGE:.0f})")
