"""The versions of a followed store run as a reader finds them: pointers, checks, cleanup order.

A reader takes the highest pointer, reads the object its number names and checks it
against the pointer's size and SHA-256; a pointer that is not a follow's (planted,
moved, malformed) or an object that is not the pointer's is refused, naming it.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

from chkq.errors import CheckpointChangedError
from chkq.staging.follow_versions import (
    PointerTakenError,
    VersionPointer,
    VersionPointerError,
    fetch_version,
    interim_keys,
    latest_pointer,
    pointer_key,
    version_key,
    versions_prefix,
    write_pointer,
)
from chkq.stores import CheckpointStore, open_store

DEST = "run/sim.h5"


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return open_store((tmp_path / "store").as_uri())


def published(store: CheckpointStore, number: int, data: bytes, *, final: bool = False,
              through: int | None = None) -> VersionPointer:
    """A version as a follow publishes it: its object, then its pointer."""
    pointer = VersionPointer(number, len(data), hashlib.sha256(data).hexdigest(),
                             through or number, 10 * number, final, uuid.uuid4().hex)
    store.put(pointer.key(DEST), data)
    write_pointer(store, DEST, pointer)
    return pointer


def test_a_reader_gets_the_highest_pointer_and_the_version_it_names(
        store: CheckpointStore, tmp_path: Path) -> None:
    assert latest_pointer(store, DEST) is None
    published(store, 1, b"one")
    second = published(store, 2, b"two two")
    store.put(version_key(DEST, 3), b"an upload completed, not yet proven")
    assert latest_pointer(store, DEST) == second
    fetch_version(store, DEST, second, tmp_path / "v.h5")
    assert (tmp_path / "v.h5").read_bytes() == b"two two"
    final = published(store, 3, b"final", final=True)
    assert latest_pointer(store, DEST) == final and final.key(DEST) == DEST


def test_a_pointer_that_is_not_a_follows_is_refused_naming_it(store: CheckpointStore) -> None:
    genuine = published(store, 1, b"one")
    store.put(pointer_key(DEST, 2), genuine.to_bytes())  # version 1's pointer moved to 2
    with pytest.raises(VersionPointerError, match=r"run/sim\.h5\.versions/000002\.json"):
        latest_pointer(store, DEST)
    store.put(pointer_key(DEST, 2), b'{"number": 2, "size": "lots"}')
    with pytest.raises(VersionPointerError, match=r"000002\.json is not a version pointer"):
        latest_pointer(store, DEST)


def test_a_number_taken_by_another_follower_is_refused_and_the_same_pointer_accepted(
        store: CheckpointStore) -> None:
    first = published(store, 1, b"one")
    write_pointer(store, DEST, first)  # the same look delivered again
    other = VersionPointer(1, 5, hashlib.sha256(b"other").hexdigest(), 1, 10, False, "x" * 32)
    with pytest.raises(PointerTakenError, match="another follower"):
        write_pointer(store, DEST, other)
    assert latest_pointer(store, DEST) == first


def test_an_object_that_is_not_its_pointers_version_is_refused_and_nothing_is_left(
        store: CheckpointStore, tmp_path: Path) -> None:
    pointer = published(store, 1, b"one")
    store.put(pointer.key(DEST), b"eno")  # same size, other bytes
    with pytest.raises(CheckpointChangedError, match="SHA-256"):
        fetch_version(store, DEST, pointer, tmp_path / "v.h5")
    assert not (tmp_path / "v.h5").exists()
    store.put(pointer.key(DEST), b"longer")
    with pytest.raises(CheckpointChangedError, match="not the 3 its pointer says"):
        fetch_version(store, DEST, pointer, tmp_path / "v.h5")


def test_the_cleanup_deletes_pointers_first_and_keeps_the_final_pointer(
        store: CheckpointStore) -> None:
    for number in (1, 2):
        published(store, number, b"v%d" % number)
    published(store, 3, b"final", final=True)
    assert interim_keys(store, DEST, 3) == [
        pointer_key(DEST, 1), pointer_key(DEST, 2), version_key(DEST, 1), version_key(DEST, 2)]
    for key in interim_keys(store, DEST, 3):
        store.delete(key)
        pointer = latest_pointer(store, DEST)
        assert pointer is not None and pointer.final  # a reader meanwhile: the final one
    assert store.list(versions_prefix(DEST)) == [pointer_key(DEST, 3)]
