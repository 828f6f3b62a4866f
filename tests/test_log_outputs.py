"""A run's consolidated outputs in its log: recorded once, listed, traced, verified, fetched.

The output object is published the way consolidation publishes it (``put_if_absent``
at ``runs/<run>/outputs/<MODEL>.h5``) and then recorded; everything a user would check
goes through ``chkq log ...`` in this process, on a local directory, the memory store
and S3 through moto's server.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest

from chkq.errors import (
    LogKeyError,
    OutputCorruptionError,
    OutputEntryError,
    OutputExistsError,
    UnknownParentError,
)
from chkq.log import CheckpointLog, OutputEntry
from chkq.log.signing import LogTrust, generate_key_pair
from chkq.log.transfer import restore_outputs
from chkq.stores import CheckpointStore, MemoryStore
from chkq.workers.cli import main as chkq_main
from support.plugins.object_stores import make_store

RUN = "r1"
MODEL = "sim"
ENTRY_KEY = f"runs/{RUN}/outputs/{MODEL}.json"
OBJECT_KEY = f"runs/{RUN}/outputs/{MODEL}.h5"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hdf5_bytes(rows: int = 4, seed: int = 0) -> bytes:
    """A small real HDF5 file: what a consolidated output is."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as fh:
        fh["data"] = np.random.default_rng(seed).random((rows, 3))
    return buffer.getvalue()


def commit_run(store: CheckpointStore, trust: LogTrust | None = None
               ) -> tuple[CheckpointLog, list[str], list[str]]:
    """Three checkpoints of model ``sim`` on one chain (deltas), each under its slug name."""
    log = CheckpointLog(store, RUN, trust=trust or LogTrust())
    data = bytearray(np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8)
                     .tobytes())
    ids: list[str] = []
    names: list[str] = []
    parent = None
    for number in (1, 2, 3):
        data[number * 1000] ^= 0xFF
        name = f"{MODEL}_chk{number:05d}.h5"
        parent = log.commit(bytes(data), parent, name=name, model=MODEL, step=number)
        ids.append(parent)
        names.append(name)
    return log, ids, names


def output_entry(data: bytes, ids: list[str], names: list[str], *, key: str = OBJECT_KEY,
                 model: str = MODEL, job: str = "job-1") -> OutputEntry:
    return OutputEntry(model=model, key=key, size=len(data), sha256=sha(data),
                       checkpoints=tuple(ids), names=tuple(names), job=job)


