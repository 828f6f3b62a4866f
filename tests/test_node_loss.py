"""Every task's duration is bounded by construction, so a lost node costs minutes.

Units of work are cut to at most ``CHKQ_TASK_BYTES`` and to what the
slowest node was measured to move in the task time budget; the default
hard limit is five minutes and the Redis visibility timeout exceeds it by a
margin, so that a lost node's tasks run again within the takeover bound
(under ten minutes) and a running task is never delivered twice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from celery.app.task import Context
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.settings import Settings
from chkq.consolidation.plan import MIN_UNIT_BYTES, unit_bytes
from chkq.consolidation.prepare import prepare
from chkq.demo import RunShape, make_run
from chkq.errors import ConfigurationError
from chkq.jobs.keys import rate as rate_key
from chkq.jobs.records import task_id
from chkq.tasks.base import RATE_KINDS, slowest_rates
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import submit_consolidation
from chkq.workers.runtime.request import requeue_delay
from support.helpers import assert_consolidated
from support.plugins.faults import Cluster

MiB = 1024 * 1024


def test_default_limits_recover_a_lost_node_within_ten_minutes() -> None:
    defaults = Settings()
    assert defaults.takeover_bound <= 600
    assert defaults.visibility_timeout >= defaults.time_limit + defaults.visibility_margin
    assert defaults.visibility_margin >= 30
    assert defaults.budget_seconds * 4 <= defaults.soft_time_limit


@pytest.mark.parametrize(("hard", "visibility"), [(300, 329), (300, 300), (40, 43)])
def test_a_visibility_timeout_within_the_margin_of_the_hard_limit_is_refused(
        hard: int, visibility: int) -> None:
    settings = Settings(soft_time_limit=hard // 2, time_limit=hard,
                        visibility_timeout=visibility)
    with pytest.raises(ConfigurationError, match="CHKQ_VISIBILITY_TIMEOUT must be at least"):
        settings.check()


def test_a_task_budget_above_half_the_soft_limit_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="CHKQ_TASK_SECONDS"):
        Settings(task_seconds=121).check()
    Settings(task_seconds=120).check()


@pytest.mark.parametrize(("rate", "expected"), [
    (None, 64 * MiB), (0.0, 64 * MiB), (float("nan"), 64 * MiB), (float("inf"), 64 * MiB),
    (10 * MiB, 60 * MiB), (100 * MiB, 64 * MiB), (1.0, MIN_UNIT_BYTES),
])
def test_unit_bytes_is_the_smaller_of_the_byte_and_time_bounds(rate: float | None,
                                                                expected: int) -> None:
    assert unit_bytes(64 * MiB, rate, 6) == expected


def test_units_cut_by_the_time_budget(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=2, trials=3000, spec_columns=256))
    by_bytes = prepare(tmp_path, "run", uuid.uuid4().hex, task_bytes=64 * MiB)
    cut = unit_bytes(64 * MiB, 1 * MiB, 2)
    by_time = prepare(tmp_path, "run", uuid.uuid4().hex, task_bytes=cut, verify_bytes=cut)
    assert len(by_time.copy_units) > len(by_bytes.copy_units)
    for unit in by_time.copy_units:
        for index, start, stop in unit.pieces:
            d = by_time.datasets[index]
            assert (stop - start) * d.row_bytes <= cut + d.chunk[0] * d.row_bytes


class _App:
    def __init__(self, client: Any) -> None:
        self.backend = type("Backend", (), {"client": client})()


def test_the_slowest_fresh_rate_of_any_node_is_used() -> None:
    client = fakeredis.FakeRedis()
    now = time.time()
    key = rate_key("copy")
    client.hset(key, "a@n", json.dumps([50e6, now]))
    client.hset(key, "b@n", json.dumps([20e6, now - 60]))
    client.hset(key, "stale@n", json.dumps([1e3, now - 3 * 24 * 3600]))
    for junk, value in [("j1", "nope"), ("j2", "[1]"), ("j3", '["x", 1]'), ("j4", "[-5, 1]"),
                        ("j5", json.dumps([float("inf"), now]))]:
        client.hset(key, junk, value)
    rates = slowest_rates(_App(client), now)
    assert rates == {"copy": 20e6, "verify": None, "merge": None}


SHAPE = RunShape(checkpoints=2, trials=4000, spec_columns=384, compression="gzip",
                 fletcher32=True, chunk_rows=100)


def _consolidate(directory: Path) -> tuple[dict[str, Any], int]:
    """Consolidate a run made in ``directory``; the plan step's result and the output rows."""
    files = make_run(directory, "run", SHAPE)
    job = submit_consolidation("run", directory)
    assert_consolidated(job.wait_for_output(timeout=240), files)
    return dict(AsyncResult(task_id(job.id, "plan"), app=get_app()).result), len(files)


