"""`kvfabric generate PROMPT`: one request through a running cluster, as ingress would send it.

The prompt is tokenized here with `--model`'s own tokenizer (the cluster's workers of that
model run the same), block-hashed and sent to the router (`shared.client.generate`). The text is
streamed to stdout as the decode worker sends it; a summary (cache hits, TTFT, where the
prefill time went, draft acceptance) goes to stderr, so `kvfabric generate ... > out.py`
keeps only the model's text. `--format json` prints one object instead.

`--chat` renders the model's own chat template (tokenizer_config.json's, or the GGUF's) around
the prompt as one user turn; `--raw` (the default) sends the prompt's tokens as they are,
without a bos token.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
import typer

from services.admin.output import check_format, format_option
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.logging import configure_logging
from shared.models import DEFAULT_MODELS, ModelError, model_path, served_name
from shared.schema import GenerateRequest, ServiceError, TokenChunk, Unavailable
from shared.subjects import DEFAULT_ROOT, INGRESS
from shared.usage import open_usage_outbox
from shared.usage_outbox import OutboxLocked, UsageOutbox
from worker.engine.checkpoint import Checkpoint
from worker.engine.errors import EngineError

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
CONNECT_TIMEOUT_S = 3.0


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """PROMPT, `-` (stdin) or --prompt-file: exactly one, not empty."""
    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give a PROMPT (or - for stdin) or --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--prompt-file") from exc
    else:
        text = sys.stdin.read() if prompt == "-" else str(prompt)
    if not text:
        raise typer.BadParameter("the prompt is empty")
    return text


def load_model_files(model: str) -> tuple[str, Checkpoint]:
    """The served name and the files of --model (a name or a path); BadParameter if absent."""
    try:
        return served_name(model), Checkpoint(model_path(model))
    except ModelError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from exc


def render_chat(checkpoint: Checkpoint, prompt: str) -> str:
    """The prompt as one user turn of the model's chat template, ready for the assistant."""
    try:
        return checkpoint.chat_template().render([{"role": "user", "content": prompt}])
    except EngineError as exc:  # no template, or one that fails to render
        raise typer.BadParameter(f"{exc}; or use --raw", param_hint="--chat") from exc


def summary_line(result: GenerateResult) -> str:
    """One line for stderr: cache hits, timings, the prefill split, draft acceptance."""
    decision, usage, stats = result.decision, result.usage, result.stats
    num_prompt = usage.num_prompt_tokens if usage else decision.num_prompt_tokens
    num_cached = usage.num_cached_tokens if usage else decision.num_cached_tokens
    num_output = len(result.token_ids)
    hit_pct = 100 * num_cached / num_prompt if num_prompt else 0.0
    parts = [
        f"prompt {num_prompt} tokens, cached {num_cached} ({hit_pct:.1f}%), "
        f"output {num_output} ({result.finish_reason or 'no finish reason'})",
    ]
    ttft = "-" if result.ttft_s is None else f"{result.ttft_s * 1000:.0f} ms"
    timing = f"TTFT {ttft}, total {result.total_s * 1000:.0f} ms"
    decode_s = result.total_s - (result.ttft_s or 0.0)
    if num_output > 1 and decode_s > 0:
        timing += f", {(num_output - 1) / decode_s:.1f} tokens/s"
    parts.append(timing)
    if stats is not None:
        p = stats.prefill
        restore = p.swa_restore or "none"
        if p.num_replay_tokens:
            restore += f", {p.num_replay_tokens} replayed"
        parts.append(
            f"prefill: load {p.load_ms:.1f} ms, restore {p.restore_ms:.1f} ms ({restore}), "
            f"compute {p.compute_ms:.1f} ms, store {p.store_ms:.1f} ms, "
            f"transfer {p.transfer_ms:.1f} ms"
        )
        if stats.num_draft_tokens:
            rate = 100 * stats.num_accepted_draft_tokens / stats.num_draft_tokens
            parts.append(
                f"drafts accepted {stats.num_accepted_draft_tokens}/{stats.num_draft_tokens} "
                f"({rate:.0f}%)"
            )
    return " | ".join(parts)


def result_json(result: GenerateResult, num_prompt_tokens: int) -> str:
    usage = result.usage
    return json.dumps(
        {
            "request_id": result.request_id,
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "num_prompt_tokens": num_prompt_tokens,
            "num_cached_tokens": usage.num_cached_tokens
            if usage
            else result.decision.num_cached_tokens,
            "usage": msgspec.to_builtins(usage),
            "ttft_s": result.ttft_s,
            "total_s": result.total_s,
            "stats": msgspec.to_builtins(result.stats),
            "decision": msgspec.to_builtins(result.decision),
        }
    )


