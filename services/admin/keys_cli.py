"""`kvfabric keys create|list|revoke`: the API keys ingress accepts, each mapped to the
account its usage is billed to. Keys live hashed in a JetStream key-value bucket of the
cluster (shared.api_keys); a new key is printed once and cannot be shown again."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer

from services.admin.output import check_format, emit, format_option
from shared import audit
from shared.accounts import AccountStore, Limits
from shared.api_keys import KeyStore
from shared.bus import Bus
from shared.bus.connection import refusals
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
LIMITS = typer.Option(
    [],
    "--limit",
    help="NAME=VALUE, repeatable; names: "
    + ", ".join(f.name for f in dataclasses.fields(Limits))
    + " (period: day or month; 0 removes a limit)",
)
T = TypeVar("T")


def parse_limits(pairs: list[str]) -> dict[str, int | str]:
    """`--limit NAME=VALUE` options -> Limits fields; BadParameter naming the bad one."""
    names = {f.name for f in dataclasses.fields(Limits)}
    out: dict[str, int | str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in names:
            raise typer.BadParameter(f"{pair!r}: use NAME=VALUE with NAME one of {sorted(names)}")
        if name == "period":
            out[name] = value
        elif value.isdigit():
            out[name] = int(value)
        else:
            raise typer.BadParameter(f"{pair!r}: the value must be a whole number")
    try:
        Limits().merged(**out)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return out


S = TypeVar("S", KeyStore, AccountStore)


@dataclasses.dataclass
class Audited:
    """What the audit log says of an action (shared/audit.py): never a secret."""

    action: str  # e.g. "keys.revoke"
    target: str  # what it acts on: an account, a key id
    detail: dict[str, str] = dataclasses.field(default_factory=dict)
    # The outcome from the action's result ("ok" unless it says otherwise: "not found").
    outcome: Callable[[Any], str] = lambda result: "ok"


def run_on_store(
    nats_url: str,
    root: str,
    js_replicas: int,
    make_store: Callable[[Bus], S],
    action: Callable[[S], Awaitable[T]],
    command: str = "keys",
    audited: Audited | None = None,
) -> T:
    """`action` on the store `make_store` opens on the cluster's bus (keys, accounts); a
    cluster error is printed after `command` and exits 1. An `audited` action is written
    to the audit log, failed or not."""

    async def run() -> T:
        bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
        bus.js.replicas = js_replicas
        try:
            store = make_store(bus)
            try:
                await store.start()
                result = await action(store)
            except (ServiceError, ValueError) as exc:
                if audited is not None:
                    why = exc.message if isinstance(exc, ServiceError) else str(exc)
                    await _audit(bus, audited, f"failed: {why}")
                raise
            if audited is not None:
                await _audit(bus, audited, audited.outcome(result))
            return result
        finally:
            await bus.close()

    try:
        return asyncio.run(run())
    except ServiceError as exc:
        typer.echo(f"{command}: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except TimeoutError as exc:
        # A request the server refused (outside these credentials' permissions) or a server
        # that stopped answering.
        why = f"refused by NATS: {refusals[-1]}" if refusals else f"NATS did not answer: {exc}"
        typer.echo(f"{command}: {why}", err=True)
        raise typer.Exit(1) from exc


async def _audit(bus: Bus, audited: Audited, outcome: str) -> None:
    try:
        await audit.record(bus, audited.action, audited.target, outcome, audited.detail)
    except ServiceError as exc:
        raise ServiceError(
            f"{audited.action} {outcome}, but its audit record was not written: {exc.message}"
        ) from exc


def _run(
    nats_url: str,
    root: str,
    js_replicas: int,
    action: Callable[[KeyStore], Awaitable[T]],
    audited: Audited | None = None,
) -> T:
    return run_on_store(nats_url, root, js_replicas, KeyStore, action, audited=audited)


@app.command()
def create(
    account: str = typer.Option(..., help="the account billed for this key's usage"),
    name: str = typer.Option("", help="a label to tell keys apart"),
    limit: list[str] = LIMITS,
    expires_in_s: int = typer.Option(
        0, min=0, help="seconds until the key stops working (0: never)"
    ),
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Create a key; it is printed once (only its hash is stored)."""
    limits = Limits().merged(**parse_limits(limit))
    expires_s = int(time.time()) + expires_in_s if expires_in_s else 0

    def action(store: KeyStore):  # noqa: ANN202
        return store.create(account, name, limits=limits, expires_s=expires_s)

    detail = {"name": name, "limits": limits.describe(), "expires_s": str(expires_s)}
    audited = Audited("keys.create", account, detail, lambda made: f"ok {made[1].key_id}")
    try:
        key, record = _run(nats_url, root, js_replicas, action, audited)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--account") from exc
    typer.echo(f"{record.key_id} for account {record.account}: {key}")