#: The default limits: a cluster of a test's own starts its workers with short ones.
DEFAULT_LIMITS = {"CHKQ_SOFT_TIME_LIMIT": "240", "CHKQ_TIME_LIMIT": "300",
                  "CHKQ_VISIBILITY_TIMEOUT": "420"}


def test_a_worker_records_its_own_rates(make_cluster: Callable[..., Cluster],
                                        tmp_path: Path) -> None:
    """Each copy, verification and merge of a MiB or more is timed; the node's rate is kept
    under its name, and the planner finds it as the slowest.

    The cluster is the test's own, so that no other worker of the session takes a task
    of the job or has left a rate.
    """
    cluster = make_cluster()
    worker, = cluster.add_workers(1, "control,copy,verify,commit", env=DEFAULT_LIMITS)
    rates = cluster.client()
    _consolidate(tmp_path / "run")
    for kind in RATE_KINDS:
        recorded = {n.decode(): json.loads(v)
                    for n, v in rates.hgetall(rate_key(kind)).items()}
        assert list(recorded) == [worker.name], kind
        (rate, when), = recorded.values()
        assert rate > 0 and abs(time.time() - when) < 300, (kind, rate, when)
        assert slowest_rates(get_app())[kind] == rate


def test_the_slowest_nodes_rate_cuts_the_next_jobs_units(make_cluster: Callable[..., Cluster],
                                                          tmp_path: Path) -> None:
    """A node measured at 2 MiB/s and a budget of 2 s: the next job's copy units hold at
    most 4 MiB of rows (plus one chunk), and its output is still right. Its merge measured
    at 1 kB/s: the worker warns that a merge item, which is never split, may hit the limit."""
    cluster = make_cluster()
    worker, = cluster.add_workers(1, "control,copy,verify,commit",
                                  env={**DEFAULT_LIMITS, "CHKQ_TASK_SECONDS": "2"})
    rates = cluster.client()
    unbounded, _ = _consolidate(tmp_path / "first")
    for kind in RATE_KINDS:
        rates.hset(rate_key(kind), "slow@node",
                   json.dumps([1e3 if kind == "merge" else 2 * MiB, time.time()]))
    budgeted, _ = _consolidate(tmp_path / "second")
    print(f"\ncopy units: {unbounded['copy_units']} by bytes, {budgeted['copy_units']} "
          "at 2 MiB/s and 2 s a unit")
    assert budgeted["copy_units"] > unbounded["copy_units"]
    assert budgeted["copy_units"] >= budgeted["bytes"] // (4 * MiB)
    warnings = [line for line in worker.log().splitlines() if "is expected to take" in line]
    assert [w.split(" task of ")[0].split()[-1] for w in warnings] == ["merge"], warnings


def test_an_outage_is_never_recorded_as_a_tasks_failure(redis_server: PrivateRedis) -> None:
    """What a task raised because the backend or broker did not answer is not stored, counted
    in a chord or passed to errbacks: the task runs again. Any other failure is stored."""
    backend = get_app().backend
    outage, bad = (f"outage-{uuid.uuid4().hex}", f"bad-{uuid.uuid4().hex}")
    for task, exc in [(outage, redis.exceptions.ConnectionError("reset by peer")),
                      (bad, ValueError("bad input"))]:
        backend.mark_as_failure(task, exc, request=Context(id=task, errbacks=None, chord=None))
    assert AsyncResult(outage, app=get_app()).state == "PENDING"
    assert AsyncResult(bad, app=get_app()).state == "FAILURE"


def test_an_interrupted_message_is_held_longer_at_each_outage() -> None:
    task = uuid.uuid4().hex
    delays = [requeue_delay(task) for _ in range(8)]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert requeue_delay(uuid.uuid4().hex) == 1
