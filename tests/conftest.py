"""Test session set-up: the checkout off ``sys.path``, the fixtures, the corpus option.

The kind of every test (``unit``, ``cluster``, ``integration``, ``fault``) and the guard of
the fast loop (``pytest -m unit``) are in :mod:`support.plugins.kinds`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

#: The checkout. Off ``sys.path`` even under ``python -m pytest`` (which puts the working
#: directory there): tests import ``chkq.tasks``, as users do, never the bare ``tasks``
#: that would load the same file a second time under another name.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]

# netCDF4, the first time it is imported, points HDF5_PLUGIN_PATH at its own filter plugins,
# built against its own copy of HDF5. Imported here once, before h5py, and the variable put
# back: neither h5py's HDF5 in a test process nor a worker a test starts loads those plugins
# (they would run on the other copy of HDF5, whose error stack and identifiers are not h5py's).
_PLUGIN_PATH = os.environ.get("HDF5_PLUGIN_PATH")
with contextlib.suppress(ImportError):
    import netCDF4  # noqa: F401
if _PLUGIN_PATH is None:
    os.environ.pop("HDF5_PLUGIN_PATH", None)
else:
    os.environ["HDF5_PLUGIN_PATH"] = _PLUGIN_PATH

pytest_plugins = [
    "support.plugins.kinds",
    "support.plugins.cluster", "support.plugins.faults", "support.plugins.object_stores",
    "support.plugins.signing", "support.plugins.users",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--corpus-all", action="store_true", default=False,
                     help="run every corpus file (default: a representative subset)")
