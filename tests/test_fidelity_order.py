"""Creation order, object comments and names, on files written the way h5py's users write them.

Groups and attributes that track creation order (h5py ``track_order=True``,
or the low-level creation property lists), comments set with
``H5Oset_comment``, objects whose names look like chkq's own, and files a
writer never closed. Every consolidation runs on real ``chkq worker``
processes; what is compared is what a user sees: ``list(group)``,
``list(obj.attrs)``, the comment of each object.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d, h5g, h5o, h5p, h5s, h5t

from chkq.consolidation.output_check import check_output
from chkq.errors import OutputMismatchError
from chkq.workers.client import submit_consolidation
from tests.corpus_expect import compare
from tests.helpers import assert_consolidated
from tests.plugins.cluster import WorkerProcess
from tests.test_hdf5_bounds import TIMEOUT, make_run, refused

Builder = Callable[[h5py.File, int], None]

#: Link names in the (non-alphabetical) order they are created in a large group: more
#: links than a group keeps compact, so its links are in dense storage.
SHUFFLED = [f"v{i:02d}" for i in (7, 3, 19, 0, 12, 5, 16, 1, 9, 14, 2, 18, 6, 11, 4, 15, 8,
                                  13, 10, 17)]
ATTRIBUTES = ["units", "axis", "long_name", "coordinates", "_offset"]


def extensible(where: h5py.Group, name: str, n: int, **options: object) -> h5py.Dataset:
    """An extensible dataset of ``3 * n`` rows (uncompressed unless ``options`` say)."""
    data = np.arange(3 * n * 2, dtype="<f8").reshape(-1, 2) + 1000 * n
    return where.create_dataset(name, data=data, maxshape=(None, 2), chunks=(4, 2),
                                **options)  # type: ignore[arg-type]


def with_attributes(obj: h5py.HLObject, names: list[str] = ATTRIBUTES) -> None:
    for i, name in enumerate(names):
        obj.attrs[name] = np.int32(i)


def ordered(f: h5py.File, n: int) -> None:
    """Tracked order at the root (where the file asks) and in subgroups, mixed link kinds."""
    extensible(f, "zeta", n, track_order=True)
    with_attributes(f["zeta"])
    f["fixed"] = np.arange(5.0)
    extensible(f, "alpha", n, compression="gzip")
    f["soft"] = h5py.SoftLink("/fixed")
    extensible(f, "mid", n)
    f["température"] = np.arange(2)
    f["alias"] = f["fixed"]
    f["elsewhere"] = h5py.ExternalLink("other.h5", "/x")
    group = f.create_group("group", track_order=True)
    with_attributes(group, ATTRIBUTES[::-1])
    for i, name in enumerate(SHUFFLED):
        if i % 3 == 2:
            group[name] = np.arange(4) + i
        else:
            extensible(group, name, n, track_order=True)
            with_attributes(group[name], ATTRIBUTES[i % 5:] + ATTRIBUTES[:i % 5])
    group["link_to_fixed"] = h5py.SoftLink("/fixed")
    small = f.create_group("small", track_order=True)
    for name in ("q", "b", "z", "a"):
        extensible(small, name, n)
    extensible(f, "beta", n)
    low_level_group(f, n)


def low_level_group(f: h5py.File, n: int) -> None:
    """A group and datasets made with explicit creation property lists (TRACKED|INDEXED)."""
    gcpl = h5p.create(h5p.GROUP_CREATE)
    gcpl.set_link_creation_order(h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED)
    gcpl.set_attr_creation_order(h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED)
    group = h5py.Group(h5g.create(f.id, b"low", gcpl=gcpl))
    with_attributes(group, ["y", "x", "w"])
    tracked_only = h5p.create(h5p.GROUP_CREATE)
    tracked_only.set_link_creation_order(h5p.CRT_ORDER_TRACKED)
    inner = h5py.Group(h5g.create(group.id, b"tracked_only", gcpl=tracked_only))
    for where, names in ((group, ["t3", "t1", "t2"]), (inner, ["r", "c", "k"])):
        for name in names:
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_chunk((8,))
            dcpl.set_attr_creation_order(h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED)
            space = h5s.create_simple((5 * n,), (h5s.UNLIMITED,))
            dsid = h5d.create(where.id, name.encode(), h5t.STD_I32LE, space, dcpl=dcpl)
            dataset = h5py.Dataset(dsid)
            dataset[:] = np.arange(5 * n, dtype="<i4") * n
            with_attributes(dataset, ["m", "a", "z"])


def groups_and_objects(f: h5py.File) -> tuple[list[str], list[str]]:
    names: list[str] = []
    f.visit(names.append)
    return (["/", *(n for n in names if isinstance(f[n], h5py.Group))], ["/", *names])


def assert_same_order(output: Path, template: Path) -> None:
    """What h5py lists: every group's members and every object's attributes, in order."""
    with h5py.File(output, "r") as out, h5py.File(template, "r") as ref:
        groups, objects = groups_and_objects(ref)
        assert groups_and_objects(out) == (groups, objects)
        for name in groups:
            assert list(out[name]) == list(ref[name]), name
        for name in objects:
            assert list(out[name].attrs) == list(ref[name].attrs), name


def recreated(output: Path, template: Path, name: str) -> bool:
    """Whether chkq recreated dataset ``name`` (allocated early in the output, not before)."""
    with h5py.File(output, "r") as out, h5py.File(template, "r") as ref:
        return (out[name].id.get_create_plist().get_alloc_time() == h5d.ALLOC_TIME_EARLY
                != ref[name].id.get_create_plist().get_alloc_time())


@pytest.mark.parametrize("options", [
    {"track_order": True},
    {},
    {"track_order": True, "libver": "latest"},
], ids=["root-and-groups", "groups-only", "latest"])
def test_link_and_attribute_creation_order_is_kept(tmp_path: Path, worker: WorkerProcess,
                                                    options: dict[str, object]) -> None:
    run = tmp_path / "run"
    files = make_run(run, ordered, checkpoints=3, **options)
    with h5py.File(files[-1], "r") as ref:
        assert list(ref["group"])[:3] == SHUFFLED[:3]
        assert list(ref["zeta"].attrs) == ATTRIBUTES
        if options.get("track_order"):
            assert list(ref)[:3] == ["zeta", "fixed", "alpha"]
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    # Datasets that track attribute order have version 2 object headers, as the datasets
    # chkq creates in these files have; under the latest bounds every dataset has.
    expected = ["zeta", f"group/{SHUFFLED[0]}", f"group/{SHUFFLED[-1]}", "low/t3",
                "low/tracked_only/r"]
    if options.get("libver") == "latest":
        expected += ["mid", "beta", "small/q"]
    for name in expected:
        assert recreated(output, files[-1], name), f"{name} was not recreated"
    assert_same_order(output, files[-1])
    assert_consolidated(output, files)
    assert compare(output, files) == []


def commented(f: h5py.File, n: int) -> None:
    extensible(f, "rows", n)
    extensible(f, "packed", n, compression="gzip")
    extensible(f, "plain", n)
    f["fixed"] = np.arange(3)
    f["kind"] = np.dtype("<i2")
    group = f.create_group("group", track_order=True)
    extensible(group, "inner", n)
    comments = {"/": "run of 2026", "rows": "metres per second, smoothed",
                "packed": "gzip level 4", "fixed": "constants", "kind": "a committed type",
                "group": "diagnostics", "group/inner": "ünïcode comment"}
    for name, text in comments.items():
        h5o.set_comment(f[name].id, text.encode())


def comment(file: h5py.File, name: str) -> bytes:
    return file.id.get_comment(name.encode())


def test_object_comments_are_kept(tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    files = make_run(run, commented, checkpoints=2)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert recreated(output, files[-1], "rows") and recreated(output, files[-1], "group/inner")
    with h5py.File(output, "r") as out, h5py.File(files[-1], "r") as ref:
        _, objects = groups_and_objects(ref)
        assert [comment(out, n) for n in objects] == [comment(ref, n) for n in objects]
        assert comment(out, "rows") == b"metres per second, smoothed"
        assert comment(out, "group/inner") == "ünïcode comment".encode()
        assert comment(out, "plain") == b""
    assert compare(output, files) == []


def _check(output: Path, template: Path) -> None:
    check_output(output, template, rows={}, raw_datasets=set())


def reinsert(group: h5py.Group, name: str) -> None:
    """Move link ``name`` away and back: HDF5 then counts it as created last."""
    group.id.links.move(name.encode(), group.id, b"moved")
    group.id.links.move(b"moved", group.id, name.encode())


def recreate_attribute(obj: h5py.HLObject, name: str) -> None:
    value = obj.attrs[name]
    del obj.attrs[name]
    obj.attrs[name] = value


@pytest.mark.parametrize("tamper, message", [
    (lambda f: reinsert(f, "zeta"),
     r"group '/' lists its links in another creation order: \['fixed'"),
    (lambda f: reinsert(f["group"], SHUFFLED[4]),
     r"group '/group' lists its links in another creation order"),
    (lambda f: reinsert(f["low/tracked_only"], "r"),
     r"group '/low/tracked_only' lists its links in another creation order"),
    (lambda f: recreate_attribute(f["zeta"], "units"),
     r"the attributes of '/zeta' are in another creation order: \['axis'"),
    (lambda f: recreate_attribute(f["low"], "y"),
     r"the attributes of '/low' are in another creation order: \['x'"),
    (lambda f: recreate_attribute(f, "b"),
     r"the attributes of '/' are in another creation order: \['a'"),
    (lambda f: h5o.set_comment(f["group"].id, b"another"), r"object '/group' has another comment"),
    (lambda f: h5o.set_comment(f["zeta"].id, b"new"), r"object '/zeta' has another comment"),
    (lambda f: h5o.set_comment(f.id, b"new"), r"object '/' has another comment"),
], ids=["root-link", "group-link", "tracked-only-link", "attribute", "group-attribute",
        "root-attribute", "changed-comment", "added-comment", "root-comment"])
def test_the_whole_output_check_compares_creation_order_and_comments(
        tmp_path: Path, tamper: Callable[[h5py.File], object], message: str) -> None:
    template = tmp_path / "template.h5"
    with h5py.File(template, "w", track_order=True) as f:
        ordered(f, 1)
        with_attributes(f, ["b", "a"])
        h5o.set_comment(f["group"].id, b"diagnostics")
    output = tmp_path / "output.h5"
    shutil.copyfile(template, output)
    _check(output, template)
    with h5py.File(output, "r+") as f:
        tamper(f)
    with pytest.raises(OutputMismatchError, match=message):
        _check(output, template)


def test_a_removed_comment_is_found(tmp_path: Path) -> None:
    template = tmp_path / "template.h5"
    with h5py.File(template, "w") as f:
        f["x"] = np.arange(3)
        h5o.set_comment(f["x"].id, b"kept")
    output = tmp_path / "output.h5"
    shutil.copyfile(template, output)
    with h5py.File(output, "r+") as f:
        del f["x"]
        f["x"] = np.arange(3)
    with pytest.raises(OutputMismatchError, match=r"object '/x' has another comment"):
        _check(output, template)


def named_like_staging(f: h5py.File, n: int) -> None:
    """Objects named as chkq once named its staging copies, next to the datasets recreated."""
    extensible(f, "rows", n)
    f[".chkq-new-rows"] = np.arange(4) * 7
    group = f.create_group("g", track_order=True)
    extensible(group, "b", n)
    group[".chkq-new-b"] = np.arange(2)
    group[".chkq-staging-0"] = h5py.SoftLink("/rows")
    extensible(group, "a", n)


def test_objects_named_like_staging_names_are_kept(tmp_path: Path,
                                                    worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    files = make_run(run, named_like_staging, checkpoints=2, track_order=True)
    output = submit_consolidation("run", run).wait_for_output(timeout=TIMEOUT)
    assert recreated(output, files[-1], "rows") and recreated(output, files[-1], "g/b")
    with h5py.File(output, "r") as out:
        assert list(out) == ["rows", ".chkq-new-rows", "g"]
        assert list(out["g"]) == ["b", ".chkq-new-b", ".chkq-staging-0", "a"]
        assert list(out[".chkq-new-rows"][:]) == [0, 7, 14, 21]
        assert out["g"].get(".chkq-staging-0", getlink=True).path == "/rows"
    assert_same_order(output, files[-1])
    assert_consolidated(output, files)


#: A writer that stops (``os._exit``) without closing its file: SWMR or not, with the
#: latest format the superblock still says the file is open for writing.
KILLED_WRITER = r"""
import os, sys
import h5py, numpy as np
f = h5py.File(sys.argv[1], "w", libver="latest")
rows = f.create_dataset("rows", shape=(0, 2), maxshape=(None, 2), chunks=(4, 2), dtype="<f8")
f.attrs["trials_completed"] = np.uint64(1)
if sys.argv[2] == "swmr":
    f.swmr_mode = True
