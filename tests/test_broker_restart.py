"""A Redis restart mid-job must not park the job: the interrupted task runs again at once.

The scenario: a persistent redis-server SIGKILLed about 1.5 s into a job and
restarted 2 s later, one ``chkq worker -c 2``. The worker's connection
breaks; Celery terminates the running steps (their messages stay
unacknowledged) and reconnects. The visibility timeout here is far longer
than the test waits, so the restore sweep cannot hide a message left behind:
the job ends (correctly, or with a clear error and the run as it was) only
if the worker hands the interrupted messages back when it reconnects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chkq.demo import make_run
from chkq.tasks.base import JobInterruptedError
from chkq.workers.client import submit_consolidation
from support.helpers import assert_consolidated, snapshot, wait_for
from support.plugins.faults import LONG_LIMITS, SLOW_RUN, Cluster, checkpoints_only, leftovers

pytestmark = [pytest.mark.fault,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


#: Seconds the job may take after Redis is back (generous: 2 busy cores).
AFTER_RESTART = 90


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(5))
def test_redis_restart_early_in_a_job_does_not_park_it(
        make_cluster: Callable[..., Cluster], tmp_path: Path, attempt: int) -> None:
    """Redis SIGKILLed 1.5 s into the job, restarted 2 s later: the job ends promptly."""
    cluster = make_cluster(persistent=True)
    (worker,) = cluster.add_workers(1, "control,copy,verify", 2, LONG_LIMITS)
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    before = snapshot(run)
    job = submit_consolidation("run", run)
    time.sleep(1.5)
    cluster.redis.stop(kill=True)
    time.sleep(2.0)
    cluster.redis.start()
    back = time.monotonic()
    try:
        output = job.wait_for_output(timeout=AFTER_RESTART)
    except JobInterruptedError as exc:
        assert "submit the job again" in str(exc)
        checkpoints_only(before, run)
        outcome = "JobInterruptedError"
    except TimeoutError:
        from chkq.tasks.state import job_status
        raise AssertionError(f"the job was parked: {job_status(job.id)!r}; worker log:\n"
                             f"{worker.log()[-12000:]}") from None
    else:
        assert_consolidated(output, files)
        outcome = "a correct output"
    took = time.monotonic() - back
    print(f"attempt {attempt}: {outcome} {took:.1f} s after Redis came back")
    assert leftovers(run) == []
    wait_for(lambda: worker.process.poll() is None, 1, "the worker to be alive")
