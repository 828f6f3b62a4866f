"""The one retry policy: capped doubling waits, jittered where asked."""

from __future__ import annotations

import pytest

from chkq.backoff import Backoff
from chkq.tasks.commit import parent_wait
from chkq.workers.runtime.request import REQUEUE_BACKOFF


def test_waits_double_up_to_their_cap() -> None:
    assert [Backoff(0.25, 5.0).wait(n) for n in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert Backoff(1.0, 30.0).wait(10_000) == 30.0


@pytest.mark.parametrize("tried", [0, 1, 3, 9])
def test_jittered_waits_lie_between_half_and_the_whole(tried: int) -> None:
    policy = Backoff(0.1, 4.0, jitter=True)
    whole = Backoff(0.1, 4.0).wait(tried)
    waits = {policy.wait(tried) for _ in range(200)}
    assert all(whole / 2 <= w <= whole for w in waits)
    assert len(waits) > 1


def test_commits_and_requeues_wait_by_the_policy() -> None:
    assert [parent_wait(n) for n in (0, 4, 50)] == [0.25, 4.0, 5.0]
    assert [REQUEUE_BACKOFF.wait(n) for n in (0, 1, 5, 6)] == [1.0, 2.0, 30.0, 30.0]
