"""Disaggregated serving end to end: real processes (kv-index, swa-memcache, router, 2 prefill
and 2 decode workers running the bundled model), real NATS, real store files, real NIXL.

Tests share one cluster and run in file order: the destructive ones (kill -9) come last. As
root the cluster is split over network-namespace hosts (HOSTS), the tests on a client host.
Blocks are 16 tokens here so that short prompts have many blocks (docs/design.md, 'Block
hashes').
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer

from services.admin.launcher import Cluster
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.schema import (
    BadRequest,
    DeadlineExceeded,
    GenerateRequest,
    InstanceState,
    LoadReport,
    NotFound,
    RouteDecision,
    UsageRecord,
    unpack_token_ids,
)
from shared.subjects import DECODE, INGRESS, PREFILL, ROUTER
from shared.testing.hosts import unavailable_reason
from shared.usage import open_usage_outbox
from tests.e2e.cluster_helpers import (
    connect,
    num_indexed_blocks,
    run_cluster,
    usage_records,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
MODEL = BUNDLED_MODEL_DIR.name
# Past tiny-coder's 512-token training context (RoPE extrapolates; quality is not tested
# here) so that the long-running requests below really run long.
MAX_MODEL_LEN = 4096
WORKER_ARGS = [
    "--kv-block-size-tokens",
    str(BLOCK),
    "--num-kv-blocks",
    "1024",
    "--max-model-len",
    str(MAX_MODEL_LEN),
]
# Prefill's pool holds 1536 tokens: prompts that each fit it, but not together, wait for pages.
PREFILL_POOL_BLOCKS = 96
PREFILL_ARGS = [*WORKER_ARGS[:2], "--num-kv-blocks", str(PREFILL_POOL_BLOCKS), *WORKER_ARGS[4:]]
# A request that runs for seconds: sampled (drafts rarely match), never stopping at EOS.
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 1.0, "seed": 1}
KVFABRIC = str(Path(sys.executable).parent / "kvfabric")
TOKENIZER = Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
CODE = '''def load_config(path):
    """Read a JSON config file and return it as a dict."""
    with open(path) as f:
        return json.load(f)


class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        return self.items.get(key)
'''


# Split over hosts where the machine allows it (root): a prefill and a decode worker on each of
# two nodes, the control plane on a third, the tests on a fourth. KV crosses hosts over TCP.
HOSTS = {"prefill-0": "node-a", "decode-0": "node-a", "prefill-1": "node-b", "decode-1": "node-b"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("serving"),
        replicas={PREFILL: 2, DECODE: 2},
        extra_args={
            PREFILL: PREFILL_ARGS,
            DECODE: WORKER_ARGS,
            ROUTER: ["--heartbeat-timeout-s", "3", "--decode-page-size-tokens", str(BLOCK)],
        },
        ready_timeout_s=180,
        hosts=HOSTS,
    )


def _tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def _request(token_ids: list[int], **kwargs: object) -> GenerateRequest:
    ignore_eos = bool(kwargs.pop("ignore_eos", False))
    request = build_request(token_ids, model=MODEL, block_size_tokens=BLOCK, **kwargs)
    if ignore_eos:
        sampling = msgspec.structs.replace(request.sampling, ignore_eos=True)
        request = msgspec.structs.replace(request, sampling=sampling)
    return request


async def _indexed(bus: Bus, token_ids: list[int], salt: str = "", timeout_s: float = 5.0) -> int:
    """Wait until kv-index knows every complete block of `token_ids`; returns the hit."""
    blocks = RequestBlocks.hash_prompt(
        token_ids, model=MODEL, block_size_tokens=BLOCK, cache_salt=salt
    )
    hashes = blocks.hashes
    return await num_indexed_blocks(bus, hashes, timeout_s)


async def _usage(bus: Bus, request_id: str) -> UsageRecord:
    return (await usage_records(bus, {request_id}, timeout_s=10.0))[request_id]


async def test_the_cluster_is_split_over_hosts_where_it_can_be(cluster: Cluster) -> None:
    """As root, each worker runs on its own host (its node id the host's name), and the
    tests reach the cluster only through the client host's cable."""
    if unavailable_reason() is not None:
        pytest.skip(f"on 127.0.0.1: {unavailable_reason()}")
    assert cluster.client is not None  # type: ignore[attr-defined]
    bus = await connect(cluster)
    try:
        nodes = {i.instance_id: i.load.get("node_id") for i in await discover(bus, timeout_s=0.5)}
    finally:
        await bus.close()
    assert {k: v for k, v in nodes.items() if k in HOSTS} == HOSTS
    assert nodes["router-0"] == "ctl" and nodes["kv-index-0"] == "ctl"


async def test_multi_turn_session_hits_its_own_history(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        history = _tokens(CODE * 3)
        results: list[GenerateResult] = []
        for turn in range(4):
            result = await generate(bus, _request(history, max_tokens=24))
            results.append(result)
            assert result.finish_reason in ("stop", "length")
            assert result.usage is not None and result.usage.num_prompt_tokens == len(history)
            previous = len(history)
            history = history + result.token_ids + _tokens(f"\n# step {turn}: refactor\n")
            # The answer's blocks are logged before the final chunk; the index applies the
            # log asynchronously: wait for it so the next turn sees the whole history.
            await _indexed(bus, history[: previous + len(result.token_ids) - 1])
        for turn, result in enumerate(results[1:], start=2):
            usage = result.usage
            assert usage is not None
            hit = usage.num_cached_tokens / usage.num_prompt_tokens
            assert hit >= 0.9, f"turn {turn}: {hit:.1%} of the prompt from the store"
            assert result.decision.num_cached_tokens == usage.num_cached_tokens
            assert result.stats is not None and result.stats.prefill.swa_restore == "snapshot"
        # Turn 3's hit reaches into turn 2's answer: the output blocks were stored.
        turn2_prompt = results[1].usage.num_prompt_tokens
        assert results[2].usage.num_cached_tokens > turn2_prompt
        record = await _usage(bus, results[-1].request_id)
        assert record.status == "completed"
        assert record.num_cache_hit_tokens == results[-1].usage.num_cached_tokens
        assert record.num_output_tokens == len(results[-1].token_ids)
    finally:
        await bus.close()


async def test_cached_output_matches_cold_and_bounded_replay_is_reported(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        prompt = _tokens(CODE * 2 + "\ndef save_config(path, config):\n")
        first = await generate(bus, _request(prompt, max_tokens=32))
        follow = prompt + first.token_ids + _tokens("\n\ndef main():\n")
        await _indexed(bus, prompt + first.token_ids[:-1])
        cached = await generate(bus, _request(follow, max_tokens=32))
        cold = await generate(bus, _request(follow, max_tokens=32, cache_salt="cold"))
        assert cold.usage is not None and cold.usage.num_cached_tokens == 0
        assert cached.usage is not None and cached.usage.num_cached_tokens > len(prompt)
        assert cached.stats is not None and cached.stats.prefill.swa_restore == "snapshot"
        assert cached.token_ids == cold.token_ids  # exact restore: greedy output identical

        # Branch off in the middle of the cached history: the boundary there has no
        # snapshot (only each request's last boundary does), so prefill replays a window.
        branch = follow[: len(prompt) - 20] + _tokens("\n# a different ending\n")
        await _indexed(bus, follow[: len(prompt) - 20], salt="")
        replayed = await generate(bus, _request(branch, max_tokens=32))
        reference = await generate(bus, _request(branch, max_tokens=32, cache_salt="cold2"))
        stats = replayed.stats
        assert stats is not None and stats.prefill.swa_restore == "bounded"
        assert stats.prefill.num_replay_tokens > 0
        assert len(replayed.token_ids) > 0
        same = sum(a == b for a, b in zip(replayed.token_ids, reference.token_ids, strict=False))
        print(
            f"bounded replay of {stats.prefill.num_replay_tokens} tokens: "
            f"{same}/{len(reference.token_ids)} greedy tokens equal to the cold run"
        )
    finally:
        await bus.close()


async def test_bad_requests_get_typed_errors_and_nothing_is_left_behind(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        prompt = _tokens(CODE)
        wrong_model = build_request(prompt, model="no-such-model", block_size_tokens=BLOCK)
        with pytest.raises(
            NotFound, match="'no-such-model' is not served here; served: tiny-coder"
        ):
            await generate(bus, wrong_model)
        too_long = _request(prompt * (MAX_MODEL_LEN // len(prompt) + 1))  # past max_model_len
        with pytest.raises(BadRequest, match="max_model_len"):
            await generate(bus, too_long)
        bad_sampling = _request(prompt)
        bad_sampling = msgspec.structs.replace(
            bad_sampling, sampling=msgspec.structs.replace(bad_sampling.sampling, top_p=0.0)
        )
        with pytest.raises(BadRequest, match="top_p"):
            await generate(bus, bad_sampling)
        ok = await generate(bus, _request(prompt, max_tokens=4))  # the cluster still serves
        assert ok.finish_reason in ("stop", "length")
    finally:
        await bus.close()


async def test_stop_strings_and_deadlines_end_the_stream(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        prompt = _tokens(CODE + "\n\ndef parse(text):\n")
        free = await generate(bus, _request(prompt, max_tokens=48))
        # A stop string from the middle of the free run's text: the same greedy run now ends
        # right before it, and no text after it is sent.
        stop = free.text[len(free.text) // 2 :][:6]
        assert stop.strip(), free.text
        stopped = await generate(bus, _request(prompt, max_tokens=48, stop=[stop]))
        assert stopped.finish_reason == "stop"
        assert stopped.text == free.text[: free.text.index(stop)]
        assert stop not in stopped.text

        endless = _request(prompt, **LONG, deadline_s=1.5)
        with pytest.raises(DeadlineExceeded):
            await generate(bus, endless)
        record = await _usage(bus, endless.request_id)  # billed, however it was cut off
        assert record.status in ("failed", "cancelled")
        assert 0 < record.num_output_tokens < 3000
    finally:
        await bus.close()


async def test_decode_exports_speculative_decoding_metrics(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        # An edit: the answer re-emits code from the prompt, which prompt lookup drafts.
        prompt = _tokens(CODE * 2 + "\n# the same, again:\n" + CODE[:120])
        await generate(bus, _request(prompt, max_tokens=48))
        decoders = [i for i in await discover(bus, timeout_s=0.5) if i.service == DECODE]
        metrics = [i.metrics for i in decoders]
        drafted = "kvfabric_decode_spec_draft_tokens_total"
        accepted = "kvfabric_decode_spec_accepted_tokens_total"
        assert all(drafted in m and accepted in m for m in metrics)
        assert max(m[drafted] for m in metrics) > 0
        # Tokens per sequence-step above one: accepted drafts emitted several per step.
        per_step = [
            m["kvfabric_decode_emitted_tokens_total"] / m["kvfabric_decode_sequence_steps_total"]
            for m in metrics
            if m["kvfabric_decode_sequence_steps_total"]
        ]
        assert max(per_step) > 1.0
    finally:
        await bus.close()


async def test_two_prefill_and_two_decode_workers_share_load(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        reports: dict[str, LoadReport] = {}

        async def keep(report: LoadReport) -> None:
            reports[report.instance_id] = report

        watch = await bus.subscribe(bus.subjects.load_all, LoadReport, keep)
        prompts = [_tokens(f"# file {i}\n" + CODE) for i in range(8)]
        results = await asyncio.gather(
            *(generate(bus, _request(p, max_tokens=16)) for p in prompts)
        )
        assert all(r.finish_reason in ("stop", "length") for r in results)
        routes = [(r.decision.prefill_worker_id, r.decision.decode_worker_id) for r in results]
        await bus.unsubscribe(watch)
        seen = {i: (r.state, r.num_queued_tokens, r.seq) for i, r in reports.items()}
        assert {p for p, _ in routes} == {"prefill-0", "prefill-1"}, (routes, seen)
        assert {d for _, d in routes} == {"decode-0", "decode-1"}, routes
    finally:
        await bus.close()


async def test_prompts_beyond_the_prefill_pool_together_wait_for_pages(cluster: Cluster) -> None:
    """Each prompt fits a prefill worker's pool alone, no two of them at once: the engine's
    scheduler holds a job back (or preempts and recomputes the youngest) until pages are
    free, and every request is served."""
    bus = await connect(cluster)
    try:
        prompts = [_tokens(f"# module {i}\n" + CODE * 9) for i in range(4)]
        blocks = [-(-len(p) // BLOCK) for p in prompts]
        assert all(n <= PREFILL_POOL_BLOCKS < 2 * n for n in blocks), blocks
        results = await asyncio.gather(*(generate(bus, _request(p, max_tokens=4)) for p in prompts))
        assert all(r.finish_reason in ("stop", "length") for r in results)
        assert all(
            r.usage is not None and r.usage.num_prompt_tokens == len(p)
            for r, p in zip(results, prompts, strict=True)
        )
    finally:
        await bus.close()


async def _pages(bus: Bus, instance_id: str) -> LoadReport:
    reports: asyncio.Queue[LoadReport] = asyncio.Queue()
    subscription = await bus.subscribe(
        bus.subjects.load(DECODE, instance_id), LoadReport, reports.put
    )
    try:
        return await asyncio.wait_for(reports.get(), 5.0)
    finally:
        await bus.unsubscribe(subscription)


async def test_cancellation_frees_decode_pages_and_bills_what_was_produced(
    cluster: Cluster,
) -> None:
    bus = await connect(cluster)
    try:
        got_tokens = asyncio.Event()
        request = _request(_tokens(CODE), **LONG)
        task = asyncio.create_task(generate(bus, request, on_chunk=lambda c: got_tokens.set()))
        await asyncio.wait_for(got_tokens.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        record = await _usage(bus, request.request_id)
        assert record.status == "cancelled"
        assert 0 < record.num_output_tokens < 3000
        decode_id = record.decode_worker_id
        deadline = time.monotonic() + 10
        while True:
            report = await _pages(bus, decode_id)
            if report.num_kv_pages_free == report.num_kv_pages_total:
                break
            assert time.monotonic() < deadline, "decode pages not freed after cancellation"
    finally:
        await bus.close()


def test_generate_cli_streams_and_reports_hits(cluster: Cluster) -> None:
    args = [
        KVFABRIC,
        "generate",
        CODE,
        "--nats-url",
        cluster.nats_url,
        "--root",
        cluster.spec.root,
        "--max-tokens",
        "16",
        "--block-size",
        str(BLOCK),
        "--model",
        MODEL,
        "--state-dir",
        str(cluster.spec.state_dir),
    ]
    env = cluster.admin_env()
    first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout  # greedy, and the cached run restores exactly
    assert "cached" in second.stderr


@pytest.mark.faults  # a fault: `make faults` runs it on this module's cluster
async def test_restarted_prefill_workers_serve_their_first_requests(cluster: Cluster) -> None:
    """A decode worker keeps the NIXL metadata of each prefill worker it pulled from; a prefill
    worker restarted under the same id is a new agent. Every request after the restart is
    served, those that pull from a restarted worker through metadata cached before it
    included (that pull used to fail: NIXL_ERR_REMOTE_DISCONNECT, the request cancelled)."""
    bus = await connect(cluster)

    async def routes_of(tag: str, until: Callable[[set[tuple[str, str]]], bool]) -> set:
        routes: set[tuple[str, str]] = set()
        for i in range(12):
            prompts = [_tokens(f"# {tag} {i}.{j}\n" + CODE) for j in range(4)]
            results = await asyncio.gather(
                *(generate(bus, _request(p, max_tokens=4)) for p in prompts)
            )  # a failed request raises here
            assert all(r.finish_reason in ("stop", "length") for r in results)
            routes |= {(r.decision.prefill_worker_id, r.decision.decode_worker_id) for r in results}
            if until(routes):
                break
        return routes

    try:
        before = await routes_of("before", lambda routes: len(routes) == 4)
        for instance_id in ("prefill-0", "prefill-1"):
            # In this thread: a worker thread's exit would end the processes it started
            # (they die with the thread that spawned them).
            cluster.restart_instance(instance_id)
        await cluster.wait_ready(bus, timeout_s=120)
        deadline = time.monotonic() + 60
        while (
            len(
                [
                    i
                    for i in await discover(bus, service=PREFILL)
                    if i.load.get("state") == InstanceState.SERVING
                ]
            )
            < 2
        ):
            assert time.monotonic() < deadline, "the restarted prefill workers never served"
            await asyncio.sleep(0.5)
        after = await routes_of("after", lambda routes: bool(routes & before))
        assert after & before, (before, after)  # a decode worker pulled through stale metadata
    finally:
        await bus.close()


def _dropped(instance_id: str, router_log: Path, offset: int) -> bool:
    """Whether the router whose log this is has said, past `offset`, that it dropped
    `instance_id`."""
    with router_log.open("rb") as log:
        log.seek(offset)
        lines = log.read().decode(errors="replace").splitlines()
    return any("instance dropped" in line and f'"{instance_id}"' in line for line in lines)


def _child(cluster: Cluster, instance_id: str) -> subprocess.Popen[bytes]:
    return next(c.process for c in cluster.children if c.instance_id == instance_id)


@pytest.mark.faults  # a fault: `make faults` runs it on this module's cluster
async def test_a_killed_decode_worker_s_stream_continues_on_the_other(
    cluster: Cluster,
) -> None:
    """Decode failover with the model: the stream goes on on the other decode worker from the
    blocks the dead one wrote through; the answer is the one an uninterrupted run gives,
    billed once, by the worker that finished it."""
    bus = await connect(cluster)
    try:
        decisions: list[RouteDecision] = []
        killed: list[str] = []
        received: list[int] = []

        def on_chunk(chunk) -> None:  # noqa: ANN001
            received.extend(unpack_token_ids(chunk.token_ids).tolist())
            # Mid-stream, past a block of answer: SIGKILL to the decode worker streaming it.
            if len(received) >= 40 and not killed:
                killed.append(decisions[0].decode_worker_id)
                os.kill(_child(cluster, killed[0]).pid, signal.SIGKILL)

        prompt = _tokens(CODE + "\n# more\n")
        request = _request(prompt, max_tokens=160, ignore_eos=True)
        # The caller's own durable outbox: it bills only when no worker can go on.
        outbox = await open_usage_outbox(bus, INGRESS, cluster.spec.state_dir, "caller")
        task = asyncio.create_task(
            generate(bus, request, on_chunk=on_chunk, on_decision=decisions.append, outbox=outbox)
        )
        result = await asyncio.wait_for(task, 60)
        assert killed, "the answer ended before the kill"
        assert result.num_failovers == 1 and result.finish_reason == "length"
        assert result.decision.decode_worker_id != killed[0]
        assert result.decision.num_cached_tokens > len(prompt)  # blocks written through

        reference = await generate(bus, _request(prompt, max_tokens=160, ignore_eos=True))
        assert result.token_ids == reference.token_ids and result.text == reference.text
        record = await _usage(bus, request.request_id)
        assert record.status == "completed" and record.num_output_tokens == 160
        assert record.num_cache_hit_tokens + record.num_cache_miss_tokens == len(prompt)
        assert await outbox.flush(timeout_s=10) and outbox.counters()["num_added"] == 0
        await outbox.close()
    finally:
        await bus.close()


@pytest.mark.faults  # a fault: `make faults` runs it on this module's cluster
async def test_killed_prefill_worker_leaves_the_survivor_serving(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        routers = [c for c in cluster.children if c.service == ROUTER]
        logged = {c.log_path: c.log_path.stat().st_size for c in routers}
        os.kill(_child(cluster, "prefill-1").pid, signal.SIGKILL)
        # every router drops it once its heartbeats stop
        deadline = time.monotonic() + 30
        while not all(_dropped("prefill-1", path, offset) for path, offset in logged.items()):
            assert time.monotonic() < deadline, "a router kept the killed prefill worker"
            await asyncio.sleep(0.2)
        results = [
            await generate(bus, _request(_tokens(f"# after {i}\n" + CODE), max_tokens=8))
            for i in range(3)
        ]
        assert all(r.finish_reason in ("stop", "length") for r in results)
        assert {r.decision.prefill_worker_id for r in results} == {"prefill-0"}
    finally:
        await bus.close()
