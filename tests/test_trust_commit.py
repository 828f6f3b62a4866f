"""Commit messages and store URLs cannot make a worker touch files it must not.

Attacks by whoever can write to the broker (a ``chkq.commit`` message with a
percent-encoded store URL, a staging key naming a file, malformed arguments)
and by whoever can write to a local store or a directory the worker writes
in (symbolic links planted where temporaries or directories go). Real
``chkq worker`` processes against the session's redis-server; after the
attacks, nothing outside has been read into a log, changed or deleted, and
the worker still answers ping.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from chkq.config.celery_app import get_app
from chkq.config.routing import COMMIT_QUEUE
from chkq.log import CheckpointLog, checkpoint_id
from chkq.stores import open_store
from support.plugins.cluster import WorkerProcess, consumers_paused

TIMEOUT = 60
SECRET = b"the worker must neither read this into a log nor delete it"

StartWorker = Callable[..., WorkerProcess]


def tree(directory: Path) -> dict[str, str]:
    """Every entry below ``directory`` (links as links, hidden ones too) with its content."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if path.is_symlink():
            found[rel] = "link -> " + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def send_commit(*args: Any, **kwargs: Any) -> AsyncResult:
    """A raw ``chkq.commit`` message, as anyone with broker access can send one.

    (``send_task`` sends it as it is, whether or not this process has imported
    the task: no client-side argument check stands in for the worker's.)
    """
    return get_app().send_task("chkq.commit", args=args, kwargs=kwargs)


def assert_alive(worker: WorkerProcess) -> None:
    assert worker.process.poll() is None, f"worker died:\n{worker.log()[-3000:]}"
    assert get_app().control.ping(destination=[worker.name], timeout=5), "no answer to ping"


def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``allowed/`` (with a checkpoint file) and ``outside/`` (with a secret) under one dir."""
    data = tmp_path / "data"
    allowed, outside = data / "allowed", data / "outside"
    allowed.mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (allowed / "state.bin").write_bytes(b"a checkpoint inside the allowed roots")
    return data, allowed, outside


def test_percent_encoded_store_url_cannot_escape_the_allowed_roots(
    tmp_path: Path, worker: WorkerProcess, start_worker: StartWorker
) -> None:
    """``file://ALLOWED/%2E%2E/outside``: the check and the store see the same decoded path."""
    data, allowed, outside = layout(tmp_path)
    (allowed / "link.bin").symlink_to(outside / "secret.txt")
    escape = f"file://{allowed}/%2E%2E/outside"
    before = tree(data)
    with consumers_paused(worker, COMMIT_QUEUE):
        guarded = start_worker("commit", concurrency=1,
                               env={"CHKQ_ALLOWED_ROOTS": str(allowed)})
        # The reported attack: the secret as a "staging key" of a store outside.
        staged = send_commit(escape, "r1", staging_key="secret.txt")
        refused = [
            send_commit(url, "r1", str(allowed / "state.bin"))
            for url in (escape,
                        f"file://{allowed}/%2e%2e/outside/store",
                        f"file://{allowed}/%2E%2E%2Foutside",
                        f"file://localhost{allowed}/%2E%2E/outside",
                        f"file://{allowed}/.%2E/.%2E/{outside.parent.name}/outside")
        ]
        # The checkpoint path is resolved too: a link inside pointing outside.
        refused.append(send_commit(f"file://{allowed}/store", "r1", str(allowed / "link.bin")))
        refused.append(send_commit(f"file://{allowed}/store", "r1",
                                   f"{allowed}/../outside/secret.txt"))
        malformed = [send_commit(url, "r1", str(allowed / "state.bin")) for url in (
            f"file://otherhost{allowed}/store", f"file://{allowed}/st%00ore",
            "file:relative/store", f"file://{allowed}/store?x=1")]
        with pytest.raises(TypeError, match="staging_key"):
            staged.get(timeout=TIMEOUT)
        for result in refused:
            with pytest.raises(PermissionError, match="CHKQ_ALLOWED_ROOTS") as caught:
                result.get(timeout=TIMEOUT)
            assert str(outside) in str(caught.value), "the error names the decoded path"
        for result in malformed:
            with pytest.raises(ValueError, match="URL"):
                result.get(timeout=TIMEOUT)
        # The same worker still commits what it may.
        inside = send_commit(f"file://{allowed}/store", "r1", str(allowed / "state.bin"))
        assert inside.get(timeout=TIMEOUT)["id"] == checkpoint_id(
            (allowed / "state.bin").read_bytes())
        assert_alive(guarded)
    after = tree(data)
    assert (outside / "secret.txt").read_bytes() == SECRET
    assert {k: v for k, v in after.items() if not k.startswith("allowed/store")} == before
    assert_alive(worker)


