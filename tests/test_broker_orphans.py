"""Messages of a lost broker connection: what the worker does with them once it is back.

A task may fail on its own from a Redis outage (its result could not be stored) before
Celery's cancellation reaches it: its pool process lives on and takes other tasks. Its
message, handed back on the lost connection, must then go back to its queue once the
worker has reconnected, not wait for that process to exit (a job parked for ever).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.worker import state

from chkq.workers.runtime import broker_transport
from chkq.workers.runtime.broker_transport import ACK, REQUEUE, Orphans


class LiveChannel:
    """A reconnected channel: what the orphans are settled through (records each call)."""

    closed = False

    def __init__(self) -> None:
        self.connection = SimpleNamespace(client=object(), connection_errors=(ConnectionError,))
        self.client = object()
        self.restored: list[tuple[Any, bool]] = []
        self.acked: list[Any] = []
        self.qos = SimpleNamespace(_remove_from_indices=self._ack)

    def restore(self, tag: Any, leftmost: bool) -> None:
        self.restored.append((tag, leftmost))

    def _ack(self, tag: Any) -> Any:
        self.acked.append(tag)
        return SimpleNamespace(execute=lambda: None)


class Held:
    """A request of this worker running in a pool process that stays alive (this one)."""

    def __init__(self, tag: str) -> None:
        self.message = SimpleNamespace(delivery_tag=tag)
        self.worker_pid = os.getpid()


@pytest.fixture
def running() -> Iterator[Held]:
    """A request holding ``tag-1`` (Celery's own record of what the worker runs)."""
    request = Held("tag-1")
    state.active_requests.add(request)  # type: ignore[arg-type]
    yield request
    state.active_requests.discard(request)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def restores_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore through a :class:`LiveChannel` is recorded by it (real ones: below)."""
    real = broker_transport._restore

    def restore(channel: Any, tag: Any, kept: Any, leftmost: bool) -> None:
        if isinstance(channel, LiveChannel):
            channel.restore(tag, leftmost)
        else:
            real(channel, tag, kept, leftmost)

    monkeypatch.setattr(broker_transport, "_restore", restore)


def _orphans_through(channel: LiveChannel) -> Orphans:
    orphans = Orphans()
    orphans.channels.add(channel)  # type: ignore[arg-type]
    return orphans


def test_a_task_that_failed_from_the_outage_goes_back_though_its_process_lives(
        running: Held) -> None:
    """Failed on its own at the outage, handed back: requeued, its live process not awaited."""
    channel = LiveChannel()
    orphans = _orphans_through(channel)
    orphans.adopt(["tag-1"])
    orphans.settle()
    assert channel.restored == [], "a message was handed back while its task ran"
    state.active_requests.discard(running)  # type: ignore[arg-type]
    orphans.settled("tag-1", REQUEUE)
    assert channel.restored == [("tag-1", True)]
    assert orphans.pending == {}


def test_a_task_that_finished_at_the_outage_is_acknowledged_though_its_process_lives(
        running: Held) -> None:
    channel = LiveChannel()
    orphans = _orphans_through(channel)
    orphans.adopt(["tag-1"])
    state.active_requests.discard(running)  # type: ignore[arg-type]
    orphans.settled("tag-1", ACK)
    assert channel.acked == ["tag-1"] and channel.restored == []


def test_nothing_heard_of_a_task_whose_process_still_runs_waits_for_it(
        running: Held) -> None:
    """Cancelled at the outage (no word from its request): back only once its process is gone."""
    channel = LiveChannel()
    orphans = _orphans_through(channel)
    orphans.adopt(["tag-1"])
    state.active_requests.discard(running)  # type: ignore[arg-type]
    orphans.settle()
    assert channel.restored == [], "handed back while its terminated process may still run it"
    orphans.pids["tag-1"] = None
    orphans.settle()
    assert channel.restored == [("tag-1", False)]


@pytest.mark.cluster
@pytest.mark.fault
def test_a_message_handed_out_as_redis_died_goes_back_to_its_queue(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis popped a message for the worker and died before the worker recorded it as
    unacknowledged: once Redis is back, the message is in its queue again, whole."""
    from kombu import Connection

    from chkq.workers.broker import PrivateRedis

    # This process's record of orphans, as a worker process has its own.
    monkeypatch.setattr(broker_transport, "ORPHANS", Orphans())

    with PrivateRedis(persistent=True, data_dir=tmp_path) as server:
        transport = "chkq.workers.runtime.broker_transport:Transport"
        with Connection(server.url, transport=transport) as first:
            channel = first.default_channel
            queue = first.SimpleQueue("copy")
            queue.put({"task": "chkq.copy", "unit": 3})
            payload = channel._get("copy")
            server.stop(kill=True)
            message = channel.Message(payload, channel=channel)
            with pytest.raises(channel.connection.connection_errors):
                channel.qos.append(message, message.delivery_tag)
            assert broker_transport.ORPHANS.messages, "the popped message was not kept"
            server.start()
            with Connection(server.url, transport=transport) as second:
                assert second.default_channel is not None  # a live channel to settle through
                broker_transport.ORPHANS.settle()
                again = second.SimpleQueue("copy").get(timeout=5)
                assert again.payload == {"task": "chkq.copy", "unit": 3}
                again.ack()
                assert broker_transport.ORPHANS.pending == {}
                assert second.default_channel.client.hlen("unacked") == 0
