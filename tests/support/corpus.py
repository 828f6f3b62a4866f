"""HDF5 files written by other software, turned into checkpointed runs.

- ``make_run`` copies one file's bytes into a run (``MODEL_chk00001.h5`` ...),
  adds the root attribute ``trials_completed`` with the low-level attribute
  API (nothing else in the file is rewritten) and varies the rows of the
  extensible datasets between files, so that the concatenation is not
  trivial.
- ``REAL`` lists the committed corpus (tests/data/corpus, see SOURCES.md).
- ``SYNTHETIC`` generates, with h5py, small files for each class of problem
  seen with other producers' files (kept apart from the real ones: these are
  written by us).
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import hdf5plugin  # Blosc, LZ4, Zstd, BZip2 (reading, resizing, writing)
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t, h5z

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "corpus"

# Files some corpus files point to (external links, virtual dataset sources):
# copied next to the checkpoints under their own names (which never match the
# checkpoint pattern).
COMPANIONS: dict[str, list[str]] = {
    "pytables-elink.h5": ["elink2.h5"],
    "hdf5ex-extlink_source.h5": ["extlink_target.h5"],
    "hdf5ex-vds.h5": ["a.h5", "b.h5", "c.h5"],
    "hdf5r-test-h5link.h5": ["test-f32.h5"],
}

ROW_DELTAS = (-1, 2, 0, 1)  # rows removed/added in the run's successive files


# --------------------------------------------------------------------------- #
# Runs
# --------------------------------------------------------------------------- #

def make_run(source: Path, out_dir: Path, model: str, n_checkpoints: int = 2,
             directory: bool = False, companions: list[Path] | None = None) -> list[Path]:
    """A checkpointed run of ``model`` in ``out_dir`` made of copies of ``source``.

    ``n_checkpoints`` single-file checkpoints, plus (``directory``) one more
    checkpoint that is a directory of two rank files. Returns every file in
    consolidation order (checkpoint order, then file order).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{model}_chk{n:05d}.h5" for n in range(1, n_checkpoints + 1)]
    if directory:
        folder = out_dir / f"{model}_chk{n_checkpoints + 1:05d}"
        folder.mkdir()
        files += [folder / "rank_0000.h5", folder / "rank_0001.h5"]
    for index, path in enumerate(files):
        shutil.copyfile(source, path)
        with h5py.File(path, "r+") as f:
            set_trials_completed(f, 1000 * (index + 1))
            vary_rows(f, ROW_DELTAS[index % len(ROW_DELTAS)])
    for extra in companions or []:
        shutil.copyfile(extra, out_dir / extra.name)
    return files


def set_trials_completed(f: h5py.File, value: int) -> None:
    """Root attribute ``trials_completed`` (scalar uint64) through H5A: nothing else rewritten."""
    name = b"trials_completed"
    if h5a.exists(f.id, name):
        h5a.delete(f.id, name)
    attr = h5a.create(f.id, name, h5t.STD_U64LE, h5s.create(h5s.SCALAR))
    attr.write(np.array(value, dtype="<u8"))


def extensible_datasets(f: h5py.File) -> list[h5py.Dataset]:
    """Datasets whose axis 0 is unlimited (the ones whose rows can vary), each once."""
    found: dict[int, h5py.Dataset] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            space = obj.id.get_space()
            if (space.get_simple_extent_type() == h5s.SIMPLE
                    and obj.id.get_create_plist().get_layout() == h5d.CHUNKED
                    and space.get_simple_extent_dims(maxdims=True)[0] == h5s.UNLIMITED):
                found.setdefault(h5py.h5o.get_info(obj.id).addr, obj)

    f.visititems(visit)
    return list(found.values())