def test_encoded_store_url_without_roots_is_decoded_once_and_used_consistently(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    """Roots unset: the decoded, resolved directory is the store; no detour is created."""
    source = tmp_path / "state.bin"
    source.write_bytes(b"checkpoint bytes")
    base = tmp_path / "base"
    base.mkdir()
    before = tree(tmp_path)
    # "a b/../store" once decoded and resolved is base/store: "a b" is never created.
    result = send_commit(f"file://{base}/a%20b/%2E%2E/st%6Fre", "r1", str(source))
    record = result.get(timeout=TIMEOUT)
    assert record["id"] == checkpoint_id(b"checkpoint bytes")
    assert CheckpointLog(open_store((base / "store").as_uri()), "r1").load(record["id"]) == \
        b"checkpoint bytes"
    # Decoded exactly once: %252E is a literal "%2E" directory name, not "..".
    twice = send_commit(f"file://{base}/lit/%252E%252E/store", "r1", str(source))
    assert twice.get(timeout=TIMEOUT)["id"] == record["id"]
    assert (base / "lit" / "%2E%2E" / "store" / "runs" / "r1").is_dir()
    created = set(tree(tmp_path)) - set(before)
    assert {c for c in created if not c.startswith(("base/store", "base/lit"))} == set()
    assert not (base / "a b").exists()
    assert source.read_bytes() == b"checkpoint bytes"
    assert_alive(worker)


def test_a_commit_never_deletes_a_file(tmp_path: Path, worker: WorkerProcess) -> None:
    """Roots unset (the default): neither a staging key nor a path gets a file deleted."""
    victims = tmp_path / "victims"
    victims.mkdir()
    (victims / "secret.txt").write_bytes(SECRET)
    source = tmp_path / "state.bin"
    source.write_bytes(b"committed, and still there afterwards")
    staged = send_commit(f"file://{victims}", "r1", staging_key="secret.txt")
    with pytest.raises(TypeError, match="staging_key"):
        staged.get(timeout=TIMEOUT)
    both = send_commit(f"file://{victims}", "r1", str(source), staging_key="secret.txt")
    with pytest.raises(TypeError, match="staging_key"):
        both.get(timeout=TIMEOUT)
    done = send_commit(f"file://{tmp_path / 'store'}", "r1", str(source))
    assert done.get(timeout=TIMEOUT)["full_size"] == source.stat().st_size
    again = send_commit(f"file://{tmp_path / 'store'}", "r1", str(source))
    assert again.get(timeout=TIMEOUT)["id"] == done.get()["id"]
    assert (victims / "secret.txt").read_bytes() == SECRET
    assert tree(victims) == {"secret.txt": hashlib.sha256(SECRET).hexdigest()}
    assert source.read_bytes() == b"committed, and still there afterwards"
    assert_alive(worker)


def test_malformed_commit_arguments_fail_at_once(tmp_path: Path, worker: WorkerProcess) -> None:
    """Wrong types, non-ids, non-regular files: a prompt clear failure, no retry loop."""
    source = tmp_path / "state.bin"
    source.write_bytes(b"x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    url = f"file://{tmp_path / 'store'}"
    cases: list[tuple[AsyncResult, type[BaseException]]] = [
        (send_commit(url, "r1", str(source), parent="../../x"), ValueError),
        (send_commit(url, "r1", str(source), parent=["a"]), TypeError),
        (send_commit(url, "r1", str(source), expect_id="zz"), ValueError),
        (send_commit(url, "r1", str(source), step="3"), TypeError),
        (send_commit(url, "r1", str(source), parent_head="yes"), TypeError),
        (send_commit(url, "r1", None), TypeError),
        (send_commit(url, "r1", str(tmp_path) + "/a\x00b"), ValueError),
        (send_commit(url, "r1", str(tmp_path)), FileNotFoundError),
        (send_commit(url, "r1", str(fifo)), FileNotFoundError),
        (send_commit(123, "r1", str(source)), ValueError),
    ]
    named: list[tuple[AsyncResult, type[BaseException], str]] = [
        (send_commit(url, "r1", str(source), name="../../etc/x"), ValueError, "etc/x"),
        (send_commit(url, "r1", str(source), label=7), TypeError, "commit label must be str"),
        # Who wrote a record is the worker's to say, not a message's.
        (send_commit(url, "r1", str(source), writer="alice@host"), TypeError, "'writer'"),
        (send_commit(url, "r1", str(source), meta={"name": "x"}), TypeError, "'meta'"),
        (send_commit(url, "r1", str(source), step=True), TypeError, "commit step must be int"),
    ]
    for result, expected in cases:
        with pytest.raises(expected):
            result.get(timeout=TIMEOUT)
    for result, expected, what in named:
        with pytest.raises(expected, match=what):
            result.get(timeout=TIMEOUT)
    assert not (tmp_path / "store").exists(), "a refused commit created its store"
    assert_alive(worker)


def test_links_planted_in_a_local_store_are_not_followed(
    tmp_path: Path, worker: WorkerProcess
) -> None:
    """A link at a key's directory is refused, not followed; one planted where earlier
    versions kept temporaries (``.chkq-tmp``) is never used: writes go through no directory
    another user can own."""
    source = tmp_path / "state.bin"
    source.write_bytes(b"checkpoint bytes")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_bytes(SECRET)
    first = tmp_path / "store1"
    first.mkdir()
    (first / ".chkq-tmp").symlink_to(elsewhere)
    second = tmp_path / "store2"
    second.mkdir()
    (second / "runs").symlink_to(elsewhere)
    before, mtime = tree(elsewhere), os.stat(elsewhere).st_mtime_ns
    send_commit(first.as_uri(), "r1", str(source)).get(timeout=TIMEOUT)
    result = send_commit(second.as_uri(), "r1", str(source))
    with pytest.raises(PermissionError, match="symbolic link"):
        result.get(timeout=TIMEOUT)
    assert tree(elsewhere) == before
    assert os.stat(elsewhere).st_mtime_ns == mtime, "something was created in the link target"
    assert tree(first)[".chkq-tmp"] == f"link -> {elsewhere}", "left alone"
    assert sorted(p.name for p in first.iterdir()) == [".chkq-tmp", "runs"]
    assert_alive(worker)


def test_a_durable_write_never_writes_through_a_planted_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link planted at the next temporary's name is left alone; the write takes another."""
    import itertools
    import secrets

    from chkq import fsutil

    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    names = itertools.chain(["planted", "planted"], (f"n{i}" for i in itertools.count()))
    monkeypatch.setattr(secrets, "token_hex", lambda _: next(names))
    (tmp_path / ".chkq-planted.tmp").symlink_to(victim)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsutil.install(dir_fd, "plan.json", b"{}")
        with pytest.raises(FileExistsError):
            fsutil.install(dir_fd, "plan.json", b"[]")
    finally:
        os.close(dir_fd)
    assert victim.read_bytes() == SECRET
    assert (tmp_path / "plan.json").read_bytes() == b"{}"
    assert {p.name for p in tmp_path.iterdir()} == {"victim.txt", "plan.json",
                                                    ".chkq-planted.tmp"}


@pytest.mark.cluster
def test_reading_a_missing_store_creates_nothing(tmp_path: Path) -> None:
    """Opening, listing or reading a missing local store writes nothing anywhere."""
    missing = tmp_path / "no" / "such" / "dir"
    url = missing.as_uri()
    store = open_store(url)
    assert store.list("runs/r1/") == []
    assert not store.exists("runs/r1/records/x.json")
    with pytest.raises(KeyError):
        store.get("runs/r1/records/x.json")
    assert list(CheckpointLog(store, "r1").manifest()) == []
    assert list(tmp_path.iterdir()) == [], "opening or reading a store created directories"
    strict = open_store(url, must_exist=True)
    with pytest.raises(FileNotFoundError, match=f"store {url} does not exist"):
        strict.list("runs/r1/")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        strict.get("runs/r1/records/x.json")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    subprocess.run([sys.executable, "-m", "chkq.workers.cli", "log", "list", url, "r1"],
                   env=env, capture_output=True, timeout=TIMEOUT)
    assert list(tmp_path.iterdir()) == [], "a read created directories"
    store.put("runs/r1/k", b"v")
    assert store.get("runs/r1/k") == b"v"
    assert sorted(p.name for p in missing.iterdir()) == ["runs"], "no temporary left"
