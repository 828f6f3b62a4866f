"""How the planner cuts a job into tasks (core library, no Celery)."""

from __future__ import annotations

import uuid
from pathlib import Path

from chkq.consolidation.prepare import prepare
from chkq.demo import RunShape, make_run


def test_one_copy_task_per_extensible_dataset_big_ones_split(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=3, writers=2, trials=3000, spec_columns=64))
    plan = prepare(tmp_path, "run", uuid.uuid4().hex, task_bytes=1 << 20)
    names = [d.name for d in plan.datasets]
    per_dataset: dict[str, list[tuple[int, int]]] = {}
    for unit in plan.copy_units:
        assert len(unit.pieces) == 1, "a copy task works on one dataset"
        (index, start, stop), = unit.pieces
        per_dataset.setdefault(names[index], []).append((start, stop))
    assert sorted(per_dataset) == sorted(names)
    for d in plan.datasets:
        ranges = sorted(per_dataset[d.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == d.total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(start % d.chunk[0] == 0 for start, _ in ranges)
    spec = next(d for d in plan.datasets if d.name == "spectra/spec")
    assert len(per_dataset["spectra/spec"]) == -(-spec.total * spec.row_bytes // (1 << 20))
    assert plan.verify_units == [[i, i + 1] for i in range(6)], "one verify task per file"


def test_many_small_files_are_batched_so_each_is_opened_once(tmp_path: Path) -> None:
    make_run(tmp_path, "run", RunShape(checkpoints=100, trials=1, spec_columns=8))
    plan = prepare(tmp_path, "run", uuid.uuid4().hex, task_files=16)
    assert len(plan.copy_units) == len(plan.verify_units) == 7
    for unit, (first, stop) in zip(plan.copy_units, plan.verify_units, strict=True):
        assert {d for d, _, _ in unit.pieces} == set(range(len(plan.datasets)))
        assert stop - first <= 16