@app.command("limit")
def limit_key(
    key_id: str = typer.Argument(..., help="the key's id, as `keys list` shows it"),
    limit: list[str] = LIMITS,
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Set a key's own limits (its account's hold too); ingresses apply them within 2 s."""
    changes = parse_limits(limit)
    audited = Audited(
        "keys.limit",
        key_id,
        {k: str(v) for k, v in changes.items()},
        lambda record: "ok" if record is not None else "not found",
    )
    record = _run(
        nats_url, root, js_replicas, lambda store: store.set_limits(key_id, **changes), audited
    )
    if record is None:
        typer.echo(f"no key {key_id!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{key_id}: limits {record.limits.describe()}")


@app.command()
def rotate(
    key_id: str = typer.Argument(..., help="the key's id, as `keys list` shows it"),
    grace_s: int = typer.Option(86400, min=0, help="seconds the old key keeps working"),
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """A new key for the same account, label and limits (printed once); the old one ends."""
    audited = Audited(
        "keys.rotate",
        key_id,
        {"grace_s": str(grace_s)},
        lambda rotated: f"ok {rotated[1].key_id}" if rotated is not None else "not found",
    )
    rotated = _run(
        nats_url, root, js_replicas, lambda store: store.rotate(key_id, grace_s), audited
    )
    if rotated is None:
        typer.echo(f"no live key {key_id!r}", err=True)
        raise typer.Exit(1)
    key, new, old = rotated
    ends = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(old.expires_s))
    typer.echo(f"{new.key_id} for account {new.account}: {key}")
    typer.echo(f"{old.key_id} works until {ends}")


@app.command("list")
def list_keys(
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
    fmt: str = format_option(),
) -> None:
    """Every key's id, account, label, creation time and state (never the key)."""
    check_format(fmt)
    records = _run(nats_url, root, js_replicas, lambda store: store.list())

    def table() -> None:
        if not records:
            typer.echo("no API keys")
            return
        typer.echo(
            f"{'KEY ID':<18} {'ACCOUNT':<16} {'NAME':<16} {'CREATED (UTC)':<20} {'STATE':<8} LIMITS"
        )
        now = time.time()
        for r in records:
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created_s))
            state = "revoked" if r.revoked else ("expired" if not r.is_live(now) else "active")
            if r.is_live(now) and r.expires_s:
                state = "expiring"
            typer.echo(
                f"{r.key_id:<18} {r.account:<16} {r.name:<16} {created:<20} {state:<8} "
                f"{r.limits.describe()}"
            )

    emit(fmt, [dataclasses.asdict(r) for r in records], table)


@app.command()
def revoke(
    key_id: str = typer.Argument(..., help="the key's id, as `keys list` shows it"),
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Revoke a key: ingress refuses it within seconds (it caches lookups for 2 s)."""
    audited = Audited("keys.revoke", key_id, outcome=lambda done: "ok" if done else "not found")
    if not _run(nats_url, root, js_replicas, lambda store: store.revoke(key_id), audited):
        typer.echo(f"no key {key_id!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")
