"""``chkq gc URL``: abort the uploads that killed publishers left unfinished under a prefix.

A consolidation from a store publishes its output as one upload completed
create-if-absent; a worker killed while uploading leaves the upload's parts
(an S3 multipart upload, GCS staged parts, a local temporary), invisible at
the key but billed. Uploads younger than ``--older-than`` may belong to a
publish still running and are left alone. The staged outputs of
``--verify-data`` jobs that ended without removing theirs
(``KEY.chkq-staged-JOB``) as old are deleted too.
"""

from __future__ import annotations

import argparse
import sys

from chkq.stores import open_store
from chkq.stores.publish import sweep_staged, sweep_uploads

#: Default age, in seconds, of the uploads swept: above any publish chkq runs (a task's
#: hard time limit is minutes).
DEFAULT_AGE = 3600.0


def cmd_gc(args: argparse.Namespace) -> int:
    store = open_store(args.store, must_exist=True)
    aborted = sweep_uploads(store, args.prefix, older_than=args.older_than)
    for stray in aborted:
        print(f"{stray.key or '(a local temporary)'} {stray.upload_id}")
    staged = sweep_staged(store, args.prefix, older_than=args.older_than)
    for key in staged:
        print(key)
    print(f"aborted {len(aborted)} unfinished upload(s) in {store.url}"
          + (f", deleted {len(staged)} staged output(s)" if staged else ""), file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``chkq gc``."""
    p = sub.add_parser("gc", help="abort the uploads killed publishers left unfinished under "
                       "a store prefix")
    p.add_argument("store", help="file:///abs/dir, s3://bucket/prefix or gs://bucket/prefix")
    p.add_argument("--prefix", default="", help="only uploads of keys under this prefix")
    p.add_argument("--older-than", type=float, default=DEFAULT_AGE, metavar="SECONDS",
                   help=f"only uploads started this long ago (default {DEFAULT_AGE:.0f})")
    p.set_defaults(func=cmd_gc)