def vary_rows(f: h5py.File, delta: int) -> None:
    """Remove ``-delta`` rows from, or append ``delta`` rows (copies of the first) to,
    every dataset whose axis 0 is unlimited; rows are copied byte for byte."""
    if delta == 0:
        return
    for ds in extensible_datasets(f):
        dcpl = ds.id.get_create_plist()
        if not all(h5z.filter_avail(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters())):
            continue  # a filter without a plugin: neither readable nor resizable here
        n = ds.shape[0]
        if delta < 0:
            if n >= 2:
                ds.resize(n + delta, axis=0)
            continue
        if n == 0:
            continue
        block = _read_rows(ds, 0, min(delta, n))
        ds.resize(n + block.shape[0], axis=0)
        _write_rows(ds, n, block)


def _row_space(ds: h5py.Dataset, start: int, count: int) -> tuple[h5s.SpaceID, h5s.SpaceID]:
    fspace = ds.id.get_space()
    shape = (count, *ds.shape[1:])
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    return h5s.create_simple(shape), fspace


def _read_rows(ds: h5py.Dataset, start: int, count: int) -> np.ndarray:
    """Rows as the bytes of the dataset's own type in memory: nothing is converted.

    For variable-length parts these are HDF5's in-memory descriptors (hvl_t,
    char*), written back unchanged into the same file by ``_write_rows``; the
    few bytes HDF5 allocates for them are not reclaimed (a test helper).
    """
    t = ds.id.get_type()
    buf = np.zeros((count, *ds.shape[1:]), dtype=f"V{t.get_size()}")
    mspace, fspace = _row_space(ds, start, count)
    ds.id.read(mspace, fspace, buf, mtype=t)
    return buf


def _write_rows(ds: h5py.Dataset, start: int, block: np.ndarray) -> None:
    t = ds.id.get_type()
    mspace, fspace = _row_space(ds, start, block.shape[0])
    ds.id.write(mspace, fspace, block, mtype=t)


# --------------------------------------------------------------------------- #
# The real corpus
# --------------------------------------------------------------------------- #

def real_files() -> list[Path]:
    """Every corpus file (companions of other files excluded)."""
    companions = {name for names in COMPANIONS.values() for name in names}
    return sorted(p for p in CORPUS_DIR.iterdir()
                  if p.is_file() and p.suffix not in (".md", ".cdl") and p.name not in companions)


def companions_of(path: Path) -> list[Path]:
    return [path.parent / name for name in COMPANIONS.get(path.name, [])]


# --------------------------------------------------------------------------- #
# Synthetic files (written here, with h5py): the ten classes of problems
# --------------------------------------------------------------------------- #

def _hdf5_library() -> ctypes.CDLL | None:
    """The HDF5 library h5py is linked to, for the two calls h5py does not wrap."""
    libs = Path(h5py.__file__).resolve().parent.parent / "h5py.libs"
    for candidate in sorted(libs.glob("libhdf5-*.so*")):
        return ctypes.CDLL(str(candidate))
    return None


def _string_type(size: int, pad: int = h5t.STR_NULLTERM) -> h5t.TypeID:
    t = h5t.C_S1.copy()
    t.set_size(size)
    t.set_strpad(pad)
    return t


def _raw_attr(obj: h5py.HLObject, name: str, t: h5t.TypeID, data: bytes,
              shape: tuple[int, ...] = ()) -> None:
    """An attribute written with its file type as the memory type (bytes as given)."""
    space = h5s.create(h5s.SCALAR) if shape == () else h5s.create_simple(shape)
    attr = h5a.create(obj.id, name.encode(), t, space)
    buf = np.frombuffer(data, dtype=f"V{t.get_size()}").reshape(shape).copy()
    attr.write(buf, mtype=t)


