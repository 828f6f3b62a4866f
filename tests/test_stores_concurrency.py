"""Eight writer processes commit one history to one log on each bucket store.

S3 runs against moto's HTTP server and GCS against fake-gcs-server (see
:mod:`support.plugins.object_stores`); each writer is a separate process with
its own client and connection pool, started together at a barrier, so
that conditional creates of the same records and payloads really race.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chkq.log import CheckpointLog
from chkq.stores import open_store
from support.helpers import assert_log_consistent
from support.plugins.object_stores import make_store
from support.races import race_commits

WRITERS = 8
COMMITS = 100


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_eight_processes_commit_one_history_to_a_bucket(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every writer sees the same ids; the log holds each checkpoint once, one
    head, every payload referenced by a record (no orphans) and every load verifies."""
    url = make_store(kind, request, tmp_path).url
    results = race_commits(url, WRITERS, COMMITS)
    assert all(result == results[0] for result in results)
    assert len(set(results[0])) == COMMITS
    log = CheckpointLog(open_store(url), "shared", max_chain=4)
    assert sorted(log.ids()) == sorted(results[0])
    assert [r.id for r in log.heads()] == [results[0][-1]]
    assert [r.id for r in log.lineage(results[0][-1])] == results[0]
    assert_log_consistent(log)
    assert set(log.store.list("runs/shared/heads/")) <= {log.head_copy_key(results[0][-1])}
