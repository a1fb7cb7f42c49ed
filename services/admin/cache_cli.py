"""`kvfabric cache stats|evict|flush`: the KV cache as kv-index sees it, shard by shard.

The shards are found through discovery (each kv-index instance publishes `shard: i/n` in its
metadata); each command goes to every shard's admin endpoint.
"""

from __future__ import annotations

import asyncio

import typer

from shared.bus import Bus
from shared.discovery import discover
from shared.schema import ServiceError
from shared.schema.kv_index import CacheCommand, CacheStats
from shared.subjects import DEFAULT_ROOT, KV_INDEX

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
NATS_URL = typer.Option(
    "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
)
ROOT = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT")
TIER = typer.Option("", help="one tier (ssd, dram); default: every tier")


async def _send(nats_url: str, root: str, command: CacheCommand) -> list[CacheStats]:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        shards = {i.metadata.get("shard", "0/1") for i in await discover(bus, service=KV_INDEX)}
        if not shards:
            raise typer.BadParameter(f"no kv-index instance under root {root!r} at {nats_url}")
        num_shards = int(next(iter(shards)).split("/")[1])
        return [
            await bus.request(bus.subjects.kv_index_admin(shard), command, CacheStats, timeout_s=30)
            for shard in range(num_shards)
        ]
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
