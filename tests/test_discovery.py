"""Checkpoint discovery, exactly as docs/consolidation.md says (core library, no Celery)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkq.consolidation.discovery import check_model_name, find_checkpoints


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def names(found: list) -> list[tuple[int, list[str]]]:
    return [(c.number, [str(p.relative_to(p.parents[1 if c.is_directory else 0]))
                        if c.is_directory else p.name for p in c.files]) for c in found]


def test_five_digit_files_in_ascending_number(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        touch(tmp_path / f"run_chk{n:05d}.h5")
    found = find_checkpoints(tmp_path, "run")
    assert [c.number for c in found] == [1, 2, 10]
    assert [c.files[0].name for c in found] == [
        "run_chk00001.h5", "run_chk00002.h5", "run_chk00010.h5"]


def test_decoys_are_ignored(tmp_path: Path) -> None:
    touch(tmp_path / "run_chk00001.h5")
    for decoy in ("run_chk1.h5", "run_chk000001.h5", "run_chk0001.h5", "run_chk00002.h5.bak",
                  "run_chk00003.hdf5", "other_chk00004.h5", "run.h5", "xrun_chk00005.h5",
                  "run_chk00006.h5.tmp", "run_chkABCDE.h5", "run_chk00007"):
        touch(tmp_path / decoy)
    (tmp_path / "run_chk00008.h5").mkdir()
    found = find_checkpoints(tmp_path, "run")
    assert [c.number for c in found] == [1]


def test_directory_of_writer_files_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "run_chk00003"
    for name in ("thread_0002.h5", "rank_0001_thread_0002.h5", "rank_0001.h5",
                 "thread_0000.h5", "notes.txt", ".thread_0001.h5.swp"):
        touch(folder / name)
    (found,) = find_checkpoints(tmp_path, "run")
    assert found.is_directory
    assert [p.name for p in found.files] == [
        "rank_0001.h5", "rank_0001_thread_0002.h5", "thread_0000.h5", "thread_0002.h5"]


def test_file_wins_over_directory_with_the_same_number(tmp_path: Path) -> None:
    touch(tmp_path / "run_chk00001" / "thread_0000.h5")
    touch(tmp_path / "run_chk00001.h5")
    touch(tmp_path / "run_chk00002" / "thread_0000.h5")
    found = find_checkpoints(tmp_path, "run")
    assert [(c.number, c.is_directory) for c in found] == [(1, False), (2, True)]
    assert found[0].files == (tmp_path / "run_chk00001.h5",)


def test_files_and_directories_mix_in_number_order(tmp_path: Path) -> None:
    touch(tmp_path / "run_chk00002.h5")
    touch(tmp_path / "run_chk00001" / "thread_0000.h5")
    touch(tmp_path / "run_chk00003" / "thread_0000.h5")
    assert [c.number for c in find_checkpoints(tmp_path, "run")] == [1, 2, 3]


def test_model_names_with_regex_characters_match_literally(tmp_path: Path) -> None:
    touch(tmp_path / "a.b+c_chk00001.h5")
    touch(tmp_path / "aXb+c_chk00002.h5")
    assert [c.number for c in find_checkpoints(tmp_path, "a.b+c")] == [1]


def test_no_checkpoints_is_an_empty_list(tmp_path: Path) -> None:
    touch(tmp_path / "other_chk00001.h5")
    assert find_checkpoints(tmp_path, "run") == []


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../x", "a\\b", ".hidden", "a\x00b", "x..y"])
def test_model_names_that_could_escape_the_directory_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid model name"):
        check_model_name(bad)


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoints(tmp_path / "nope", "run")
    touch(tmp_path / "file")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        find_checkpoints(tmp_path / "file", "run")
