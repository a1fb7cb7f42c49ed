"""`kvfabric accounts set|list`: settings of the accounts API keys bill to (cache scope, rate
limits and quotas), kept in a JetStream key-value bucket of the cluster (shared.accounts)
that every ingress reads. An account without settings has the defaults: its prompts cached
in a namespace of its own, no limits."""

from __future__ import annotations

import dataclasses
import time

import typer

from services.admin.keys_cli import (
    JS_REPLICAS,
    LIMITS,
    NATS_URL,
    ROOT,
    Audited,
    parse_limits,
    run_on_store,
)
from services.admin.output import check_format, emit, format_option
from shared.accounts import AccountStore

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)


@app.command("set")
def set_account(
    account: str = typer.Argument(..., help="the account's name, as `keys create` gave it"),
    cache_scope: str | None = typer.Option(
        None,
        help="where its prompts' KV is cached: 'account' (its own namespace, the default), "
        "'group:NAME' (shared with every account of that group) or 'shared' (the cluster's)",
    ),
    prefix_guard: bool | None = typer.Option(
        None,
        "--prefix-guard/--no-prefix-guard",
        help="rewrite known volatile lines of its system prompts (billing headers: removed; "
        "timestamps, UUIDs, nonces: moved to the prompt's end) so its cached prefix survives "
        "them; every rewrite is audited (default: off)",
    ),
    limit: list[str] = LIMITS,
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
) -> None:
    """Set an account's cache scope, prefix guard and limits (the rest stays); applied
    within 5 s."""
    changes = parse_limits(limit)

    async def action(store: AccountStore):  # noqa: ANN202
        return await store.set(
            account, cache_scope=cache_scope, prefix_guard=prefix_guard, **changes
        )

    try:
        detail = {k: str(v) for k, v in changes.items()}
        if cache_scope is not None:
            detail["cache_scope"] = cache_scope
        if prefix_guard is not None:
            detail["prefix_guard"] = "on" if prefix_guard else "off"
        audited = Audited("accounts.set", account, detail)
        saved = run_on_store(nats_url, root, js_replicas, AccountStore, action, "accounts", audited)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    guard = "on" if saved.prefix_guard else "off"
    typer.echo(
        f"account {saved.name}: cache scope {saved.cache_scope}, prefix guard {guard}, "
        f"limits {saved.limits.describe()}"
    )


@app.command("list")
def list_accounts(
    nats_url: str = NATS_URL,
    root: str = ROOT,
    js_replicas: int = JS_REPLICAS,
    fmt: str = format_option(),
) -> None:
    """The accounts with settings of their own (the rest have the defaults)."""
    check_format(fmt)
    accounts = run_on_store(
        nats_url, root, js_replicas, AccountStore, lambda s: s.list(), "accounts"
    )

    def table() -> None:
        if not accounts:
            typer.echo(
                "no account settings: every account has the defaults (cache scope 'account')"
            )
            return
        typer.echo(f"{'ACCOUNT':<24} {'CACHE SCOPE':<24} {'GUARD':<6} {'UPDATED (UTC)':<20} LIMITS")
        for a in accounts:
            updated = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(a.updated_s))
            guard = "on" if a.prefix_guard else "off"
            typer.echo(
                f"{a.name:<24} {a.cache_scope:<24} {guard:<6} {updated:<20} {a.limits.describe()}"
            )

    emit(fmt, [dataclasses.asdict(a) for a in accounts], table)
