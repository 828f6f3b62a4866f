"""Tests of the checkpoint log, on real stores."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from chkq import CheckpointCorruptionError
from chkq.log import CheckpointLog
from chkq.log.delta import compress_full
from chkq.stores import CheckpointStore, LocalDirectoryStore, MemoryStore, open_store
from chkq.stores.faults import FaultyStore
from support.helpers import assert_log_consistent
from support.races import blob, mutate, race_commits

MiB = 1 << 20
LOCAL = pytest.mark.parametrize("store", ["file", "memory"], indirect=True)






def cold(log: CheckpointLog) -> CheckpointLog:
    """A new handle on the same log, with nothing cached (another process's view)."""
    return CheckpointLog(log.store, log.run_id, max_chain=log.max_chain)


def test_commit_round_trip_and_record(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run-1")
    data = blob(100_000, 1)
    checkpoint = log.commit(data, step=3, label="first", meta={"t": 1.5})
    assert checkpoint == hashlib.sha256(data).hexdigest()
    assert cold(log).load(checkpoint) == data
    record = cold(log).record(checkpoint)
    assert (record.kind, record.parent, record.base, record.depth) == ("full", None, None, 0)
    assert (record.step, record.label, record.meta) == (3, "first", {"t": 1.5})
    assert record.full_size == len(data)
    assert record.stored_size == len(store.get(record.payload))
    assert store.exists(log.keys.record(checkpoint))
    assert checkpoint in log and "0" * 64 not in log
    with pytest.raises(KeyError):
        cold(log).load("0" * 64)


def test_deltas_are_small(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    first = blob(4 * MiB, 2)
    second = mutate(first, 0.01, 3)
    a = log.commit(first)
    b = log.commit(second, a)
    record = log.record(b)
    assert (record.kind, record.base, record.depth, record.parent) == ("delta", a, 1, a)
    assert record.stored_size <= 0.02 * len(second)
    assert cold(log).load(b) == second
    fresh = cold(log)
    fresh.store.delete(log.keys.head_copy(b))
    assert fresh.load(b) == second


def test_same_bytes_twice_change_nothing(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    a = log.commit(blob(50_000, 4))
    b = log.commit(mutate(blob(50_000, 4), 0.01, 5), a, label="b")
    before = {key: store.get(key) for key in store.list()}
    assert log.commit(mutate(blob(50_000, 4), 0.01, 5), a, label="b") == b
    assert cold(log).commit(mutate(blob(50_000, 4), 0.01, 5), None, label="other") == b
    assert cold(log).commit(blob(50_000, 4), b) == a
    assert {key: store.get(key) for key in store.list()} == before


@LOCAL
def test_max_chain_and_fallback_to_full(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run", max_chain=3)
    data = blob(64 * 1024, 6)
    parent = None
    kinds = []
    for i in range(7):
        parent = log.commit(data, parent, step=i)
        record = log.record(parent)
        kinds.append((record.kind, record.depth))
        data = mutate(data, 0.01, 100 + i)
    assert kinds == [("full", 0), ("delta", 1), ("delta", 2), ("delta", 3),
                     ("full", 0), ("delta", 1), ("delta", 2)]
    unrelated = log.commit(blob(64 * 1024, 7), parent)
    assert log.record(unrelated).kind == "full"
    assert log.record(unrelated).parent == parent
    fresh = cold(log)
    for record in fresh.manifest():
        assert hashlib.sha256(fresh.load(record.id)).hexdigest() == record.id


@LOCAL
def test_history_queries(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    base = blob(20_000, 8)
    a = log.commit(base, step=0)
    b = log.commit(mutate(base, 0.01, 1), a, step=1)
    c = log.commit(mutate(base, 0.02, 2), b, step=2)
    f = log.fork(b, mutate(base, 0.03, 3), label="what-if", edit="halved the timestep")
    view = cold(log)
    assert [r.id for r in view.manifest()] == [a, b, c, f]
    assert [r.id for r in view] == [a, b, c, f]
    assert len(view) == 4
    assert [r.id for r in view.lineage(f)] == [a, b, f]
    assert [r.id for r in view.lineage(a)] == [a]
    assert [r.id for r in view.children(b)] == [c, f]
    assert view.children(c) == []
    assert {r.id for r in view.heads()} == {c, f}
    forked = view.record(f)
    assert forked.parent == b
    assert forked.fork == {"source": b, "edit": "halved the timestep"}
    assert forked.label == "what-if"
    assert view.record(c).fork is None
    with pytest.raises(ValueError, match="unknown parent"):
        log.commit(b"x", "f" * 64)
    with pytest.raises(KeyError):
        view.lineage("f" * 64)


@LOCAL
def test_head_copies_follow_the_heads(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    data = blob(200_000, 9)
    a = log.commit(data)
    b = log.commit(mutate(data, 0.01, 1), a)
    c = log.commit(mutate(data, 0.02, 2), b)
    heads_dir = f"runs/{log.run_id}/heads/"
    assert store.list(heads_dir) == [log.keys.head_copy(c)]
    f = log.fork(b, mutate(data, 0.03, 3))
    assert store.list(heads_dir) == sorted([log.keys.head_copy(c), log.keys.head_copy(f)])
    assert cold(log).load(c) == mutate(data, 0.02, 2)


@pytest.mark.parametrize("run_id", ["", "a/b", "..", ".", "a\\b", "x\x00"])
def test_run_id_validated(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        CheckpointLog(MemoryStore(), run_id)


def _corrupt(store: CheckpointStore, key: str) -> None:
    raw = bytearray(store.get(key))
    raw[len(raw) // 2] ^= 0xFF
    if isinstance(store, LocalDirectoryStore):
        path = store.root / key
        path.write_bytes(bytes(raw))
    else:
        store.put(key, bytes(raw))


@LOCAL
def test_corruption_names_checkpoint_and_payload(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    data = blob(300_000, 10)
    a = log.commit(data)
    b = log.commit(mutate(data, 0.01, 1), a)
    c = log.commit(mutate(data, 0.02, 2), b)
    for victim, dependents in ((b, [b]), (a, [a, b])):
        payload = log.record(victim).payload
        _corrupt(store, payload)
        for checkpoint in dependents:
            with pytest.raises(CheckpointCorruptionError) as caught:
                cold(log).load(checkpoint)
            assert victim in str(caught.value)
            assert payload in str(caught.value)
    assert cold(log).load(c) == mutate(data, 0.02, 2), "the head copy still serves the head"
    _corrupt(store, log.keys.head_copy(c))
    with pytest.warns(UserWarning, match="head copy"), pytest.raises(CheckpointCorruptionError):
        cold(log).load(c)


@LOCAL
def test_missing_payload_is_corruption(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    a = log.commit(b"a" * 1000)
    store.delete(log.record(a).payload)
    with pytest.raises(CheckpointCorruptionError, match="payload missing"):
        cold(log).load(a)


def test_cache_avoids_rereading_the_parent() -> None:
    store = FaultyStore(MemoryStore())
    log = CheckpointLog(store, "run")
    data = blob(100_000, 11)
    parent = None
    for i in range(5):
        parent = log.commit(data, parent)
        data = mutate(data, 0.01, i)

    def reads() -> list[str]:
        return [key for operation, key in store.calls
                if operation in ("get", "get_at_most") and "/records/" not in key]

    assert reads() == []
    tiny = CheckpointLog(store, "run", cache_bytes=1)
    assert tiny.load(parent) == log.load(parent)
    assert reads() == [log.keys.head_copy(parent)]




@pytest.mark.cluster
def test_concurrent_processes_commit_one_history(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    writers, count = 3, 8
    results = race_commits(url, writers, count, size=256 * 1024)
    assert results[0] == results[1] == results[2]
    log = CheckpointLog(open_store(url), "shared", max_chain=4)
    assert sorted(log.ids()) == sorted(results[0])
    assert [r.id for r in log.heads()] == [results[0][-1]]
    assert [r.id for r in log.lineage(results[0][-1])] == results[0]
    assert_log_consistent(log)
    heads_dir = "runs/shared/heads/"
    assert set(log.store.list(heads_dir)) <= {log.keys.head_copy(results[0][-1])}


@LOCAL
def test_gc_removes_only_old_unreferenced_payloads(store: CheckpointStore) -> None:
    log = CheckpointLog(store, "run")
    data = blob(50_000, 13)
    a = log.commit(data)
    b = log.commit(mutate(data, 0.01, 1), a)
    orphan_data = mutate(data, 0.05, 2)
    orphan_id = hashlib.sha256(orphan_data).hexdigest()
    orphan = log.keys.payload(orphan_id, "full", None)
    store.put_if_absent(orphan, b"written by a writer killed before its record")
    stale_copy = log.keys.head_copy(a)
    store.put_if_absent(stale_copy, b"left by a writer killed before deleting it")
    referenced = sorted(r.payload for r in log.manifest())

    assert log.gc(older_than=3600) == [stale_copy]
    assert store.exists(orphan)
    assert log.gc(older_than=0) == [orphan]
    assert store.list(f"runs/{log.run_id}/payloads/") == referenced
    assert store.exists(log.keys.head_copy(b))
    assert log.gc(older_than=0) == []
    assert_log_consistent(cold(log))
    assert log.commit(orphan_data, b) == orphan_id
    assert_log_consistent(cold(log))


def test_commit_survives_gc_of_a_reused_orphan_payload() -> None:
    """A garbage collection runs between the writer's payload and record writes."""
    store = FaultyStore(MemoryStore())
    log = CheckpointLog(store, "run")
    data = blob(10_000, 14)
    checkpoint = hashlib.sha256(data).hexdigest()
    orphan = log.keys.payload(checkpoint, "full", None)
    log.store.put_if_absent(orphan, compress_full(data))
    collected: list[str] = []
    store.before("put_if_absent", lambda operation, key: collected.extend(
        CheckpointLog(store.inner, "run").gc(older_than=0)), "/records/")
    assert log.commit(data) == checkpoint
    assert collected == [orphan], "the orphan was collected mid-commit"
    assert cold(log).load(checkpoint) == data


def test_racing_writers_with_different_parents_leave_no_orphans() -> None:
    store = MemoryStore()
    log = CheckpointLog(store, "run")
    data = blob(40_000, 15)
    a = log.commit(data)
    b = log.commit(mutate(data, 0.2, 1), a)
    target = mutate(data, 0.01, 2)
    interleaved = FaultyStore(store)

    def other_writer(operation: str, key: str) -> None:
        if not store.exists(key):
            CheckpointLog(store, "run").commit(target, b)

    interleaved.before("put_if_absent", other_writer, "/records/", times=None)
    racer = CheckpointLog(interleaved, "run")
    assert racer.commit(target, a) == hashlib.sha256(target).hexdigest()
    record = log.record(hashlib.sha256(target).hexdigest())
    assert record.parent == b
    assert_log_consistent(cold(log))


@pytest.mark.parametrize("seed", [1, 2])
def test_random_histories_load_exactly(seed: int) -> None:
    rng = random.Random(seed)
    log = CheckpointLog(MemoryStore(), "run", max_chain=2, cache_bytes=100_000)
    known: dict[str, bytes] = {}
    data = blob(30_000, seed)
    known[log.commit(data)] = data
    for i in range(12):
        parent = rng.choice(sorted(known))
        data = mutate(known[parent], rng.choice([0.001, 0.01, 0.5]), seed * 100 + i)
        known[log.commit(data, parent)] = data
    view = cold(log)
    for checkpoint, expected in known.items():
        assert view.load(checkpoint) == expected


@pytest.mark.cluster
def test_eight_processes_commit_the_same_thousand_checkpoints(tmp_path: Path) -> None:
    """Fault bar: nothing lost, no orphan payloads."""
    url = (tmp_path / "store").as_uri()
    writers, count = 8, 1000
    results = race_commits(url, writers, count)
    assert all(result == results[0] for result in results)
    log = CheckpointLog(open_store(url), "shared", max_chain=4)
    assert sorted(log.ids()) == sorted(set(results[0]))
    assert [r.id for r in log.heads()] == [results[0][-1]]
    assert_log_consistent(log)


def test_unserialisable_meta_writes_nothing() -> None:
    store = MemoryStore()
    log = CheckpointLog(store, "run")
    with pytest.raises(TypeError):
        log.commit(b"data", meta={"bad": object()})
    assert store.list() == []
