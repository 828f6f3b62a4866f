"""The app factory: importing chkq reads no setting and builds no app; apps are built and used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chkq.config.celery_app import get_app, make_app, use_app
from chkq.config.settings import Settings


@pytest.mark.cluster
def test_importing_reads_nothing_and_builds_nothing() -> None:
    """With a setting that cannot be read, every layer still imports; the app is made on use."""
    env = {**os.environ, "CHKQ_BLOCK_BYTES": "-5"}
    program = ("import chkq.config.celery_app as c, chkq.tasks.state, chkq.workers.client, "
               "chkq.workers.cli.status\n"
               "assert c._app is None and c._settings is None\n"
               "try:\n    c.app\nexcept ValueError as exc:\n    print('on use:', exc)\n")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("on use: CHKQ_BLOCK_BYTES must be positive")


def test_an_app_of_ones_own_is_used_and_the_previous_one_comes_back() -> None:
    own = make_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    previous = use_app(own)
    try:
        assert get_app() is own
        assert get_app().conf.broker_url == "redis://127.0.0.1:1/0"
    finally:
        use_app(previous)
    assert get_app() is not own


def test_a_redis_result_backend_is_found_without_asking_every_installed_package(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's own Redis backend class, with chkq's mixin, and the same class Celery would pick."""
    from celery.app import backends
    from celery.backends.redis import RedisBackend

    from chkq.config.celery_app import backend_by_url
    from chkq.workers.runtime.result_backend import RequeueOutages

    app = make_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    expected = {url: backends.by_url(url, app.loader)
                for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0",
                            "sentinel://127.0.0.1:1/0", "cache+memory://")}

    def scan(namespace: str) -> dict[str, str]:
        raise AssertionError(f"entry points of {namespace} were scanned")

    monkeypatch.setattr(backends, "load_extension_class_names", scan)
    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "sentinel://127.0.0.1:1/0"):
        assert backend_by_url(url, app.loader) == expected[url]
    backend = app.backend
    assert isinstance(backend, RedisBackend) and isinstance(backend, RequeueOutages)
    monkeypatch.undo()
    assert backend_by_url("cache+memory://", app.loader) == expected["cache+memory://"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0",
                                 "redis+socket://:pw@/tmp/chkq-none/redis.sock?virtual_host=0"])
def test_every_redis_broker_gets_chkqs_transport(url: str) -> None:
    """A broker on a Unix socket (the embedded cluster's) gets the transport a cluster's
    gets, though kombu takes the URL's ``redis+`` prefix as the transport's name."""
    from chkq.workers.runtime.broker_transport import Transport

    app = make_app(Settings(broker_url=url, result_backend=url))
    assert isinstance(app.connection_for_write().transport, Transport)
