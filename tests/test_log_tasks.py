"""Commit tasks and ``chkq log``: real workers, real stores (local directory and moto S3)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chkq.config.celery_app import get_app
from chkq.config.routing import COMMIT_QUEUE
from chkq.errors import BadMessageError, BadMessageTypeError
from chkq.log import CheckpointLog
from chkq.log.transfer import CommitOptions
from chkq.stores import open_store
from chkq.workers.commit_client import record_of, submit_commit
from support.helpers import checkpoint_series, payload_keys
from support.plugins.cluster import WorkerProcess, consumers_paused

TIMEOUT = 120


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()






def referenced_payloads(log: CheckpointLog) -> set[str]:
    return {r.payload for r in log.manifest()}


def test_concurrent_committers_leave_one_record_each_and_no_orphans(
    tmp_path: Path, worker: WorkerProcess, start_worker: object
) -> None:
    """Three clients enqueue the same chained sequence at once; four worker processes."""
    start_worker("commit", concurrency=2)  # type: ignore[operator]
    paths = checkpoint_series(tmp_path / "run", 6)
    url = f"file://{tmp_path / 'store'}"
    ids = [sha(p.read_bytes()) for p in paths]
    results = []
    for _client in range(3):
        for i, path in enumerate(paths):
            parent = ids[i - 1] if i else None
            results.append(submit_commit(url, "r1", path, parent=parent, step=i,
                                         name=path.name))
    records = [record_of(r.get(timeout=TIMEOUT)) for r in results]
    assert {r.id for r in records} == set(ids)
    log = CheckpointLog(open_store(url), "r1")
    manifest = log.manifest()
    assert [r.id for r in manifest] == ids
    assert [h.id for h in log.heads()] == [ids[-1]]
    assert [r.id for r in log.lineage(ids[-1])] == ids
    assert any(r.kind == "delta" for r in manifest)
    visible = {k for k in payload_keys(url, "r1")}
    assert visible == referenced_payloads(log), "orphan or missing payloads"
    for checkpoint, path in zip(ids, paths, strict=True):
        assert log.load(checkpoint) == path.read_bytes()


def test_commit_refuses_a_relative_or_missing_path(tmp_path: Path, worker: WorkerProcess
                                                   ) -> None:
    url = f"file://{tmp_path / 'store'}"
    result = get_app().signature("chkq.commit", args=(url, "r1", "relative/file.bin")).apply_async()
    with pytest.raises(ValueError, match="must be absolute"):
        result.get(timeout=TIMEOUT)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        submit_commit(url, "r1", tmp_path / "missing.bin")
    with pytest.raises(ValueError, match="run"):
        submit_commit(url, "../escape", tmp_path / "x")


def test_commit_to_s3_through_a_briefly_unreachable_endpoint(
    tmp_path: Path, worker: WorkerProcess, start_worker: object, s3_proxy: object
) -> None:
    """moto's HTTP server behind a proxy that refuses connections for a while: retried."""
    paths = checkpoint_series(tmp_path / "run", 3, size=256 * 1024)
    env = {"AWS_ENDPOINT_URL": s3_proxy.url,  # type: ignore[attr-defined]
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    from support.plugins.object_stores import BUCKET

    url = f"s3://{BUCKET}/t-{os.getpid()}-{tmp_path.name}"
    with consumers_paused(worker, COMMIT_QUEUE):
        start_worker("commit", concurrency=1, env=env)  # type: ignore[operator]
        first = submit_commit(url, "r1", paths[0], name=paths[0].name)
        record_of(first.get(timeout=TIMEOUT))
        s3_proxy.go_down(2.0)  # type: ignore[attr-defined]
        results = [submit_commit(url, "r1", p, parent_head=False,
                                 parent=sha(paths[i].read_bytes()), name=p.name)
                   for i, p in enumerate(paths[1:])]
        records = [record_of(r.get(timeout=TIMEOUT)) for r in results]
    assert [r.id for r in records] == [sha(p.read_bytes()) for p in paths[1:]]
    log = CheckpointLog(open_store(url), "r1")
    assert len(log.manifest()) == 3
    assert log.load(records[-1].id) == paths[-1].read_bytes()


def chkq(*args: str, broker: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if not broker:
        env.pop("CHKQ_BROKER_URL", None)
        env.pop("CHKQ_RESULT_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.cluster
def test_log_cli_on_the_embedded_cluster(tmp_path: Path) -> None:
    """``chkq log`` end to end with no broker configured (embedded cluster)."""
    paths = checkpoint_series(tmp_path / "run", 3)
    url = f"file://{tmp_path / 'store'}"
    first = chkq("log", "commit", url, "r1", str(paths[0]), "--step", "0", "--label", "start")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == sha(paths[0].read_bytes())
    for step, path in enumerate(paths[1:], start=1):
        done = chkq("log", "commit", url, "r1", str(path), "--parent-head", "--step", str(step))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == sha(path.read_bytes())
    listed = chkq("log", "list", url, "r1").stdout.splitlines()
    assert [line.split()[0] for line in listed] == [sha(p.read_bytes()) for p in paths]
    assert "label=start" in listed[0]
    heads = chkq("log", "heads", url, "r1").stdout.split()
    assert heads[0] == sha(paths[-1].read_bytes())
    lineage = chkq("log", "lineage", url, "r1", heads[0][:10]).stdout.splitlines()
    assert len(lineage) == 3
    out = tmp_path / "pulled.bin"
    assert chkq("log", "pull", url, "r1", heads[0][:12], "-o", str(out)).returncode == 0
    assert out.read_bytes() == paths[-1].read_bytes()
    back = tmp_path / "back"
    restored = chkq("log", "restore", url, "r1", str(back))
    assert restored.returncode == 0, restored.stderr
    assert sorted(p.name for p in back.iterdir()) == [p.name for p in paths]
    assert (back / paths[1].name).read_bytes() == paths[1].read_bytes()
    gc = chkq("log", "gc", url, "r1", "--older-than", "0")
    assert gc.returncode == 0 and gc.stdout == ""
    bad = chkq("log", "pull", url, "r1", "ffffff", "-o", str(out))
    assert bad.returncode == 1 and bad.stderr.startswith("error: ")
    usage = chkq("log", "commit", url)
    assert usage.returncode == 2


@pytest.mark.cluster
def test_gc_removes_only_payloads_left_by_a_crashed_committer(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    paths = checkpoint_series(tmp_path / "run", 2)
    log = CheckpointLog(open_store(url), "r1")
    log.commit(paths[0].read_bytes())
    orphan = f"runs/r1/payloads/{'ab' * 32}.full.zst"
    log.store.put(orphan, b"left by a committer killed before its record")
    before = payload_keys(url, "r1")
    out = chkq("log", "gc", url, "r1", "--older-than", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [orphan]
    assert payload_keys(url, "r1") == before - {orphan}
    assert log.load(log.heads()[0].id) == paths[0].read_bytes()


@pytest.mark.cluster
def test_gc_says_which_orphans_it_kept_for_their_age(tmp_path: Path) -> None:
    """An orphan ``log verify`` reports, younger than ``--older-than``: gc says it kept it, why."""
    url = f"file://{tmp_path / 'store'}"
    paths = checkpoint_series(tmp_path / "run", 1)
    log = CheckpointLog(open_store(url), "r1")
    log.commit(paths[0].read_bytes())
    orphan = f"runs/r1/payloads/{'ab' * 32}.full.zst"
    log.store.put(orphan, b"left by a committer killed before its record")
    verified = chkq("log", "verify", url, "r1")
    assert f"orphan {orphan}" in verified.stdout, verified.stdout
    out = chkq("log", "gc", url, "r1")
    assert out.returncode == 0 and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert re.fullmatch(rf"kept {orphan}: unreferenced but \d+ s old, younger than "
                        r"--older-than 86,400 s \(a commit may still be recording it\)",
                        lines[0]), lines
    assert lines[1] == ("removed 0 unreferenced payload(s) and 0 unfinished upload(s); kept 1 "
                        "unreferenced payload for its age (removed by a gc once older than "
                        "86,400 s)"), lines
    assert orphan in payload_keys(url, "r1")


@pytest.mark.cluster
def test_restore_into_a_directory_holding_the_files_lists_none_as_restored(
        tmp_path: Path) -> None:
    """Files already there with their committed bytes are kept, and not listed as restored."""
    url = f"file://{tmp_path / 'store'}"
    paths = checkpoint_series(tmp_path / "run", 2)
    for path in paths:
        assert chkq("log", "commit", url, "r1", str(path)).returncode == 0
    back = tmp_path / "back"
    first = chkq("log", "restore", url, "r1", str(back))
    assert first.returncode == 0, first.stderr
    assert sorted(first.stdout.split()) == sorted(str(back / p.name) for p in paths)
    (back / paths[1].name).unlink()
    again = chkq("log", "restore", url, "r1", str(back))
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == [str(back / paths[1].name)]
    assert again.stderr.endswith(f"into {back}; 1 file(s) already there with their committed "
                                 "bytes were kept, not rewritten\n"), again.stderr


def test_commit_options_are_one_message_format_checked_field_by_field() -> None:
    """What a client sends is what the task reads; a wrong field is named, a local one refused."""
    parent = sha(b"parent")
    options = CommitOptions(parent=parent, step=3, label="l", name="run_chk00003.h5",
                            model="run", expect_id=sha(b"x"), writer="me@host")
    message = options.to_json()
    assert set(message) == {"parent", "parent_head", "step", "label", "name", "model",
                            "expect_id"}, "writer and meta stay out of a message"
    assert json.loads(json.dumps(message)) == message
    assert CommitOptions.from_json(message) == replace(options, writer=None)
    for bad, field_name, kind in (({"step": True}, "step", BadMessageTypeError),
                                  ({"parent": parent[:-1]}, "parent", BadMessageError),
                                  ({"model": 3}, "model", BadMessageTypeError),
                                  ({"writer": "x"}, "writer", BadMessageTypeError),
                                  ({"staging_key": "k"}, "staging_key", BadMessageTypeError)):
        with pytest.raises(kind, match=field_name):
            CommitOptions.from_json(bad)
    with pytest.raises(BadMessageTypeError, match="JSON object"):
        CommitOptions.from_json(["parent"])
    with pytest.raises(TypeError, match="'stepp'"):
        CommitOptions.of(options, stepp=4)
