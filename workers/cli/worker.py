"""``chkq worker``: start a worker node serving chkq's queues and its own."""

from __future__ import annotations

import argparse
from typing import Any

from chkq.workers.cli.common import positive_int


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
    from chkq.workers.runtime.log_filter import install_log_filter

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



def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="start a worker (CHKQ_BROKER_URL names the broker)",
                       description="Start a chkq worker node: it serves the queues of "
                       "consolidation and commit jobs from the broker CHKQ_BROKER_URL names "
                       "(results in CHKQ_RESULT_BACKEND, default the same) until stopped "
                       "(Ctrl-C or SIGTERM: running tasks finish first).")
    p.add_argument("-Q", "--queues", help="queues to serve: control,copy,verify,commit "
                   "(default: all)")
    p.add_argument("-c", "--concurrency", type=positive_int,
                   help="worker processes (default: CPUs)")
    p.add_argument("-n", "--hostname", help="node name (default: celery@HOST)")
    p.add_argument("--loglevel", default="INFO",
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: INFO)")
    p.add_argument("--without-gossip", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--without-mingle", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_worker)