def _raw_dataset(group: h5py.Group, name: str, t: h5t.TypeID, data: bytes,
                 shape: tuple[int, ...], maxshape: tuple[int | None, ...] | None = None,
                 chunks: tuple[int, ...] | None = None, gzip: int | None = None,
                 dcpl: h5p.PropDCID | None = None) -> h5d.DatasetID:
    """A dataset created and written with a file type of our own, bytes as given."""
    if dcpl is None:
        dcpl = h5p.create(h5p.DATASET_CREATE)
    if chunks:
        dcpl.set_chunk(chunks)
    if gzip is not None:
        dcpl.set_deflate(gzip)
    maxdims = tuple(h5s.UNLIMITED if m is None else m for m in (maxshape or shape))
    space = h5s.create_simple(shape, maxdims)
    dsid = h5d.create(group.id, name.encode(), t, space, dcpl=dcpl)
    if data:
        buf = np.frombuffer(data, dtype=f"V{t.get_size()}").reshape(shape).copy()
        dsid.write(h5s.ALL, h5s.ALL, buf, mtype=t)
    return dsid


def syn_fullwidth_strings(path: Path) -> None:
    """1. NULLTERM strings filling their whole size, size-1 character arrays."""
    with h5py.File(path, "w") as f:
        _raw_attr(f, "CLASS", _string_type(5), b"GROUP")
        _raw_attr(f, "Conventions", _string_type(6), b"CF-1.5")
        _raw_attr(f, "flag", _string_type(1), b"Y")
        _raw_attr(f, "chars", _string_type(1), b"abc", shape=(3,))
        _raw_attr(f, "padded", _string_type(8, h5t.STR_SPACEPAD), b"AB      ")
        g = f.create_group("table")
        _raw_attr(g, "CLASS", _string_type(5), b"TABLE")
        _raw_attr(g, "VERSION", _string_type(3), b"2.7")
        d = _raw_dataset(g, "codes", _string_type(4), b"ABC1WXYZ12\x00\x00",
                         shape=(3,), maxshape=(None,), chunks=(2,))
        del d
        f["table/codes"].attrs["TITLE"] = np.bytes_(b"")


def syn_links(path: Path) -> None:
    """2. Soft (also dangling) and external links."""
    target = path.with_name(path.stem + "_target.h5")
    with h5py.File(target, "w") as t:
        t["x"] = np.arange(3)
    with h5py.File(path, "w") as f:
        f["data/values"] = np.arange(5, dtype="<i4")
        f["soft"] = h5py.SoftLink("/data/values")
        f["data/soft_group"] = h5py.SoftLink("/data")
        f["dangling"] = h5py.SoftLink("/nowhere")
        f["external"] = h5py.ExternalLink(target.name, "/x")
        f["external_missing"] = h5py.ExternalLink("missing.h5", "/y")
        f.create_dataset("rows", data=np.arange(4.0), maxshape=(None,), chunks=(2,))


def syn_hard_links(path: Path) -> None:
    """3. Objects with several hard-link names."""
    with h5py.File(path, "w") as f:
        d = f.create_dataset("entry/data/counts", data=np.arange(6, dtype="<u2"),
                             maxshape=(None,), chunks=(4,))
        f["entry/instrument/detector/counts"] = d
        f["entry/alias_of_data"] = f["entry/data"]
        fixed = f.create_dataset("fixed", data=np.arange(3))
        f["also_fixed"] = fixed
        f["entry"].attrs["NX_class"] = np.bytes_(b"NXentry")


def syn_committed_types(path: Path) -> None:
    """4. Named datatypes and the datasets and attributes that use them."""
    with h5py.File(path, "w") as f:
        f["types/pair"] = np.dtype([("a", "<i4"), ("b", "S3")])
        f["types/pair_alias"] = f["types/pair"]
        f["types/big"] = np.dtype(">f8")
        f["types/unused"] = np.dtype("<u2")
        pair = f["types/pair"]
        rows = np.array([(1, b"ab"), (2, b"cd"), (3, b"ef")], dtype=pair.dtype)
        d = f.create_dataset("rows", shape=(3,), maxshape=(None,), chunks=(2,), dtype=pair)
        d[...] = rows
        f.create_dataset("fixed", data=np.arange(3.0), dtype=f["types/big"])
        f.attrs.create("first", rows[:1], dtype=pair)
        d.attrs.create("scale", 2.5, dtype=f["types/big"])


