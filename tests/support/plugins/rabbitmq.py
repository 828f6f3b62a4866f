"""RabbitMQ for the tests: a virtual host of each test's own on the machine's server.

The server is the machine's (127.0.0.1:5672, guest/guest; CI starts it).
Each fixture use creates a vhost named ``chkq-test-<random>`` with
``rabbitmqctl`` and deletes it afterwards, queues and messages included,
so tests never see each other's queues.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

AMQP_HOST = "127.0.0.1"
AMQP_PORT = 5672


def rabbitmqctl(*args: str, timeout: float = 60.0) -> str:
    """Run ``rabbitmqctl ARGS``; its output (RuntimeError naming the command if it fails)."""
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def rabbitmq_available() -> str | None:
    """Why RabbitMQ cannot serve the tests here, or None when it can."""
    if shutil.which("rabbitmqctl") is None:
        return ("rabbitmqctl is not on PATH: `apt-get install rabbitmq-server`, then "
                "`rabbitmq-server -detached` (as .ci/run does)")
    try:
        rabbitmqctl("status", timeout=30)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"rabbitmq-server is not running (start it: `rabbitmq-server -detached`): {exc}"
    return None


class Vhost:
    """A RabbitMQ virtual host of one test: ``url`` (guest's) addresses it."""

    def __init__(self, host: str = AMQP_HOST) -> None:
        self.name = f"chkq-test-{uuid.uuid4().hex[:12]}"
        self.host = host

    def url_for(self, host: str) -> str:
        """The broker URL of this vhost reached at ``host`` (another network namespace's view)."""
        return f"amqp://guest:guest@{host}:{AMQP_PORT}/{self.name}"

    @property
    def url(self) -> str:
        return self.url_for(self.host)

    def create(self) -> Vhost:
        rabbitmqctl("add_vhost", self.name)
        rabbitmqctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        rabbitmqctl("delete_vhost", self.name)

    def queues(self) -> dict[str, dict[str, str]]:
        """Queues of the vhost: name -> {type, messages, consumers}."""
        out = rabbitmqctl("list_queues", "-q", "-p", self.name, "--no-table-headers",
                          "name", "type", "messages", "consumers")
        rows = [line.split("\t") for line in out.splitlines() if line.strip()]
        return {r[0]: {"type": r[1], "messages": r[2], "consumers": r[3]}
                for r in rows if r and r[0] != "name"}


@pytest.fixture
def amqp_vhost() -> Iterator[Vhost]:
    """A fresh RabbitMQ vhost for one test (deleted after); skipped without a server."""
    why = rabbitmq_available()
    if why is not None:
        pytest.fail(f"these tests need RabbitMQ: {why}")
    vhost = Vhost().create()
    try:
        yield vhost
    finally:
        vhost.delete()
