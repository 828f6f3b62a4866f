"""Independent checks of a consolidated output, written as a user would check it, and the
files and waits the tests share."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import h5py
import numpy as np

from chkq.consolidation.checkpoint_files import is_extensible
from chkq.consolidation.h5types import type_key as type_signature
from chkq.log import CheckpointLog
from chkq.stores import open_store

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
        found[rel] = "dir" if path.is_dir() else content_digest(path)
    return found


def content_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in blocks; a file that is one hole has its size instead.

    A file with no data at all (``SEEK_DATA`` finds none) reads as zeros:
    hashing the gigabytes of a sparse test file would only read zeros.
    """
    with open(path, "rb") as fh:
        try:
            os.lseek(fh.fileno(), 0, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return f"zeros:{os.fstat(fh.fileno()).st_size}"
            raise
        digest = hashlib.sha256()
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


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



def checkpoint_series(directory: Path, count: int, size: int = 1 << 20, seed: int = 1
                      ) -> list[Path]:
    """``count`` checkpoint-like files, each a 1% scattered change of the one before."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    paths = []
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        if i:
            where = rng.integers(0, size, size // 100)
            data[where] = rng.integers(0, 256, len(where), dtype=np.uint8)
        path = directory / f"state_{i:03d}.bin"
        path.write_bytes(data.tobytes())
        paths.append(path)
    return paths


def payload_keys(store_url: str, run: str) -> set[str]:
    """The payload keys of run ``run`` in the store at ``store_url``."""
    return set(open_store(store_url).list(f"runs/{run}/payloads/"))


def assert_log_consistent(log: CheckpointLog) -> None:
    """One record per checkpoint; every payload referenced; every load verifies."""
    records = log.manifest()
    payloads = log.store.list(f"runs/{log.run_id}/payloads/")
    assert sorted(r.payload for r in records) == payloads
    for record in records:
        assert hashlib.sha256(log.load(record.id)).hexdigest() == record.id


def modules_loaded_by(imports: list[str], watched: list[str]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded once it imported ``imports``."""
    program = (f"import json, sys\nimport {', '.join(imports)}\n"
               f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def one_shot(out_dir: Path, into: Path, model: str = "sim") -> Path:
    """The run's checkpoints consolidated once, in a copy of the run (no MODEL.h5, no done file).

    The reference a followed output must equal when the run has ended.
    """
    from chkq.consolidation.driver import consolidate_here

    shutil.copytree(out_dir, into, ignore=shutil.ignore_patterns(f"{model}.h5", "done"))
    return consolidate_here(into, model)


def assert_same_hdf5(left: Path, right: Path) -> None:
    """Two HDF5 files hold the same objects: names, kinds, attributes, types, layouts, values.

    Compared through h5py's high-level API, object by object, so that two
    files written at different times (or in different places) are equal
    when everything a reader of them can see is.
    """
    with h5py.File(left, "r") as a, h5py.File(right, "r") as b:
        assert attrs_of(a) == attrs_of(b), "root attributes"
        names_a: list[str] = []
        a.visit(names_a.append)
        names_b: list[str] = []
        b.visit(names_b.append)
        assert names_a == names_b
        for name in names_a:
            x, y = a[name], b[name]
            assert type(x) is type(y), name
            assert attrs_of(x) == attrs_of(y), name
            if isinstance(x, h5py.Group):
                continue
            assert type_signature(x.id.get_type()) == type_signature(y.id.get_type()), name
            for prop in ("shape", "maxshape", "chunks", "compression", "compression_opts",
                         "shuffle", "fletcher32"):
                assert getattr(x, prop) == getattr(y, prop), (name, prop)
            assert _bytes(x[()]) == _bytes(y[()]), name
