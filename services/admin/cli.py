"""`kvfabric`: the admin CLI. `up` runs the whole cluster on one machine, `serve` runs one
service instance against an existing NATS, `status` lists live instances, `demo` brings the
cluster up, serves a request and stops it, `generate` sends one prompt through a running
cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import urllib.request
from pathlib import Path

import typer

from services.admin import cache_cli, generate_cli
from services.admin.launcher import START_ORDER, Cluster, ClusterSpec, module_of, parse_replicas
from services.admin.status import render
from shared import kv_index_client as index_client
from shared.bus import Bus
from shared.client import build_request, generate
from shared.config import ENGINES
from shared.discovery import discover
from shared.engine.bundled import BUNDLED_MODEL_DIR
from shared.kvstore.blocks import RequestBlocks
from shared.schema import ServiceError, SwaGet, SwaGetReply, SwaPut, SwaPutReply
from shared.subjects import DECODE, DEFAULT_ROOT, PREFILL, SERVICES

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
app.add_typer(cache_cli.app, name="cache")
app.command("generate")(generate_cli.generate_command)

NATS_URL_HELP = "URL of a running NATS server (default: start an embedded one)"


@app.command()
def up(
    nats_url: str | None = typer.Option(None, help=NATS_URL_HELP, envvar="KVF_NATS_URL"),
    nats_port: int = typer.Option(4222, help="embedded nats-server port (0: any free port)"),
    http_port: int = typer.Option(
        8000, help="ingress HTTP port; replicas take the next ports (0: any)"
    ),
    http_host: str = typer.Option("127.0.0.1", help="ingress HTTP bind address"),
    replicas: str = typer.Option("", help="instances per service, e.g. prefill=2,decode=2"),
    state_dir: Path = typer.Option(Path(".kvfabric"), help="JetStream data and service logs"),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root"),
    log_level: str = typer.Option("info", help="debug|info|warning|error"),
    shutdown_grace_s: float = typer.Option(10.0, help="how long each service may drain"),
    model: Path = typer.Option(BUNDLED_MODEL_DIR, help="HF model directory prefill and decode run"),
    engine: str = typer.Option(
        "model", help="model: run it; mock: simulated timing, real KV events and usage"
    ),
) -> None:
    """Run the whole cluster on this machine until Ctrl-C or SIGTERM."""
    spec = _spec(
        nats_url,
        nats_port,
        http_host,
        http_port,
        replicas,
        state_dir,
        root,
        log_level,
        shutdown_grace_s,
    )
    spec.extra_args = _model_args(model, engine)
    raise typer.Exit(asyncio.run(_up(spec, serve_forever=True)))


@app.command()
def demo(
    state_dir: Path | None = typer.Option(None, help="default: a fresh temporary directory"),
) -> None:
    """Bring the cluster up on free ports, serve requests (health over HTTP, a kv-index match
    of a tokenized prompt, a swa-memcache round trip), show its status, stop it."""
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix="kvfabric-"))
    spec = ClusterSpec(state_dir=state_dir, nats_port=0, http_port=0)
    spec.extra_args = _model_args(BUNDLED_MODEL_DIR)
    raise typer.Exit(asyncio.run(_up(spec, serve_forever=False)))


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],  # `serve <service> --help` lists that service's flags
    }
)
def serve(
    ctx: typer.Context,
    service: str = typer.Argument(..., help=f"one of: {', '.join(SERVICES)}"),
) -> None:
    """Run one service instance against an existing NATS. Further flags go to the service
    (e.g. --nats-url, --instance-id, --root; `kvfabric serve router --help` lists them);
    every flag also reads from the environment (KVF_NATS_URL, KVF_ROUTER_HEARTBEAT_S...).
    Ctrl-C or SIGTERM drains it."""
    if service in ("--help", "-h"):
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    name = service.replace("_", "-")
    if name not in SERVICES:
        typer.echo(f"unknown service {service!r}; one of: {', '.join(SERVICES)}", err=True)
        raise typer.Exit(2)
    main = __import__(f"{module_of(name)}.main", fromlist=["main"]).main
    raise typer.Exit(main(list(ctx.args)))


@app.command()
def status(
    nats_url: str = typer.Option(
        "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
    ),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    timeout_s: float = typer.Option(0.5, help="how long to collect discovery replies"),
) -> None:
    """List every live instance with its load (from NATS discovery)."""

    async def collect() -> list:
        bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
        try:
            return await discover(bus, timeout_s=timeout_s)
        finally:
            await bus.close()

    try:
        instances = asyncio.run(collect())
    except ServiceError as exc:
        typer.echo(f"status: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        typer.echo(json.dumps([i.__dict__ for i in instances], indent=2))
    elif not instances:
        typer.echo(f"no kvfabric instances under root {root!r} at {nats_url}")
    else:
        typer.echo(render(instances))


def _model_args(model: Path, engine: str = "model") -> dict[str, list[str]]:
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} is not an HF model directory", param_hint="--model")
    if engine not in ENGINES:
        raise typer.BadParameter(f"must be one of {', '.join(ENGINES)}", param_hint="--engine")
    args = ["--model-dir", str(model), "--engine", engine]
    return {PREFILL: args, DECODE: list(args)}


def _spec(
    nats_url, nats_port, http_host, http_port, replicas, state_dir, root, log_level, grace
) -> ClusterSpec:  # noqa: ANN001
    try:
        parsed = parse_replicas(replicas)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--replicas") from exc
    return ClusterSpec(
        state_dir=state_dir, nats_url=nats_url, nats_port=nats_port, root=root,
        http_host=http_host, http_port=http_port, replicas=parsed, log_level=log_level,
        shutdown_grace_s=grace,
    )  # fmt: skip


async def _up(spec: ClusterSpec, *, serve_forever: bool) -> int:
    cluster = Cluster(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    echo = lambda text: print(text, flush=True)  # noqa: E731
    bus = None
    try:
        echo(f"starting {sum(spec.num_replicas(s) for s in START_ORDER)} service processes")
        cluster.start()
        echo(
            f"nats-server   {cluster.nats_url}"
            + ("" if spec.nats_url else f" (embedded, pid {cluster.nats.pid})")
        )
        for child in cluster.children:
            echo(f"process       {child.instance_id} pid {child.process.pid} log {child.log_path}")
        bus = await Bus.connect(cluster.nats_url, service="admin", root=spec.root)
        ready = asyncio.create_task(cluster.wait_ready(bus))
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            echo("interrupted during start-up")
            return 130
        instances = ready.result()
        echo(f"HTTP API      {', '.join(cluster.http_urls)}  (GET /health)")
        echo(f"ready         {len(instances)} instances under root {spec.root}")
        if serve_forever:
            echo("Ctrl-C stops the cluster")
            while not stop.is_set() and not cluster.exited():
                # Wake once a second to notice a service that exited on its own.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
            for child in cluster.exited():
                echo(f"{child.instance_id} exited with code {child.process.returncode}; stopping")
            return 0 if stop.is_set() else 1
        return await _demo_requests(cluster, bus, echo)
    except (RuntimeError, TimeoutError, ServiceError) as exc:
        echo(f"error: {exc}")
        return 1
    finally:
        if bus is not None:
            await bus.close()
        echo("stopping")
        await asyncio.to_thread(cluster.stop, echo)


DEMO_PROMPT = "import os\n\n\ndef list_files(path):\n    return sorted(os.listdir(path))\n" * 8


async def _demo_requests(cluster: Cluster, bus: Bus, echo) -> int:  # noqa: ANN001
    url = f"{cluster.http_urls[0]}/health"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    echo(f"GET {url} -> {body}")
    # A prompt as ingress will see it: tokenized with the bundled model's tokenizer, hashed
    # into blocks, looked up in kv-index; then a sliding-window snapshot through swa-memcache.
    from tokenizers import Tokenizer

    token_ids = (
        Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json")).encode(DEMO_PROMPT).ids
    )
    hashes = RequestBlocks.hash_prompt(
        token_ids, model=BUNDLED_MODEL_DIR.name, block_size_tokens=16
    ).hashes
    matched = await index_client.match(bus, hashes, num_shards=1)
    cached = max((m.num_blocks for m in matched.values()), default=0)
    echo(f"kv-index match: {len(token_ids)} tokens, {len(hashes)} blocks, {cached} cached")
    snapshot = SwaPut(block_hash=hashes[-1], snapshot=b"\x00" * 4096)
    stored = await bus.request(bus.subjects.swa_put, snapshot, SwaPutReply)
    got = await bus.request(bus.subjects.swa_get, SwaGet(block_hash=hashes[-1]), SwaGetReply)
    echo(f"swa-memcache put {stored.stored}, get found {got.found} ({len(got.snapshot)} bytes)")
    # Two turns of an agent through router -> prefill -> decode: the second re-sends the
    # first turn's prompt and answer and is served mostly from the store.
    history = list(token_ids)
    for turn in (1, 2):
        request = build_request(history, model=BUNDLED_MODEL_DIR.name, max_tokens=32)
        result = await generate(bus, request)
        usage = result.usage
        assert usage is not None  # a completed stream always ends with usage
        echo(
            f"generate turn {turn}: {usage.num_prompt_tokens} prompt tokens, "
            f"{usage.num_cached_tokens} from the store, {usage.num_output_tokens} generated "
            f"({result.finish_reason}), TTFT {(result.ttft_s or 0) * 1000:.0f} ms, "
            f"prefill {result.decision.prefill_worker_id}, decode "
            f"{result.decision.decode_worker_id}: {result.text!r}"
        )
        history += result.token_ids + [int(t) for t in token_ids[:8]]
        await asyncio.sleep(0.2)  # kv-index applies the answer's BlocksStored asynchronously
    echo(render(await discover(bus, timeout_s=0.5)))
    return 0


if __name__ == "__main__":
    sys.exit(app())
