"""The versions of a followed run kept in a store: where they live, and how a reader finds one.

A follow of a run kept in an object store (``chkq consolidate MODEL --from
URL --follow``) publishes each version as an object of its own, next to the
destination key ``DEST`` (the key a one-shot ``--from`` job writes)::

    DEST.versions/000001.h5     version 1, create-if-absent, never replaced
    DEST.versions/000001.json   its pointer: written once the version is proven stored
    DEST.versions/000002.h5
    DEST.versions/000002.json
    ...
    DEST                        the final version, create-if-absent
    DEST.versions/00000N.json   the final pointer (``final``: true), naming DEST

A reader finds the latest version by its pointer, never by the highest
numbered version object: a version object becomes visible the moment its
upload completes, before its stored bytes are proven equal to the verified
file (a mismatch deletes it again), while a pointer is written only after
that proof, and names the object's size and SHA-256, which the reader can
check what it read against. Each pointer and each version is written
create-if-absent, so nothing a reader holds is ever replaced under it; the
interim versions are deleted only after the final version and its pointer
are published (and a grace time the follower is given has passed).

No Celery here: a reader (:func:`latest_pointer`, :func:`fetch_version`)
needs only the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from chkq.errors import CheckpointChangedError, ChkqError
from chkq.stores.base import CheckpointStore

#: What follows the destination key in the name of the prefix its versions are kept under.
VERSIONS_SUFFIX = ".versions/"
#: The largest pointer object read (a pointer is a few hundred bytes).
POINTER_LIMIT = 64 * 1024
#: Bytes read at a time when a version is fetched.
READ_BYTES = 32 << 20

_POINTER = re.compile(r"(\d{6})\.json")


class VersionPointerError(ChkqError, ValueError):
    """A pointer object that is not one a follow wrote (malformed, or naming another key)."""


class PointerTakenError(ChkqError, FileExistsError):
    """A version's pointer exists and says something else: another follower published it."""


def versions_prefix(destination: str) -> str:
    """The key prefix under which the versions of the output ``destination`` are kept."""
    return destination + VERSIONS_SUFFIX


def version_key(destination: str, number: int) -> str:
    """The key of interim version ``number`` of the output ``destination``."""
    return f"{versions_prefix(destination)}{number:06d}.h5"


def pointer_key(destination: str, number: int) -> str:
    """The key of the pointer of version ``number`` of the output ``destination``."""
    return f"{versions_prefix(destination)}{number:06d}.json"


