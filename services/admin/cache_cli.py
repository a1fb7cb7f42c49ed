"""`kvfabric cache stats|evict|flush|rebuild|explain`: the KV cache as kv-index sees it,
shard by shard, and why a request missed it.

The shards are found through discovery (each kv-index instance publishes `shard: i/n` in its
metadata); each command goes to every shard's admin endpoint. `explain` reads what ingress
kept of a request's diagnosis (services/ingress/diagnosis.py), with admin credentials.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from services.ingress.diagnosis import Explanation, Explanations, request_id_of
from shared import audit
from shared.bus import Bus
from shared.discovery import discover
from shared.schema import ServiceError, StoredBlock
from shared.schema.kv_index import CacheCommand, CacheStats, RebuildBatch, RebuildReply
from shared.subjects import DEFAULT_ROOT, KV_INDEX
from worker.kvstore.scan import infer_payload_nbytes, scan_headers

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
NATS_URL = typer.Option(
    "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
)
ROOT = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT")
TIER = typer.Option("", help="one tier (ssd, dram); default: every tier")
REBUILD_BATCH_BLOCKS = 20_000  # ~40 bytes a block: well under the 8 MB max payload


async def _num_shards(bus: Bus) -> int:
    shards = {i.metadata.get("shard", "0/1") for i in await discover(bus, service=KV_INDEX)}
    if not shards:
        raise typer.BadParameter(f"no kv-index instance under root {bus.subjects.root!r}")
    return int(next(iter(shards)).split("/")[1])


async def _send(nats_url: str, root: str, command: CacheCommand) -> list[CacheStats]:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        num_shards = await _num_shards(bus)
        action, target = f"cache.{command.action}", command.tier or "every tier"
        detail = {"fraction": str(command.fraction)} if command.action == "evict" else {}
        try:
            replies = [
                await bus.request(
                    bus.subjects.kv_index_admin(shard), command, CacheStats, timeout_s=30
                )
                for shard in range(num_shards)
            ]
        except ServiceError as exc:
            if command.action != "stats":
                await audit.record(bus, action, target, f"failed: {exc.message}", detail)
            raise
        if command.action != "stats":  # reading changes nothing: not an action to audit
            await audit.record(bus, action, target, "ok", detail)
        return replies
    finally:
        await bus.close()


def _run(nats_url: str, root: str, command: CacheCommand) -> None:
    try:
        replies = asyncio.run(_send(nats_url, root, command))
    except ServiceError as exc:
        typer.echo(f"cache {command.action}: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"{'SHARD':6} {'TIER':6} {'BLOCKS':>10} {'USED':>14} {'CAPACITY':>16}  INSTANCE")
    for reply in replies:
        for tier, figures in sorted(reply.tiers.items()):
            used, capacity = figures["used_bytes"], figures["capacity_bytes"]
            typer.echo(
                f"{reply.shard_id:<6} {tier:6} {figures['num_blocks']:>10,} "
                f"{used:>14,} {capacity:>16,}  {reply.instance_id}"
            )
    totals: dict[str, int] = {}
    for reply in replies:
        for name, value in reply.counters.items():
            totals[name] = totals.get(name, 0) + value
    typer.echo("  ".join(f"{name}={value:,}" for name, value in sorted(totals.items())))


@app.command()
def stats(nats_url: str = NATS_URL, root: str = ROOT) -> None:
    """Blocks, bytes and counters per shard and tier."""
    _run(nats_url, root, CacheCommand(action="stats"))


@app.command()
def evict(
    fraction: float = typer.Option(
        ..., help="share of each tier to drop, least recently used first"
    ),
    tier: str = TIER,
    nats_url: str = NATS_URL,
    root: str = ROOT,
) -> None:
    """Evict the least recently used share of the cache (writers are told to free the slots)."""
    if not 0 <= fraction <= 1:
        raise typer.BadParameter("must be in [0, 1]", param_hint="--fraction")
    _run(nats_url, root, CacheCommand(action="evict", tier=tier, fraction=fraction))


@app.command()
def flush(tier: str = TIER, nats_url: str = NATS_URL, root: str = ROOT) -> None:
    """Forget every cached block (of one tier); writers are told to free the slots."""
    _run(nats_url, root, CacheCommand(action="flush", tier=tier))


@app.command()
def explain(
    request_id: str = typer.Argument(
        ..., help="as a response named it: chatcmpl-..., resp_..., msg_... or the bare id"
    ),
    nats_url: str = NATS_URL,
    root: str = ROOT,
) -> None:
    """Why a request's prompt missed the cache: the cause, where, and the prompt's text
    around its first missed token (not kept for an account whose cache is isolated)."""
    if request_id_of(request_id) is None:
        raise typer.BadParameter(f"{request_id!r} is not a request id", param_hint="REQUEST_ID")
    found = asyncio.run(_explanation(nats_url, root, request_id))
    if found is None:
        typer.echo(f"no cache explanation for {request_id} (never kept, or expired)", err=True)
        raise typer.Exit(1)
    part = f" ({found.part})" if found.part else ""
    typer.echo(f"request  {found.request_id}  account {found.account}  model {found.model}")
    typer.echo(f"cause    {found.cause}{part}")
    typer.echo(f"missed   from token {found.first_miss_token:,} of {found.num_prompt_tokens:,}")
    evicted = found.eviction
    if evicted is not None:
        ago_s = (found.ts_ms - evicted.evicted_ms) / 1000
        typer.echo(
            f"evicted  from {evicted.tier} ({evicted.reason}) {ago_s:,.1f} s before the request,"
            f" after {evicted.idle_s:,.0f} s unused"
        )
    if not found.has_text:
        typer.echo("text     not kept: the account's cache is isolated from others'")
        return
    typer.echo("text     ... " + f"{found.before}>>>[first miss]<<<{found.after}" + " ...")


async def _explanation(nats_url: str, root: str, request_id: str) -> Explanation | None:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        return await Explanations(bus, ttl_s=0.0).get(request_id)
    finally:
        await bus.close()


@app.command()
def rebuild(
    store_dir: Path = typer.Option(..., help="the SSD store's root (the shared mount)"),
    payload_bytes: int = typer.Option(0, help="a block's KV bytes (0: read from a slot header)"),
    tier: str = typer.Option("ssd", help="the tier the store is"),
    nats_url: str = NATS_URL,
    root: str = ROOT,
) -> None:
    """Rebuild the index from the store's slot headers, when its event log is lost."""
    if not store_dir.is_dir():
        raise typer.BadParameter(f"{store_dir} is not a directory", param_hint="--store-dir")
    payload_nbytes = payload_bytes or infer_payload_nbytes(store_dir)
    if not payload_nbytes:
        raise typer.BadParameter(f"no slot header under {store_dir}: pass --payload-bytes")
    try:
        num_slots, num_indexed = asyncio.run(
            _rebuild(store_dir, payload_nbytes, tier, nats_url, root)
        )
    except ServiceError as exc:
        typer.echo(f"cache rebuild: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"rebuilt: {num_slots:,} valid slots found, {num_indexed:,} blocks indexed")


async def _rebuild(
    store_dir: Path, payload_nbytes: int, tier: str, nats_url: str, root: str
) -> tuple[int, int]:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        num_shards = await _num_shards(bus)
        num_slots = num_indexed = 0

        async def send(writer_id: str, blocks: list[StoredBlock], is_last: bool) -> None:
            nonlocal num_indexed
            batch = RebuildBatch(
                tier=tier, writer_id=writer_id, blocks=tuple(blocks), is_last=is_last
            )
            for shard in range(num_shards):  # each shard keeps the hashes it owns
                reply = await bus.request(
                    bus.subjects.kv_index_rebuild(shard), batch, RebuildReply, timeout_s=60
                )
                num_indexed += reply.num_indexed

        pending: list[StoredBlock] = []
        writer = ""
        for found in scan_headers(store_dir, payload_nbytes):
            if pending and (found.writer_id != writer or len(pending) == REBUILD_BATCH_BLOCKS):
                await send(writer, pending, is_last=False)
                pending = []
            writer = found.writer_id
            pending.append(found.stored_block)
            num_slots += 1
            if num_slots % 100_000 == 0:
                typer.echo(f"  {num_slots:,} slots scanned ...")
        await send(writer, pending, is_last=True)
        await audit.record(
            bus,
            "cache.rebuild",
            tier,
            "ok",
            {"store_dir": str(store_dir), "num_slots": str(num_slots), "indexed": str(num_indexed)},
        )
        return num_slots, num_indexed
    finally:
        await bus.close()
