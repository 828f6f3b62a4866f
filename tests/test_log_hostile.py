"""Hostile store content: decompression bombs, objects planted to abort a whole run, and
what restored and pulled files may be (their modes, what they may replace).

Bombs are real: a zstd frame of about 32 KiB that expands to 1 GiB, planted as a head copy
or as the payload of an added record. The commands run as processes of their own and their
peak resident memory (``ru_maxrss``) is measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from chkq.log import CheckpointLog, CheckpointRecord, NameEntry
from chkq.log.delta import zstd
from chkq.log.signing import LogTrust
from chkq.stores import CheckpointStore, LocalDirectoryStore
from chkq.stores.memory import MemoryStore
from chkq.stores.url import open_store
from chkq.workers.cli import main as chkq_main
from chkq.workers.commit_client import record_of, submit_commit
from support.plugins.cluster import WorkerProcess
from support.plugins.object_stores import make_store

GiB = 1 << 30
MiB = 1 << 20
RSS_BOUND = 400 * MiB
"""Far below the 1 GiB a bomb expands to; the commands themselves need ~100 MiB."""
TIMEOUT = 300


def bomb(size: int = GiB) -> bytes:
    """A zstd frame that decompresses to ``size`` zero bytes (made in bounded memory)."""
    compressor = zstd.ZstdCompressor()
    block = bytes(16 * MiB)
    parts = [compressor.compress(block) for _ in range(size // len(block))]
    parts.append(compressor.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def gib_bomb() -> bytes:
    frame = bomb()
    assert len(frame) < 64 * 1024
    return frame


def chkq_measured(*args: str, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``chkq ARGS`` in a process of its own; its result and its peak RSS in bytes."""
    wrapper = ("import resource, subprocess, sys\n"
               "done = subprocess.run(sys.argv[1:])\n"
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
               "print(f'PEAK {peak} {done.returncode}', file=sys.stderr)\n")
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    environment.update(env or {})
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m",
                           "chkq.workers.cli", *args], capture_output=True, text=True,
                          env=environment, timeout=TIMEOUT)
    peak_line = done.stderr.strip().splitlines()[-1].split()
    assert peak_line[0] == "PEAK", done.stderr
    done.returncode = int(peak_line[2])
    return done, int(peak_line[1]) * 1024


def delta_chain(store: CheckpointStore) -> tuple[CheckpointLog, list[str], list[bytes]]:
    log = CheckpointLog(store, "run", trust=LogTrust())
    first = os.urandom(300_000)
    second = bytearray(first)
    second[1000:1100] = os.urandom(100)
    a = log.commit(first, name="m_chk00001.h5")
    b = log.commit(bytes(second), a, name="m_chk00002.h5")
    assert log.record(b).kind == "delta" and store.exists(log.keys.head_copy(b))
    return log, [a, b], [first, bytes(second)]


