"""An agent's next turn goes back to the node whose swa-memcache holds its sliding window, and
the router learns that from the memcaches' events, not by asking them (docs/design.md,
'Sliding-window state').

A mock cluster on one host, laid out as three prefill nodes: `node-i` runs `swa-memcache-i`
and `prefill-i` (per-instance `--node-id`), plus one decode worker, kv-index and the router.
Three sessions' first turns run at once, so the router spreads them over the three prefill
workers (in-flight work counts); each prefill worker puts its prompt's window into a
memcache -- its own node's -- whose `SwaHeld` event names the node. The second turns, one
at a time, each extend
their first prompt: each must go back to the node whose memcache got its window, knowing it has
the snapshot (`has_swa_snapshot`: without the map the router has no way to know), and no
memcache may have been asked `contains` on the way. Before each, the work the router counts
in flight settles (a heartbeat of every prefill worker after the last job): a worker that
still looked busy could rightly be passed over for an idle one that replays.

The memcaches start ~2 s slower (NIXL) than a mock prefill worker, so a worker may find no
memcache on its node at start-up; it looks again every second (`worker/serving/wiring.py`
`node_swa_client`), and the test starts once every worker names its own node's memcache.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import pytest

from services.admin.launcher import Cluster
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import build_request, generate
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.schema import (
    LoadReport,
    SwaContains,
    SwaContainsReply,
    pack_block_hashes,
    unpack_block_hashes,
)
from shared.schema.swa import SwaHeld
from shared.subjects import (
    BILLING,
    DECODE,
    INGRESS,
    KV_INDEX,
    PREFILL,
    ROUTER,
    SWA_MEMCACHE,
)
from tests.e2e.cluster_helpers import connect, num_indexed_blocks, run_cluster, two_nodes

pytestmark = [pytest.mark.e2e]

BLOCK = 16
NUM_NODES = 3
PROMPT_TOKENS = 100  # 6 whole blocks and 4 tokens: the window is put at the 6th block's end
MODEL = BUNDLED_MODEL_DIR.name
VOCAB = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())["vocab_size"]
# Heartbeats every 0.1 s settle the router's in-flight counts quickly (`LoadTable`).
MOCK_ARGS = [
    "--engine",
    "mock",
    "--kv-block-size-tokens",
    str(BLOCK),
    "--store-file-nbytes",
    str(8 << 20),
    "--heartbeat-s",
    "0.1",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    nodes = {
        f"{service}-{i}": ["--node-id", f"node-{i}"]
        for i in range(NUM_NODES)
        for service in (SWA_MEMCACHE, PREFILL)
    }
    yield from run_cluster(
        tmp_path_factory.mktemp("swa"),
        replicas={
            SWA_MEMCACHE: NUM_NODES,
            PREFILL: NUM_NODES,
            DECODE: 1,
            KV_INDEX: 1,
            ROUTER: 1,
            BILLING: 0,
            INGRESS: 0,
        },
        extra_args={
            PREFILL: MOCK_ARGS,
            DECODE: [*MOCK_ARGS, "--node-id", "node-decode"],
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        instance_args=nodes,
        ready_timeout_s=60,
        hosts=two_nodes,
    )


def boundary_of(prompt: list[int]) -> int:
    """The block whose window a prefill of `prompt` puts: the last whole one before its last
    token (the one decode computes)."""
    blocks = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=BLOCK)
    boundary = blocks.boundary_hash(blocks.num_prefill_blocks)
    assert boundary is not None
    return boundary


class PrefillHeartbeats:
    """When each prefill worker's latest heartbeat arrived (on this test's clock)."""

    def __init__(self) -> None:
        self.received_at: dict[str, float] = {}

    async def on_report(self, report: LoadReport) -> None:
        if report.service == PREFILL:
            self.received_at[report.instance_id] = time.monotonic()

    async def settled(self) -> None:
        """Until every prefill worker has reported well after now: the router then counts
        nothing in flight to any of them (a report `inflight_settle_s` after a job settles
        it)."""
        since = time.monotonic() + 0.1
        for _ in range(200):
            if len(self.received_at) == NUM_NODES and min(self.received_at.values()) > since:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"prefill heartbeats stopped: {self.received_at}")


async def own_memcaches_found(bus: Bus) -> None:
    """Until each prefill worker puts into the memcache of its own node."""
    for _ in range(100):
        workers = await discover(bus, service=PREFILL)
        named = {w.instance_id: w.metadata.get("swa_memcache") for w in workers}
        if named == {f"prefill-{i}": f"swa-memcache-{i}" for i in range(NUM_NODES)}:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"prefill workers never found their nodes' memcaches: {named}")


async def num_contains_asked(bus: Bus) -> int:
    memcaches = await discover(bus, service=SWA_MEMCACHE)
    assert len(memcaches) == NUM_NODES
    return sum(e["num_requests"] for m in memcaches for e in m.endpoints if e["name"] == "contains")


async def test_next_turns_return_to_the_node_holding_their_window_without_asking(
    cluster: Cluster,
) -> None:
    bus = await connect(cluster)
    try:
        node_holding: dict[int, str] = {}  # block hash -> node, from the memcaches' events

        async def on_held(batch: SwaHeld) -> None:
            for block_hash in unpack_block_hashes(batch.added).tolist():
                node_holding[block_hash] = batch.node_id

        heartbeats = PrefillHeartbeats()
        await bus.subscribe(bus.subjects.swa_events_all, SwaHeld, on_held)
        await bus.subscribe(bus.subjects.load_all, LoadReport, heartbeats.on_report)
        await bus.flush()
        await own_memcaches_found(bus)
        rng = random.Random(11)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(3)]
        node_of = {i.instance_id: i.metadata["node_id"] for i in await discover(bus)}

        first = await asyncio.gather(
            *(
                generate(bus, build_request(p, model=MODEL, block_size_tokens=BLOCK, max_tokens=4))
                for p in prompts
            )
        )
        first_workers = [r.decision.prefill_worker_id for r in first]
        assert sorted(first_workers) == [f"prefill-{i}" for i in range(NUM_NODES)]
        boundaries = [boundary_of(p) for p in prompts]
        for prompt in prompts:
            hashes = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=BLOCK)
            assert await num_indexed_blocks(bus, hashes.hashes, timeout_s=10) == 6
        for _ in range(200):  # the puts follow the streams' ends: wait for their events
            if all(b in node_holding for b in boundaries):
                break
            await asyncio.sleep(0.05)
        assert all(b in node_holding for b in boundaries), "a window's put was never announced"
        for boundary, worker in zip(boundaries, first_workers, strict=True):
            assert node_holding[boundary] == node_of[worker]  # node-local: its own memcache
        worker_on = {node: worker for worker, node in node_of.items() if worker.startswith(PREFILL)}

        second = []
        for prompt in prompts:  # one at a time, nothing in flight steering the choice
            await heartbeats.settled()
            extended = prompt + [rng.randrange(3, VOCAB) for _ in range(40)]
            request = build_request(extended, model=MODEL, block_size_tokens=BLOCK, max_tokens=4)
            second.append(await generate(bus, request))
        for boundary, turn_2 in zip(boundaries, second, strict=True):
            assert turn_2.decision.num_cached_tokens == 6 * BLOCK
            assert turn_2.decision.has_swa_snapshot, turn_2.decision
            assert turn_2.decision.prefill_worker_id == worker_on[node_holding[boundary]]

        assert await num_contains_asked(bus) == 0  # routed from the map alone
        # What the events said is what the memcaches hold (asked only now, after the count).
        memcache_on = {n: i for i, n in node_of.items() if i.startswith(SWA_MEMCACHE)}
        for boundary in boundaries:
            memcache = memcache_on[node_holding[boundary]]
            subject = bus.subjects.instance(bus.subjects.swa_contains, memcache)
            ask = SwaContains(block_hashes=pack_block_hashes([boundary]))
            assert (await bus.request(subject, ask, SwaContainsReply)).found == b"\x01"
    finally:
        await bus.close()