@dataclass(frozen=True)
class VersionPointer:
    """What a pointer object says of one published version.

    Attributes
    ----------
    number
        The version's number, from 1. The object that holds it follows from it
        (:meth:`key`): the pointer names no key, so it cannot send a reader elsewhere.
    size, sha256
        Its size and SHA-256, as verified before it was published.
    through
        The last checkpoint it holds: it holds the rows of checkpoints 1..through.
    rows
        Rows of all its extensible datasets together.
    final
        The follow's last version, at the destination key.
    follow
        The id of the follow that published it.
    """

    number: int
    size: int
    sha256: str
    through: int
    rows: int
    final: bool
    follow: str

    def key(self, destination: str) -> str:
        """The key of the object that holds the version, of the output at ``destination``."""
        return destination if self.final else version_key(destination, self.number)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str, destination: str) -> VersionPointer:
        """The pointer stored at ``where``, checked as untrusted input.

        Raises
        ------
        VersionPointerError
            Naming ``where``, if it is not a pointer of this destination's versions.
        """
        try:
            raw = json.loads(data)
            pointer = cls(int(raw["number"]), int(raw["size"]),
                          str(raw["sha256"]), int(raw["through"]), int(raw["rows"]),
                          bool(raw["final"]), str(raw["follow"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise VersionPointerError(f"{where} is not a version pointer ({exc!r})") from None
        if (pointer_key(destination, pointer.number) != where or pointer.number < 1
                or not re.fullmatch(r"[0-9a-f]{64}", pointer.sha256) or pointer.size < 0
                or pointer.through < 1):
            raise VersionPointerError(f"{where} is not a pointer of a version of {destination}: "
                                      "refused")
        return pointer


def pointer_numbers(store: CheckpointStore, destination: str) -> list[int]:
    """The numbers of the versions whose pointers are in the store, in order."""
    prefix = versions_prefix(destination)
    found = []
    for key in store.list(prefix):
        matched = _POINTER.fullmatch(key[len(prefix):])
        if matched:
            found.append(int(matched.group(1)))
    return sorted(found)


def read_pointer(store: CheckpointStore, destination: str, number: int) -> VersionPointer:
    """The pointer of version ``number`` (KeyError if there is none)."""
    where = pointer_key(destination, number)
    data = store.get_at_most(where, POINTER_LIMIT)
    if len(data) > POINTER_LIMIT:
        raise VersionPointerError(f"{where} is larger than a version pointer: refused")
    return VersionPointer.from_bytes(data, where, destination)


def latest_pointer(store: CheckpointStore, destination: str) -> VersionPointer | None:
    """The pointer of the newest version published of the output ``destination``, or None.

    This is how a reader finds the version to open: the highest-numbered
    pointer, whose version was proven stored before the pointer was written.
    """
    numbers = pointer_numbers(store, destination)
    for number in reversed(numbers):
        try:
            return read_pointer(store, destination, number)
        except KeyError:
            continue  # deleted meanwhile by the cleanup after the final version: look lower
    return None


def write_pointer(store: CheckpointStore, destination: str, pointer: VersionPointer) -> None:
    """Publish ``pointer`` create-if-absent; the same pointer already there is accepted.

    Raises
    ------
    PointerTakenError
        If another pointer holds the number (another follower of the run).
    """
    where = pointer_key(destination, pointer.number)
    if store.put_if_absent(where, pointer.to_bytes()):
        return
    try:
        there = read_pointer(store, destination, pointer.number)
    except (KeyError, VersionPointerError):
        there = None
    if there != pointer:
        raise PointerTakenError(
            f"{store.url.rstrip('/')}/{where} already names another version (another "
            "follower published it): this follow stops; its versions so far stay")


def fetch_version(store: CheckpointStore, destination: str, pointer: VersionPointer,
                  path: Path) -> None:
    """Write the version ``pointer`` names to the new file ``path``, checked against it.

    Every read is pinned to the version the object had at the first: a
    version object is never replaced, and one that changed, or whose bytes
    are not the pointer's size and SHA-256, is refused.

    Raises
    ------
    CheckpointChangedError
        If the object changed while it was read, or is not what the pointer says.
    KeyError
        If the object is gone (deleted by the cleanup after the final version).
    """
    key = pointer.key(destination)
    url = f"{store.url.rstrip('/')}/{key}"
    pinned = store.version(key)
    if pinned.size != pointer.size:
        raise CheckpointChangedError(f"version {pointer.number} at {url} holds {pinned.size:,} "
                                     f"bytes, not the {pointer.size:,} its pointer says")
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        offset = 0
        while True:
            piece = store.get_range_pinned(key, pinned, offset, READ_BYTES)
            if piece is None:
                raise CheckpointChangedError(f"version {pointer.number} at {url} changed "
                                             "while it was read")
            if not piece:
                break
            digest.update(piece)
            _write_all(fd, piece)
            offset += len(piece)
        os.fsync(fd)
    finally:
        os.close(fd)
    if offset != pointer.size or digest.hexdigest() != pointer.sha256:
        path.unlink()
        raise CheckpointChangedError(f"version {pointer.number} at {url} is not the version "
                                     "its pointer names (size or SHA-256 differ): refused")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def interim_keys(store: CheckpointStore, destination: str, final: int) -> list[str]:
    """The interim versions and pointers to delete once version ``final`` is the last.

    Everything under the versions prefix but the final pointer: the pointers
    first, lowest first, then the objects, so that no pointer ever names a
    deleted object and a reader listing meanwhile finds the final pointer,
    the highest, at every moment.
    """
    prefix = versions_prefix(destination)
    keep = pointer_key(destination, final)
    keys = [k for k in store.list(prefix) if k != keep]
    return sorted(k for k in keys if k.endswith(".json")) + sorted(
        k for k in keys if not k.endswith(".json"))