def plant_record(store: CheckpointStore, run: str, payload: bytes, full_size: int,
                 name: str) -> str:
    """An added record (with payload and name entry) declaring ``full_size`` bytes."""
    log = CheckpointLog(store, run, trust=LogTrust())
    ident = hashlib.sha256(name.encode()).hexdigest()
    key = log.keys.payload(ident, "full", None)
    record = CheckpointRecord(id=ident, parent=None, kind="full", base=None, depth=0,
                              payload=key, stored_size=len(payload), full_size=full_size)
    store.put(key, payload)
    store.put(log.keys.record(ident), record.to_json())
    entry = NameEntry(name=name, id=ident)
    store.put(log.keys.entry(entry.digest()), entry.to_json())
    return ident


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
def test_a_head_copy_bomb_is_refused_in_bounded_memory_and_the_chain_serves(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path, gib_bomb: bytes) -> None:
    store = make_store(kind, request, tmp_path)
    log, ids, data = delta_chain(store)
    store.put(log.keys.head_copy(ids[1]), gib_bomb)
    url = store.url

    verify, peak = chkq_measured("log", "verify", url, "run")
    assert verify.returncode == 1 and peak < RSS_BOUND, (peak, verify.stdout)
    assert f"problem {log.keys.head_copy(ids[1])}: head copy of checkpoint {ids[1]} does not " \
           "decode: payload expands beyond its declared 300000 bytes" in verify.stdout

    target = tmp_path / "pulled.bin"
    pull, peak = chkq_measured("log", "pull", url, "run", ids[1], "-o", str(target))
    assert pull.returncode == 0 and peak < RSS_BOUND, (peak, pull.stderr)
    assert target.read_bytes() == data[1]

    restore, peak = chkq_measured("log", "restore", url, "run", str(tmp_path / "out"))
    assert restore.returncode == 0 and peak < RSS_BOUND, (peak, restore.stderr)
    assert (tmp_path / "out" / "m_chk00002.h5").read_bytes() == data[1]

    if kind == "file":
        third = tmp_path / "m_chk00003.h5"
        third.write_bytes(data[1][:-10] + b"0123456789")
        commit, peak = chkq_measured("log", "commit", url, "run", str(third),
                                     "--parent", ids[1][:12])
        assert commit.returncode == 0 and peak < RSS_BOUND, (peak, commit.stderr)
        assert CheckpointLog(store, "run").record(commit.stdout.strip()).parent == ids[1]


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
def test_an_added_record_whose_payload_is_a_bomb_fails_alone(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path, gib_bomb: bytes) -> None:
    store = make_store(kind, request, tmp_path)
    log, ids, data = delta_chain(store)
    planted = plant_record(store, "run", gib_bomb, 4096, "evil.h5")

    restore, peak = chkq_measured("log", "restore", store.url, "run", str(tmp_path / "out"))
    assert restore.returncode == 1 and peak < RSS_BOUND, (peak, restore.stderr)
    assert (tmp_path / "out" / "m_chk00001.h5").read_bytes() == data[0]
    assert (tmp_path / "out" / "m_chk00002.h5").read_bytes() == data[1]
    assert not (tmp_path / "out" / "evil.h5").exists()
    assert f"not restored: evil.h5: checkpoint {planted}" in restore.stderr
    assert "payload expands beyond its declared 4096 bytes" in restore.stderr

    verify, peak = chkq_measured("log", "verify", store.url, "run", "--read-data")
    assert verify.returncode == 1 and peak < RSS_BOUND, (peak, verify.stdout)
    assert f"problem {log.keys.payload(planted, 'full', None)}" in verify.stdout
    assert "2 rebuilt" in verify.stdout


@pytest.mark.cluster
def test_the_size_cap_refuses_a_record_that_declares_more_and_a_commit_of_more(
        tmp_path: Path, gib_bomb: bytes) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    planted = plant_record(store, "run", gib_bomb, GiB, "evil.h5")
    cap = {"CHKQ_LOG_MAX_CHECKPOINT_BYTES": str(64 * MiB)}

    restore, peak = chkq_measured("log", "restore", store.url, "run", str(tmp_path / "out"),
                                  env=cap)
    assert restore.returncode == 1 and peak < RSS_BOUND, (peak, restore.stderr)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "m_chk00001.h5", "m_chk00002.h5"]
    assert "1 file(s) not restored (first: evil.h5: checkpoint" in restore.stderr
    assert (f"warning: {log.keys.record(planted)}: record refused: it declares {GiB} bytes, "
            f"above the {64 * MiB}-byte limit (CHKQ_LOG_MAX_CHECKPOINT_BYTES)") in restore.stderr

    big = tmp_path / "big.bin"
    big.write_bytes(bytes(2 * MiB))
    commit, _ = chkq_measured("log", "commit", store.url, "run", str(big),
                              env={"CHKQ_LOG_MAX_CHECKPOINT_BYTES": str(MiB)})
    assert commit.returncode == 1
    assert f"checkpoint of {2 * MiB} bytes is larger than the {MiB}-byte limit" in commit.stderr


# one planted object must not abort the run ------------------------------------------------


def run_commands(store: CheckpointStore, tmp_path: Path
                 ) -> dict[str, subprocess.CompletedProcess[str]]:
    env = {k: v for k, v in os.environ.items() if k != "CHKQ_BROKER_URL"}
    results = {}
    for name, args in {
        "list": ["log", "list", store.url, "run"],
        "verify": ["log", "verify", store.url, "run"],
        "restore": ["log", "restore", store.url, "run", str(tmp_path / "out")],
        "gc": ["log", "gc", store.url, "run"],
    }.items():
        results[name] = subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args],
                                       capture_output=True, text=True, env=env,
                                       timeout=TIMEOUT)
    return results


