"""Test session set-up: the checkout off ``sys.path``, the fixtures, the corpus option.

The kind of every test (``unit``, ``cluster``, ``integration``, ``fault``) and the guard of
the fast loop (``pytest -m unit``) are in :mod:`support.plugins.kinds`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: The checkout. Off ``sys.path`` even under ``python -m pytest`` (which puts the working
#: directory there): tests import ``chkq.tasks``, as users do, never the bare ``tasks``
#: that would load the same file a second time under another name.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]

pytest_plugins = [
    "support.plugins.kinds",
    "support.plugins.cluster", "support.plugins.faults", "support.plugins.object_stores",
    "support.plugins.signing", "support.plugins.users",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--corpus-all", action="store_true", default=False,
                     help="run every corpus file (default: a representative subset)")
