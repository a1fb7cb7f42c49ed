"""The router on a real nats-server, in process, with fake workers around it: which workers
it picks, what it sends them, what it refuses and how, and what its replicas share."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.router.policy import RequestFacts
from shared.blocks import RequestBlocks
from shared.schema import (
    BadRequest,
    DecodeJob,
    NotFound,
    Overloaded,
    PrefillJob,
    RouteDecision,
    pack_block_hashes,
    unpack_block_hashes,
)
from shared.subjects import DECODE, PREFILL, SWA_MEMCACHE
from shared.testing.fixtures import BusFactory
from tests.service.router.fakes import (
    BLOCK,
    FakeKvIndex,
    FakeMemcache,
    StartRouter,
    eventually,
    hashes_of,
    known,
    make_request,
    start_workers,
)

pytestmark = [pytest.mark.nats]


async def test_picks_the_shorter_prefill_queue_and_a_decode_worker_with_room(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    p1, p2 = await start_workers(
        bus_factory, PREFILL, {"queued_tokens": 50_000}, {"queued_tokens": 1_000}
    )
    # d1 has 6 free KV pages, fewer than the 7 that 69 + 350 tokens need.
    d1, d2 = await start_workers(bus_factory, DECODE, {"pages_free": 6}, {"pages_free": 500})
    for worker in (p1, p2, d1, d2):
        await worker.serve()
    await FakeKvIndex(await bus_factory("kv-index", "kv-index-0"), stored=[]).serve()
    await known(router, "prefill-1", "prefill-2", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")

    unhashed = make_request(num_tokens=4 * BLOCK + 5, max_tokens=350, with_hashes=False)
    with pytest.raises(BadRequest, match="block_hashes: 0 block hashes for 69 tokens"):
        await client.request(client.subjects.router_generate, unhashed, RouteDecision)
    request = make_request(num_tokens=4 * BLOCK + 5, max_tokens=350)
    decision = await client.request(client.subjects.router_generate, request, RouteDecision)

    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("prefill-2", "decode-2")
    assert decision.num_prompt_tokens == 4 * BLOCK + 5 and decision.num_cached_tokens == 0
    assert decision.estimated_ttft_ms > 0
    [decode_job] = d2.jobs
    assert isinstance(decode_job, DecodeJob) and decode_job.decision == decision
    # The caller's hashes travel on unchanged: nobody after it hashes the prompt again.
    assert decode_job.request.block_hashes == pack_block_hashes(hashes_of(request))
    await eventually(lambda: len(p2.jobs) == 1)
    [prefill_job] = p2.jobs
    assert isinstance(prefill_job, PrefillJob)
    assert (prefill_job.decision, prefill_job.attempt) == (decision, 0)
    assert prefill_job.request == decode_job.request
    assert not p1.jobs and not d1.jobs
    metrics = router.metrics.snapshot()
    assert metrics['kvfabric_router_decisions_total{outcome="routed"}'] == 1
    assert metrics["kvfabric_router_cold_index_total"] == 0
    assert metrics["kvfabric_router_prompt_tokens_total"] == 4 * BLOCK + 5
    await eventually(lambda: len(router.prefill_jobs) == 0)  # PrefillDone arrived


async def test_a_cache_hit_goes_to_the_node_holding_its_sliding_window_snapshot(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    # The whole prompt is 4 cached blocks; its last token is always computed, so 3 are used
    # and their boundary is block 2.
    request = make_request(num_tokens=4 * BLOCK)
    hashes = hashes_of(request)
    await FakeKvIndex(await bus_factory("kv-index", "kv-index-0"), stored=hashes).serve()
    a, b = await start_workers(
        bus_factory,
        PREFILL,
        {"node_id": "node-a", "queued_tokens": 0},
        {"node_id": "node-b", "queued_tokens": 30},
    )
    [d1] = await start_workers(bus_factory, DECODE, {})
    for worker in (a, b, d1):
        await worker.serve()
    memcaches = [
        FakeMemcache(await bus_factory(SWA_MEMCACHE, f"swa-memcache-{node}"), node, held)
        for node, held in (("node-a", set()), ("node-b", {hashes[2]}), ("node-c", set()))
    ]
    for memcache in memcaches:
        await memcache.start()
    # node-c stored it after its full state; node-a held it once and it expired.
    await memcaches[2].publish([hashes[2]])
    await memcaches[0].publish([hashes[2]])
    await memcaches[0].publish([], [hashes[2]])
    await known(
        router, "prefill-1", "prefill-2", "decode-1", *(f"swa-memcache-node-{n}" for n in "abc")
    )
    await eventually(lambda: router.swa_map.holders(hashes[2]) == {"node-b", "node-c"})

    # The case is what its name says: b's queue costs less than the replay a saves.
    cost = router.policy.cost
    facts = RequestFacts.of(request, RequestBlocks.of_request(request), len(hashes))
    ttft = {
        name: cost.prefill(
            num_queued_tokens=queued,
            num_prompt_tokens=facts.num_prompt_tokens,
            num_cached_tokens=facts.num_cached_tokens,
            has_swa_snapshot=has_swa,
        ).ttft_s
        for name, queued, has_swa in (("a", 0, False), ("b", 30, True))
    }
    assert ttft["b"] < ttft["a"]

    client = await bus_factory("ingress", "ingress-0")
    decision = await client.request(client.subjects.router_generate, request, RouteDecision)

    assert decision.prefill_worker_id == "prefill-2" and decision.has_swa_snapshot
    assert decision.num_cached_tokens == 3 * BLOCK
    # From the map the memcaches' events built: not one question per request.
    assert [m.num_asked for m in memcaches] == [0, 0, 0]
    [decode_job] = d1.jobs
    cached = decode_job.cached_blocks
    assert len(cached) == 3 and cached.writer_ids == ("prefill-9",)
    assert unpack_block_hashes(cached.block_hashes).tolist() == hashes[:3]
    assert [row.slot for row in cached.rows()] == [0, 1, 2]
    await eventually(lambda: len(b.jobs) == 1)
    assert b.jobs[0].cached_blocks == cached
    hits = router.metrics.snapshot()['kvfabric_router_cache_hit_tokens_total{tier="ssd"}']
    assert hits == 3 * BLOCK


async def test_kv_index_down_routes_cold(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router(match_timeout_s=0.2)
    [p1] = await start_workers(bus_factory, PREFILL, {})
    [d1] = await start_workers(bus_factory, DECODE, {})
    for worker in (p1, d1):
        await worker.serve()
    await known(router, "prefill-1", "decode-1")
    client = await bus_factory("ingress", "ingress-0")

    decision = await client.request(client.subjects.router_generate, make_request(), RouteDecision)

    assert decision.num_cached_tokens == 0 and not decision.has_swa_snapshot
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("prefill-1", "decode-1")
    assert len(d1.jobs[0].cached_blocks) == 0
    assert router.metrics.snapshot()["kvfabric_router_cold_index_total"] == 1


async def test_bad_requests_are_refused_before_any_worker_sees_them(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    [p1] = await start_workers(bus_factory, PREFILL, {})
    [d1] = await start_workers(bus_factory, DECODE, {})
    for worker in (p1, d1):
        await worker.serve()
    await known(router, "prefill-1", "decode-1")
    client = await bus_factory("ingress", "ingress-0")
    request = make_request()
    other = make_request(first_token=7)
    bad = {
        "does not match its tokens": msgspec.structs.replace(
            request, block_hashes=other.block_hashes
        ),
        "block hashes for 69 tokens": msgspec.structs.replace(
            request, block_hashes=request.block_hashes[:8]
        ),
        "empty": msgspec.structs.replace(request, prompt_token_ids=b"", block_hashes=b""),
        "stream_inbox": msgspec.structs.replace(request, stream_inbox=""),
        "a reply inbox": msgspec.structs.replace(request, stream_inbox="kvf.v1.usage.decode"),
        "block_size_tokens": msgspec.structs.replace(request, block_size_tokens=0),
    }
    for words, message in bad.items():
        with pytest.raises(BadRequest) as caught:
            await client.request(client.subjects.router_generate, message, RouteDecision)
        assert words in caught.value.message
    assert not p1.jobs and not d1.jobs
    metrics = router.metrics.snapshot()
    assert metrics['kvfabric_router_rejections_total{code="BAD_REQUEST"}'] == 6
    assert metrics['kvfabric_router_decisions_total{outcome="rejected"}'] == 6
    assert metrics['kvfabric_router_decisions_total{outcome="routed"}'] == 0


async def test_full_queues_then_full_decode_pages_are_overloaded_with_a_retry_after(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    prefills = await start_workers(
        bus_factory, PREFILL, {"queued_tokens": 300_000}, {"queued_tokens": 250_000}
    )
    decoders = await start_workers(bus_factory, DECODE, {"pages_free": 1}, {"pages_free": 0})
    for worker in prefills + decoders:
        await worker.serve()
    await known(router, "prefill-1", "prefill-2", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")
    request = make_request()
    num_tokens = 4 * BLOCK + 5

    with pytest.raises(Overloaded) as caught:
        await client.request(client.subjects.router_generate, request, RouteDecision)
    # Until the shorter queue has drained enough to take the job under the limit.
    expected = router.policy.cost.queue_wait_s(250_000 + num_tokens - 240_000)
    assert caught.value.retry_after_s == pytest.approx(expected)

    for worker in prefills:
        worker.queued_tokens = 0
        await worker.beat()
    await eventually(
        lambda: router.table.view("prefill-2", time.monotonic()).num_queued_tokens == 0
    )
    with pytest.raises(Overloaded) as caught:
        await client.request(client.subjects.router_generate, request, RouteDecision)
    assert caught.value.retry_after_s == router.config.decode_retry_after_s
    assert "free KV pages" in caught.value.message
    assert not any(w.jobs for w in prefills + decoders)
    overloaded = router.metrics.snapshot()['kvfabric_router_rejections_total{code="OVERLOADED"}']
    assert overloaded == 2


async def test_a_replica_counts_what_another_replica_just_sent(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router_a = await start_router("router-a")
    router_b = await start_router("router-b")
    # No heartbeat follows these: in-flight work stays counted for the whole test.
    p1, p2 = await start_workers(bus_factory, PREFILL, {"queued_tokens": 0}, {"queued_tokens": 30})
    [d1] = await start_workers(bus_factory, DECODE, {})
    for worker in (p1, p2, d1):
        await worker.serve()
    for router in (router_a, router_b):
        await known(router, "prefill-1", "prefill-2", "decode-1")
    client = await bus_factory("ingress", "ingress-0")
    subjects = client.subjects

    first = await client.request(
        subjects.instance(subjects.router_generate, "router-a"), make_request("r1"), RouteDecision
    )
    assert first.prefill_worker_id == "prefill-1"
    # router-b hears of the job's 69 tokens: prefill-1's queue is now longer than prefill-2's.
    await eventually(
        lambda: router_b.table.view("prefill-1", time.monotonic()).num_inflight_tokens == 69
    )
    second = await client.request(
        subjects.instance(subjects.router_generate, "router-b"), make_request("r2"), RouteDecision
    )
    assert second.prefill_worker_id == "prefill-2"
    # router-a counted its own job once: its own notice echoed back and was ignored.
    await eventually(
        lambda: router_a.table.view("prefill-2", time.monotonic()).num_inflight_tokens == 69
    )
    view = router_a.table.view("prefill-1", time.monotonic())
    assert (view.num_inflight_tokens, view.num_inflight_requests) == (69, 1)
    assert router_a.table.view("decode-1", time.monotonic()).num_inflight_requests == 2


async def test_each_model_goes_to_its_own_workers_and_an_unknown_one_is_not_found(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    p1, p2 = await start_workers(bus_factory, PREFILL, {}, {"model": "SmolLM2-135M-Instruct"})
    d1, d2 = await start_workers(bus_factory, DECODE, {}, {"model": "SmolLM2-135M-Instruct"})
    for worker in (p1, p2, d1, d2):
        await worker.serve()
    await known(router, "prefill-1", "prefill-2", "decode-1", "decode-2")
    client = await bus_factory("ingress", "ingress-0")
    smol = msgspec.structs.replace(make_request("r-smol"), model="SmolLM2-135M-Instruct")
    smol = msgspec.structs.replace(
        smol,
        block_hashes=pack_block_hashes(
            RequestBlocks.hash_prompt(
                smol.prompt_token_ids, model=smol.model, block_size_tokens=BLOCK
            ).hashes
        ),
    )
    decision = await client.request(client.subjects.router_generate, smol, RouteDecision)
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("prefill-2", "decode-2")
    tiny = await client.request(
        client.subjects.router_generate, make_request("r-tiny"), RouteDecision
    )
    assert (tiny.prefill_worker_id, tiny.decode_worker_id) == ("prefill-1", "decode-1")
    unknown = msgspec.structs.replace(make_request("r-x"), model="gpt-9")
    with pytest.raises(NotFound) as caught:
        await client.request(client.subjects.router_generate, unknown, RouteDecision)
    assert caught.value.message == (
        "model 'gpt-9' is not served here; served: SmolLM2-135M-Instruct, tiny-coder"
    )
    assert not [j for j in d1.jobs + d2.jobs if j.request.request_id == "r-x"]