def publish(log: CheckpointLog, data: bytes, ids: list[str], names: list[str], *,
            key: str = OBJECT_KEY, model: str = MODEL, job: str = "job-1") -> OutputEntry:
    """What a consolidation worker does: publish the object create-if-absent, then record it."""
    assert log.store.put_if_absent(key, data)
    return log.record_output(output_entry(data, ids, names, key=key, model=model, job=job))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = chkq_main(["log", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(params=["file", "memory", "s3"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def any_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """A fresh store: a local directory, the memory store, or S3 through moto's server."""
    return make_store(kind, request, tmp_path)


@pytest.fixture(params=["file", "memory"])
def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """A fresh local-directory or memory store (unit tests)."""
    return make_store(str(request.param), request, tmp_path)


# recording and listing ------------------------------------------------------


def test_an_output_is_listed_and_its_entry_is_write_once(
        any_store: CheckpointStore, capsys: pytest.CaptureFixture[str]) -> None:
    log, ids, names = commit_run(any_store)
    data = hdf5_bytes()
    entry = publish(log, data, ids, names)
    assert entry.created > 0 and entry.writer
    assert any_store.exists(ENTRY_KEY)

    reader = CheckpointLog(any_store, RUN, trust=LogTrust())
    assert reader.output(MODEL) == entry
    assert reader.outputs() == [entry]
    assert reader.output("other") is None

    code, out, err = cli(capsys, "list", any_store.url, RUN)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 4 and all(line.startswith(i) for line, i in zip(lines, ids, strict=False))
    assert lines[3].startswith(f"output {MODEL} key={OBJECT_KEY} size={len(data)} "
                               f"sha256={sha(data)[:16]} checkpoints=3 ")
    assert lines[3].endswith(" job=job-1")

    again = reader.record_output(replace(output_entry(data, ids, names, job="job-2"),
                                         writer="another worker"))
    assert again == entry, "a redelivered record returns the entry already there"

    other = hdf5_bytes(seed=7)
    other_key = f"runs/{RUN}/outputs/{MODEL}-again.h5"
    assert any_store.put_if_absent(other_key, other)
    before = any_store.get(ENTRY_KEY)
    with pytest.raises(OutputExistsError) as refused:
        reader.record_output(output_entry(other, ids, names, key=other_key, job="job-3"))
    message = str(refused.value)
    assert ENTRY_KEY in message and OBJECT_KEY in message and "not replaced" in message
    assert any_store.get(ENTRY_KEY) == before


def test_racing_records_of_one_output_agree(tmp_path: Path) -> None:
    store = MemoryStore()
    log, ids, names = commit_run(store)
    data = hdf5_bytes()
    assert store.put_if_absent(OBJECT_KEY, data)
    results: list[OutputEntry] = []
    barrier = threading.Barrier(4)

    def record(job: str) -> None:
        writer = CheckpointLog(store, RUN, trust=LogTrust())
        barrier.wait()
        results.append(writer.record_output(output_entry(data, ids, names, job=job)))

    threads = [threading.Thread(target=record, args=(f"delivery-{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert results[0] == CheckpointLog(store, RUN, trust=LogTrust()).output(MODEL)


def test_record_output_refuses_what_it_cannot_vouch_for() -> None:
    store = MemoryStore()
    log, ids, names = commit_run(store)
    data = hdf5_bytes()
    with pytest.raises(OutputCorruptionError, match=f"{OBJECT_KEY} .*publish it before"):
        log.record_output(output_entry(data, ids, names))
    store.put(OBJECT_KEY, data + b"x")
    with pytest.raises(OutputCorruptionError, match=f"{OBJECT_KEY} .* is {len(data) + 1} bytes"):
        log.record_output(output_entry(data, ids, names))
    store.put(OBJECT_KEY, data)
    with pytest.raises(UnknownParentError, match="0{64}"):
        log.record_output(output_entry(data, [*ids[:2], "0" * 64], names))
    assert not store.exists(ENTRY_KEY)

    with pytest.raises(ValueError, match="invalid model name"):
        output_entry(data, ids, names, model="../sim")
    with pytest.raises(ValueError, match="2 names for 3 checkpoints"):
        output_entry(data, ids, names[:2])
    with pytest.raises(ValueError, match="group 'payloads'"):
        output_entry(data, ids, names, key=f"runs/{RUN}/payloads/{ids[0]}.full.zst")
    with pytest.raises(ValueError, match="name of an output entry"):
        output_entry(data, ids, names, key=f"runs/{RUN}/outputs/elsewhere.json")
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        output_entry(data, ids, [names[0], names[1], "../escape.h5"])

    elsewhere = "results/sim-final.h5"
    store.put(elsewhere, data)
    recorded = log.record_output(output_entry(data, ids, names, key=elsewhere))
    assert recorded.key == elsewhere and log.outputs() == [recorded]


def test_trusted_keys_without_a_signing_key_record_nothing(tmp_path: Path) -> None:
    store = MemoryStore()
    _, public, _ = generate_key_pair(tmp_path)
    log, ids, names = commit_run(store)
    data = hdf5_bytes()
    store.put(OBJECT_KEY, data)
    reader = CheckpointLog(store, RUN, trust=LogTrust.from_files(None, public))
    with pytest.raises(LogKeyError, match="no signing key"):
        reader.record_output(output_entry(data, ids, names))
    assert not store.exists(ENTRY_KEY)


# lineage --------------------------------------------------------------------


def test_lineage_names_the_outputs_made_from_a_checkpoint_and_an_outputs_sources(
        local_store: CheckpointStore, capsys: pytest.CaptureFixture[str]) -> None:
    log, ids, names = commit_run(local_store)
    publish(log, hdf5_bytes(), ids, names)
    url = local_store.url

    code, out, err = cli(capsys, "lineage", url, RUN, ids[1][:12])
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ids[:2]
    assert lines[2].startswith(f"output {MODEL} key={OBJECT_KEY} ")
    assert lines[2].endswith(f" made-from=2/3 name={names[1]}")
    assert len(lines) == 3

    code, out, err = cli(capsys, "lineage", url, RUN, "--output", MODEL)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"output {MODEL} key={OBJECT_KEY} ")
    assert [(line.split()[0], line.split()[-1]) for line in lines[1:]] == [
        (i, f"name={n}") for i, n in zip(ids, names, strict=True)]

    code, _, err = cli(capsys, "lineage", url, RUN, "--output", "other")
    assert code == 1 and "no recorded output of model 'other' (its outputs: sim)" in err
    code, _, err = cli(capsys, "lineage", url, RUN)
    assert code == 1 and "give a checkpoint ID or --output MODEL" in err


# verify ---------------------------------------------------------------------


def test_verify_reads_each_output_and_reports_a_changed_or_missing_one(
        any_store: CheckpointStore, capsys: pytest.CaptureFixture[str]) -> None:
    log, ids, names = commit_run(any_store)
    data = hdf5_bytes(rows=50)
    publish(log, data, ids, names)
    url = any_store.url

    code, out, err = cli(capsys, "verify", url, RUN, "--read-data")
    assert code == 0, out + err
    assert f", 1 output (1 read, {len(data)} bytes), 0 problems, 0 orphans" in out
    code, out, _ = cli(capsys, "verify", url, RUN, "--read-data", "--json")
    summary = json.loads(out)
    assert code == 0 and (summary["outputs"], summary["output_bytes"]) == (1, len(data))

    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 1
    any_store.put(OBJECT_KEY, bytes(damaged))
    code, out, _ = cli(capsys, "verify", url, RUN)
    assert code == 0, "without --read-data only the object's presence and size are checked"
    code, out, err = cli(capsys, "verify", url, RUN, "--read-data")
    assert code == 1
    [problem] = [line for line in out.splitlines() if line.startswith("problem")]
    assert problem.startswith(f"problem {OBJECT_KEY}: ") and "SHA-256" in problem
    assert "verify found 1 problem(s)" in err

    any_store.put(OBJECT_KEY, data[:-10])
    code, out, _ = cli(capsys, "verify", url, RUN)
    assert code == 1
    assert f"problem {OBJECT_KEY}: output object of model 'sim' is {len(data) - 10} bytes, " \
           f"its entry says {len(data)}" in out

    any_store.delete(OBJECT_KEY)
    for extra in ((), ("--read-data",)):
        code, out, _ = cli(capsys, "verify", url, RUN, *extra)
        assert code == 1
        assert f"problem {OBJECT_KEY}: output object" in out and "missing" in out


def test_verify_reports_an_output_whose_names_no_name_entry_gives(
        local_store: CheckpointStore) -> None:
    log, ids, names = commit_run(local_store)
    publish(log, hdf5_bytes(), ids, [names[1], names[0], names[2]])
    report = CheckpointLog(local_store, RUN, trust=LogTrust()).verify()
    assert not report.ok
    assert sorted(why.split(" is checkpoint")[0] for key, why in report.problems
                  if key == ENTRY_KEY) == [
        f"output of model 'sim' says file {names[0]!r}",
        f"output of model 'sim' says file {names[1]!r}"]


# restore --------------------------------------------------------------------


def test_restore_outputs_brings_back_the_verified_file_and_refuses_a_damaged_one(
        any_store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, ids, names = commit_run(any_store)
    data = hdf5_bytes(rows=200)
    publish(log, data, ids, names)
    url = any_store.url

    out_dir = tmp_path / "back"
    code, out, err = cli(capsys, "restore", url, RUN, str(out_dir), "--outputs")
    assert code == 0, err
    target = out_dir / f"{MODEL}.h5"
    assert out.splitlines() == [str(target)]
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with h5py.File(target, "r") as fh:
        assert fh["data"].shape == (200, 3)
    assert os.listdir(out_dir) == [f"{MODEL}.h5"]
    code, out, err = cli(capsys, "restore", url, RUN, str(out_dir), MODEL, "--outputs")
    assert code == 0 and out == "", out
    assert "restored 0 file(s), 0 bytes" in err and "; 1 file(s) already there" in err, err

    code, _, err = cli(capsys, "restore", url, RUN, str(tmp_path / "none"), "other",
                       "--outputs")
    assert code == 1 and "no recorded output of model 'other' (its outputs: sim)" in err

    damaged = bytearray(data)
    damaged[-1] ^= 1
    any_store.put(OBJECT_KEY, bytes(damaged))
    bad_dir = tmp_path / "bad"
    code, _, err = cli(capsys, "restore", url, RUN, str(bad_dir), "--outputs")
    assert code == 1
    assert f"sim.h5: output of model 'sim' of run 'r1' in {url}: {OBJECT_KEY}: " in err
    assert "SHA-256" in err
    assert os.listdir(bad_dir) == [], "no file and no temporary is left"

    any_store.delete(OBJECT_KEY)
    code, _, err = cli(capsys, "restore", url, RUN, str(bad_dir), "--outputs")
    assert code == 1 and f"{OBJECT_KEY}: output object missing" in err
    assert os.listdir(bad_dir) == []


class RangeCountingStore(MemoryStore):
    """A memory store that remembers every read of ``key``: its kind and length."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.reads: list[tuple[str, int]] = []

    def _get(self, key: str) -> bytes:
        if key == self.key:
            self.reads.append(("get", -1))
        return super()._get(key)

    def _get_at_most(self, key: str, limit: int) -> bytes:
        if key == self.key:
            self.reads.append(("get_at_most", limit))
        return super()._get_at_most(key, limit)

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        if key == self.key:
            self.reads.append(("get_range", length))
        with self._bucket.lock:
            return self._bucket.objects[key][0][start:start + length]


def test_restore_reads_the_object_in_pieces_and_replaces_nothing(tmp_path: Path) -> None:
    store = RangeCountingStore(OBJECT_KEY)
    log, ids, names = commit_run(store)
    data = np.random.default_rng(3).integers(0, 256, 1_000_000, dtype=np.uint8).tobytes()
    publish(log, data, ids, names)
    store.reads.clear()

    result = restore_outputs(log, tmp_path / "out", piece=64 << 10)
    assert not result.failed and (tmp_path / "out" / "sim.h5").read_bytes() == data
    kinds = {kind for kind, _ in store.reads}
    assert kinds == {"get_range"}, "the object is never read whole"
    assert max(length for _, length in store.reads) <= 64 << 10
    assert len(store.reads) == -(-len(data) // (64 << 10)) + 1, "one piece each, and the end"

    other = tmp_path / "other"
    other.mkdir()
    (other / "sim.h5").write_bytes(b"someone's file")
    result = restore_outputs(log, other)
    [(name, why)] = result.failed
    assert name == "sim.h5" and "exists with other content; not overwritten" in why
    assert (other / "sim.h5").read_bytes() == b"someone's file"

    linked = tmp_path / "linked"
    linked.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (linked / "sim.h5").symlink_to(victim)
    result = restore_outputs(log, linked)
    assert "symbolic link" in result.failed[0][1]
    assert victim.read_bytes() == b"precious" and (linked / "sim.h5").is_symlink()


# gc -------------------------------------------------------------------------


def test_gc_keeps_outputs_and_outputs_keep_nothing_alive(local_store: CheckpointStore) -> None:
    log, ids, names = commit_run(local_store)
    data = hdf5_bytes()
    publish(log, data, ids, names)
    unrecorded = f"runs/{RUN}/outputs/crashed-publisher.h5"
    local_store.put(unrecorded, b"published, never recorded")
    orphan = log.keys.payload(ids[0], "delta", ids[2])
    local_store.put(orphan, b"a losing writer's payload of a checkpoint the output names")
    stale = log.keys.head_copy(ids[1])
    local_store.put(stale, local_store.get(log.keys.head_copy(ids[2])))
    outputs_before = {k: local_store.get(k) for k in local_store.list(f"runs/{RUN}/outputs/")}
    assert set(outputs_before) == {ENTRY_KEY, OBJECT_KEY, unrecorded}

    removed = CheckpointLog(local_store, RUN, trust=LogTrust()).gc(older_than=0)
    assert sorted(removed) == sorted([orphan, stale]), \
        "a checkpoint an output was made from keeps no unrecorded payload or stale head copy"
    assert {k: local_store.get(k) for k in local_store.list(f"runs/{RUN}/outputs/")} \
        == outputs_before

    report = CheckpointLog(local_store, RUN, trust=LogTrust()).verify(read_data=True)
    assert report.ok, report.problems
    assert report.orphans == []
    assert report.unrecorded_outputs == [unrecorded]
    assert (report.outputs, report.outputs_read, report.output_bytes) == (1, 1, len(data))


# untrusted entries ----------------------------------------------------------


def _raw_entry(ids: list[str], file_names: list[str], **changes: object) -> bytes:
    data = hdf5_bytes()
    obj = json.loads(output_entry(data, ids, file_names).to_json())
    obj.update(changes)
    return json.dumps(obj).encode()


PLANTED = {
    "not JSON": (lambda ids, names: b"\x00not json", "not JSON"),
    "a string size": (lambda ids, names: _raw_entry(ids, names, size="12"),
                      "field 'size' is str, expected int"),
    "another model's entry": (lambda ids, names: _raw_entry(ids, names, model="other"),
                              "it records model 'other', whose entry is not this key"),
    "a key in the payloads": (
        lambda ids, names: _raw_entry(ids, names, key=f"runs/{RUN}/payloads/{ids[0]}.full.zst"),
        "group 'payloads'"),
    "a newer format": (lambda ids, names: _raw_entry(ids, names, format=9),
                       "format 9 is newer"),
    "a non-string name": (lambda ids, names: _raw_entry(ids, names, names=[1, 2, 3]),
                          "field 'names' holds something that is not a string"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_malformed_output_entry_is_refused_naming_its_key(
        local_store: CheckpointStore, planted: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    log, ids, names = commit_run(local_store)
    make, why = PLANTED[planted]
    raw = make(ids, names)
    local_store.put(OBJECT_KEY, hdf5_bytes())
    assert local_store.put_if_absent(ENTRY_KEY, raw)

    reader = CheckpointLog(local_store, RUN, trust=LogTrust())
    with pytest.raises(OutputEntryError) as refused:
        reader.output(MODEL)
    assert f"{ENTRY_KEY}: malformed output entry: " in str(refused.value)
    assert why in str(refused.value)
    assert reader.outputs() == [] and why in reader.malformed[ENTRY_KEY]

    url = local_store.url
    code, out, err = cli(capsys, "list", url, RUN)
    assert code == 0 and "output " not in out
    assert f"warning: {ENTRY_KEY}: malformed output entry: " in err
    code, out, _ = cli(capsys, "verify", url, RUN)
    assert code == 1 and f"problem {ENTRY_KEY}: malformed output entry: " in out
    code, _, err = cli(capsys, "restore", url, RUN, str(tmp_path / "out"), "--outputs")
    assert code == 1 and ENTRY_KEY in err
    code, _, err = cli(capsys, "restore", url, RUN, str(tmp_path / "out"), MODEL, "--outputs")
    assert code == 1 and ENTRY_KEY in err

    with pytest.raises(OutputExistsError, match=f"{ENTRY_KEY} exists but cannot be used"):
        reader.record_output(output_entry(hdf5_bytes(), ids, names))
    assert local_store.get(ENTRY_KEY) == raw, "what is there is reported, never replaced"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[LogTrust, LogTrust]:
    """(this writer's trust: signs with and trusts its own key; another writer's)."""
    made = []
    for name in ("mine", "other"):
        (tmp_path / name).mkdir()
        made.append(generate_key_pair(tmp_path / name)[0])
    return LogTrust.from_files(made[0], None), LogTrust.from_files(made[1], None)


def test_a_signed_log_refuses_output_entries_no_trusted_key_signed(
        local_store: CheckpointStore, keys: tuple[LogTrust, LogTrust],
        capsys: pytest.CaptureFixture[str]) -> None:
    mine, other = keys
    log, ids, names = commit_run(local_store, trust=mine)
    data = hdf5_bytes()
    local_store.put(OBJECT_KEY, data)
    unsigned = CheckpointLog(local_store, RUN, trust=LogTrust())
    unsigned.record_output(output_entry(data, ids, names, job="planted"))

    reader = CheckpointLog(local_store, RUN, trust=mine)
    with pytest.raises(OutputEntryError,
                       match=f"{ENTRY_KEY}: output entry refused: not signed"):
        reader.output(MODEL)
    report = reader.verify()
    assert (ENTRY_KEY, "output entry refused: not signed (trusted log keys are configured)") \
        in report.problems
    with pytest.raises(OutputExistsError, match="cannot be used"):
        reader.record_output(output_entry(data, ids, names))

    local_store.delete(ENTRY_KEY)
    CheckpointLog(local_store, RUN, trust=other).record_output(output_entry(data, ids, names))
    with pytest.raises(OutputEntryError, match="which is not trusted"):
        reader.output(MODEL)

    local_store.delete(ENTRY_KEY)
    entry = log.record_output(output_entry(data, ids, names))
    assert reader.output(MODEL) == entry
    assert reader.verify(read_data=True).ok

    # A signed entry is bound to its run: copied into another, it is refused.
    local_store.put(f"runs/r2/outputs/{MODEL}.json", local_store.get(ENTRY_KEY))
    with pytest.raises(OutputEntryError, match="bad signature"):
        CheckpointLog(local_store, "r2", trust=mine).output(MODEL)
