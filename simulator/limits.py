"""The physical limits of a simulated day: each demand the day puts on a part against the
capacity a benchmark measured for that part, and the headroom (capacity / demand; below 1 the
part cannot carry the day as one instance).

Capacities are measurements, never guesses: `MEASURED` holds the figures docs/benchmarks.md
records (bench name and date beside each), and `measured_capacities` replaces them with a
`kvfabric bench NAME --json FILE` result when one is given. The router's decisions per
CPU-second are measured in the calibration runs themselves. The store's read bandwidth is the
reference design's (10 TiB/s: docs/design.md), a hardware figure no benchmark here measures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from services.admin.plan import Plan
from simulator.config import SimConfig
from simulator.fluid import Day

NATS_SERVERS = 3  # the cluster the bus rows assume
# NATS messages per request besides its token stream, as the code sends them: the request
# and its reply at the router (2), the prefill job and its acceptance (2), the decode job and
# its acceptance (2), PrefillDone (1), the prefill and the decode writer's KvEventBatch (2),
# the usage record (1).
CONTROL_MESSAGES_PER_REQUEST = 10
# A token stream: one TokenChunk per decode step of a sequence (worker/serving/lifecycle.py's
# send_tokens; shared/streams.StreamWriter does not coalesce), i.e. one per output token.
CHUNKS_PER_OUTPUT_TOKEN = 1.0
# Decisions per CPU-second at the reference shape (1,200 + 1,216 workers in one LoadTable):
# docs/simulator.md, 'The decision rate', `kvfabric simulate --reference --load 0.02`. It
# counts the simulator's node-memory lookups too (0.40 of its 0.75 ms), which a production
# router does not make: an upper bound on the cores.
REFERENCE_SHAPE_DECISIONS_PER_CPU_S = 1_340.0


@dataclass(frozen=True)
class Capacities:
    """Per-instance rates a benchmark measured (docs/benchmarks.md unless `source` says)."""

    # kvfabric bench bus, 2026-12-01T17:12:32: one publisher, one subscriber, one nats-server
    bus_events_per_s: float = 87_691.0
    bus_request_reply_p50_us: float = 308.0  # same run
    # kvfabric bench kv-index, 2026-12-01T18:20:03, C row index, 10M blocks
    index_ingest_blocks_per_s: float = 2_245_348.0
    index_match_p50_us: float = 21.09  # match of 1,200 blocks stored in 40 turns: p50
    index_match_p99_us: float = 45.02
    index_bytes_per_block: float = 29.98  # tracemalloc
    # kvfabric bench ledger, 2026-12-01T17:28:41: JetStream -> UsageConsumer -> ledger
    ledger_sqlite_records_per_s: float = 26_087.0
    ledger_postgres_records_per_s: float = 12_862.0
    source: str = "docs/benchmarks.md (bus, kv-index, ledger of 2026-12-01)"


# (bench name, the name of its ratio or figure, the Capacities field it measures)
_FROM_BENCH = (
    ("bus", "events/s, one publisher and one subscriber", "bus_events_per_s"),
    ("bus", "request/reply p50", "bus_request_reply_p50_us"),
    ("kv-index", "ingest, 10M blocks", "index_ingest_blocks_per_s"),
    ("kv-index", "match 1200 blocks stored in 40 turns, 10M blocks: p50", "index_match_p50_us"),
    ("kv-index", "match 1200 blocks stored in 40 turns, 10M blocks: p99", "index_match_p99_us"),
    ("kv-index", "memory per indexed block, 10M blocks (tracemalloc)", "index_bytes_per_block"),
    (
        "ledger",
        "sqlite: records/s into the ledger per billing process",
        "ledger_sqlite_records_per_s",
    ),
    (
        "ledger",
        "postgres: records/s into the ledger per billing process",
        "ledger_postgres_records_per_s",
    ),
)

MEASURED = Capacities()


def measured_capacities(paths: Iterable[Path] = ()) -> Capacities:
    """`MEASURED`, with each figure a given `kvfabric bench --json` result measured instead."""
    capacities, sources = MEASURED, []
    for path in paths:
        result = json.loads(Path(path).read_text())
        values = {r["name"]: r["ours"] for r in result.get("ratios", [])}
        values |= {f["name"]: f["value"] for f in result.get("figures", [])}
        changed = {
            field: float(values[name])
            for bench, name, field in _FROM_BENCH
            if bench == result.get("name") and name in values
        }
        if changed:
            capacities = replace(capacities, **changed)
            sources.append(f"{path} ({result.get('name')}, {result.get('started_at', '?')})")
    if sources:
        capacities = replace(
            capacities, source=f"{MEASURED.source}; replaced by {', '.join(sources)}"
        )
    return capacities


@dataclass(frozen=True)
class Limit:
    part: str
    demand: float
    capacity: float | None  # None: no measurement to hold it against
    unit: str
    note: str

    @property
    def headroom(self) -> float | None:
        """Capacity / demand; None without a capacity or a demand."""
        if self.capacity is None or not self.demand:
            return None
        return self.capacity / self.demand

    @property
    def instances(self) -> int | None:
        """Instances of the measured capacity the demand needs."""
        if self.capacity is None:
            return None
        return max(1, math.ceil(self.demand / self.capacity))

    def to_dict(self) -> dict:
        return {
            "part": self.part,
            "demand": self.demand,
            "capacity": self.capacity,
            "unit": self.unit,
            "headroom": self.headroom,
            "instances": self.instances,
            "note": self.note,
        }


def limits(
    day: Day,
    the_plan: Plan,
    config: SimConfig,
    decisions_per_cpu_s: float,
    capacities: Capacities = MEASURED,
) -> list[Limit]:
    """The day's mean demands (and the store's at its peak) against measured capacities."""
    totals = day.totals()
    seconds = totals["seconds"]
    hit_per_s = totals["hit_tokens"] / seconds
    new_per_s = (totals["miss_tokens"] + totals["output_tokens"]) / seconds
    served_per_s = totals["served_requests"] / seconds
    decisions_per_s = day.total(day.decisions_per_s) / seconds
    output_per_s = totals["output_tokens"] / seconds
    store = config.store_read_bytes_per_s
    all_hits_bytes = hit_per_s * config.kv_bytes_per_token
    shards = the_plan.inputs.num_index_shards
    blocks_per_s = new_per_s / config.block_size_tokens
    retained_blocks = blocks_per_s * 86_400 * the_plan.inputs.retention_days
    must_local = max(0.0, 1 - store / all_hits_bytes) if all_hits_bytes else 0.0
    simulated_local = 1 - totals["store_read_bytes_per_s_mean"] / all_hits_bytes
    workers = day.num_prefill_gpus + day.num_decode_gpus
    match_per_s = 1e6 / capacities.index_match_p50_us
    return [
        Limit(
            "store read, every hit from the store",
            all_hits_bytes,
            store,
            "bytes/s",
            f"hits x {config.kv_bytes_per_token:,} KV bytes/token; capacity: the design's "
            f"store bandwidth (not a benchmark); >= {must_local:.1%} of hits must come from "
            "node memory",
        ),
        Limit(
            "store read, hits not in node memory (day mean)",
            totals["store_read_bytes_per_s_mean"],
            store,
            "bytes/s",
            f"simulated node-memory share of hits {simulated_local:.1%} (the slice's)",
        ),
        Limit(
            "store read, day peak",
            totals["store_read_bytes_per_s_peak"],
            store,
            "bytes/s",
            "the busiest step of the curve",
        ),
        Limit(
            f"NATS control messages per server ({NATS_SERVERS} servers)",
            (served_per_s * CONTROL_MESSAGES_PER_REQUEST + workers / config.heartbeat_s)
            / NATS_SERVERS,
            capacities.bus_events_per_s,
            "msgs/s",
            f"{CONTROL_MESSAGES_PER_REQUEST} per request + a LoadReport per GPU per "
            f"{config.heartbeat_s:g} s; capacity: bench bus, 1 pub/1 sub on one server",
        ),
        Limit(
            f"NATS token chunks per server ({NATS_SERVERS} servers)",
            output_per_s * CHUNKS_PER_OUTPUT_TOKEN / NATS_SERVERS,
            capacities.bus_events_per_s,
            "msgs/s",
            "one TokenChunk per output token (no coalescing in StreamWriter)",
        ),
        Limit(
            "kv-index ingest, all shards in one",
            2 * blocks_per_s,
            capacities.index_ingest_blocks_per_s,
            "blocks/s",
            f"BlocksStored ({blocks_per_s:,.0f}/s: misses + outputs / "
            f"{config.block_size_tokens}) + as many BlocksRemoved",
        ),
        Limit(
            f"kv-index ingest per shard ({shards} shards)",
            2 * blocks_per_s / shards,
            capacities.index_ingest_blocks_per_s,
            "blocks/s",
            "blocks partition by hash % shards",
        ),
        Limit(
            "kv-index probes per shard",
            decisions_per_s,
            match_per_s,
            "probes/s",
            f"every routing attempt asks every shard (a prompt's blocks lie on all); "
            f"capacity 1 / match p50 ({capacities.index_match_p50_us:g} us), one core",
        ),
        Limit(
            f"kv-index memory per shard ({shards} shards)",
            retained_blocks * capacities.index_bytes_per_block / shards,
            None,
            "bytes",
            f"{the_plan.inputs.retention_days:g} days of blocks at "
            f"{capacities.index_bytes_per_block:g} bytes/block (measured); no RAM budget given",
        ),
        Limit(
            "router decisions, per core at the slice's size",
            decisions_per_s,
            decisions_per_cpu_s,
            "decisions/s",
            "measured in the calibration runs; the cost grows with the workers in the table",
        ),
        Limit(
            "router decisions, per core at the reference shape",
            decisions_per_s,
            REFERENCE_SHAPE_DECISIONS_PER_CPU_S,
            "decisions/s",
            "docs/simulator.md: 1,200 + 1,216 workers in one LoadTable",
        ),
        Limit(
            "ledger, sqlite (per billing process)",
            served_per_s,
            capacities.ledger_sqlite_records_per_s,
            "records/s",
            "one usage record per request served",
        ),
        Limit(
            "ledger, postgres (per billing process)",
            served_per_s,
            capacities.ledger_postgres_records_per_s,
            "records/s",
            "one usage record per request served",
        ),
    ]
