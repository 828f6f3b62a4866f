"""The script chkq's Redis consumers take messages with, against fakeredis's Lua.

A message must leave its queue and enter kombu's unacknowledged index in one
step, in the very form kombu's own ``QoS.append`` writes (so kombu's restore
sweep and acknowledgement treat it as theirs), and only for a queue consumed
with acknowledgements.
"""

from __future__ import annotations

import json

import fakeredis
import pytest

from chkq.jobs import keys
from chkq.workers.runtime.broker_transport import POP_SCRIPT

CONSUMER = keys.popped("c0ffee")


def _message(tag: str, task: str = "chkq.copy") -> str:
    return json.dumps({"body": "W10=", "headers": {"task": task, "id": f"job-{tag}"},
                       "properties": {"delivery_tag": tag, "delivery_info": {
                           "exchange": "chkq", "routing_key": "chkq.copy"}}})


def _pop(client: fakeredis.FakeRedis, queues: list[str], recorded: str, call: str = "7",
         drop_token: str = "1") -> object:
    rings = [keys.ring(q) for q in queues]
    return client.eval(POP_SCRIPT, 2 * len(queues) + 3, *queues, *rings, CONSUMER,
                       "unacked", "unacked_index",
                       len(queues), "1700000000.5", drop_token, call, 60, recorded)


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_a_message_taken_is_in_the_unacknowledged_index_as_kombu_writes_it(
        client: fakeredis.FakeRedis) -> None:
    item = _message("tag-1")
    client.lpush("chkq.copy", item)
    client.lpush(keys.ring("chkq.copy"), "1")
    assert _pop(client, ["chkq.verify", "chkq.copy"], "11") == [b"chkq.copy", item.encode()]
    assert client.llen("chkq.copy") == 0
    assert json.loads(client.hget("unacked", "tag-1")) == [json.loads(item), "chkq",
                                                           "chkq.copy"]
    assert client.zscore("unacked_index", "tag-1") == 1700000000.5
    assert client.get(CONSUMER) == b"7 tag-1"
    assert client.llen(keys.ring("chkq.copy")) == 0, "its token was not dropped"


def test_a_queue_consumed_without_acknowledgements_records_nothing(
        client: fakeredis.FakeRedis) -> None:
    client.lpush("reply.queue", _message("tag-2"))
    assert _pop(client, ["reply.queue"], "0") is not None
    assert client.hlen("unacked") == 0
    assert client.zcard("unacked_index") == 0
    assert client.get(CONSUMER) is None


def test_queues_are_tried_in_order_and_nothing_found_forgets_the_note(
        client: fakeredis.FakeRedis) -> None:
    client.lpush("first", _message("a"))
    client.lpush("second", _message("b"))
    assert _pop(client, ["second", "first"], "11")[0] == b"second"  # type: ignore[index]
    assert _pop(client, ["second", "first"], "11", call="8")[0] == b"first"  # type: ignore[index]
    assert client.get(CONSUMER) == b"8 a"
    assert _pop(client, ["second", "first"], "11", call="9") is None
    assert client.get(CONSUMER) is None


def test_a_token_already_taken_by_the_wait_is_not_dropped_again(
        client: fakeredis.FakeRedis) -> None:
    client.lpush("chkq.copy", _message("t"))
    client.lpush(keys.ring("chkq.copy"), "1")
    _pop(client, ["chkq.copy"], "1", drop_token="0")
    assert client.llen(keys.ring("chkq.copy")) == 1


def test_an_item_that_is_not_a_message_is_handed_out_unrecorded(
        client: fakeredis.FakeRedis) -> None:
    client.lpush("chkq.copy", "not json {")
    assert _pop(client, ["chkq.copy"], "1") == [b"chkq.copy", b"not json {"]
    assert client.hlen("unacked") == 0
    assert client.get(CONSUMER) is None