for step in range(6):
    rows.resize((step + 1, 2))
    rows[step] = step
    rows.flush()
f.flush()
if sys.argv[3] == "killed":
    os._exit(0)
print("ready", flush=True)
sys.stdin.read()
f.close()
"""


def plain(f: h5py.File, n: int) -> None:
    extensible(f, "rows", n)


@pytest.mark.parametrize("mode", ["swmr", "plain"])
def test_a_file_its_writer_never_closed_is_reported_as_open_for_writing(
        tmp_path: Path, worker: WorkerProcess, mode: str) -> None:
    run = tmp_path / "run"
    make_run(run, plain, checkpoints=3, libver="latest")
    middle = run / "run_chk00002.h5"
    middle.unlink()
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(middle), mode, "killed"],
                   check=True)
    text = refused(run, "still open for writing")
    assert str(middle) in text and "not HDF5" not in text


def test_a_file_a_live_writer_holds_is_reported_as_open_for_writing(
        tmp_path: Path, worker: WorkerProcess) -> None:
    run = tmp_path / "run"
    make_run(run, plain, checkpoints=2, libver="latest")
    final = run / "run_chk00002.h5"
    final.unlink()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(final), "plain",
                               "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "HDF5_USE_FILE_LOCKING": "TRUE"})
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        text = refused(run, "still open for writing")
        assert str(final) in text
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
