"""``CheckpointLog.verify`` and ``chkq log verify`` on real stores (file, memory, S3, GCS)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from chkq.log import CheckpointLog
from chkq.stores import CheckpointStore, LocalDirectoryStore

TIMEOUT = 120


def blob(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def mutate(data: bytes, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    array = np.frombuffer(data, dtype=np.uint8).copy()
    where = rng.integers(0, len(array), len(array) // 100)
    array[where] ^= 0x5A
    return array.tobytes()


def corrupt(store: CheckpointStore, key: str) -> None:
    """Flip one byte in the middle of an object, as a disk or a hostile writer would."""
    raw = bytearray(store.get(key))
    raw[len(raw) // 2] ^= 0xFF
    if isinstance(store, LocalDirectoryStore):
        (store.root / key).write_bytes(bytes(raw))
    else:
        store.put(key, bytes(raw))


def chain(store: CheckpointStore) -> tuple[CheckpointLog, list[str]]:
    """a (full) <- b (delta) <- c (delta, the head, with a head copy), all named."""
    log = CheckpointLog(store, "run")
    data = blob(200_000, 1)
    ids = []
    parent = None
    for step in range(3):
        parent = log.commit(data, parent, step=step, name=f"m_chk{step:05d}.h5")
        ids.append(parent)
        data = mutate(data, step)
    assert [log.record(i).kind for i in ids] == ["full", "delta", "delta"]
    assert store.exists(log.keys.head_copy(ids[2]))
    return log, ids


def fresh(log: CheckpointLog) -> CheckpointLog:
    return CheckpointLog(log.store, log.run_id)


def test_clean_store_passes(store: CheckpointStore) -> None:
    log, ids = chain(store)
    for read_data in (False, True):
        report = fresh(log).verify(read_data=read_data)
        assert report.ok, report.problems
        assert (report.records, report.names, report.head_copies) == (3, 3, 1)
        assert report.orphans == []
    report = fresh(log).verify(read_data=True)
    assert report.decoded == 3
    assert report.decoded_bytes == 3 * 200_000


def test_corrupted_payload_behind_a_head_copy_is_found(store: CheckpointStore) -> None:
    log, ids = chain(store)
    head = log.record(ids[2])
    corrupt(store, head.payload)
    assert fresh(log).load(ids[2]) == log.load(ids[2]), "the head copy hides the damage"
    report = fresh(log).verify(read_data=True)
    assert not report.ok
    assert [key for key, _ in report.problems] == [head.payload]
    assert ids[2] in report.problems[0][1]


def test_corrupted_middle_payload_reports_it_and_what_depends_on_it(
        store: CheckpointStore) -> None:
    log, ids = chain(store)
    middle = log.record(ids[1]).payload
    corrupt(store, middle)
    problems = fresh(log).verify(read_data=True).problems
    assert [key for key, _ in problems] == [middle, log.record(ids[2]).payload]
    assert "cannot be rebuilt" in problems[1][1]


def test_corrupted_head_copy_is_found_without_reading_data(store: CheckpointStore) -> None:
    log, ids = chain(store)
    copy = log.keys.head_copy(ids[2])
    corrupt(store, copy)
    report = fresh(log).verify()
    assert [key for key, _ in report.problems] == [copy]
    assert "head copy" in report.problems[0][1]


def test_head_copy_of_other_bytes_is_found(store: CheckpointStore) -> None:
    """A well-formed frame of the wrong checkpoint (not a decode error) is found too."""
    log, ids = chain(store)
    copy = log.keys.head_copy(ids[2])
    from chkq.log.delta import compress_full

    store.put(copy, compress_full(log.load(ids[1])))
    report = fresh(log).verify()
    assert [key for key, _ in report.problems] == [copy]
    assert "does not decode to its record's id" in report.problems[0][1]


def test_missing_payload_is_found(store: CheckpointStore) -> None:
    log, ids = chain(store)
    payload = log.record(ids[0]).payload
    store.delete(payload)
    report = fresh(log).verify()
    assert report.problems == [(payload, f"payload of checkpoint {ids[0]} missing")]
    report = fresh(log).verify(read_data=True)
    keys = [key for key, _ in report.problems]
    assert keys[0] == payload and len(keys) == 3, "the missing keyframe breaks its chain"


def test_orphans_and_malformed_objects_are_listed(store: CheckpointStore) -> None:
    log, ids = chain(store)
    orphan = f"runs/run/payloads/{'ab' * 32}.full.zst"
    store.put(orphan, b"left by a writer that died before its record")
    bad_entry = f"runs/run/names/{'cd' * 32}.json"
    store.put(bad_entry, b'{"name": "../../etc/passwd", "id": "' + ids[0].encode() + b'"}')
    report = fresh(log).verify()
    assert report.orphans == [orphan]
    assert [key for key, _ in report.problems] == [bad_entry]


def chkq(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CHKQ_BROKER_URL",
                                                             "CHKQ_RESULT_BACKEND")}
    return subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.cluster
@pytest.mark.parametrize("store", ["file"], indirect=True)
def test_verify_command(store: CheckpointStore) -> None:
    log, ids = chain(store)
    url = store.url
    ok = chkq("log", "verify", url, "run", "--read-data")
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""
    assert re.fullmatch(r"ok: 3 checkpoints, 3 rebuilt \(\d+ bytes\), \d+ names?, 1 head copy, "
                        r"0 outputs, 0 problems, 0 orphans", ok.stdout.splitlines()[-1]), ok.stdout
    summary = json.loads(chkq("log", "verify", url, "run", "--json").stdout)
    assert summary["ok"] is True and summary["records"] == 3

    corrupt(store, log.record(ids[2]).payload)
    store.delete(log.record(ids[0]).payload)
    corrupt(store, log.keys.head_copy(ids[2]))
    bad = chkq("log", "verify", url, "run", "--read-data")
    assert bad.returncode == 1
    problems = [line for line in bad.stdout.splitlines() if line.startswith("problem ")]
    assert len(problems) == 4, bad.stdout  # missing keyframe, 2 unbuildable, head copy
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: verify found 4")
    summary = json.loads(chkq("log", "verify", url, "run", "--json", "--read-data").stdout)
    assert summary["ok"] is False and len(summary["problems"]) == 4