def syn_references(path: Path) -> None:
    """5. Object and region references (datasets, attributes), dimension scales,
    a MATLAB-like cell array (#refs#) in a file with a 512-byte userblock."""
    with h5py.File(path, "w", userblock_size=512) as f:
        x = f.create_dataset("x", data=np.arange(4.0), maxshape=(None,), chunks=(4,))
        x.make_scale("x")
        v = f.create_dataset("v", data=np.arange(8.0).reshape(4, 2),
                             maxshape=(None, 2), chunks=(2, 2))
        v.dims[0].attach_scale(x)
        refs = f.create_group("#refs#")
        a = refs.create_dataset("a", data=np.arange(3.0))
        b = refs.create_dataset("b", data=np.bytes_(b"text"))
        cell = f.create_dataset("cell", shape=(2,), dtype=h5py.ref_dtype)
        cell[0], cell[1] = a.ref, b.ref
        cell.attrs["MATLAB_class"] = np.bytes_(b"cell")
        f.attrs.create("points_to", v.ref, dtype=h5py.ref_dtype)
        nulls = f.create_dataset("null_refs", shape=(2,), dtype=h5py.ref_dtype)
        nulls[1] = a.ref
        region = f.create_dataset("region", shape=(2,), dtype=h5py.regionref_dtype)
        region[0] = v.regionref[1:3, :]
        region[1] = a.regionref[[0, 2]]
    with open(path, "r+b") as fh:
        fh.write(b"MATLAB 7.3 MAT-file, written by corpus.py" + b" " * 20)


def syn_extensible_vlen(path: Path) -> None:
    """6. Extensible vlen strings, vlen sequences and reference datasets."""
    with h5py.File(path, "w") as f:
        s = f.create_dataset("names", shape=(3,), maxshape=(None,), chunks=(2,),
                             dtype=h5py.string_dtype("utf-8"))
        s[...] = ["α", "", "longer text"]
        b = f.create_dataset("bnames", shape=(2,), maxshape=(None,), chunks=(2,),
                             dtype=h5py.string_dtype("ascii"))
        b[...] = [b"a", b"bc"]
        q = f.create_dataset("seq", shape=(3,), maxshape=(None,), chunks=(2,),
                             dtype=h5py.vlen_dtype(np.dtype(">i2")))
        q[0], q[1], q[2] = np.arange(3), np.arange(0), np.arange(5)
        targets = f.create_group("targets")
        t0 = targets.create_dataset("t0", data=[1])
        t1 = targets.create_dataset("t1", data=[2])
        r = f.create_dataset("refs", shape=(3,), maxshape=(None,), chunks=(2,),
                             dtype=h5py.ref_dtype)
        r[0], r[1] = t0.ref, t1.ref
        rr = f.create_dataset("regions", shape=(2,), maxshape=(None,), chunks=(2,),
                              dtype=h5py.regionref_dtype)
        rr[0] = t0.regionref[0:1]


def syn_gzip_padding(path: Path) -> None:
    """7. gzip NULLTERM S4 column holding 'ABC1'; gzip compound with non-zero padding."""
    with h5py.File(path, "w") as f:
        _raw_dataset(f, "codes", _string_type(4), b"ABC1AB\x00\x00WXYZ", shape=(3,),
                     maxshape=(None,), chunks=(2,), gzip=6)
        t = h5t.create(h5t.COMPOUND, 16)
        t.insert(b"a", 0, h5t.STD_U8LE)
        t.insert(b"b", 8, h5t.IEEE_F64LE)
        rows = b"".join(bytes([k]) + b"\xab" * 7 + np.float64(k / 2).tobytes()
                        for k in range(5))
        _raw_dataset(f, "padded", t, rows, shape=(5,), maxshape=(None,), chunks=(2,), gzip=4)
        _raw_attr(f, "padded_attr", t, rows[:16])


