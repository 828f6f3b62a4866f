"""A contract suite for checkpoint stores: subclass :class:`StoreTests` to test a store.

Every guarantee :class:`~chkq.stores.base.CheckpointStore` documents is a
test here, so that a store written outside chkq can be checked against the
same promises as the built-in ones before a checkpoint log trusts it::

    import pytest
    from chkq.stores.testing import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path / "objects")   # fresh and empty for each test

Each test receives the ``store`` fixture, which must give a new, empty
store; :meth:`StoreTests.reopen` gives a second handle on the same objects
(by default ``open_store(store.url)``: override it for a store
:func:`~chkq.stores.open_store` cannot name).

This module imports pytest, which chkq itself does not need: import it only
from tests (pytest is in chkq's ``test`` extra).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import random
import threading
import time

import pytest

from chkq.errors import BadMessageError, CheckpointChangedError
from chkq.stores.base import CheckpointStore, InvalidKeyError, ObjectVersion
from chkq.stores.shared_upload import PartRecord, SharedUpload, checksums_match
from chkq.stores.url import open_store

__all__ = ["BAD_KEYS", "StoreTests"]

BAD_KEYS = ["", "/abs", "a//b", "a/", "a/./b", "./a", "a/../b", "..", ".", "a\\b", "a\x00b"]
"""Keys every store must refuse with :class:`~chkq.stores.base.InvalidKeyError`."""


class StoreTests:
    """The :class:`~chkq.stores.base.CheckpointStore` guarantees, one test each.

    Override the ``store`` fixture (a fresh, empty store per test) and, if
    ``open_store(store.url)`` does not reach the same objects, :meth:`reopen`.
    Class attributes tune the sizes used.
    """

    large_size: int = 3 << 20
    """Bytes of the object in :meth:`test_large_object_round_trip`."""
    racers: int = 4
    """Threads racing in :meth:`test_put_if_absent_one_winner_among_racing_handles`."""
    shared_part_size: int = 5 << 20
    """Bytes of a shared upload's parts but the last (S3's smallest)."""

    @pytest.fixture
    def store(self) -> CheckpointStore:
        """A new, empty store (override in the subclass)."""
        raise NotImplementedError("override the store fixture in the StoreTests subclass")

    def reopen(self, store: CheckpointStore) -> CheckpointStore:
        """A second handle on the objects of ``store``, as another client would have."""
        return open_store(store.url)

    # writes and reads -----------------------------------------------------------

    def test_put_get_exists_delete(self, store: CheckpointStore) -> None:
        assert not store.exists("a/b")
        store.put("a/b", b"one")
        assert store.exists("a/b")
        assert store.get("a/b") == b"one"
        store.put("a/b", b"two")
        assert store.get("a/b") == b"two", "put replaces"
        store.delete("a/b")
        assert not store.exists("a/b")
        store.delete("a/b")
        assert store.list() == []

    def test_empty_and_binary_objects_round_trip(self, store: CheckpointStore) -> None:
        every_byte = bytes(range(256)) * 4
        store.put("bin", every_byte)
        store.put("empty", b"")
        assert store.get("bin") == every_byte
        assert store.get("empty") == b""
        assert store.exists("empty")
        assert store.put_if_absent("empty", b"x") is False

    def test_large_object_round_trip(self, store: CheckpointStore) -> None:
        data = random.Random(1).randbytes(self.large_size)
        assert store.put_if_absent("large", data) is True
        assert store.get("large") == data
        assert store.get_at_most("large", 10) == data[:11]

    def test_written_objects_are_seen_by_another_handle(self, store: CheckpointStore) -> None:
        store.put_if_absent("shared/k", b"v")
        other = self.reopen(store)
        assert other.get("shared/k") == b"v"
        assert other.put_if_absent("shared/k", b"w") is False
        other.delete("shared/k")
        assert not store.exists("shared/k")

    # create-if-absent ------------------------------------------------------------

    def test_put_if_absent_creates_once(self, store: CheckpointStore) -> None:
        assert store.put_if_absent("k/x", b"first") is True
        assert store.put_if_absent("k/x", b"second") is False
        assert store.put_if_absent("k/x", b"first") is False, "same bytes: still not created"
        assert store.get("k/x") == b"first", "a refused create leaves the object untouched"
        store.delete("k/x")
        assert store.put_if_absent("k/x", b"third") is True
        assert store.get("k/x") == b"third"

    def test_put_if_absent_does_not_replace_a_put(self, store: CheckpointStore) -> None:
        store.put("k", b"put")
        assert store.put_if_absent("k", b"create") is False
        assert store.get("k") == b"put"

    def test_put_if_absent_one_winner_among_racing_handles(
            self, store: CheckpointStore) -> None:
        keys = [f"race/{i:02d}" for i in range(12)]
        handles = [self.reopen(store) for _ in range(self.racers)]
        barrier = threading.Barrier(self.racers)
        results: list[list[bool]] = [[] for _ in handles]
        failures: list[BaseException] = []

        def race(index: int) -> None:
            try:
                barrier.wait(30)
                results[index] = [handles[index].put_if_absent(key, f"writer {index}".encode())
                                  for key in keys]
            except BaseException as exc:  # reported below, in the test's thread
                failures.append(exc)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(self.racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures
        for index, key in enumerate(keys):
            winners = [w for w in range(self.racers) if results[w][index]]
            assert len(winners) == 1, (key, winners)
            assert store.get(key) == f"writer {winners[0]}".encode()

    # bounded reads ----------------------------------------------------------------

    def test_get_at_most_reads_a_bounded_prefix(self, store: CheckpointStore) -> None:
        store.put("obj", b"0123456789")
        assert store.get_at_most("obj", 0) == b"0"
        assert store.get_at_most("obj", 3) == b"0123"
        assert store.get_at_most("obj", 9) == b"0123456789"
        assert store.get_at_most("obj", 10) == b"0123456789"
        assert store.get_at_most("obj", 1000) == b"0123456789"
        store.put("empty", b"")
        assert store.get_at_most("empty", 0) == b""
        assert store.get_at_most("empty", 5) == b""
        with pytest.raises(ValueError, match="limit"):
            store.get_at_most("obj", -1)
        with pytest.raises(KeyError) as caught:
            store.get_at_most("missing/obj", 4)
        assert caught.value.args[0] == "missing/obj"

    def test_get_range_reads_like_pread(self, store: CheckpointStore) -> None:
        data = bytes(range(200))
        store.put("obj", data)
        assert store.get_range("obj", 0, 10) == data[:10]
        assert store.get_range("obj", 5, 1) == data[5:6]
        assert store.get_range("obj", 150, 100) == data[150:], "short at the end"
        assert store.get_range("obj", 199, 1) == data[199:]
        assert store.get_range("obj", 200, 5) == b"", "nothing from the end on"
        assert store.get_range("obj", 1000, 5) == b""
        assert store.get_range("obj", 7, 0) == b""
        assert store.get_range("obj", 0, 200) == data
        store.put("empty", b"")
        assert store.get_range("empty", 0, 4) == b""
        assert store.get_range("empty", 3, 4) == b""
        for start, length in ((-1, 2), (0, -2)):
            with pytest.raises(ValueError):
                store.get_range("obj", start, length)
        for length in (0, 4):
            with pytest.raises(KeyError) as caught:
                store.get_range("missing/obj", 2, length)
            assert caught.value.args[0] == "missing/obj"

    def test_version_pins_one_write(self, store: CheckpointStore) -> None:
        store.put("obj", b"a" * 300)
        first = store.version("obj")
        assert first.size == 300
        assert store.version("obj") == first, "reading does not change the version"
        assert self.reopen(store).version("obj") == first
        store.put("obj", b"b" * 300)
        second = store.version("obj")
        assert second.size == 300 and second != first, "a rewrite of the same size is seen"
        with pytest.raises(KeyError) as caught:
            store.version("missing/obj")
        assert caught.value.args[0] == "missing/obj"

    def test_versions_list_keys_with_their_versions(self, store: CheckpointStore) -> None:
        for key, data in (("run/a", b"1"), ("run/sub/b", b"22"), ("other", b"333")):
            store.put(key, data)
        listed = store.versions("run/")
        assert list(listed) == ["run/a", "run/sub/b"]
        assert listed == {key: store.version(key) for key in listed}
        assert store.versions("nothing/") == {}

    def test_get_range_pinned_reads_one_version_only(self, store: CheckpointStore) -> None:
        data = bytes(range(200))
        store.put("obj", data)
        pinned = store.version("obj")
        assert store.get_range_pinned("obj", pinned, 0, 10) == data[:10]
        assert store.get_range_pinned("obj", pinned, 150, 100) == data[150:]
        assert store.get_range_pinned("obj", pinned, 200, 1) == b"", "unchanged: nothing more"
        store.put("obj", bytes(reversed(data)))
        for start in (0, 150, 200):
            assert store.get_range_pinned("obj", pinned, start, 10) in (None, data[start:][:10]), \
                "only the pinned version's bytes"
        assert store.get_range_pinned("obj", pinned, 200, 1) is None, "a rewrite is seen"
        current = store.version("obj")
        store.delete("obj")
        assert store.get_range_pinned("obj", current, 0, 10) is None
        assert store.get_range_pinned("missing/obj", ObjectVersion(1, "x"), 0, 1) is None
        with pytest.raises(ValueError):
            store.get_range_pinned("obj", current, -1, 1)

    def test_read_pinned_streams_one_version_only(self, store: CheckpointStore) -> None:
        data = bytes(i % 251 for i in range(1000))
        store.put("obj", data)
        pinned = store.version("obj")
        pieces = list(store.read_pinned("obj", pinned, 300))
        assert [len(p or b"") for p in pieces] == [300, 300, 300, 100]
        assert b"".join(p or b"" for p in pieces) == data
        store.put("empty", b"")
        assert list(store.read_pinned("empty", store.version("empty"), 10)) == []
        reading = store.read_pinned("obj", pinned, 300)
        first = next(reading)
        rewritten = bytes(reversed(data))
        store.put("obj", rewritten)
        rest = list(reading)
        assert rest[-1:] == [None] or (first or b"") + b"".join(p or b"" for p in rest) == data, \
            "a rewrite mid-read: the pinned version's bytes, or None"
        assert None not in rest[:-1]
        later = list(store.read_pinned("obj", pinned, 300))
        assert later == [None] or b"".join(p or b"" for p in later) == data
        current = store.version("obj")
        store.delete("obj")
        assert list(store.read_pinned("obj", current, 300)) == [None]
        with pytest.raises(ValueError):
            store.read_pinned("obj", current, 0)

    def test_size(self, store: CheckpointStore) -> None:
        store.put("obj", b"x" * 1234)
        store.put("empty", b"")
        assert store.size("obj") == 1234
        assert store.size("empty") == 0
        store.put("obj", b"y")
        assert store.size("obj") == 1
        with pytest.raises(KeyError) as caught:
            store.size("missing/obj")
        assert caught.value.args[0] == "missing/obj"

    # publishing from parts --------------------------------------------------------

    def test_upload_publishes_its_parts_once_complete(self, store: CheckpointStore) -> None:
        source = random.Random(2).randbytes(3000)
        store.put("src/a", source)
        upload = store.upload("out/obj")
        upload.write(b"head-")
        upload.copy("src/a", 100, 1000)
        upload.copy("src/a", 0, len(source))
        upload.write(b"-tail")
        assert not store.exists("out/obj"), "nothing visible before completion"
        assert store.list("out/") == []
        upload.complete()
        expected = b"head-" + source[100:1100] + source + b"-tail"
        assert upload.size == len(expected)
        assert store.get("out/obj") == expected
        assert store.list() == ["out/obj", "src/a"]
        assert store.stray_uploads() == []

    def test_upload_never_replaces_an_object(self, store: CheckpointStore) -> None:
        store.put("out/obj", b"first")
        with store.upload("out/obj") as upload:
            upload.write(b"second")
            with pytest.raises(FileExistsError) as caught:
                upload.complete()
        assert "out/obj" in str(caught.value)
        assert store.get("out/obj") == b"first"
        assert store.stray_uploads() == [], "the refused upload was aborted"

    def test_upload_of_nothing_publishes_an_empty_object(self, store: CheckpointStore) -> None:
        with store.upload("empty") as upload:
            upload.complete()
        assert store.get("empty") == b""

    def test_upload_left_by_an_error_is_aborted(self, store: CheckpointStore) -> None:
        with pytest.raises(RuntimeError), store.upload("out/obj") as upload:
            upload.write(b"x" * 1000)
            raise RuntimeError("the publisher failed")
        assert not store.exists("out/obj")
        assert store.list() == []
        assert store.stray_uploads() == []
        with pytest.raises(ValueError, match="finished"):
            upload.write(b"more")

    def test_upload_refuses_a_range_past_the_source(self, store: CheckpointStore) -> None:
        store.put("src", b"0123456789")
        with store.upload("out") as upload:
            with pytest.raises(ValueError, match="src"):
                upload.copy("src", 5, 6)
            with pytest.raises(KeyError):
                upload.copy("missing", 0, 1)
        assert not store.exists("out")

    def test_checksums_are_of_the_bytes_stored(self, store: CheckpointStore) -> None:
        data = random.Random(3).randbytes(2500)
        part_size = store.upload_part_size(1000)
        with store.upload("out/obj", part_size=1000, checksum=True) as upload:
            assert upload.part_size == part_size
            for offset in range(0, len(data), 1000):
                piece = data[offset : offset + 1000]
                upload.write(piece, sha256=hashlib.sha256(piece).digest())
            upload.complete()
        assert store.get("out/obj") == data
        checks = store.checksums("out/obj")
        assert checks.size == len(data)
        if checks.sha256 is not None:
            step = part_size or len(data)
            parts = [hashlib.sha256(data[i : i + step]).digest()
                     for i in range(0, len(data), step)]
            composite = hashlib.sha256(b"".join(parts)).digest()
            assert checks.sha256 == base64.b64encode(composite).decode()
            assert checks.sha256_parts in (None, len(parts))
        if checks.crc32c is not None:
            google_crc32c = pytest.importorskip("google_crc32c")
            assert checks.crc32c == google_crc32c.value(data)
        with pytest.raises(KeyError):
            store.checksums("missing/obj")
        with pytest.raises(ValueError, match="part size"):
            store.upload_part_size(0)

    # shared uploads: parts from many writers -----------------------------------------

    def _shared(self, store: CheckpointStore) -> None:
        if not store.supports_shared_uploads:
            pytest.skip(f"{store.url} has no shared uploads")

    def test_shared_upload_assembles_parts_from_other_handles(
            self, store: CheckpointStore) -> None:
        self._shared(store)
        size = self.shared_part_size
        source = random.Random(5).randbytes(size + 1000)
        built = random.Random(6).randbytes(size)
        store.put("src/a", source)
        pinned = store.version("src/a")
        upload = store.begin_shared_upload("out/obj")
        token = upload.to_record()
        assert SharedUpload.from_record(token) == upload
        first, second = self.reopen(store), self.reopen(store)
        records = [
            first.copy_part(SharedUpload.from_record(token), 1, "src/a", pinned, 1000, size,
                            0).to_record(),
            second.put_part(SharedUpload.from_record(token), 3, b"tail", 2 * size).to_record(),
            second.put_part(SharedUpload.from_record(token), 2, built, size).to_record(),
        ]
        parts = sorted((PartRecord.from_record(r) for r in records), key=lambda p: p.number)
        assert [(p.number, p.offset, p.size) for p in parts] == [
            (1, 0, size), (2, size, size), (3, 2 * size, 4)]
        assert not store.exists("out/obj"), "nothing visible before completion"
        assert store.list("out/") == []
        with pytest.raises(ValueError, match="starts at"):
            store.complete_shared_upload(upload, [parts[1], parts[0], parts[2]])
        swapped = [dataclasses.replace(parts[0], number=2),
                   dataclasses.replace(parts[1], number=1), parts[2]]
        with pytest.raises(ValueError, match="number order"):
            store.complete_shared_upload(upload, swapped)
        with pytest.raises(ValueError, match="starts at"):
            store.complete_shared_upload(upload, [parts[0], parts[2]])
        with pytest.raises(ValueError, match="no parts"):
            store.complete_shared_upload(upload, [])
        assert self.reopen(store).complete_shared_upload(upload, parts) is True
        expected = source[1000 : 1000 + size] + built + b"tail"
        assert store.get("out/obj") == expected
        assert store.list() == ["out/obj", "src/a"]
        assert store.stray_uploads() == []
        proof = store.shared_upload_checksums(parts)
        assert proof.size == len(expected)
        assert checksums_match(store.checksums("out/obj"), proof), (
            store.checksums("out/obj"), proof)
        assert not checksums_match(store.checksums("src/a"), proof)

    def test_shared_upload_part_put_twice_and_an_existing_key(
            self, store: CheckpointStore) -> None:
        self._shared(store)
        upload = store.begin_shared_upload("out/obj")
        store.put_part(upload, 1, b"redelivered", 0)
        again = self.reopen(store).put_part(upload, 1, b"redelivered", 0)
        assert store.complete_shared_upload(upload, [again]) is True
        assert store.get("out/obj") == b"redelivered"
        other = store.begin_shared_upload("out/obj")
        part = store.put_part(other, 1, b"second", 0)
        assert store.complete_shared_upload(other, [part]) is False
        assert store.get("out/obj") == b"redelivered", "an object is never replaced"
        assert store.stray_uploads() == [], "the refused upload left nothing"
        store.abort_shared_upload(other)

    def test_shared_upload_aborted_leaves_nothing(self, store: CheckpointStore) -> None:
        self._shared(store)
        upload = store.begin_shared_upload("out/obj")
        assert len(store.stray_uploads()) == 1, "listed before any part"
        store.put_part(upload, 1, b"x" * 100, 0)
        strays = store.stray_uploads()
        assert len(strays) == 1 and strays[0].key in ("", "out/obj")
        self.reopen(store).abort_shared_upload(upload)
        assert store.stray_uploads() == []
        store.abort_shared_upload(upload)
        assert store.list() == []
        left = store.begin_shared_upload("out/other")
        store.put_part(left, 1, b"y", 0)
        for stray in store.stray_uploads():  # as chkq gc does
            store.abort_upload(stray)
        assert store.stray_uploads() == []
        assert store.list() == []

    def test_shared_copy_part_refuses_a_changed_source(self, store: CheckpointStore) -> None:
        self._shared(store)
        store.put("src/a", b"a" * 3000)
        pinned = store.version("src/a")
        upload = store.begin_shared_upload("out/obj")
        assert store.copy_part(upload, 1, "src/a", pinned, 10, 100, 0).size == 100
        store.put("src/a", b"b" * 3000)
        with pytest.raises(CheckpointChangedError, match="src/a"):
            store.copy_part(upload, 1, "src/a", pinned, 10, 100, 0)
        current = store.version("src/a")
        store.delete("src/a")
        with pytest.raises(CheckpointChangedError, match="src/a"):
            store.copy_part(upload, 1, "src/a", current, 0, 100, 0)
        store.abort_shared_upload(upload)
        assert store.stray_uploads() == []

    def test_shared_upload_refuses_bad_parts(self, store: CheckpointStore) -> None:
        self._shared(store)
        store.put("src", b"0123456789")
        pinned = store.version("src")
        upload = store.begin_shared_upload("out/obj")
        for number in (0, 10_001, -1):
            with pytest.raises(ValueError, match="part number"):
                store.put_part(upload, number, b"x", 0)
        with pytest.raises(ValueError, match="negative"):
            store.put_part(upload, 1, b"x", -5)
        with pytest.raises(ValueError, match="within"):
            store.copy_part(upload, 1, "src", pinned, 5, 6, 0)
        with pytest.raises(ValueError, match="within"):
            store.copy_part(upload, 1, "src", pinned, 0, 0, 0)
        huge = ObjectVersion(6 << 30, pinned.version)
        with pytest.raises(ValueError, match="more than"):
            store.copy_part(upload, 1, "src", huge, 0, (5 << 30) + 1, 0)
        part = store.put_part(upload, 1, b"x", 0)
        with pytest.raises(ValueError, match="starts at"):
            store.complete_shared_upload(upload, [PartRecord(1, 1, 3, part.etag, part.checksum)])
        assert store.complete_shared_upload(upload, [part]) is True
        assert store.get("out/obj") == b"x"

    @pytest.mark.parametrize("record", [
        None, [], "token", {"key": "k", "upload_id": "u"},
        {"key": "k", "upload_id": "u", "write_id": "0" * 32, "extra": 1},
        {"key": 1, "upload_id": "u", "write_id": "0" * 32},
        {"key": "k", "upload_id": ["u"], "write_id": "0" * 32},
        {"key": "../k", "upload_id": "u", "write_id": "0" * 32},
        {"key": "k", "upload_id": "abc/..", "write_id": "0" * 32},
        {"key": "k", "upload_id": "a..b", "write_id": "0" * 32},
        {"key": "k", "upload_id": "", "write_id": "0" * 32},
        {"key": "k", "upload_id": "u\n", "write_id": "0" * 32},
        {"key": "k", "upload_id": "u", "write_id": "not hex"},
    ], ids=repr)
    def test_shared_upload_record_refuses_hostile_input(self, record: object) -> None:
        with pytest.raises(BadMessageError):
            SharedUpload.from_record(record)

    @pytest.mark.parametrize("record", [
        None, {"number": 1},
        {"number": True, "size": 1, "offset": 0, "etag": "", "checksum": ""},
        {"number": 1, "size": "1", "offset": 0, "etag": "", "checksum": ""},
        {"number": 0, "size": 1, "offset": 0, "etag": "", "checksum": ""},
        {"number": 10_001, "size": 1, "offset": 0, "etag": "", "checksum": ""},
        {"number": 1, "size": -1, "offset": 0, "etag": "", "checksum": ""},
        {"number": 1, "size": 1, "offset": -1, "etag": "", "checksum": ""},
        {"number": 1, "size": 1, "offset": 0, "etag": "a b", "checksum": ""},
        {"number": 1, "size": 1, "offset": 0, "etag": "", "checksum": "x" * 2000},
        {"number": 1, "size": 1, "offset": 0, "etag": "", "checksum": "", "more": 0},
    ], ids=repr)
    def test_part_record_refuses_hostile_input(self, record: object) -> None:
        with pytest.raises(BadMessageError):
            PartRecord.from_record(record)

    # missing objects -------------------------------------------------------------------

    def test_missing_key(self, store: CheckpointStore) -> None:
        key = "runs/r/nothing-here"
        with pytest.raises(KeyError) as caught:
            store.get(key)
        assert caught.value.args[0] == key, "KeyError names the key"
        assert not store.exists(key)
        store.delete(key)
        with pytest.raises(KeyError):
            store.modified(key)
        assert store.list() == []

    # keys ----------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
    def test_bad_keys_rejected(self, store: CheckpointStore, key: str) -> None:
        operations = [
            lambda: store.put(key, b"x"),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.get(key),
            lambda: store.get_at_most(key, 1),
            lambda: store.get_range(key, 0, 1),
            lambda: store.size(key),
            lambda: store.exists(key),
            lambda: store.delete(key),
            lambda: store.modified(key),
        ]
        for operation in operations:
            with pytest.raises(InvalidKeyError) as caught:
                operation()
            assert repr(key) in str(caught.value), "the error names the key"
            assert isinstance(caught.value, ValueError)
        assert store.list() == [], "nothing was written"

    @pytest.mark.parametrize("prefix", ["/abs", "a//b", "../x", "a/./", "a\x00"], ids=repr)
    def test_bad_prefixes_rejected(self, store: CheckpointStore, prefix: str) -> None:
        with pytest.raises(InvalidKeyError) as caught:
            store.list(prefix)
        assert repr(prefix) in str(caught.value)

    def test_deep_and_dotted_names_are_ordinary_keys(self, store: CheckpointStore) -> None:
        keys = ["runs/r-1/records/" + "ab" * 32 + ".json", "a/b/c/d/e/f/g", "x.y/.hidden",
                "sp ace/k~1_2+3"]
        for key in keys:
            store.put(key, key.encode())
        assert store.list() == sorted(keys)
        for key in keys:
            assert store.get(key) == key.encode()

    # listing --------------------------------------------------------------------------

    def test_list_is_sorted_and_filtered_by_prefix(self, store: CheckpointStore) -> None:
        keys = ["runs/a/1", "runs/a/2", "runs/a/sub/3", "runs/ab/4", "runs/b/5", "top"]
        for key in random.Random(4).sample(keys, len(keys)):
            store.put(key, key.encode())
        assert store.list() == keys
        assert store.list("") == keys
        assert store.list("runs/a/") == ["runs/a/1", "runs/a/2", "runs/a/sub/3"]
        assert store.list("runs/a") == ["runs/a/1", "runs/a/2", "runs/a/sub/3", "runs/ab/4"]
        assert store.list("runs/a/sub") == ["runs/a/sub/3"]
        assert store.list("nothing/") == []
        assert store.list("runs/b/5") == ["runs/b/5"]
        assert store.list("runs/b/5/") == [], "a key is not a directory"

    def test_list_is_complete_across_pages(self, store: CheckpointStore) -> None:
        if hasattr(store, "page_size"):
            store.page_size = 7
        keys = [f"many/{i:03d}" for i in range(30)]
        for key in keys:
            store.put(key, b"x")
        assert store.list("many/") == keys

    def test_list_omits_deleted_keys(self, store: CheckpointStore) -> None:
        for key in ("d/1", "d/2", "d/3"):
            store.put(key, b"x")
        store.delete("d/2")
        assert store.list("d/") == ["d/1", "d/3"]

    # times and the store itself ----------------------------------------------------

    def test_modified_is_recent_and_kept_by_a_refused_create(self, store: CheckpointStore) -> None:
        store.put("t", b"x")
        first = store.modified("t")
        assert abs(first - time.time()) < 120
        assert store.put_if_absent("t", b"y") is False
        assert store.modified("t") == first, "a refused create does not touch the object"

    def test_check_available_once_written(self, store: CheckpointStore) -> None:
        store.put("k", b"v")
        store.check_available()
        assert store.list() == ["k"], "the check writes nothing"

    def test_url_and_repr_name_the_store(self, store: CheckpointStore) -> None:
        assert isinstance(store.url, str) and "://" in store.url
        assert store.url in repr(store)
