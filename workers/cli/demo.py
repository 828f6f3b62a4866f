"""``chkq demo``: write a small slug-like checkpointed run to try chkq on."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chkq.workers.cli.common import positive_int


def cmd_demo(args: argparse.Namespace) -> int:
    from chkq.demo import write_demo

    files = write_demo(args.out_dir, args.model, checkpoints=args.checkpoints,
                       writers=args.writers, trials=args.trials)
    print(f"wrote {len(files)} checkpoint files of model {args.model!r} in {args.out_dir}")
    return 0



def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="write a small slug-like checkpointed run to try chkq on",
                       description="Write a small slug-like checkpointed run (MODEL_chkNNNNN/ "
                       "directories of thread files) into OUT_DIR, to try chkq consolidate on. "
                       "A directory that already holds a run of the model is refused.")
    p.add_argument("out_dir", type=Path, help="directory to write the run into (created if "
                   "missing)")
    p.add_argument("--model", default="demo", help="the run's model name (default: demo)")
    p.add_argument("--checkpoints", type=positive_int, default=4,
                   help="checkpoints to write (default: 4)")
    p.add_argument("--writers", type=int, default=2,
                   help="files per checkpoint (0: one file; default: 2)")
    p.add_argument("--trials", type=int, default=500, help="trials per file (default: 500)")
    p.set_defaults(func=cmd_demo)
