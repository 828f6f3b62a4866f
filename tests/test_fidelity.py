"""Full fidelity on HDF5 as other software writes it (Celery-free, in one process).

Each test builds checkpoint files with h5py the way PyTables, netCDF-4,
MATLAB or the HDF Group's examples do, consolidates them with the same
functions the tasks call, and checks what a user of the output would
check: the value, the type, the link, the reference target.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5a, h5d, h5p, h5s, h5t

from chkq.consolidation.driver import consolidate_here
from tests.helpers import snapshot

Builder = Callable[[h5py.File, int], None]


def mark_complete(path: Path) -> None:
    """Add the root attribute ``trials_completed`` with the low-level API only."""
    fid = h5py.h5f.open(str(path).encode(), h5py.h5f.ACC_RDWR)
    try:
        space = h5s.create(h5s.SCALAR)
        attr = h5a.create(fid, b"trials_completed", h5t.STD_U64LE, space)
        attr.write(np.array(1, dtype="<u8"))
    finally:
        fid.close()


def make_run(tmp_path: Path, build: Builder, checkpoints: int = 2, userblock: int = 0) -> None:
    for n in range(1, checkpoints + 1):
        path = tmp_path / f"run_chk{n:05d}.h5"
        with h5py.File(path, "w", userblock_size=userblock or None) as f:
            build(f, n)
        mark_complete(path)


def nullterm(size: int) -> h5t.TypeID:
    tid = h5t.C_S1.copy()
    tid.set_size(size)
    tid.set_strpad(h5t.STR_NULLTERM)
    return tid


def raw_attr(obj: h5py.HLObject, name: str) -> tuple[bytes, bytes]:
    """An attribute's file type encoding and stored bytes, read without conversion."""
    attr = h5a.open(obj.id, name.encode())
    tid = attr.get_type()
    buf = np.empty(attr.get_space().shape, dtype=f"V{tid.get_size()}")
    attr.read(buf, mtype=tid)
    return tid.encode(), buf.tobytes()


def test_full_width_nullterm_and_char_array_attributes(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        for obj in (f, f.create_group("g")):
            a = h5a.create(obj.id, b"CLASS", nullterm(5), h5s.create(h5s.SCALAR))
            a.write(np.array(b"GROUP", dtype="S5"), mtype=nullterm(5))
            c = h5a.create(obj.id, b"flag", nullterm(1), h5s.create_simple((3,)))
            c.write(np.array([b"a", b"b", b"c"], dtype="S1"), mtype=nullterm(1))
        d = f.create_dataset("g/x", data=np.arange(4 * n), maxshape=(None,), chunks=(4,))
        a = h5a.create(d.id, b"Conventions", nullterm(6), h5s.create(h5s.SCALAR))
        a.write(np.array(b"CF-1.5", dtype="S6"), mtype=nullterm(6))

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o, h5py.File(tmp_path / "run_chk00002.h5") as t:
        for obj in ("/", "/g"):
            for name in ("CLASS", "flag"):
                assert raw_attr(o[obj], name) == raw_attr(t[obj], name)
        assert raw_attr(o["g/x"], "Conventions") == raw_attr(t["g/x"], "Conventions")
        assert raw_attr(o, "CLASS")[1] == b"GROUP"
        assert list(o["g/x"][:]) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]


