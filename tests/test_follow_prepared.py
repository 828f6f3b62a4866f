"""A followed run's next version is cloned as soon as a version is published, and taken over.

Without reflinks a clone is a copy of the whole file: made while the
simulation writes its next checkpoint, the next version waits only for its
own rows. The clone is the previous job's file in the output directory, so
it is checked before it is taken, and proven as any clone is.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import h5py

from chkq.consolidation.driver import consolidate_here
from chkq.consolidation.temporaries import JobFiles
from chkq.consolidation.versions import publish_version
from chkq.demo import RunShape, make_run
from support.helpers import assert_same_hdf5, one_shot


def _run(tmp_path: Path) -> tuple[Path, list[Path]]:
    source = tmp_path / "all"
    source.mkdir()
    make_run(source, "sim", RunShape(checkpoints=4, trials=300, spec_columns=16))
    run = tmp_path / "run"
    run.mkdir()
    return run, sorted(source.iterdir())


def test_the_next_version_takes_over_the_clone_its_previous_job_prepared(
        tmp_path: Path) -> None:
    run, files = _run(tmp_path)
    for f in files[:2]:
        os.link(f, run / f.name)
    consolidate_here(run, "sim")
    os.link(files[2], run / files[2].name)
    third = uuid.uuid4().hex
    record = publish_version(run, "sim", third, 3, None, prepare_next=True)
    prepared = JobFiles(run, "sim", third).next_version
    assert prepared.exists() and "next" in record
    os.link(files[3], run / files[3].name)
    last = publish_version(run, "sim", uuid.uuid4().hex, 4, record)
    assert last["clone"] == "prepared"
    assert not prepared.exists() and "next" not in last
    assert_same_hdf5(run / "sim.h5", one_shot(run, tmp_path / "again"))
    assert not list(run.glob(".chkq-*")), "temporaries left behind"


def test_a_prepared_clone_changed_after_it_was_made_is_not_taken(tmp_path: Path) -> None:
    run, files = _run(tmp_path)
    for f in files[:2]:
        os.link(f, run / f.name)
    consolidate_here(run, "sim")
    os.link(files[2], run / files[2].name)
    third = uuid.uuid4().hex
    record = publish_version(run, "sim", third, 3, None, prepare_next=True)
    prepared = JobFiles(run, "sim", third).next_version
    with h5py.File(prepared, "r+") as f:
        f["galaxy/trial"][0] += 1
    os.link(files[3], run / files[3].name)
    last = publish_version(run, "sim", uuid.uuid4().hex, 4, record)
    assert last["clone"] != "prepared"
    assert_same_hdf5(run / "sim.h5", one_shot(run, tmp_path / "again"))
    assert not list(run.glob(".chkq-*")), "temporaries left behind"
