"""Sessions' latest turns (services/ingress/diagnosis.py SessionTurns) on a real nats-server:
shared by two ingress replicas, kept for the TTL and no longer, an unreadable entry read as
no turn at all."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.ingress.diagnosis import SessionTurns, TurnDigest, session_key
from shared.testing.fixtures import BusFactory

pytestmark = pytest.mark.nats

TURN = TurnDigest(
    namespace="n", system="s", tools="t", messages=("m0", "m1"), num_prompt_tokens=300
)


async def test_a_turn_kept_by_one_replica_is_read_by_another_until_it_expires(
    bus_factory: BusFactory,
) -> None:
    a = SessionTurns(await bus_factory("ingress", "ingress-0"), ttl_s=1.0)
    b = SessionTurns(await bus_factory("ingress", "ingress-1"), ttl_s=1.0)
    await a.start()
    await b.start()
    key = session_key("acct", "session-1")
    assert await b.get(key) is None
    await a.put(key, TURN)
    assert await b.get(key) == TURN
    assert await b.get(session_key("other-acct", "session-1")) is None
    deadline = time.monotonic() + 30
    while await b.get(key) is not None:  # JetStream drops it past the bucket's max age
        assert time.monotonic() < deadline, "the turn outlived its TTL"
        await asyncio.sleep(0.1)


async def test_an_entry_of_another_layout_is_no_previous_turn(bus_factory: BusFactory) -> None:
    bus = await bus_factory("ingress", "ingress-0")
    turns = SessionTurns(bus, ttl_s=60.0)
    await turns.start()
    key = session_key("acct", "s")
    await bus.js.kv_put(turns.bucket, key, b"\x93not a digest")
    assert await turns.get(key) is None
