"""The corpus comparator on its own: it accepts an exact output and catches each problem class.

An exact output is built here by a tiny independent consolidator
(``ideal_output``: the template's bytes, extensible datasets resized and
filled with the sources' rows, references re-pointed by name); then one thing
at a time is broken in a copy of it and ``compare`` must name it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d, h5p, h5r, h5s, h5t

from support.corpus import (
    _raw_attr,
    _raw_dataset,
    _string_type,
    all_cases,
    make_run,
    resolve,
)
from support.corpus_expect import CorpusWarning, compare, compare_full, needs_decoding, template_of

# Cases where an exact consolidation does not exist or cannot be verified: the
# comparator must say so (the corpus test expects a refusal for these).
NOT_CONSOLIDATABLE = {
    "syn-bounded-axis0.h5": "axis 0 is bounded",
    "pytables-Tables_lzo2_shuffle.h5": "cannot be verified",
}


# --------------------------------------------------------------------------- #
# An independent exact consolidation
# --------------------------------------------------------------------------- #

def _extensible(f: h5py.File) -> list[str]:
    seen: dict[int, str] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and obj.maxshape and None in obj.maxshape:
            seen.setdefault(h5py.h5o.get_info(obj.id).addr, "/" + name)

    f.visititems(visit)
    return sorted(seen.values())


def _rows_space(shape: tuple[int, ...], start: int, count: int) -> tuple[h5s.SpaceID,
                                                                         h5s.SpaceID]:
    fspace = h5s.create_simple(shape, (h5s.UNLIMITED,) * len(shape))
    sel = (count, *shape[1:])
    fspace.select_hyperslab((start,) + (0,) * (len(shape) - 1), sel)
    return h5s.create_simple(sel), fspace


def ideal_output(sources: list[Path], out: Path) -> Path:
    template = template_of(sources)
    shutil.copyfile(template, out)
    with h5py.File(out, "r+") as o:
        for path in _extensible(o):
            ds = o[path]
            if ds.maxshape[0] is not None:
                raise NotImplementedError(f"{path}: axis 0 bounded")
            t = ds.id.get_type()
            opened = [h5py.File(s, "r") for s in sources]
            try:
                counts = [sf[path].shape[0] for sf in opened]
                ds.resize(sum(counts), axis=0)
                pos = 0
                for sf, n in zip(opened, counts, strict=True):
                    if n:
                        try:
                            _copy_rows(sf, sf[path], o, ds, t, pos, n)
                        except OSError as e:  # a filter without a plugin
                            raise NotImplementedError(f"{path}: {e}") from e
                    pos += n
            finally:
                for sf in opened:
                    sf.close()
    return out


def _copy_rows(sf: h5py.File, sds: h5py.Dataset, o: h5py.File, ds: h5py.Dataset,
               t: h5t.TypeID, pos: int, n: int) -> None:
    if t.get_class() == h5t.REFERENCE:
        region = t == h5t.STD_REF_DSETREG
        values = sds[()]
        out = np.empty(values.shape, dtype=h5py.regionref_dtype if region else h5py.ref_dtype)
        for index, ref in np.ndenumerate(values):
            if not ref:
                out[index] = h5py.RegionReference() if region else h5py.Reference()
                continue
            target = sf[ref].name
            if region:
                out[index] = h5r.create(o.id, target.encode(), h5r.DATASET_REGION,
                                        h5r.get_region(ref, sf.id))
            else:
                out[index] = o[target].ref
        ds[pos:pos + n] = out
        return
    if needs_decoding(t) and _holds_references(t):
        raise NotImplementedError("references inside another type")
    st = sds.id.get_type()
    buf = np.zeros((n, *sds.shape[1:]), dtype=f"V{st.get_size()}")
    mspace, fspace = _rows_space(sds.shape, 0, n)
    sds.id.read(mspace, fspace, buf, mtype=st)
    mspace, fspace = _rows_space(ds.shape, pos, n)
    ds.id.write(mspace, fspace, buf, mtype=t)


def _holds_references(t: h5t.TypeID) -> bool:
    cls = t.get_class()
    if cls == h5t.REFERENCE:
        return True
    if cls == h5t.COMPOUND:
        return any(_holds_references(t.get_member_type(i)) for i in range(t.get_nmembers()))
    if cls in (h5t.ARRAY, h5t.VLEN):
        return _holds_references(t.get_super())
    return False


def run_of(case: str, tmp_path: Path, checkpoints: int = 2,
           directory: bool = True) -> tuple[list[Path], Path]:
    source, companions = resolve(case, tmp_path / "source")
    files = make_run(source, tmp_path / "run", "run", checkpoints, directory, companions)
    return files, ideal_output(files, tmp_path / "run" / "ideal.h5")


# --------------------------------------------------------------------------- #
# No false alarm on any corpus case
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("case", all_cases())
def test_exact_consolidation_of_every_case_is_accepted(case: str, tmp_path: Path) -> None:
    try:
        files, output = run_of(case, tmp_path)
    except NotImplementedError:
        assert case in NOT_CONSOLIDATABLE
        return
    diffs = compare(output, files)
    if case in NOT_CONSOLIDATABLE:
        assert any(NOT_CONSOLIDATABLE[case] in d for d in diffs), diffs
    else:
        assert diffs == []


def test_template_is_the_final_checkpoints_first_file(tmp_path: Path) -> None:
    files, _ = run_of("syn-hard-links.h5", tmp_path)
    assert template_of(files) == tmp_path / "run" / "run_chk00003" / "rank_0000.h5"
    single, _ = run_of("syn-hard-links.h5", tmp_path / "b", directory=False)
    assert template_of(single) == tmp_path / "b" / "run" / "run_chk00002.h5"


# --------------------------------------------------------------------------- #
# Each problem class is caught
# --------------------------------------------------------------------------- #

Breaker = Callable[[h5py.File], None]


def broken(case: str, tmp_path: Path, breaker: Breaker) -> list[str]:
    files, ideal = run_of(case, tmp_path)
    assert compare(ideal, files) == []
    with h5py.File(ideal, "r+") as f:
        breaker(f)
    return compare(ideal, files)


def _recreate_attr(obj: h5py.HLObject, name: str, t: h5t.TypeID, data: bytes,
                   shape: tuple[int, ...] = ()) -> None:
    del obj.attrs[name]
    _raw_attr(obj, name, t, data, shape)


def assert_names(diffs: list[str], *needles: str) -> None:
    assert diffs, "the comparator found no difference"
    assert any(all(n in d for n in needles) for d in diffs), (needles, diffs)


def test_1_truncated_full_width_nullterm_string_attribute(tmp_path: Path) -> None:
    diffs = broken("syn-fullwidth-strings.h5", tmp_path, lambda f: _recreate_attr(
        f, "CLASS", _string_type(5), b"GROU\0"))
    assert_names(diffs, "/", "CLASS", "value")


def test_1_string_padding_changed(tmp_path: Path) -> None:
    diffs = broken("syn-fullwidth-strings.h5", tmp_path, lambda f: _recreate_attr(
        f["table"], "CLASS", _string_type(5, h5t.STR_NULLPAD), b"TABLE"))
    assert_names(diffs, "/table", "CLASS", "NULLPAD")


def test_1_size1_character_array_turned_into_a_string(tmp_path: Path) -> None:
    diffs = broken("syn-fullwidth-strings.h5", tmp_path, lambda f: _recreate_attr(
        f, "chars", _string_type(3), b"abc"))
    assert_names(diffs, "chars", "type")


def test_2_dropped_soft_link(tmp_path: Path) -> None:
    def drop(f: h5py.File) -> None:
        del f["soft"]

    assert_names(broken("syn-links.h5", tmp_path, drop), "/soft", "missing")


def test_2_soft_link_resolved_into_a_hard_link(tmp_path: Path) -> None:
    def harden(f: h5py.File) -> None:
        del f["soft"]
        f["soft"] = f["data/values"]

    diffs = broken("syn-links.h5", tmp_path, harden)
    assert_names(diffs, "/soft", "hard")


def test_2_external_link_copied_or_retargeted(tmp_path: Path) -> None:
    def retarget(f: h5py.File) -> None:
        del f["external"]
        f["external"] = h5py.ExternalLink("elsewhere.h5", "/x")

    assert_names(broken("syn-links.h5", tmp_path, retarget), "/external", "elsewhere.h5")

    def copied(f: h5py.File) -> None:
        del f["external"]
        f["external"] = np.arange(3)

    assert_names(broken("syn-links.h5", tmp_path / "b", copied), "/external", "external")


def test_3_lost_hard_link_alias(tmp_path: Path) -> None:
    def split(f: h5py.File) -> None:
        del f["also_fixed"]
        f.copy("fixed", "also_fixed")

    assert_names(broken("syn-hard-links.h5", tmp_path, split), "also_fixed", "one object")


def test_3_lost_alias_of_a_group_in_a_real_file(tmp_path: Path) -> None:
    def split(f: h5py.File) -> None:
        del f["hardlink/test2"]
        f.copy("testgroup/test", "hardlink/test2")

    assert_names(broken("hdf5r-test-h5link.h5", tmp_path, split), "/hardlink/test2")


def test_4_anonymous_copy_of_a_committed_type(tmp_path: Path) -> None:
    def anonymous(f: h5py.File) -> None:
        data = f["fixed"][()]
        del f["fixed"]
        f.create_dataset("fixed", data=data, dtype=">f8")

    assert_names(broken("syn-committed-types.h5", tmp_path, anonymous), "/fixed", "committed")


def test_4_attribute_loses_its_committed_type(tmp_path: Path) -> None:
    def anonymous(f: h5py.File) -> None:
        value = f.attrs["first"]
        del f.attrs["first"]
        f.attrs.create("first", value, dtype=value.dtype)

    assert_names(broken("syn-committed-types.h5", tmp_path, anonymous), "first", "committed")


def test_4_named_type_dropped(tmp_path: Path) -> None:
    def drop(f: h5py.File) -> None:
        del f["types/unused"]

    assert_names(broken("syn-committed-types.h5", tmp_path, drop), "/types/unused", "missing")


def test_5_null_reference(tmp_path: Path) -> None:
    def null(f: h5py.File) -> None:
        f["cell"][1] = h5py.Reference()

    assert_names(broken("syn-references.h5", tmp_path, null), "/cell", "NULL")


def test_5_reference_pointing_elsewhere(tmp_path: Path) -> None:
    def elsewhere(f: h5py.File) -> None:
        f.attrs["points_to"] = f["x"].ref

    assert_names(broken("syn-references.h5", tmp_path, elsewhere), "points_to", "/x")


def test_5_region_selection_changed(tmp_path: Path) -> None:
    def moved(f: h5py.File) -> None:
        f["region"][0] = f["v"].regionref[0:2, :]

    assert_names(broken("syn-references.h5", tmp_path, moved), "/region")


def test_5_dimension_scale_detached(tmp_path: Path) -> None:
    def detach(f: h5py.File) -> None:
        f["v"].dims[0].detach_scale(f["x"])

    assert_names(broken("syn-references.h5", tmp_path, detach), "DIMENSION_LIST")


def test_5_userblock_lost(tmp_path: Path) -> None:
    files, ideal = run_of("syn-references.h5", tmp_path)
    with open(ideal, "r+b") as fh:
        fh.write(b"X")
    assert_names(compare(ideal, files), "userblock")


def test_6_extensible_vlen_rows_wrong(tmp_path: Path) -> None:
    def drop_text(f: h5py.File) -> None:
        f["names"][2] = "longer tex"

    assert_names(broken("syn-extensible-vlen.h5", tmp_path, drop_text), "/names", "row 2")

    def seq(f: h5py.File) -> None:
        f["seq"][0] = np.arange(2, dtype=">i2")

    assert_names(broken("syn-extensible-vlen.h5", tmp_path / "b", seq), "/seq", "row 0")


def test_6_extensible_references_not_repointed(tmp_path: Path) -> None:
    def swap(f: h5py.File) -> None:
        refs = f["refs"][()]
        refs[0], refs[1] = refs[1], refs[0]
        f["refs"][...] = refs

    assert_names(broken("syn-extensible-vlen.h5", tmp_path, swap), "/refs", "row 0")


def test_6_rows_in_the_wrong_order_or_missing(tmp_path: Path) -> None:
    files, ideal = run_of("syn-hard-links.h5", tmp_path)
    assert compare(ideal, files[::-1][1:] + files[-1:]) != []

    def shrink(f: h5py.File) -> None:
        f["entry/data/counts"].resize(f["entry/data/counts"].shape[0] - 1, axis=0)

    assert_names(broken("syn-hard-links.h5", tmp_path / "b", shrink), "counts", "dataspace")


def _raw_write(ds: h5py.Dataset, row: int, data: bytes) -> None:
    t = ds.id.get_type()
    fspace = ds.id.get_space()
    fspace.select_hyperslab((row,), (1,))
    buf = np.frombuffer(data, dtype=f"V{t.get_size()}").copy()
    ds.id.write(h5s.create_simple((1,)), fspace, buf, mtype=t)


def test_7_gzip_nullterm_column_truncated(tmp_path: Path) -> None:
    diffs = broken("syn-gzip-padding.h5", tmp_path,
                   lambda f: _raw_write(f["codes"], 0, b"ABC\0"))
    assert_names(diffs, "/codes", "rows differ")


def test_7_compound_padding_bytes_zeroed(tmp_path: Path) -> None:
    row = bytes([0]) + b"\0" * 7 + np.float64(0).tobytes()
    diffs = broken("syn-gzip-padding.h5", tmp_path, lambda f: _raw_write(f["padded"], 0, row))
    assert_names(diffs, "/padded", "rows differ")


def _recreate(f: h5py.File, name: str, dcpl: h5p.PropDCID, chunks: tuple[int, ...] | None,
              maxshape: tuple[int | None, ...] | None) -> None:
    ds = f[name]
    t = ds.id.get_type()
    shape = ds.shape
    buf = np.zeros(shape, dtype=f"V{t.get_size()}")
    ds.id.read(h5s.ALL, h5s.ALL, buf, mtype=t)
    del f[name]
    _raw_dataset(f, name, t, buf.tobytes(), shape, maxshape=maxshape, chunks=chunks, dcpl=dcpl)


def test_8_fill_value_defined_where_it_was_not(tmp_path: Path) -> None:
    def define(f: h5py.File) -> None:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_fill_value(np.array(0, dtype="<i4"))
        _recreate(f, "rows", dcpl, (4,), (None,))

    assert_names(broken("syn-fill-undefined.h5", tmp_path, define), "/rows", "fill_value")


def test_8_filters_and_chunks_changed(tmp_path: Path) -> None:
    def plain(f: h5py.File) -> None:
        _recreate(f, "codes", h5p.create(h5p.DATASET_CREATE), (3,), (None,))

    diffs = broken("syn-gzip-padding.h5", tmp_path, plain)
    assert_names(diffs, "/codes", "filters")
    assert_names(diffs, "/codes", "chunk")


def test_8_compound_members_reordered(tmp_path: Path) -> None:
    def reorder(f: h5py.File) -> None:
        ds = f["rows"]
        t = ds.id.get_type()
        buf = np.zeros(ds.shape, dtype=f"V{t.get_size()}")
        ds.id.read(h5s.ALL, h5s.ALL, buf, mtype=t)
        ordered = h5t.create(h5t.COMPOUND, 12)
        ordered.insert(b"early", 0, h5t.STD_I32BE)
        ordered.insert(b"late", 4, h5t.IEEE_F64LE)
        del f["rows"]
        _raw_dataset(f, "rows", ordered, buf.tobytes(), ds.shape, (None,), (3,))

    diffs = broken("syn-compound-out-of-order.h5", tmp_path, reorder)
    assert_names(diffs, "/rows", "dtype")


def test_8_int128_narrowed(tmp_path: Path) -> None:
    def narrow(f: h5py.File) -> None:
        data = f["fixed"].id
        del data
        del f["fixed"]
        f["fixed"] = np.array([1, -1], dtype="<i8")

    assert_names(broken("syn-int128.h5", tmp_path, narrow), "/fixed", "dtype")


def test_9_bounded_first_axis_reported(tmp_path: Path) -> None:
    source, _ = resolve("syn-bounded-axis0.h5", tmp_path / "src")
    files = make_run(source, tmp_path / "run", "run", 2, False)
    assert_names(compare(files[-1], files), "/wide", "bounded")


def test_10_fill_time_changed_is_a_difference_alloc_time_a_warning(tmp_path: Path) -> None:
    def fill_time(f: h5py.File) -> None:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_INCR)
        dcpl.set_fill_time(h5d.FILL_TIME_ALLOC)
        dcpl.set_fill_value(np.array(-3, dtype="<i4"))
        _recreate(f, "incr_ifset", dcpl, (2,), (None,))

    assert_names(broken("syn-alloc-fill-time.h5", tmp_path, fill_time), "/incr_ifset",
                 "fill_time")

    def alloc_time(f: h5py.File) -> None:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_LATE)
        dcpl.set_fill_time(h5d.FILL_TIME_IFSET)
        dcpl.set_fill_value(np.array(-3, dtype="<i4"))
        _recreate(f, "early_contig", dcpl, None, None)

    files, ideal = run_of("syn-alloc-fill-time.h5", tmp_path / "b")
    with h5py.File(ideal, "r+") as f:
        alloc_time(f)
    result = compare_full(ideal, files)
    assert result.differences == []
    assert any("/early_contig" in w and "alloc_time" in w for w in result.warnings)
    with pytest.warns(CorpusWarning, match="alloc_time"):
        assert compare(ideal, files) == []


def test_trials_completed_comes_from_the_template(tmp_path: Path) -> None:
    def other(f: h5py.File) -> None:
        f.attrs.modify("trials_completed", np.uint64(1))

    assert_names(broken("syn-dataspaces.h5", tmp_path, other), "trials_completed")


def test_unexpected_object_and_dataspace_change(tmp_path: Path) -> None:
    def extra(f: h5py.File) -> None:
        f["extra"] = np.arange(2)
        del f["scalar"]
        f["scalar"] = np.array([1.5], dtype=np.float32)

    diffs = broken("syn-dataspaces.h5", tmp_path, extra)
    assert_names(diffs, "/extra", "unexpected")
    assert_names(diffs, "/scalar", "dataspace")