def syn_fill_undefined(path: Path) -> None:
    """8a. A dataset whose fill value is undefined (H5Pset_fill_value(NULL))."""
    lib = _hdf5_library()
    with h5py.File(path, "w") as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        if lib is not None:
            lib.H5Pset_fill_value(ctypes.c_int64(dcpl.id), ctypes.c_int64(h5t.STD_I32LE.id),
                                  None)
        data = np.arange(6, dtype="<i4").tobytes()
        _raw_dataset(f, "rows", h5t.STD_I32LE, data, shape=(6,), maxshape=(None,),
                     chunks=(4,), dcpl=dcpl)


def syn_compound_out_of_order(path: Path) -> None:
    """8b. A compound type whose members are stored out of offset order."""
    with h5py.File(path, "w") as f:
        t = h5t.create(h5t.COMPOUND, 12)
        t.insert(b"late", 4, h5t.IEEE_F64LE)
        t.insert(b"early", 0, h5t.STD_I32BE)
        rows = b"".join(np.int32(k).astype(">i4").tobytes() + np.float64(k).tobytes()
                        for k in range(4))
        _raw_dataset(f, "rows", t, rows, shape=(4,), maxshape=(None,), chunks=(3,))


def syn_filter_without_plugin(path: Path) -> None:
    """8c. A dataset whose (optional) filter no plugin provides."""
    with h5py.File(path, "w") as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(31999, h5py.h5z.FLAG_OPTIONAL, (1, 2, 3))
        data = np.arange(8, dtype="<i8").tobytes()
        _raw_dataset(f, "rows", h5t.STD_I64LE, data, shape=(8,), maxshape=(None,), dcpl=dcpl)


def syn_int128(path: Path) -> None:
    """8d. 128-bit integers (fixed and extensible)."""
    with h5py.File(path, "w") as f:
        t = h5t.STD_I64LE.copy()
        t.set_size(16)
        t.set_precision(128)
        data = b"".join(k.to_bytes(16, "little", signed=True) for k in (1, -1, 2**100, 7))
        _raw_dataset(f, "rows", t, data, shape=(4,), maxshape=(None,), chunks=(2,))
        _raw_dataset(f, "fixed", t, data[:32], shape=(2,))


def syn_binary128(path: Path) -> None:
    """8e. IEEE binary128 floats."""
    with h5py.File(path, "w") as f:
        t = h5t.IEEE_F64LE.copy()
        t.set_size(16)
        t.set_precision(128)
        t.set_fields(127, 112, 15, 0, 112)
        t.set_ebias(16383)
        one = (16383 << 112).to_bytes(16, "little")
        two = (16384 << 112).to_bytes(16, "little")
        _raw_dataset(f, "rows", t, one + two + one, shape=(3,), maxshape=(None,), chunks=(2,))


def syn_bounded_axis0(path: Path) -> None:
    """9. A dataset whose first axis is bounded but another axis unlimited."""
    with h5py.File(path, "w") as f:
        f.create_dataset("wide", data=np.arange(6.0).reshape(3, 2), maxshape=(3, None),
                         chunks=(3, 1))
        f.create_dataset("rows", data=np.arange(4), maxshape=(None,), chunks=(2,))


