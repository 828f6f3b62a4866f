"""The kind of every test, and the guard that keeps the fast loop in one process.

Every test gets one or more kind markers, from the fixtures it uses or the mark of its
module:

- ``cluster``: it starts processes — the session's private redis-server and Celery
  workers (``redis_server``, ``worker``, ``start_worker``, ``make_cluster``), or, marked
  in its module, the ``chkq`` command line, an embedded cluster, a script;
- ``integration``: it talks to other servers or users — the S3 and GCS emulators (also a
  ``store`` or ``kind`` parameter ``s3`` or ``gcs``), RabbitMQ, two real local users, network
  namespaces;
- ``fault``: it injects a real fault — network faults through a proxy or a cut link, or,
  marked in its module, killed processes and servers;
- ``unit``: none of ``cluster`` and ``integration``: it runs in this process alone.
  ``pytest -m unit`` is the developers' fast loop. A ``unit`` test that starts a child
  process, or asks for one of the fixtures above at run time, fails and says which mark
  it needs, so the fast loop stays fast and in one process.

A plugin (registered in ``tests/conftest.py``), not conftest hooks: a fixture of the
session's scope is set up through the session's hooks, which a conftest's do not join.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

#: Fixtures that start processes of the session or the test: redis-server, Celery workers.
CLUSTER_FIXTURES = frozenset({"redis_server", "worker", "start_worker", "make_cluster"})
#: Fixtures that talk to other servers or users.
INTEGRATION_FIXTURES = frozenset({"s3_endpoint", "gcs_endpoint", "s3_proxy", "gcs_proxy",
                                  "black_hole", "amqp_vhost", "local_users", "hosts"})
#: Fixtures that inject network faults.
FAULT_FIXTURES = frozenset({"s3_proxy", "gcs_proxy", "black_hole", "hosts"})
#: Store kinds served by an emulator, as the ``store`` fixture or a ``kind`` parameter name them.
SERVER_STORES = frozenset({"s3", "gcs"})
STORE_PARAMS = ("store", "kind")
KINDS = ("cluster", "integration", "fault")


def kinds_of(item: pytest.Item) -> set[str]:
    """The kind markers of ``item``: its own, and those its fixtures imply."""
    kinds = {kind for kind in KINDS if item.get_closest_marker(kind) is not None}
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & CLUSTER_FIXTURES:
        kinds.add("cluster")
    if fixtures & INTEGRATION_FIXTURES:
        kinds.add("integration")
    if fixtures & FAULT_FIXTURES:
        kinds.add("fault")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(params.get(name) in SERVER_STORES for name in STORE_PARAMS):
        kinds.add("integration")
    if not kinds & {"cluster", "integration"}:
        kinds.add("unit")
    return kinds


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for kind in sorted(kinds_of(item)):
            if item.get_closest_marker(kind) is None:
                item.add_marker(kind)


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"a unit test started {what}: mark its module or test `pytest.mark.cluster` "
            "(it then leaves the fast loop)")
    return refused


def _refuse_children(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Every way to start a child process raises, naming ``where``, until undone."""
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse(f"a child process{where}"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse(f"a child process{where}"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        monkeypatch.setattr(os, name, _refuse(f"a child process (os.{name}){where}"))


@pytest.fixture(autouse=True)
def _one_process(request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ``unit`` test runs in this process: every way to start a child raises."""
    if request.node.get_closest_marker("unit") is not None:
        _refuse_children(monkeypatch, "")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any],
                         request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``unit`` test whose fixtures (of any scope) start servers or children is not one."""
    item = getattr(request, "_pyfuncitem", None)
    unit = item is not None and item.get_closest_marker("unit") is not None
    if unit and fixturedef.argname in CLUSTER_FIXTURES | INTEGRATION_FIXTURES:
        raise AssertionError(
            f"a unit test asked for fixture {fixturedef.argname!r} at run time: mark it "
            "`pytest.mark.integration` or `pytest.mark.cluster`")
    if not unit or fixturedef.scope == "function":
        # A test's own fixtures run under ``_one_process`` (autouse, so set up first).
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        _refuse_children(monkeypatch, f" in fixture {fixturedef.argname!r}")
        yield