def assert_run_still_served(results: dict[str, subprocess.CompletedProcess[str]],
                            ids: list[str], tmp_path: Path, data: list[bytes]) -> None:
    for name, done in results.items():
        assert "Traceback" not in done.stderr, (name, done.stderr)
    assert results["list"].returncode == 0, results["list"].stderr
    assert [line.split()[0] for line in results["list"].stdout.splitlines()] == ids
    assert results["gc"].returncode == 0, results["gc"].stderr
    assert (tmp_path / "out" / "m_chk00001.h5").read_bytes() == data[0]
    assert (tmp_path / "out" / "m_chk00002.h5").read_bytes() == data[1]


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["file", "memory"])
def test_a_deeply_nested_json_record_is_reported_and_the_rest_served(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if kind == "memory":
        store: CheckpointStore = MemoryStore(f"nested-{tmp_path.name}")
    else:
        store = make_store(kind, request, tmp_path)
    log, ids, data = delta_chain(store)
    deep = "f" * 64
    store.put(log.keys.record(deep), b"[" * 200_000 + b"]" * 200_000)
    if kind == "memory":
        reader = CheckpointLog(store, "run")
        assert [r.id for r in reader.manifest()] == ids
        assert reader.malformed == {log.keys.record(deep): "malformed record: record is "
                                    "nested too deeply"}
        report = CheckpointLog(store, "run").verify()
        assert report.problems == [(log.keys.record(deep),
                                    "malformed record: record is nested too deeply")]
        return
    results = run_commands(store, tmp_path)
    assert_run_still_served(results, ids, tmp_path, data)
    warning = f"{log.keys.record(deep)}: malformed record: record is nested too deeply"
    assert f"warning: {warning}" in results["list"].stderr
    assert f"problem {warning}" in results["verify"].stdout
    assert results["verify"].returncode == 1


def nest(top: Path, depth: int) -> None:
    """``top/d/d/.../d/x.json``, ``depth`` directories deep (made through descriptors)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    with open(os.open("x.json", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as fh:
        fh.write("{}")
    os.close(fd)


def unnest(top: Path) -> None:
    """Remove what :func:`nest` made without recursion (shutil.rmtree cannot)."""
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    while fds:
        fd = fds.pop()
        for name in os.listdir(fd):
            if os.path.isdir(f"/proc/self/fd/{fd}/{name}"):
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        os.close(fd)


@pytest.mark.cluster
def test_thousands_of_nested_directories_under_records_are_skipped_with_a_warning(
        tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    records = store.root / "runs" / "run" / "records"
    nest(records, 1200)
    try:
        (records / "d" / "stray.json").write_text("{}")
        results = run_commands(store, tmp_path)
    finally:
        unnest(records / "d")
        (records / "d").rmdir()
    assert_run_still_served(results, ids, tmp_path, data)
    assert results["restore"].returncode == 0, results["restore"].stderr
    assert "more than 32 directories deep; not listed" in results["list"].stderr
    assert ("problem runs/run/records/d/stray.json: not a record: records are not kept in "
            "subdirectories") in results["verify"].stdout


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["file", "memory"])
def test_a_name_entry_with_a_component_too_long_for_a_file_system_is_malformed(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store = MemoryStore(f"long-{tmp_path.name}") if kind == "memory" \
        else make_store(kind, request, tmp_path)
    log, ids, data = delta_chain(store)
    entry = {"format": 2, "name": "x" * 300 + ".h5", "id": ids[0], "model": None,
             "step": None, "label": None, "meta": {}, "created": 1.0}
    digest = hashlib.sha256(json.dumps({k: entry[k] for k in (
        "name", "id", "model", "step", "label", "meta")}, sort_keys=True).encode()).hexdigest()
    key = f"runs/run/names/{digest}.json"
    store.put(key, json.dumps(entry).encode())
    reader = CheckpointLog(store, "run")
    assert sorted(reader.files()) == ["m_chk00001.h5", "m_chk00002.h5"]
    assert "a component is longer than 255 bytes" in reader.malformed[key]
    if kind == "file":
        results = run_commands(store, tmp_path)
        assert_run_still_served(results, ids, tmp_path, data)
        assert results["restore"].returncode == 0, results["restore"].stderr
        assert f"warning: {key}: malformed name entry: invalid checkpoint name" in \
            results["restore"].stderr


@pytest.mark.cluster
def test_a_symlinked_names_directory_is_reported_not_followed(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    names = store.root / "runs" / "run" / "names"
    elsewhere = tmp_path / "elsewhere"
    names.rename(elsewhere)
    names.symlink_to(elsewhere)
    entries = sorted(os.listdir(elsewhere))
    results = run_commands(store, tmp_path)
    for name, done in results.items():
        assert "Traceback" not in done.stderr, (name, done.stderr)
    assert results["list"].returncode == 0
    assert [line.split()[0] for line in results["list"].stdout.splitlines()] == ids
    assert "warning: runs/run/names/: not listed:" in results["list"].stderr
    assert "is a symbolic link" in results["list"].stderr
    assert results["verify"].returncode == 1
    assert "problem runs/run/names/: not listed:" in results["verify"].stdout
    assert results["restore"].returncode == 1
    assert "warning: runs/run/names/: not listed" in results["restore"].stderr
    assert "no named files to restore" in results["restore"].stderr
    assert results["gc"].returncode == 0
    assert names.is_symlink() and sorted(os.listdir(elsewhere)) == entries
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.cluster
def test_names_with_control_characters_are_printed_escaped(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log = CheckpointLog(store, "run")
    name = "m_chk00001/\x1b[2J\x1b]0;owned\x07thread\u202e\n.h5"
    ident = log.commit(b"bytes" * 100, name=name)
    log.commit(b"other" * 100, name=name)  # a conflict: the name is printed by restore and verify
    results = run_commands(store, tmp_path)
    for done in results.values():
        for text in (done.stdout, done.stderr):
            assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    listed = results["list"].stdout
    assert f"{ident} " in listed
    assert "name=m_chk00001/\\x1b[2J\\x1b]0;owned\\x07thread\\u202e\\n.h5" in listed
    assert "\\x1b[2J" in results["restore"].stderr
    assert "conflict" in results["verify"].stdout


# restored and pulled files ---------------------------------------------------------------


def test_restore_and_pull_keep_the_committed_modes_without_setuid(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    run = tmp_path / "run"
    run.mkdir()
    modes = {"m_chk00001.h5": 0o600, "m_chk00002.h5": 0o640, "m_chk00003.h5": 0o4755}
    for number, (name, mode) in enumerate(modes.items()):
        (run / name).write_bytes(bytes([number]) * 1000)
        (run / name).chmod(mode)
        assert chkq_main(["log", "commit", store.url, "r1", str(run / name)]) == 0
    old = CheckpointLog(store, "r1").commit(b"from an old log" * 10, name="m_chk00004.h5")
    out = tmp_path / "out"
    assert chkq_main(["log", "restore", store.url, "r1", str(out)]) == 0
    got = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert got == {"m_chk00001.h5": 0o600, "m_chk00002.h5": 0o640, "m_chk00003.h5": 0o755,
                   "m_chk00004.h5": 0o600}
    second = CheckpointLog(store, "r1").files()["m_chk00002.h5"].id
    assert chkq_main(["log", "pull", store.url, "r1", second, "-o", str(tmp_path / "p")]) == 0
    assert stat.S_IMODE((tmp_path / "p").stat().st_mode) == 0o640
    assert chkq_main(["log", "pull", store.url, "r1", old, "-o", str(tmp_path / "q")]) == 0
    assert stat.S_IMODE((tmp_path / "q").stat().st_mode) == 0o600


def test_pull_refuses_to_replace_a_different_existing_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(f"file://{tmp_path / 'store'}")
    ident = CheckpointLog(store, "r1").commit(b"checkpoint bytes")
    target = tmp_path / "mine.h5"
    target.write_bytes(b"a different file of mine")
    argv = ["log", "pull", store.url, "r1", ident[:8], "-o", str(target)]
    assert chkq_main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {str(target)!r} exists with other content; not overwritten "
                   "(--force replaces it)\n")
    assert target.read_bytes() == b"a different file of mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".chkq-")] == []

    target.write_bytes(b"checkpoint bytes")
    before = target.stat()
    assert chkq_main(argv) == 0
    assert capsys.readouterr().out == f"{target}\n"
    assert target.stat().st_ino == before.st_ino  # kept, not rewritten

    target.write_bytes(b"another")
    assert chkq_main([*argv, "--force"]) == 0
    assert target.read_bytes() == b"checkpoint bytes"


def peak_rss(pid: int) -> int:
    """A process's peak resident memory so far (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_the_commit_task_on_a_parent_whose_head_copy_is_a_bomb_stays_bounded(
        tmp_path: Path, worker: WorkerProcess, gib_bomb: bytes) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    store.put(log.keys.head_copy(ids[1]), gib_bomb)
    third = tmp_path / "m_chk00003.h5"
    third.write_bytes(data[1][:-10] + b"0123456789")
    done = record_of(submit_commit(store.url, "run", third, parent=ids[1],
                                   name="m_chk00003.h5").get(timeout=TIMEOUT))
    assert done.parent == ids[1] and done.kind == "delta"
    assert CheckpointLog(store, "run").load(done.id) == third.read_bytes()
    peaks = [peak_rss(pid) for pid in worker.child_pids()]
    assert peaks and max(peaks) < RSS_BOUND, peaks


