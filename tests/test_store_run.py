"""A run whose checkpoints live in an object store, fetched into a local run directory.

Against real stores: a ``file://`` directory, moto's S3 HTTP server,
fake-gcs-server, and checkpoint logs committed with ``CheckpointLog.commit``.
The runs are slug-like HDF5 runs (:func:`chkq.demo.make_run`); a fetched
directory must be a run that ``find_run`` takes, with the checkpoints and
bytes of the run directory it came from.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chkq.consolidation.discovery import Checkpoint
from chkq.consolidation.run_scan import find_run
from chkq.demo import RunShape, make_run
from chkq.errors import (
    BadCheckpointError,
    CheckpointChangedError,
    CheckpointCorruptionError,
    CheckpointGapError,
    NoCheckpointsError,
    OutputExistsError,
    StoreNotFoundError,
    SymlinkInRunError,
)
from chkq.log import CheckpointLog
from chkq.staging import (
    SourceObject,
    StoreRun,
    default_output_key,
    delete_sources,
    fetch_objects,
    fetching,
    find_store_run,
)
from chkq.stores import CheckpointStore, LocalDirectoryStore, open_store
from chkq.stores.objects import ObjectVersion
from support.plugins.object_stores import BUCKET

SHAPES = {"flat": RunShape(checkpoints=3, trials=20),
          "threads": RunShape(checkpoints=2, writers=3, trials=20)}


def layout(checkpoints: list[Checkpoint], root: Path) -> list[tuple[int, list[str]]]:
    """What ``find_run`` says of a run: each checkpoint's number and files, relative."""
    return [(c.number, [f.relative_to(root).as_posix() for f in c.files]) for c in checkpoints]


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too), by relative name, with its bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file() or p.is_symlink()}


def make_source(kind: str, request: pytest.FixtureRequest, tmp_path: Path
                ) -> tuple[str, CheckpointStore, Callable[[str, bytes], None]]:
    """A fresh source of ``kind``: its URL, the store at that URL, and a raw writer.

    The raw writer puts any key under the URL, checked by nothing (as anyone
    who can write to the bucket can).
    """
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if kind == "file":
        root = tmp_path / "source"
        root.mkdir()

        def raw_file(key: str, data: bytes) -> None:
            path = root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        return root.as_uri() + "/", LocalDirectoryStore(root), raw_file
    if kind == "s3":
        request.getfixturevalue("s3_endpoint")
        from chkq.stores import S3Store

        s3 = S3Store(BUCKET, prefix)

        def raw_s3(key: str, data: bytes) -> None:
            s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=data)

        return f"s3://{BUCKET}/{prefix}/", s3, raw_s3
    request.getfixturevalue("gcs_endpoint")
    from chkq.stores import GCSStore

    gcs = GCSStore(BUCKET, prefix)

    def raw_gcs(key: str, data: bytes) -> None:
        gcs.client.bucket(BUCKET).blob(f"{prefix}/{key}").upload_from_string(data)

    return f"gs://{BUCKET}/{prefix}/", gcs, raw_gcs


def upload_run(run_dir: Path, put: Callable[[str, bytes], None]) -> list[str]:
    names = []
    for path in sorted(run_dir.rglob("*.h5")):
        name = path.relative_to(run_dir).as_posix()
        put(name, path.read_bytes())
        names.append(name)
    return names


