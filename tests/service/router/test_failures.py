"""Workers that are gone: the prefill job sent once more (attempt 1), the request cancelled
with an error code when that fails too, silent workers dropped, a gone decode worker
replaced before the reply (also one that died with the job in hand), and a caller's cancel
ending the router's wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.bus import Context, Endpoint
from shared.schema import CancelRequest, DecodeJob, ErrorCode, JobAccepted, RouteDecision
from shared.subjects import DECODE, PREFILL
from shared.testing.fixtures import BusFactory
from tests.service.router.fakes import (
    CancelListener,
    StartRouter,
    eventually,
    known,
    make_request,
    start_workers,
)

pytestmark = [pytest.mark.nats]


async def test_a_prefill_worker_without_responders_gets_its_job_moved(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    # prefill-1 is preferred and heartbeats, but serves nothing (its endpoint is gone).
    p1, p2 = await start_workers(
        bus_factory, PREFILL, {"queued_tokens": 0}, {"queued_tokens": 1_000}
    )
    [d1] = await start_workers(bus_factory, DECODE, {})
    await p2.serve()
    await d1.serve()
    await known(router, "prefill-1", "prefill-2", "decode-1")
    client = await bus_factory("ingress", "ingress-0")

    decision = await client.request(client.subjects.router_generate, make_request(), RouteDecision)

    assert decision.prefill_worker_id == "prefill-1"
    await eventually(lambda: len(p2.jobs) == 1)
    [job] = p2.jobs
    assert job.attempt == 1
    assert job.decision.prefill_worker_id == "prefill-2"
    assert job.decision.decode_worker_id == "decode-1"  # the decode worker keeps waiting
    assert len(d1.jobs) == 1
    await eventually(lambda: len(router.prefill_jobs) == 0)
    metrics = router.metrics.snapshot()
    assert metrics["kvfabric_router_prefill_retries_total"] == 1
    assert metrics["kvfabric_router_prefill_failures_total"] == 0


async def test_when_every_prefill_worker_is_gone_the_request_is_cancelled_with_the_error(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    await start_workers(bus_factory, PREFILL, {}, {})  # both heartbeat, neither serves
    [d1] = await start_workers(bus_factory, DECODE, {})
    await d1.serve()
    listener = CancelListener()
    await listener.start(await bus_factory(DECODE, "decode-listener"))
    await known(router, "prefill-1", "prefill-2", "decode-1")
    client = await bus_factory("ingress", "ingress-0")

    # The decode worker accepted the job, so the caller gets its decision and then the error
    # on its stream (the decode worker ends it when it hears the cancel).
    decision = await client.request(
        client.subjects.router_generate, make_request("req-doomed"), RouteDecision
    )
    assert decision.decode_worker_id == "decode-1" and len(d1.jobs) == 1

    await eventually(lambda: len(listener.cancels) == 1)
    [cancel] = listener.cancels
    assert isinstance(cancel, CancelRequest) and cancel.request_id == "req-doomed"
    assert cancel.error_code == ErrorCode.UNAVAILABLE.value
    assert cancel.error_message
    metrics = router.metrics.snapshot()
    assert metrics["kvfabric_router_prefill_retries_total"] == 1
    assert metrics["kvfabric_router_prefill_failures_total"] == 1
    assert len(router.prefill_jobs) == 0


async def test_silent_workers_are_dropped_and_a_held_job_moves_off_a_dead_one(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router(heartbeat_timeout_s=0.5)
    p1, p2 = await start_workers(
        bus_factory, PREFILL, {"queued_tokens": 0}, {"queued_tokens": 1_000}
    )
    d1, d2 = await start_workers(bus_factory, DECODE, {"pages_free": 900}, {"pages_free": 500})
    await p1.serve(hold=True)  # takes the job and never finishes it
    for worker in (p2, d1, d2):
        await worker.serve()
    for worker in (p1, p2, d1, d2):
        worker.beat_every(0.1)
    await known(router, "prefill-1", "prefill-2", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")
    try:
        first = await client.request(
            client.subjects.router_generate, make_request("r1"), RouteDecision
        )
        assert (first.prefill_worker_id, first.decode_worker_id) == ("prefill-1", "decode-1")
        await eventually(lambda: len(p1.jobs) == 1)

        await p1.stop_beating()  # dies holding the job
        await eventually(lambda: len(p2.jobs) == 1)
        assert p2.jobs[0].attempt == 1
        assert p2.jobs[0].decision.decode_worker_id == "decode-1"

        await d1.stop_beating()
        await eventually(lambda: router.table.view("decode-1", time.monotonic()) is None)
        second = await client.request(
            client.subjects.router_generate, make_request("r2"), RouteDecision
        )
        assert (second.prefill_worker_id, second.decode_worker_id) == ("prefill-2", "decode-2")
        await router.prune()
        assert "prefill-1" not in {
            w.instance_id for w in router.table.workers(PREFILL, time.monotonic())
        }
        assert len(router.table) == 2  # prefill-2 and decode-2 (the table keeps no others)
    finally:
        for worker in (p1, p2, d1, d2):
            await worker.stop_beating()
        p1.release()


async def test_a_held_job_moves_off_a_worker_restarted_within_the_heartbeat_timeout(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    """A supervisor restarts a killed worker under its id faster than its heartbeats go
    stale: the job the old process held is sent again, not awaited forever."""
    router = await start_router(heartbeat_timeout_s=5.0)
    [p1] = await start_workers(bus_factory, PREFILL, {"queued_tokens": 0})
    [d1] = await start_workers(bus_factory, DECODE, {"pages_free": 900})
    await p1.serve(hold=True)  # takes the job and never finishes it
    await d1.serve()
    for worker in (p1, d1):
        worker.beat_every(0.1)
    await known(router, "prefill-1", "decode-1")
    client = await bus_factory("ingress", "ingress-0")
    try:
        await client.request(client.subjects.router_generate, make_request("r1"), RouteDecision)
        await eventually(lambda: len(p1.jobs) == 1)
        p1.restart()  # never silent for the 5 s the timeout would take
        await eventually(lambda: len(p1.jobs) == 2)
        assert [job.attempt for job in p1.jobs] == [0, 1]
    finally:
        for worker in (p1, d1):
            await worker.stop_beating()
        p1.release()


async def test_a_decode_worker_without_responders_is_replaced_before_the_reply(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    [p1] = await start_workers(bus_factory, PREFILL, {})
    # decode-1 has the most free pages but stopped serving.
    d1, d2 = await start_workers(bus_factory, DECODE, {"pages_free": 900}, {"pages_free": 500})
    await p1.serve()
    await d2.serve()
    await known(router, "prefill-1", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")

    decision = await client.request(client.subjects.router_generate, make_request(), RouteDecision)

    assert decision.decode_worker_id == "decode-2"
    assert len(d2.jobs) == 1 and d2.jobs[0].decision == decision
    assert router.table.view("decode-1", time.monotonic()) is None
    await eventually(lambda: len(p1.jobs) == 1)
    assert p1.jobs[0].decision == decision


async def test_a_cancelled_request_is_no_longer_awaited(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    [p1] = await start_workers(bus_factory, PREFILL, {})
    [d1] = await start_workers(bus_factory, DECODE, {})
    await p1.serve(hold=True)
    await d1.serve()
    await known(router, "prefill-1", "decode-1")
    client = await bus_factory("ingress", "ingress-0")
    try:
        await client.request(client.subjects.router_generate, make_request("r1"), RouteDecision)
        await eventually(lambda: len(p1.jobs) == 1)
        assert len(router.prefill_jobs) == 1

        await client.publish(client.subjects.cancel, CancelRequest(request_id="r1"))
        await eventually(lambda: len(router.prefill_jobs) == 0)
        metrics = router.metrics.snapshot()
        assert metrics["kvfabric_router_prefill_retries_total"] == 0
        assert metrics["kvfabric_router_prefill_failures_total"] == 0
    finally:
        p1.release()


async def test_a_decode_worker_that_dies_with_the_job_in_hand_is_replaced_at_once(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    """It took the job and its process died before accepting: the router learns it from a
    ping NATS answers with no responders, well before the accept timeout (5 s)."""
    router = await start_router()
    [p1] = await start_workers(bus_factory, PREFILL, {})
    d1, d2 = await start_workers(bus_factory, DECODE, {"pages_free": 900}, {"pages_free": 500})
    await p1.serve()
    await d2.serve()
    taken: list[DecodeJob] = []

    async def take_and_die(job: DecodeJob, ctx: Context) -> JobAccepted:
        taken.append(job)
        await d1.bus._nc.close()  # the process is gone: its subscriptions with it
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    await d1.bus.serve(Endpoint("run", d1.bus.subjects.decode_run, DecodeJob, take_and_die))
    await known(router, "prefill-1", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")

    started = time.monotonic()
    decision = await client.request(client.subjects.router_generate, make_request(), RouteDecision)

    assert len(taken) == 1 and decision.decode_worker_id == "decode-2"
    assert time.monotonic() - started < 3.0  # not the 5 s accept timeout
    assert len(d2.jobs) == 1 and d2.jobs[0].decision == decision
    await eventually(lambda: len(p1.jobs) == 1)