def syn_alloc_fill_time(path: Path) -> None:
    """10. Allocation and fill times of the sources (INCR/IFSET, EARLY/ALLOC, LATE/NEVER)."""
    with h5py.File(path, "w") as f:
        for name, alloc, fill, chunked in (
            ("incr_ifset", h5d.ALLOC_TIME_INCR, h5d.FILL_TIME_IFSET, True),
            ("early_alloc", h5d.ALLOC_TIME_EARLY, h5d.FILL_TIME_ALLOC, True),
            ("late_never", h5d.ALLOC_TIME_LATE, h5d.FILL_TIME_NEVER, False),
            ("early_contig", h5d.ALLOC_TIME_EARLY, h5d.FILL_TIME_IFSET, False),
        ):
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_alloc_time(alloc)
            dcpl.set_fill_time(fill)
            dcpl.set_fill_value(np.array(-3, dtype="<i4"))
            data = np.arange(5, dtype="<i4").tobytes()
            if chunked:
                _raw_dataset(f, name, h5t.STD_I32LE, data, shape=(5,), maxshape=(None,),
                             chunks=(2,), dcpl=dcpl)
            else:
                _raw_dataset(f, name, h5t.STD_I32LE, data, shape=(5,), dcpl=dcpl)


def syn_dataspaces(path: Path) -> None:
    """Scalar and null dataspaces, empty datasets, attribute with a null dataspace."""
    with h5py.File(path, "w") as f:
        f.create_dataset("scalar", data=np.float32(1.5))
        f.create_dataset("null", data=h5py.Empty("<f8"))
        f.attrs["empty"] = h5py.Empty("<i4")
        f.create_dataset("zero_rows", shape=(0, 3), maxshape=(None, 3), chunks=(4, 3),
                         dtype="<f4")
        f.create_dataset("rows", data=np.arange(9.0).reshape(3, 3), maxshape=(None, 3),
                         chunks=(2, 3), compression="lzf", shuffle=True, fletcher32=True)


def syn_plugin_filters(path: Path) -> None:
    """Filters from plugins (hdf5plugin): Blosc, LZ4, Zstd, BZip2 on extensible datasets."""
    with h5py.File(path, "w") as f:
        data = np.arange(40, dtype="<i4").reshape(20, 2)
        for name, options in (("blosc", hdf5plugin.Blosc()), ("lz4", hdf5plugin.LZ4()),
                              ("zstd", hdf5plugin.Zstd()), ("bzip2", hdf5plugin.BZip2())):
            f.create_dataset(name, data=data, maxshape=(None, 2), chunks=(8, 2), **options)


SYNTHETIC: dict[str, Callable[[Path], None]] = {
    "syn-fullwidth-strings.h5": syn_fullwidth_strings,
    "syn-links.h5": syn_links,
    "syn-hard-links.h5": syn_hard_links,
    "syn-committed-types.h5": syn_committed_types,
    "syn-references.h5": syn_references,
    "syn-extensible-vlen.h5": syn_extensible_vlen,
    "syn-gzip-padding.h5": syn_gzip_padding,
    "syn-fill-undefined.h5": syn_fill_undefined,
    "syn-compound-out-of-order.h5": syn_compound_out_of_order,
    "syn-filter-without-plugin.h5": syn_filter_without_plugin,
    "syn-int128.h5": syn_int128,
    "syn-binary128.h5": syn_binary128,
    "syn-bounded-axis0.h5": syn_bounded_axis0,
    "syn-alloc-fill-time.h5": syn_alloc_fill_time,
    "syn-dataspaces.h5": syn_dataspaces,
    "syn-plugin-filters.h5": syn_plugin_filters,
}


def make_synthetic(name: str, directory: Path) -> tuple[Path, list[Path]]:
    """Write synthetic file ``name`` into ``directory``; return it and its companions."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    SYNTHETIC[name](path)
    companions = [p for p in directory.iterdir() if p.name.startswith(path.stem + "_")]
    return path, companions


def all_cases() -> list[str]:
    """Every corpus case: real file names, then synthetic ones."""
    return [p.name for p in real_files()] + list(SYNTHETIC)


def resolve(case: str, scratch: Path) -> tuple[Path, list[Path]]:
    """The source file of a case and its companions (synthetic ones written to ``scratch``)."""
    if case in SYNTHETIC:
        return make_synthetic(case, scratch)
    path = CORPUS_DIR / case
    return path, companions_of(path)