@pytest.fixture(params=["file", "s3", "gcs"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each kind of source store in turn."""
    return str(request.param)


@pytest.fixture
def source(kind: str, request: pytest.FixtureRequest, tmp_path: Path
           ) -> tuple[str, CheckpointStore, Callable[[str, bytes], None]]:
    """A fresh source of each kind: its URL, its store, a raw writer."""
    return make_source(kind, request, tmp_path)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fetched_objects_are_the_run(source: tuple[str, CheckpointStore, Callable[..., None]],
                                     shape: str, tmp_path: Path) -> None:
    url, store, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES[shape])
    names = upload_run(original, put)
    put("notes.txt", b"not a checkpoint")
    put("run.h5", b"an old output")

    found = find_store_run(url, "run")
    assert found.names == names
    assert found.run_id is None
    into = tmp_path / "fetched"
    into.mkdir()
    written = fetch_objects(found, found.names, into)

    assert written == sum((original / n).stat().st_size for n in names)
    assert tree(into) == {n: (original / n).read_bytes() for n in names}
    assert layout(find_run(into, "run"), into) == layout(find_run(original, "run"), original)
    if isinstance(store, LocalDirectoryStore):
        # A directory on the scratch's filesystem: each file is the store's own, linked.
        assert all((into / n).samefile(store.root / n) for n in names)
    else:
        assert {stat.S_IMODE((into / n).stat().st_mode) for n in names} == {0o600}


def test_other_objects_are_ignored_as_discovery_ignores_files(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, _, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    data = (original / "run_chk00001" / "thread_0000.h5").read_bytes()
    others = ["run_chk00001.h5.bak", "other_chk00003.h5", "run_chk1.h5", "run_chk000001.h5",
              "run_chk00002/readme.txt", "run_chk00002/.hidden.h5", "run_chk00002/sub/deep.h5",
              "sub/run_chk00003.h5", "run_chk00003", "xrun_chk00003.h5"]
    for name in others:
        path = original / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    upload_run(original, put)
    for name in others:
        put(name, data)

    found = find_store_run(url, "run")
    into = tmp_path / "fetched"
    into.mkdir()
    fetch_objects(found, found.names, into)
    assert layout(find_run(into, "run"), into) == layout(find_run(original, "run"), original)
    assert found.names == [n for c in layout(find_run(original, "run"), original) for n in c[1]]


def test_a_file_checkpoint_wins_over_a_directory_of_the_same_number(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, _, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    (original / "run_chk00002.h5").write_bytes(
        (original / "run_chk00002" / "thread_0000.h5").read_bytes())
    upload_run(original, put)
    found = find_store_run(url, "run")
    assert [n for n in found.names if n.startswith("run_chk00002")] == ["run_chk00002.h5"]
    assert layout(find_run(original, "run"), original)[1] == (2, ["run_chk00002.h5"])


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_hostile_keys_never_leave_the_directory(kind: str, request: pytest.FixtureRequest,
                                                tmp_path: Path) -> None:
    url, _, put = make_source(kind, request, tmp_path)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    data = (original / "run_chk00001" / "thread_0000.h5").read_bytes()
    upload_run(original, put)
    hostile = ["run_chk00001/../../escape.h5", "run_chk00001/../run_chk00002/x.h5",
               "../run_chk00003.h5", "run_chk00001//double.h5", "/run_chk00003.h5",
               "run_chk00001/..", "run_chk00001.h5/inside.h5", "run_chk00002/./dot.h5",
               "run_chk00001/", "run_chk00002/../../../../tmp/escape.h5"]
    for key in hostile:
        put(key, data)
    sandbox = tmp_path / "sandbox"
    into = sandbox / "fetched"
    into.mkdir(parents=True)

    found = find_store_run(url, "run")
    fetch_objects(found, found.names, into)

    assert sorted(tree(sandbox)) == sorted(f"fetched/{n}" for n in upload_run(original,
                                                                            lambda *_: None))
    assert layout(find_run(into, "run"), into) == layout(find_run(original, "run"), original)
    assert not (tmp_path / "escape.h5").exists() and not Path("/tmp/escape.h5").exists()


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_checkpoint_file_no_directory_can_hold_is_refused(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url, _, put = make_source(kind, request, tmp_path)
    make_run(tmp_path / "original", "run", SHAPES["threads"])
    upload_run(tmp_path / "original", put)
    put("run_chk00001/back\\slash.h5", b"x")
    with pytest.raises(BadCheckpointError, match=r"run_chk00001/back\\\\slash\.h5"):
        find_store_run(url, "run")


def test_a_control_character_in_a_member_name_is_a_name_like_any(tmp_path: Path,
                                                                  s3_endpoint: str) -> None:
    url, _, put = make_source_s3(tmp_path)
    original = tmp_path / "original"
    make_run(original, "run", RunShape(checkpoints=1, writers=2, trials=5))
    os.rename(original / "run_chk00001" / "thread_0001.h5",
              original / "run_chk00001" / "thread\t0001.h5")
    upload_run(original, put)
    found = find_store_run(url, "run")
    into = tmp_path / "fetched"
    into.mkdir()
    fetch_objects(found, found.names, into)
    assert layout(find_run(into, "run"), into) == layout(find_run(original, "run"), original)


def make_source_s3(tmp_path: Path) -> tuple[str, CheckpointStore, Callable[[str, bytes], None]]:
    from chkq.stores import S3Store

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    s3 = S3Store(BUCKET, prefix)

    def raw(key: str, data: bytes) -> None:
        s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=data)

    return f"s3://{BUCKET}/{prefix}/", s3, raw


def test_nothing_found_names_the_url_and_the_model(
        source: tuple[str, CheckpointStore, Callable[..., None]]) -> None:
    url, _, put = source
    put("other_chk00001.h5", b"x")
    with pytest.raises(NoCheckpointsError, match=f"no checkpoints of model 'run' in '{url}'"):
        find_store_run(url, "run")


def test_a_directory_checkpoint_without_h5_files_is_refused(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, _, put = source
    make_run(tmp_path / "original", "run", SHAPES["flat"])
    upload_run(tmp_path / "original", put)
    put("run_chk00004/readme.txt", b"x")
    with pytest.raises(BadCheckpointError, match="run_chk00004/.* holds no .h5 file"):
        find_store_run(url, "run")


def test_a_gap_is_refused_unless_accepted(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, store, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    put("run_chk00001.h5", (original / "run_chk00001.h5").read_bytes())
    put("run_chk00003.h5", (original / "run_chk00003.h5").read_bytes())
    with pytest.raises(CheckpointGapError, match=f"00002 of model 'run' are missing in '{url}'"):
        find_store_run(url, "run", allow_gaps=False)
    found = find_store_run(url, "run", allow_gaps=True)
    assert found.names == ["run_chk00001.h5", "run_chk00003.h5"]
    assert "consolidated without them" in found.warnings[0]
    left = find_store_run(url, "run")
    assert left.names == found.names and left.warnings == ()
    into = tmp_path / "fetched"
    into.mkdir()
    fetch_objects(left, left.names, into)
    with pytest.raises(CheckpointGapError, match="00002"):
        find_run(into, "run")


@pytest.mark.integration
@pytest.mark.parametrize("url", ["s3://no-such-bucket-chkq/run/", "gs://no-such-bucket-chkq/run/"])
def test_a_missing_bucket_is_named(url: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("s3_endpoint" if url.startswith("s3") else "gcs_endpoint")
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-chkq"):
        find_store_run(url, "run")


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match=str(tmp_path / "nowhere")):
        find_store_run((tmp_path / "nowhere").as_uri(), "run")


def test_a_link_in_a_file_store_is_refused_as_in_a_run_directory(tmp_path: Path) -> None:
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    outside = tmp_path / "outside.h5"
    os.rename(original / "run_chk00003.h5", outside)
    os.symlink(outside, original / "run_chk00003.h5")
    with pytest.raises(BadCheckpointError, match="symbolic link"):
        find_store_run(original.as_uri(), "run")


def flipped(data: bytes) -> bytes:
    """The same number of bytes, one of them other."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def test_an_object_replaced_before_the_fetch_is_refused_and_leaves_nothing(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, _, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    upload_run(original, put)
    found = find_store_run(url, "run")
    replaced = "run_chk00002/thread_0001.h5"
    put(replaced, flipped((original / replaced).read_bytes()))
    into = tmp_path / "fetched"
    into.mkdir()

    with pytest.raises(CheckpointChangedError, match="changed since the job was planned") as e:
        fetch_objects(found, found.names, into)
    assert found.url_of(replaced) in str(e.value)
    assert list(into.iterdir()) == []


def test_a_local_object_rewritten_in_place_is_refused(tmp_path: Path) -> None:
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    found = find_store_run(original.as_uri(), "run")
    path = original / "run_chk00001.h5"
    with path.open("r+b") as fh:
        fh.seek(100)
        fh.write(b"\0")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    into = tmp_path / "fetched"
    into.mkdir()
    with pytest.raises(CheckpointChangedError, match="run_chk00001.h5"):
        fetch_objects(found, found.names, into)
    assert tree(into) == {}


@pytest.mark.parametrize("kind", ["s3", "gcs", "file"])
def test_an_object_replaced_during_its_fetch_is_refused(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, store, put = make_source(kind, request, tmp_path)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    upload_run(original, put)
    found = find_store_run(url, "run")
    victim = "run_chk00002.h5"
    monkeypatch.setattr(fetching, "FETCH_BYTES", 4096)
    real = type(store).read_pinned
    pieces: list[int] = []

    def replacing(self: CheckpointStore, key: str, pinned: ObjectVersion, piece: int
                  ) -> Iterator[bytes | None]:
        for data in real(self, key, pinned, piece):
            if key.endswith(victim):
                pieces.append(1)
                if len(pieces) == 2:
                    put(victim, flipped((original / victim).read_bytes()))
            yield data

    monkeypatch.setattr(type(store), "read_pinned", replacing)

    def another_filesystem(*args: object) -> bool:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(LocalDirectoryStore, "link_to", another_filesystem)
    into = tmp_path / "fetched"
    into.mkdir()
    if kind == "s3":
        # One GET streams the object: S3 goes on sending the version it began with, so
        # the fetch is either refused or the pinned bytes, never a mix of the two.
        try:
            fetch_objects(found, found.names, into)
        except CheckpointChangedError as exc:
            assert victim in str(exc)
            assert list(into.iterdir()) == []
        else:
            assert (into / victim).read_bytes() == (original / victim).read_bytes()
    else:
        with pytest.raises(CheckpointChangedError, match=victim):
            fetch_objects(found, found.names, into)
        assert list(into.iterdir()) == []
    assert len(pieces) >= 2


def test_a_local_object_replaced_before_it_is_linked_is_refused(tmp_path: Path) -> None:
    url, _, put = make_source("file", None, tmp_path)  # type: ignore[arg-type]
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    upload_run(original, put)
    found = find_store_run(url, "run")
    victim = "run_chk00002.h5"
    put(victim, flipped((original / victim).read_bytes()))
    into = tmp_path / "fetched"
    into.mkdir()
    with pytest.raises(CheckpointChangedError, match=victim):
        fetch_objects(found, found.names, into)
    assert list(into.iterdir()) == []


def test_a_local_store_on_another_filesystem_is_copied(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url, store, put = make_source("file", None, tmp_path)  # type: ignore[arg-type]
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    names = upload_run(original, put)

    def another_filesystem(*args: object) -> bool:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(LocalDirectoryStore, "link_to", another_filesystem)
    found = find_store_run(url, "run")
    into = tmp_path / "fetched"
    into.mkdir()
    fetch_objects(found, found.names, into)
    assert tree(into) == {n: (original / n).read_bytes() for n in names}
    assert not any((into / n).samefile(original / n) for n in names)
    assert {stat.S_IMODE((into / n).stat().st_mode) for n in names} == {0o600}


def test_a_fetch_never_overwrites_nor_follows_a_link(tmp_path: Path) -> None:
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    found = find_store_run(original.as_uri(), "run")
    into = tmp_path / "fetched"
    into.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, into / "run_chk00001")
    with pytest.raises(SymlinkInRunError, match="run_chk00001"):
        fetch_objects(found, found.names, into)
    assert list(elsewhere.iterdir()) == []
    os.unlink(into / "run_chk00001")
    (into / "run_chk00001").mkdir()
    (into / "run_chk00001" / "thread_0001.h5").write_bytes(b"mine")
    with pytest.raises(OutputExistsError, match="thread_0001.h5"):
        fetch_objects(found, found.names, into)
    assert (into / "run_chk00001" / "thread_0001.h5").read_bytes() == b"mine"
    same_size = flipped((original / "run_chk00001" / "thread_0001.h5").read_bytes())
    (into / "run_chk00001" / "thread_0001.h5").write_bytes(same_size)
    with pytest.raises(OutputExistsError, match="thread_0001.h5"):
        fetch_objects(found, found.names, into)
    assert (into / "run_chk00001" / "thread_0001.h5").read_bytes() == same_size
    assert sorted(tree(into)) == ["run_chk00001/thread_0001.h5"]


@pytest.mark.parametrize("log_run", [False, True])
def test_a_fetch_delivered_again_keeps_what_is_there(log_run: bool, tmp_path: Path,
                                                      s3_endpoint: str) -> None:
    url, store, put = make_source_s3(tmp_path)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    if log_run:
        commit_run(CheckpointLog(store, "r1"), original)
    else:
        upload_run(original, put)
    found = find_store_run(url, "run", run="r1" if log_run else None)
    into = tmp_path / "fetched"
    into.mkdir()
    first = found.names[:2]
    assert fetch_objects(found, first, into) == sum((original / n).stat().st_size
                                                   for n in first)
    before = {n: (into / n).stat().st_ino for n in first}
    rest = sum((original / n).stat().st_size for n in found.names[2:])
    assert fetch_objects(found, found.names, into) == rest
    assert {n: (into / n).stat().st_ino for n in first} == before, "kept, not rewritten"
    assert tree(into) == {n: (original / n).read_bytes() for n in found.names}


@pytest.mark.parametrize("theirs", ["pinned", "other bytes"])
def test_a_fetch_that_another_delivery_finishes_first_keeps_its_file_if_it_is_the_object(
        theirs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted worker gets its unfinished fetch at once, while the killed worker's pool
    process may still be fetching the same object: the second to link keeps the first's
    file when it holds the pinned bytes, and refuses (changing nothing) when not."""
    url, store, put = make_source("file", None, tmp_path)  # type: ignore[arg-type]
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    names = upload_run(original, put)
    monkeypatch.setattr(LocalDirectoryStore, "link_to",
                        lambda *args: (_ for _ in ()).throw(OSError(errno.EXDEV, "no link")))
    found = find_store_run(url, "run")
    into = tmp_path / "fetched"
    into.mkdir()
    target = into / names[0]
    real_copy = fetching._copy_plain

    def raced(store: CheckpointStore, run: StoreRun, obj: SourceObject, fd: int) -> str:
        if obj.name == names[0]:
            data = (original / names[0]).read_bytes()
            target.write_bytes(data if theirs == "pinned" else flipped(data))
        return real_copy(store, run, obj, fd)

    monkeypatch.setattr(fetching, "_copy_plain", raced)
    if theirs == "pinned":
        fetch_objects(found, found.names, into)
        assert tree(into) == {n: (original / n).read_bytes() for n in names}
    else:
        with pytest.raises(OutputExistsError, match=names[0]):
            fetch_objects(found, found.names, into)
        assert tree(into) == {names[0]: flipped((original / names[0]).read_bytes())}


def test_a_name_not_of_the_run_is_refused(tmp_path: Path) -> None:
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    found = find_store_run(original.as_uri(), "run")
    into = tmp_path / "fetched"
    into.mkdir()
    forged = StoreRun(found.source, found.store_url, found.prefix, None, "run",
                      found.objects + (found.objects[0].__class__(
                          "../escape.h5", "run_chk00001.h5", 1, "x"),))
    with pytest.raises(ValueError, match="escape"):
        fetch_objects(forged, ["../escape.h5"], into)
    assert not (tmp_path / "escape.h5").exists()


# ------------------------------------------------------------------------------ logs


def commit_run(log: CheckpointLog, run_dir: Path, model: str = "run", mode: int = 0o640
               ) -> dict[str, str]:
    """Commit every ``.h5`` file of ``run_dir`` under its name; name -> checkpoint id."""
    ids = {}
    parent = None
    for path in sorted(run_dir.rglob("*.h5")):
        name = path.relative_to(run_dir).as_posix()
        parent = log.commit(path.read_bytes(), parent, name=name, model=model, mode=mode)
        ids[name] = parent
    return ids


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_log_run_is_fetched_as_its_run_directory(
        kind: str, shape: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url, store, _ = make_source(kind, request, tmp_path)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES[shape])
    ids = commit_run(CheckpointLog(store, "r1"), original)
    CheckpointLog(store, "r1").commit(b"notes", name="notes.txt", model="run")

    found = find_store_run(url, "run", run="r1")
    assert found.names == sorted(ids)
    assert [o.version for o in found.objects] == [ids[n] for n in sorted(ids)]
    into = tmp_path / "fetched"
    into.mkdir()
    fetch_objects(found, found.names, into)
    assert tree(into) == {n: (original / n).read_bytes() for n in ids}
    assert layout(find_run(into, "run"), into) == layout(find_run(original, "run"), original)
    assert {stat.S_IMODE((into / n).stat().st_mode) for n in ids} == {0o640}
    assert default_output_key(found) == "runs/r1/outputs/run.h5"


def test_a_corrupt_log_payload_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "log"
    store = LocalDirectoryStore(root)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    log = CheckpointLog(store, "r1", max_chain=0)
    ids = commit_run(log, original)
    found = find_store_run(root.as_uri(), "run", run="r1")
    victim = "run_chk00002.h5"
    payload = log.record(ids[victim]).payload
    (root / payload).write_bytes(flipped((root / payload).read_bytes()))
    into = tmp_path / "fetched"
    into.mkdir()
    with pytest.raises(CheckpointCorruptionError, match=ids[victim]) as e:
        fetch_objects(found, found.names, into)
    assert victim in str(e.value)
    assert list(into.iterdir()) == []


def test_conflicting_log_entries_are_refused_naming_them(tmp_path: Path) -> None:
    root = tmp_path / "log"
    log = CheckpointLog(LocalDirectoryStore(root), "r1")
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    commit_run(log, original)
    log.commit(b"planted", name="run_chk00002.h5", model="run")
    with pytest.raises(BadCheckpointError, match="conflicting.*run_chk00002.h5"):
        find_store_run(root.as_uri(), "run", run="r1")


def test_a_log_without_the_model_names_the_url(tmp_path: Path) -> None:
    root = tmp_path / "log"
    CheckpointLog(LocalDirectoryStore(root), "r1").commit(b"x", name="other_chk00001.h5")
    with pytest.raises(NoCheckpointsError, match=r"model 'run' in .*log run 'r1'"):
        find_store_run(root.as_uri(), "run", run="r1")
    with pytest.raises(NoCheckpointsError, match=r"model 'run' in .*log run 'r2'"):
        find_store_run(root.as_uri(), "run", run="r2")


# ------------------------------------------------------------------------------ cleanup


def test_delete_sources_deletes_only_what_it_pinned(
        source: tuple[str, CheckpointStore, Callable[..., None]], tmp_path: Path) -> None:
    url, _, put = source
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    names = upload_run(original, put)
    put("notes.txt", b"kept")
    found = find_store_run(url, "run")
    replaced = "run_chk00003.h5"
    put(replaced, flipped((original / replaced).read_bytes()))
    put("run_chk00004.h5", b"written after the listing")

    warnings = delete_sources(found)

    assert len(warnings) == 1 and found.url_of(replaced) in warnings[0]
    store = open_store(found.store_url)
    left = sorted(k[len(found.prefix):] for k in store.list(found.prefix))
    assert left == ["notes.txt", replaced, "run_chk00004.h5"]
    assert set(names) - {replaced} <= set(found.names)


def test_delete_sources_of_a_log_removes_the_names_not_the_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "log"
    store = LocalDirectoryStore(root)
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["flat"])
    log = CheckpointLog(store, "r1")
    ids = commit_run(log, original)
    shared = original / "run_chk00001.h5"
    log.commit(shared.read_bytes(), name="keep/run_chk00001.h5", model="other")
    payloads_before = sorted(store.list("runs/r1/payloads/"))
    found = find_store_run(root.as_uri(), "run", run="r1")

    assert delete_sources(found) == []

    fresh = CheckpointLog(store, "r1")
    assert fresh.files("run") == {}
    assert list(fresh.files("other")) == ["keep/run_chk00001.h5"]
    assert sorted(store.list("runs/r1/payloads/")) == payloads_before
    for name, checkpoint in ids.items():
        assert fresh.load(checkpoint) == (original / name).read_bytes()
    with pytest.raises(NoCheckpointsError):
        find_store_run(root.as_uri(), "run", run="r1")


def test_default_output_key_of_plain_objects(tmp_path: Path, s3_endpoint: str) -> None:
    url, _, put = make_source_s3(tmp_path)
    make_run(tmp_path / "original", "run", SHAPES["flat"])
    upload_run(tmp_path / "original", put)
    found = find_store_run(url, "run")
    assert found.store_url == f"s3://{BUCKET}"
    assert default_output_key(found) == f"{found.prefix}run.h5"
    assert found.url_of("run_chk00001.h5") == f"{url}run_chk00001.h5"


def test_a_local_checkpoint_file_the_store_cannot_read_is_refused(tmp_path: Path) -> None:
    original = tmp_path / "original"
    make_run(original, "run", SHAPES["threads"])
    os.rename(original / "run_chk00002" / "thread_0001.h5",
              original / "run_chk00002" / "thread\\0001.h5")
    with pytest.raises(BadCheckpointError, match=r"thread\\\\0001\.h5"):
        find_store_run(original.as_uri(), "run")
