"""The pure parts of a store job: fetch batches, destinations, errors named by URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkq.errors import BadCheckpointError
from chkq.staging import SourceObject, StoreRun
from chkq.tasks.from_store import StoreJob, destination_of, fetch_units, in_store_terms


def objects(*sizes: int) -> tuple[SourceObject, ...]:
    return tuple(SourceObject(f"m_chk{i + 1:05d}.h5", f"k{i}", size, "v")
                 for i, size in enumerate(sizes))


def test_fetch_units_are_cut_by_bytes_and_by_count() -> None:
    assert fetch_units(objects(40, 40, 40), 100, 64) == [(0, 2), (2, 3)]
    assert fetch_units(objects(*[1] * 5), 100, 2) == [(0, 2), (2, 4), (4, 5)]
    assert fetch_units(objects(500, 1), 100, 64) == [(0, 1), (1, 2)], "one object at least"
    assert fetch_units((), 100, 64) == []


RUN = StoreRun(source="s3://b/runs/r1/", store_url="s3://b", prefix="runs/r1/", run_id=None,
               model="m", objects=objects(10, 10))


def test_the_destination_is_beside_the_sources_or_the_object_named() -> None:
    assert destination_of(RUN, None) == ("s3://b", "runs/r1/m.h5")
    assert destination_of(RUN, "gs://other/final/m.h5") == ("gs://other/final/", "m.h5")
    for bad in ("s3://b/dir/", "m.h5"):
        with pytest.raises(ValueError, match="must name an object"):
            destination_of(RUN, bad)


def test_errors_name_the_object_not_the_workers_scratch_copy(tmp_path: Path) -> None:
    job = StoreJob(RUN, ("s3://b", "runs/r1/m.h5"), "chkq.node.w@h", "0" * 32, False)
    local = f"{job.run_dir}/m_chk00002.h5"
    renamed = in_store_terms(BadCheckpointError(f"{local!r} is truncated"), job)
    assert type(renamed) is BadCheckpointError
    assert str(renamed) == "'s3://b/runs/r1/m_chk00002.h5' is truncated"
    missing = in_store_terms(FileNotFoundError(2, "no such file", local), job)
    assert isinstance(missing, FileNotFoundError) and missing.filename == \
        "s3://b/runs/r1/m_chk00002.h5"
    other = ValueError("nothing local here")
    assert in_store_terms(other, job) is other