def test_get_at_most_reads_a_bounded_prefix_on_every_store(store: CheckpointStore) -> None:
    store.put("a/empty", b"")
    store.put("a/ten", b"0123456789")
    assert store.get_at_most("a/empty", 0) == b""
    assert store.get_at_most("a/empty", 5) == b""
    assert store.get_at_most("a/ten", 0) == b"0"
    assert store.get_at_most("a/ten", 4) == b"01234"
    assert store.get_at_most("a/ten", 10) == b"0123456789"
    assert store.get_at_most("a/ten", 100) == b"0123456789"
    with pytest.raises(KeyError):
        store.get_at_most("a/missing", 10)


@pytest.mark.cluster
def test_huge_planted_records_and_payloads_are_refused_without_being_read(
        tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    huge = "e" * 64
    with open(store.root / "runs" / "run" / "records" / f"{huge}.json", "wb") as fh:
        fh.truncate(2 * GiB)  # sparse: costs no disk, reads as 2 GiB of zeros
    padded = plant_record(store, "run", b"x", 1, "padded.h5")
    with open(store.root / log.keys.payload(padded, "full", None), "r+b") as fh:
        fh.truncate(2 * GiB)

    restore, peak = chkq_measured("log", "restore", store.url, "run", str(tmp_path / "out"))
    assert peak < RSS_BOUND, (peak, restore.stderr)
    assert restore.returncode == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "m_chk00001.h5", "m_chk00002.h5"]
    assert (f"warning: {log.keys.record(huge)}: malformed record: record of {MiB + 1} bytes "
            f"is larger than {MiB}") in restore.stderr
    assert "not restored: padded.h5" in restore.stderr
    assert "payload is larger than its record's 1 bytes" in restore.stderr

    verify, peak = chkq_measured("log", "verify", store.url, "run", "--read-data")
    assert verify.returncode == 1 and peak < RSS_BOUND, (peak, verify.stdout)


@pytest.mark.cluster
def test_gc_deletes_a_huge_planted_orphan_without_reading_it(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    log, ids, data = delta_chain(store)
    orphan = store.root / log.keys.payload("c" * 64, "full", None)
    with open(orphan, "wb") as fh:
        fh.truncate(2 * GiB)
    old = os.stat(orphan).st_mtime - 2 * 86400
    os.utime(orphan, (old, old))
    gc, peak = chkq_measured("log", "gc", store.url, "run",
                             env={"CHKQ_LOG_MAX_CHECKPOINT_BYTES": str(64 * MiB)})
    assert gc.returncode == 0 and peak < RSS_BOUND, (peak, gc.stderr)
    assert gc.stdout.split() == [log.keys.payload("c" * 64, "full", None)]
    assert not orphan.exists()
    assert CheckpointLog(store, "run").load(ids[1]) == data[1]