async def _connect(nats_url: str, root: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Bus:
    # Bound here: with nothing listening at the URL, `Bus.connect` keeps retrying (nats-py
    # never gives up on the first connect when reconnects are unlimited).
    try:
        async with asyncio.timeout(timeout_s):
            return await Bus.connect(
                nats_url, service="admin", root=root, connect_timeout_s=timeout_s
            )
    except TimeoutError as exc:
        raise Unavailable(f"cannot connect to NATS at {nats_url}") from exc


class TextPrinter:
    """Streams chunk text to stdout; knows whether a line is left open (for the stderr line)."""

    def __init__(self) -> None:
        self.is_line_open = False

    def __call__(self, chunk: TokenChunk) -> None:
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            self.is_line_open = not chunk.text.endswith("\n")


async def _run(
    nats_url: str,
    root: str,
    request: GenerateRequest,
    *,
    printer: TextPrinter | None,
    timeout_s: float,
    overload_wait_s: float,
    outbox_dir: Path,
) -> GenerateResult:
    bus = await _connect(nats_url, root)
    try:
        outbox = await _open_outbox(bus, outbox_dir)
        try:
            return await generate(
                bus,
                request,
                on_chunk=printer,
                first_chunk_timeout_s=timeout_s,
                idle_timeout_s=min(timeout_s, 60.0),
                overload_wait_s=overload_wait_s,
                outbox=outbox,
            )
        finally:
            # A lost stream's usage goes out now; if JetStream cannot take it, it stays on
            # disk for the next `kvfabric generate`.
            await outbox.close(timeout_s=5.0)
    finally:
        await bus.close()  # drains: a CancelRequest sent on Ctrl-C still goes out


async def _open_outbox(bus: Bus, directory: Path) -> UsageOutbox:
    """The CLI's outbox; another `generate` running beside this one holds it, so a second
    one gets its own file, named by process id."""
    try:
        return await open_usage_outbox(bus, INGRESS, directory, "generate")
    except OutboxLocked:
        return await open_usage_outbox(bus, INGRESS, directory, f"generate-{os.getpid()}")


TEXT_FORMATS = ("text", "json")  # a stream of text is not a table


def generate_command(
    prompt: str | None = typer.Argument(
        None, metavar="PROMPT", help="prompt text; - reads it from stdin"
    ),
    prompt_file: Path | None = typer.Option(None, help="read the prompt from this file"),
    nats_url: str = typer.Option(
        "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
    ),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT"),
    model: str = typer.Option(
        DEFAULT_MODELS[0],
        help="the model to ask (kvfabric models list), or its path: "
        "its tokenizer and chat template, its name in the request",
    ),
    chat: bool = typer.Option(False, "--chat/--raw", help="wrap in the chat template, or not"),
    max_tokens: int = typer.Option(64, min=1, help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy"),
    seed: int | None = typer.Option(None, help="sampling seed"),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    block_size: int = typer.Option(64, min=1, help="tokens per KV block (as the cluster uses)"),
    cache_salt: str = typer.Option("", help="tenant namespace of the block hashes"),
    timeout_s: float = typer.Option(300.0, min=0.001, help="deadline of the whole request"),
    overload_wait_s: float = typer.Option(
        30.0, min=0.0, help="wait out OVERLOADED refusals this long in all (0: fail at once)"
    ),
    state_dir: Path = typer.Option(
        Path(".kvfabric"), help="usage of a lost stream waits in <state-dir>/outbox until stored"
    ),
    fmt: str = format_option("text", TEXT_FORMATS),
) -> None:
    """Generate from PROMPT through a running cluster; stream the text to stdout (`--format
    json`: one JSON object at the end instead, with the usage and timings)."""
    text = read_prompt(prompt, prompt_file)
    name, checkpoint = load_model_files(model)
    if chat:
        text = render_chat(checkpoint, text)
    try:
        tokenizer = checkpoint.tokenizer()
    except EngineError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from exc
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    request = build_request(
        token_ids,
        model=name,
        block_size_tokens=block_size,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop=stop,
        cache_salt=cache_salt,
        deadline_s=timeout_s,
    )
    # Logs go to stderr, and only errors: stdout is the model's text.
    configure_logging(service="admin", instance_id="generate", level="error")
    printer = None if check_format(fmt, TEXT_FORMATS) == "json" else TextPrinter()
    try:
        result = asyncio.run(
            _run(
                nats_url,
                root,
                request,
                printer=printer,
                timeout_s=timeout_s,
                overload_wait_s=overload_wait_s,
                outbox_dir=state_dir / "outbox",
            )
        )
    except ServiceError as exc:
        retry = f" (retry after {exc.retry_after_s:g} s)" if exc.retry_after_s else ""
        _end_line(printer)
        typer.echo(f"generate: {exc.code}: {exc.message}{retry}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    except KeyboardInterrupt as exc:
        _end_line(printer)
        typer.echo("generate: interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from exc
    if printer is None:
        typer.echo(result_json(result, len(token_ids)))
        return
    _end_line(printer)
    typer.echo(summary_line(result), err=True)


def _end_line(printer: TextPrinter | None) -> None:
    # The stderr line must not continue the streamed text's last line on a terminal; piped,
    # stdout keeps exactly the model's text.
    if printer is not None and printer.is_line_open and sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()
