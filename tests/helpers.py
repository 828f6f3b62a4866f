"""Independent checks of a consolidated output, written as a user would check it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import h5py
import numpy as np

from chkq.consolidation.checkpoint_files import is_extensible
from chkq.consolidation.h5types import type_key as type_signature

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, what: str = "condition",
             interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry below ``directory`` (hidden ones too) with a digest of its content."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        found[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def attrs_of(obj: h5py.HLObject) -> dict[str, tuple[str, bytes]]:
    """Attributes as (type signature, raw value bytes) so that types are compared too."""
    found = {}
    for name in obj.attrs:
        attr = obj.attrs.get_id(name)
        value = obj.attrs[name]
        raw = repr(value).encode() if not isinstance(value, np.ndarray) else (
            value.tobytes() if not value.dtype.hasobject else repr(value.tolist()).encode())
        found[name] = (type_signature(attr.get_type()), raw)
    return found


def assert_consolidated(output: Path, files: list[Path]) -> None:
    """``output`` holds the rows of ``files`` in order and the final first file's rest."""
    reference = files[-1] if len(files) == 1 else None
    assert output.exists(), f"{output} was not written"
    with h5py.File(output, "r") as out:
        last_checkpoint_first = _final_first(files)
        with h5py.File(last_checkpoint_first, "r") as ref:
            assert attrs_of(out) == attrs_of(ref)
            names: list[str] = []
            ref.visit(names.append)
            out_names: list[str] = []
            out.visit(out_names.append)
            assert sorted(names) == sorted(out_names)
            for name in names:
                src, dst = ref[name], out[name]
                assert attrs_of(dst) == attrs_of(src), name
                if isinstance(src, h5py.Group):
                    continue
                assert type_signature(dst.id.get_type()) == type_signature(src.id.get_type())
                if not is_extensible(src):
                    assert dst.shape == src.shape
                    assert _bytes(dst[()]) == _bytes(src[()]), name
                    continue
                for prop in ("chunks", "compression", "compression_opts", "shuffle",
                             "fletcher32", "maxshape"):
                    assert getattr(dst, prop) == getattr(src, prop), (name, prop)
                assert _bytes(np.asarray(dst.fillvalue)) == _bytes(np.asarray(src.fillvalue))
                parts = []
                for path in files:
                    with h5py.File(path, "r") as f:
                        parts.append(f[name][()])
                expected = np.concatenate(parts).astype(dst.dtype)
                got = dst[()]
                assert got.shape == expected.shape, name
                assert _bytes(got) == _bytes(expected), name
    del reference


def _final_first(files: list[Path]) -> Path:
    """The final checkpoint's first file among ``files`` (given in consolidation order)."""
    last = files[-1]
    if last.parent.name.count("_chk"):
        siblings = [f for f in files if f.parent == last.parent]
        return siblings[0]
    return last


def _bytes(value: object) -> bytes:
    array = np.asarray(value)
    if array.dtype.hasobject:
        return repr(array.tolist()).encode()
    return array.tobytes()


def corrupt_chunk(path: Path, dataset: str) -> None:
    """Flip a byte inside the first stored chunk of ``dataset`` (a real on-disk fault)."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        byte = fh.read(1)
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))


class Lease:
    """A write lease held on a file (see :func:`write_lease`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def waited_on(self) -> bool:
        """True once another process waits in ``open`` for this lease to go."""
        return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK


@contextlib.contextmanager
def write_lease(path: Path) -> Iterator[Lease]:
    """Hold a write lease on ``path``: another process's ``open`` of it blocks until released.

    What makes a job wait for the test, whatever the machine's speed. Taken
    when no other process has the file open (else OSError), it holds the
    next opener in ``open`` until the lease is released, or at most
    ``/proc/sys/fs/lease-break-time`` seconds (45 by default). The lease
    break's SIGIO is ignored meanwhile.
    """
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        yield Lease(fd)
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)
        signal.signal(signal.SIGIO, previous)
