"""A worker's scratch directory is its own: made private, and refused when it is not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chkq.fsutil import private_directory


def test_a_missing_scratch_directory_is_made_private(tmp_path: Path) -> None:
    path = private_directory(tmp_path / "a" / "scratch")
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700


def test_an_existing_private_directory_is_used(tmp_path: Path) -> None:
    (tmp_path / "scratch").mkdir(mode=0o700)
    assert private_directory(tmp_path / "scratch") == tmp_path / "scratch"


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_directory_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch").chmod(mode)
    with pytest.raises(PermissionError, match=r"scratch.*open to other users"):
        private_directory(tmp_path / "scratch")


def test_a_link_planted_where_the_scratch_directory_goes_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    (tmp_path / "scratch").symlink_to(target)
    with pytest.raises(PermissionError, match="not a directory"):
        private_directory(tmp_path / "scratch")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's directory")
def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "scratch").mkdir(mode=0o700)
    os.chown(tmp_path / "scratch", 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        private_directory(tmp_path / "scratch")