def test_links_hard_soft_external_and_committed_types(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        f["fixed"] = np.arange(3.0) * n
        f["alias"] = f["fixed"]
        f["soft"] = h5py.SoftLink("/fixed")
        f["ext"] = h5py.ExternalLink("other.h5", "/y")
        f["mytype"] = np.dtype([("a", "<i4"), ("b", "<f8")])
        f.create_dataset("rows", shape=(2,), maxshape=(None,), chunks=(2,), dtype=f["mytype"])
        f["rows"][:] = np.array([(n, 1.5), (n + 1, 2.5)], dtype=f["mytype"].dtype)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert o["alias"].id == o["fixed"].id
        assert h5py.h5o.get_info(o["fixed"].id).rc == 2
        assert o.get("soft", getlink=True).path == "/fixed"
        link = o.get("ext", getlink=True)
        assert (link.filename, link.path) == ("other.h5", "/y")
        assert o["rows"].id.get_type().committed()
        assert o["rows"].id.get_type().equal(o["mytype"].id)
        assert [tuple(r) for r in o["rows"][:]] == [(1, 1.5), (2, 2.5), (2, 1.5), (3, 2.5)]
        assert list(o["fixed"][:]) == [0.0, 2.0, 4.0]


def test_references_and_dimension_scales_point_into_the_output(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        time = f.create_dataset("time", data=np.arange(3.0) + 10 * n, maxshape=(None,),
                                chunks=(3,))
        temp = f.create_dataset("temp", data=np.ones(3) * n, maxshape=(None,), chunks=(3,))
        time.make_scale("time")
        temp.dims[0].attach_scale(time)
        f["grid"] = np.arange(5)
        f.attrs["target"] = f["grid"].ref
        refs = f.create_dataset("cells", shape=(2,), dtype=h5py.ref_dtype)
        refs[0], refs[1] = f["grid"].ref, f["time"].ref
        f.create_dataset("rowrefs", data=[f["grid"].ref], maxshape=(None,), chunks=(4,),
                         dtype=h5py.ref_dtype)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert o[o.attrs["target"]].name == "/grid"
        assert [o[r].name for r in o["cells"][:]] == ["/grid", "/time"]
        assert [o[r].name for r in o["rowrefs"][:]] == ["/grid", "/grid"]
        assert o["temp"].dims[0][0].name == "/time"
        assert h5py.h5ds.is_scale(o["time"].id)
        assert list(o["time"][:]) == [10.0, 11, 12, 20, 21, 22]


def test_extensible_variable_length_rows(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        f.create_dataset("names", data=[f"row{n}-{i}" for i in range(3)], maxshape=(None,),
                         chunks=(2,), dtype=h5py.string_dtype())
        seq = f.create_dataset("seq", shape=(2,), maxshape=(None,), chunks=(2,),
                               dtype=h5py.vlen_dtype(np.int32))
        seq[0], seq[1] = np.arange(n), np.arange(n + 2)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert [s.decode() for s in o["names"][:]] == [
            "row1-0", "row1-1", "row1-2", "row2-0", "row2-1", "row2-2"]
        assert [list(s) for s in o["seq"][:]] == [[0], [0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_compressed_bytes_numpy_would_change(tmp_path: Path) -> None:
    padded = np.dtype({"names": ["a", "b"], "formats": ["u1", "<u4"], "offsets": [0, 4],
                       "itemsize": 8})

    def build(f: h5py.File, n: int) -> None:
        sid = h5s.create_simple((2,), (h5s.UNLIMITED,))
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((2,))
        dcpl.set_deflate(4)
        ds = h5d.create(f.id, b"codes", nullterm(4), sid, dcpl=dcpl)
        ds.write(h5s.ALL, h5s.ALL, np.frombuffer(b"ABC1XYZ%d" % n, "V4").copy(),
                 mtype=nullterm(4))
        comp = f.create_dataset("comp", shape=(2,), maxshape=(None,), chunks=(2,),
                                dtype=padded, compression="gzip")
        raw = np.frombuffer(bytes([n, 0xAA, 0xBB, 0xCC, 1, 0, 0, 0] * 2), "V8").copy()
        comp.id.write(h5s.ALL, h5s.ALL, raw, mtype=comp.id.get_type())

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        buf = np.empty(4, "V4")
        o["codes"].id.read(h5s.ALL, h5s.ALL, buf, mtype=o["codes"].id.get_type())
        assert buf.tobytes() == b"ABC1XYZ1ABC1XYZ2"
        raw = np.empty(4, "V8")
        o["comp"].id.read(h5s.ALL, h5s.ALL, raw, mtype=o["comp"].id.get_type())
        assert raw.tobytes() == bytes([1, 0xAA, 0xBB, 0xCC, 1, 0, 0, 0] * 2
                                      + [2, 0xAA, 0xBB, 0xCC, 1, 0, 0, 0] * 2)


def test_types_numpy_cannot_express(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        big = h5t.STD_I64LE.copy()
        big.set_size(16)
        big.set_precision(128)
        for name, tid, compress in ((b"i128", big, True), (b"when", h5t.UNIX_D64LE, False)):
            sid = h5s.create_simple((2,), (h5s.UNLIMITED,))
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_chunk((2,))
            if compress:
                dcpl.set_deflate(1)
            ds = h5d.create(f.id, name, tid, sid, dcpl=dcpl)
            data = np.frombuffer(bytes((n * 7 + i) % 256 for i in range(2 * tid.get_size())),
                                 f"V{tid.get_size()}").copy()
            ds.write(h5s.ALL, h5s.ALL, data, mtype=tid)
            h5a.create(ds, b"unit", tid, h5s.create(h5s.SCALAR)).write(data[:1].reshape(()),
                                                                       mtype=tid)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    sources = [tmp_path / "run_chk00001.h5", tmp_path / "run_chk00002.h5"]
    with h5py.File(out) as o:
        for name in ("i128", "when"):
            dsid = o[name].id
            tid = dsid.get_type()
            buf = np.empty(4, f"V{tid.get_size()}")
            dsid.read(h5s.ALL, h5s.ALL, buf, mtype=tid)
            expected = b""
            for src in sources:
                with h5py.File(src) as s:
                    part = np.empty(2, f"V{tid.get_size()}")
                    s[name].id.read(h5s.ALL, h5s.ALL, part, mtype=tid)
                    expected += part.tobytes()
            assert buf.tobytes() == expected


def test_creation_properties_and_userblock_kept(tmp_path: Path) -> None:
    def build(f: h5py.File, n: int) -> None:
        sid = h5s.create_simple((3,), (h5s.UNLIMITED,))
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((2,))
        dcpl.set_fill_value(np.array(-1.0))
        dcpl.set_fill_time(h5d.FILL_TIME_IFSET)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_INCR)
        ds = h5d.create(f.id, b"x", h5t.IEEE_F64LE, sid, dcpl=dcpl)
        ds.write(h5s.ALL, h5s.ALL, np.arange(3.0) + n)
        f.create_dataset("nofill", shape=(2,), maxshape=(None,), chunks=(2,), dtype="i4",
                         fillvalue=None)
        f["nofill"][:] = [n, n]
        f.create_dataset("scalar", data=3.5)
        f.create_dataset("null", data=h5py.Empty("f4"))

    make_run(tmp_path, build, userblock=512)
    with open(tmp_path / "run_chk00002.h5", "r+b") as fh:
        fh.write(b"MATLAB 7.3 MAT-file, written by a test")
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        dcpl = o["x"].id.get_create_plist()
        assert dcpl.get_fill_time() == h5d.FILL_TIME_IFSET
        assert dcpl.get_alloc_time() == h5d.ALLOC_TIME_INCR
        assert o["x"].fillvalue == -1.0
        assert list(o["x"][:]) == [1.0, 2, 3, 2, 3, 4]
        assert o.userblock_size == 512
        assert o["scalar"][()] == 3.5
        assert o["null"].shape is None
    assert out.read_bytes()[:38] == b"MATLAB 7.3 MAT-file, written by a test"


@pytest.mark.parametrize("case, message", [
    ("bounded-first-axis", r"dataset '/x' of checkpoint file .* unlimited along another axis"),
    ("no-plugin", r"dataset '/z' of checkpoint file .* uses filter 305"),
    ("declares-more", r"dataset '/big' of checkpoint file .* declares 100000000 rows"),
    ("external", r"dataset '/e' of checkpoint file .* external files"),
])
def test_refusals_name_the_object_and_write_nothing(tmp_path: Path, case: str,
                                                    message: str) -> None:
    def build(f: h5py.File, n: int) -> None:
        if case == "bounded-first-axis":
            f.create_dataset("x", shape=(2, 3), maxshape=(2, None), chunks=(1, 3), dtype="f8")
        elif case == "no-plugin":
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_chunk((4,))
            dcpl.set_filter(305, h5py.h5z.FLAG_OPTIONAL, ())
            h5d.create(f.id, b"z", h5t.STD_I32LE, h5s.create_simple((4,), (h5s.UNLIMITED,)),
                       dcpl=dcpl)
        elif case == "declares-more":
            f.create_dataset("big", shape=(10**8,), maxshape=(None,), chunks=(1024,),
                             dtype="f8")
        else:
            f.create_dataset("e", shape=(4,), dtype="f8", external=[("data.bin", 0, 32)])

    make_run(tmp_path, build)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=message):
        consolidate_here(tmp_path, "run")
    assert snapshot(tmp_path) == before


def test_symbolic_links_in_a_run_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    run = tmp_path / "run"
    outside.mkdir()
    run.mkdir()
    make_run(outside, lambda f, n: f.create_dataset("x", data=[n], maxshape=(None,)))
    (run / "run_chk00001.h5").symlink_to(outside / "run_chk00001.h5")
    with pytest.raises(ValueError, match="symbolic link"):
        consolidate_here(run, "run")
    (run / "run_chk00001.h5").unlink()
    (run / "run_chk00001").symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link"):
        consolidate_here(run, "run")
    assert sorted(p.name for p in outside.iterdir()) == ["run_chk00001.h5", "run_chk00002.h5"]


@pytest.mark.parametrize("filter_options", [
    {"compression": 32001, "compression_opts": (0, 0, 0, 0, 5, 1, 1)},  # Blosc (lz4, shuffle)
    {"compression": 32015, "compression_opts": (3,)},  # Zstd
    {"compression": 32004},  # LZ4
    {"compression": 307, "compression_opts": (9,)},  # BZip2
])
def test_plugin_filters_through_hdf5plugin(tmp_path: Path, filter_options: dict) -> None:
    import hdf5plugin  # noqa: F401

    def build(f: h5py.File, n: int) -> None:
        f.create_dataset("x", data=np.arange(1000.0) * n, maxshape=(None,), chunks=(100,),
                         **filter_options)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert o["x"].id.get_create_plist().get_filter(0)[0] == filter_options["compression"]
        assert np.array_equal(o["x"][:], np.concatenate([np.arange(1000.0),
                                                         np.arange(1000.0) * 2]))


def test_extensible_compound_rows_holding_variable_length_strings(tmp_path: Path) -> None:
    row = np.dtype([("a", "<i4"), ("s", h5py.string_dtype())])

    def build(f: h5py.File, n: int) -> None:
        ds = f.create_dataset("rows", shape=(2,), maxshape=(None,), chunks=(2,), dtype=row)
        ds[0], ds[1] = (n, f"hello{n}"), (n + 1, "x" * n)

    make_run(tmp_path, build)
    out = consolidate_here(tmp_path, "run")
    with h5py.File(out) as o:
        assert [(int(a), s.decode()) for a, s in o["rows"][:]] == [
            (1, "hello1"), (2, "x"), (2, "hello2"), (3, "xx")]
