"""``python -m chkq.workers.cli``: the ``chkq`` command."""

from chkq.workers.cli import run

run()
