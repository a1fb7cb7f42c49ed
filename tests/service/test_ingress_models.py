"""Ingress's model table over a real NATS server: a model is learned from discovery and
stays served while a worker of it beats (LoadReport), even when no discovery round sees that
worker any more; once no serving worker of it has beaten for `heartbeat_timeout_s` it is
forgotten, as the router forgets the workers (the same table, shared/load_table.py)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from services.ingress.models import ModelTable
from shared.discovery import DiscoveryResponder
from shared.models import model_path
from shared.schema import LoadReport
from shared.schema.control import InstanceState
from shared.subjects import DECODE, PREFILL
from shared.testing.fixtures import BusFactory
from shared.testing.waits import eventually

pytestmark = pytest.mark.nats

MODEL = "tiny-coder"
TIMEOUT_S = 0.6
SEQ = itertools.count(1)


def report(bus, model: str, state: InstanceState = InstanceState.SERVING) -> LoadReport:  # noqa: ANN001
    """A fresh report (a later seq and time than any before: the table drops repeats)."""
    return LoadReport(
        service=bus.service,
        instance_id=bus.instance_id,
        seq=next(SEQ),
        ts_ms=int(time.time() * 1000),
        state=state,
        model=model,
    )


async def beat(bus, model: str, seconds: float, **state: InstanceState) -> None:  # noqa: ANN001
    """Heartbeats every 0.1 s for `seconds`."""
    for _ in range(round(seconds / 0.1)):
        message = report(bus, model, **state)
        await bus.publish(bus.subjects.load(bus.service, bus.instance_id), message)
        await asyncio.sleep(0.1)


def served(table: ModelTable) -> list[str]:
    return [m.name for m in table.served()]


async def test_a_beating_worker_keeps_its_model_served_between_rounds(
    bus_factory: BusFactory,
) -> None:
    decode = await bus_factory(DECODE)
    metadata = {"model": MODEL, "model_path": str(model_path(MODEL)), "kv_block_size_tokens": "64"}
    responder = DiscoveryResponder(
        decode,
        version="0",
        description="decode",
        metadata=metadata,
        load_report=lambda: report(decode, MODEL),
    )
    await responder.start()
    await decode.flush()
    ingress = await bus_factory("ingress")
    table = ModelTable(ingress, heartbeat_timeout_s=TIMEOUT_S)
    await table.refresh()
    assert served(table) == [MODEL]
    await responder.stop()  # no discovery round sees the worker from here on
    await table.follow_heartbeats()
    await ingress.flush()

    await beat(decode, MODEL, 3 * TIMEOUT_S)
    assert served(table) == [MODEL]
    assert (await table.get(MODEL)) is not None

    # Heartbeats that do not speak for a serving worker of it keep nothing: a draining
    # decode worker, a prefill worker, another model's worker.
    draining, other = await bus_factory(DECODE), await bus_factory(DECODE)
    prefill = await bus_factory(PREFILL)
    await asyncio.gather(
        beat(draining, MODEL, 2 * TIMEOUT_S, state=InstanceState.DRAINING),
        beat(other, "other-model", 2 * TIMEOUT_S),
        beat(prefill, MODEL, 2 * TIMEOUT_S),
    )
    assert served(table) == []


async def test_a_model_heard_of_before_its_tokenizer_loaded_waits_for_the_load(
    bus_factory: BusFactory,
) -> None:
    """A heartbeat names the model while the discovery round that found it is still
    loading its tokenizer: a request for it waits for that round instead of a 404."""
    decode = await bus_factory(DECODE)
    metadata = {"model": MODEL, "model_path": str(model_path(MODEL)), "kv_block_size_tokens": "64"}
    responder = DiscoveryResponder(
        decode,
        version="0",
        description="decode",
        metadata=metadata,
        load_report=lambda: report(decode, MODEL),
    )
    await responder.start()
    await decode.flush()
    ingress = await bus_factory("ingress")
    table = ModelTable(ingress, heartbeat_timeout_s=10.0)
    await table.follow_heartbeats()
    await ingress.flush()
    await decode.publish(decode.subjects.load(DECODE, decode.instance_id), report(decode, MODEL))
    await eventually(lambda: MODEL in table._served())
    assert served(table) == []  # heard of, not loaded

    found = await table.get(MODEL)
    assert found is not None and found.name == MODEL
    assert served(table) == [MODEL]
    await responder.stop()
