"""Ingress's model table over a real NATS server: a model is learned from discovery and
stays served while a worker of it beats (LoadReport), even when no discovery round has seen
that worker for longer than the table forgets after (a restart's gap)."""

from __future__ import annotations

import asyncio

import pytest

from services.ingress.models import ModelTable
from shared.discovery import DiscoveryResponder
from shared.models import model_path
from shared.schema import LoadReport
from shared.schema.control import InstanceState
from shared.subjects import DECODE, PREFILL
from shared.testing.fixtures import BusFactory

pytestmark = pytest.mark.nats

MODEL = "tiny-coder"
FORGET_S = 0.6


def report(bus, model: str, state: InstanceState = InstanceState.SERVING) -> LoadReport:  # noqa: ANN001
    return LoadReport(
        service=bus.service, instance_id=bus.instance_id, seq=1, ts_ms=0, state=state, model=model
    )


async def beat(bus, message: LoadReport, seconds: float) -> None:  # noqa: ANN001
    """Heartbeats every 0.1 s for `seconds`."""
    for _ in range(round(seconds / 0.1)):
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
    table = ModelTable(ingress, forget_after_s=FORGET_S)
    await table.refresh()
    assert served(table) == [MODEL]
    await responder.stop()  # no discovery round sees the worker from here on
    await table.follow_heartbeats()
    await ingress.flush()

    await beat(decode, report(decode, MODEL), 3 * FORGET_S)
    assert served(table) == [MODEL]
    assert (await table.get(MODEL)) is not None

    # Heartbeats that do not speak for a serving worker of it keep nothing: a draining
    # decode worker, a prefill worker, another model's worker.
    others = [report(decode, MODEL, InstanceState.DRAINING), report(decode, "other-model")]
    prefill = await bus_factory(PREFILL)
    await asyncio.gather(
        *(beat(decode, r, 2 * FORGET_S) for r in others),
        beat(prefill, report(prefill, MODEL), 2 * FORGET_S),
    )
    assert served(table) == []
