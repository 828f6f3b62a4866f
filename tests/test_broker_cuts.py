"""Redis cut off at the worst instants of a job: the job still ends, with a correct output.

Each test puts a :class:`~support.redis_cut.RedisCut` proxy between a worker and
Redis and cuts every connection (and refuses new ones for a few seconds, as a
server that went down) at one instant a restart can hit only by luck:

- the answer that hands a task's message to the worker is lost, after Redis
  took the message off its queue;
- the part of a chord that completes it has claimed the chord's callback, and
  is cut off before it sends it (or after it sent it, before it marked the
  chord done).

The visibility timeout is far longer than the test waits, so its sweep cannot
hand a lost message back in time: the job ends only if chkq itself recovers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from celery.backends.redis import CHORD_CLAIM_EXTEND_LUA, CHORD_CLEANUP_LUA

from chkq.demo import make_run
from chkq.tasks.state import job_status
from chkq.workers.client import submit_consolidation
from support.helpers import assert_consolidated, wait_for
from support.plugins.faults import LONG_LIMITS, SLOW_RUN, Cluster, leftovers
from support.redis_cut import RedisCut

pytestmark = [pytest.mark.fault,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


#: Seconds the proxy refuses connections after a cut.
DOWN_FOR = 3.0

#: Seconds the job may take in all (a chord's claim lapses in about ten).
JOB_TIMEOUT = 90


def _run_through(cluster: Cluster, cut: RedisCut, tmp_path: Path,
                 env: dict[str, str]) -> None:
    """One worker whose connections ``env`` sends through ``cut``; a job that must end."""
    (worker,) = cluster.add_workers(1, "control,copy,verify", 2, {**LONG_LIMITS, **env})
    run = tmp_path / "run"
    files = make_run(run, "run", SLOW_RUN)
    job = submit_consolidation("run", run)
    try:
        output = job.wait_for_output(timeout=JOB_TIMEOUT)
    except TimeoutError:
        raise AssertionError(f"the job was parked: {job_status(job.id)!r}; worker log:\n"
                             f"{worker.log()[-12000:]}") from None
    assert cut.cuts == 1, "the proxy never saw its instant"
    assert_consolidated(output, files)
    assert leftovers(run) == []
    broker = cluster.client()
    try:
        wait_for(lambda: broker.hlen("unacked") == 0, 30, "every message to be acknowledged")
    except AssertionError:
        raise AssertionError(f"left unacknowledged: {broker.hgetall('unacked')}; worker log:\n"
                             f"{cluster.workers[0].log()[-12000:]}") from None
    rings = list(broker.scan_iter(match="chkq:ring:*"))
    assert all(broker.ttl(ring) > 0 for ring in rings), "a ring that never expires"


#: What marks each message in the answer that hands it out: its task's name, or the end of
#: its id (the last copy unit is handed out after the plan that sent it has ended, so no
#: second plan sends it again).
MESSAGES = {"plan": b'"task": "chkq.plan"', "last copy unit": b'-copy-6"',
            "merge": b'"task": "chkq.merge"', "link": b'"task": "chkq.link"'}


@pytest.mark.parametrize("message", MESSAGES)
def test_a_message_taken_as_the_broker_is_cut_off_is_delivered(
        make_cluster: Callable[..., Cluster], tmp_path: Path, message: str) -> None:
    """Redis took ``message`` off its queue; the answer never reached the worker."""
    cluster = make_cluster()
    cut = RedisCut(cluster.redis.url)
    try:
        cut.cut_at_reply(MESSAGES[message], DOWN_FOR)
        _run_through(cluster, cut, tmp_path, {"CHKQ_BROKER_URL": cut.redis_url,
                                              "CHKQ_RESULT_BACKEND": cluster.redis.url})
    finally:
        cut.close()


@pytest.mark.parametrize("step", ["claimed", "sent"])
def test_a_chord_cut_off_with_its_callback_claimed_completes(
        make_cluster: Callable[..., Cluster], tmp_path: Path, step: str) -> None:
    """The part completing the copy chord claimed the merge and lost the backend before
    sending it (``claimed``), or after sending it, before marking the chord done (``sent``:
    the merge is then sent again once the claim lapses, and both deliveries must agree)."""
    script = CHORD_CLAIM_EXTEND_LUA if step == "claimed" else CHORD_CLEANUP_LUA
    cluster = make_cluster()
    cut = RedisCut(cluster.redis.url)
    try:
        cut.cut_at_request(hashlib.sha1(script.encode()).hexdigest().encode(), DOWN_FOR)
        _run_through(cluster, cut, tmp_path, {"CHKQ_BROKER_URL": cluster.redis.url,
                                              "CHKQ_RESULT_BACKEND": cut.redis_url})
    finally:
        cut.close()
