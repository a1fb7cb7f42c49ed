"""`kvfabric keys create|list|revoke`: the API keys ingress accepts, each mapped to the
account its usage is billed to. Keys live hashed in a JetStream key-value bucket of the
cluster (shared.api_keys); a new key is printed once and cannot be shown again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer

from shared.api_keys import KeyStore
from shared.bus import Bus
from shared.schema import ServiceError
from shared.subjects import DEFAULT_ROOT

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
NATS_URL = typer.Option(
    "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
)
ROOT = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT")
JS_REPLICAS = typer.Option(
    1,
    min=1,
    max=5,
    help="copies JetStream keeps of the keys bucket: 3 on a three-server NATS cluster",
    envvar="KVF_JS_REPLICAS",
)
T = TypeVar("T")


def _run(
    nats_url: str, root: str, js_replicas: int, action: Callable[[KeyStore], Awaitable[T]]
) -> T:
    async def run() -> T:
        bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
        bus.js.replicas = js_replicas
        try:
            store = KeyStore(bus)
            await store.start()
            return await action(store)
        finally:
            await bus.close()

    try:
        return asyncio.run(run())
    except ServiceError as exc:
        typer.echo(f"keys: {exc.message}", err=True)
        raise typer.Exit(1) from exc


@app.command()
def create(
    account: str = typer.Option(..., help="the account billed for this key's usage"),
    name: str = typer.Option("", help="a label to tell keys apart"),
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Create a key; it is printed once (only its hash is stored)."""
    try:
        key, record = _run(nats_url, root, js_replicas, lambda store: store.create(account, name))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--account") from exc
    typer.echo(f"{record.key_id} for account {record.account}: {key}")


@app.command("list")
def list_keys(
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Every key's id, account, label, creation time and state (never the key)."""
    records = _run(nats_url, root, js_replicas, lambda store: store.list())
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in records], indent=2))
        return
    if not records:
        typer.echo("no API keys")
        return
    typer.echo(f"{'KEY ID':<18} {'ACCOUNT':<16} {'NAME':<16} {'CREATED (UTC)':<20} STATE")
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created_s))
        state = "revoked" if r.revoked else "active"
        typer.echo(f"{r.key_id:<18} {r.account:<16} {r.name:<16} {created:<20} {state}")


@app.command()
def revoke(
    key_id: str = typer.Argument(..., help="the key's id, as `keys list` shows it"),
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Revoke a key: ingress refuses it within seconds (it caches lookups for 5 s)."""
    if not _run(nats_url, root, js_replicas, lambda store: store.revoke(key_id)):
        typer.echo(f"no key {key_id!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")
