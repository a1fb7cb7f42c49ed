"""`kvfabric`: the admin CLI. `up` runs the whole cluster on one machine, `serve` runs one
service instance against an existing NATS, `status` lists live instances and the launcher's
restarts, `drain` restarts one instance without failing its requests, `demo` brings the
cluster up, serves an agent's two turns and stops it, `generate` sends one prompt through a
running cluster, `cache` inspects the KV cache and `models` the model cache."""

from __future__ import annotations

import asyncio
import secrets
import signal
import sys
import tempfile
import time
from importlib.metadata import version as package_version
from pathlib import Path

import msgspec
import typer
from aiohttp import web

from services.admin import (
    accounts_cli,
    bench_cli,
    billing_cli,
    cache_cli,
    generate_cli,
    keys_cli,
    models_cli,
    plan_cli,
    simulate_cli,
    top_cli,
    trace_cli,
)
from services.admin.demo import demo_requests
from services.admin.launcher import (
    GIB,
    START_ORDER,
    Cluster,
    ClusterSpec,
    module_of,
    parse_replicas,
)
from services.admin.output import check_format, emit, format_option
from services.admin.status import render, render_supervision
from services.admin.supervisor import RestartPolicy, load_state
from shared import audit, models
from shared.bus import Bus
from shared.config import ENGINES, ConfigError, read_table
from shared.discovery import discover
from shared.logging import configure_cli_logging
from shared.metrics import CONTENT_TYPE
from shared.models import DEFAULT_MODELS
from shared.nats_auth import authorization_conf, ensure_credentials, seed_path
from shared.schema import (
    AuditRecord,
    DrainAccepted,
    DrainRequest,
    InstanceState,
    NoResponders,
    ServiceError,
)
from shared.subjects import DECODE, DEFAULT_ROOT, PREFILL, SERVICES, VLLM_WORKER, Subjects

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"kvfabric {package_version('kvfabric')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="print the version and exit"
    ),
) -> None:
    # Every command's own log lines go to stderr: its stdout (tables, JSON) stays clean.
    configure_cli_logging()


app.add_typer(
    cache_cli.app,
    name="cache",
    short_help="The KV cache as kv-index sees it: stats, evict, flush, rebuild.",
)
app.add_typer(
    models_cli.app,
    name="models",
    short_help="The models a cluster can serve and their local cache: list, fetch, show.",
)
app.add_typer(
    billing_cli.app,
    name="billing",
    short_help="The ledger: revenue and tokens by account, model, hour or day; one account.",
)
app.add_typer(
    accounts_cli.app,
    name="accounts",
    short_help="Settings of the accounts keys bill to (cache scope): set, list.",
)
app.add_typer(
    keys_cli.app,
    name="keys",
    short_help="API keys ingress accepts, each mapped to a billing account: create, list, revoke.",
)
app.command("generate")(generate_cli.generate_command)
app.command("bench", short_help="Benchmarks, each against its peer in one run: NAME, list, all.")(
    bench_cli.bench_command
)
app.command("plan", short_help="GPUs, servers, money, SSD of a deployment.")(plan_cli.plan_command)
app.command(
    "simulate", short_help="A cluster simulated with the real router and kv-index, by window."
)(simulate_cli.simulate_command)
app.command("top", short_help="The cluster live: instances, request rate, hit share, TTFT.")(
    top_cli.top_command
)
app.command("trace", short_help="One request's spans as a tree, from `up --trace-dir`'s files.")(
    trace_cli.trace_command
)

NATS_URL_HELP = "URL of a running NATS server (default: start an embedded one)"


def _up_defaults_from_file(ctx: typer.Context, value: Path | None) -> Path | None:
    """`--config FILE`: its [up] table becomes this command's defaults (click's default
    map: a flag or its variable still wins). Runs before the other options (eager)."""
    if value is None:
        return None
    try:
        table = read_table(value, "up")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    names = {
        opt.lstrip("-").replace("-", "_"): param.name
        for param in ctx.command.params
        for opt in param.opts
        if opt.startswith("--")
    }
    defaults = {}
    for key, item in table.items():
        name = names.get(key.replace("-", "_"))
        if name is None or name == "config":
            raise typer.BadParameter(
                f"{value}: [up] {key} is not an option of up", param_hint="--config"
            )
        defaults[name] = ",".join(map(str, item)) if isinstance(item, list) else item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


@app.command()
def up(
    nats_url: str | None = typer.Option(None, help=NATS_URL_HELP, envvar="KVF_NATS_URL"),
    nats_port: int = typer.Option(
        4222, help="embedded nats-server port; a cluster's take the next ones (0: any free port)"
    ),
    nats_cluster: int = typer.Option(
        1,
        help="embedded NATS servers: 1, or a JetStream cluster of this many (3: every stream, "
        "bucket and object store kept on three servers, R3; one may be lost)",
    ),
    js_replicas: int | None = typer.Option(
        None,
        help="replicas of every stream, bucket and object store (default: min(servers, 3); "
        "1 with --nats-url unless given: say what an external cluster supports)",
    ),
    nats_max_store_gib: float = typer.Option(
        64,
        min=0,
        help="embedded servers' JetStream store ceiling, GiB (streams reserve their limits "
        "from it; 0: the server's default, 75% of the disk's free space at start)",
    ),
    http_port: int = typer.Option(
        8000, help="ingress HTTP port; replicas take the next ports (0: any)"
    ),
    http_host: str = typer.Option("127.0.0.1", help="ingress HTTP bind address"),
    metrics_port: int = typer.Option(
        0,
        help="every process's /metrics and /health: this port and the next ones, one per "
        "process (0: any free port); `kvfabric status` lists them",
    ),
    replicas: str = typer.Option("", help="instances per service, e.g. prefill=2,decode=2"),
    state_dir: Path = typer.Option(Path(".kvfabric"), help="JetStream data and service logs"),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root"),
    log_level: str | None = typer.Option(
        None,
        help="debug|info|warning|error, for every service (default: each one's own: "
        "KVF_LOG_LEVEL, the configuration file, else info)",
    ),
    shutdown_grace_s: float | None = typer.Option(
        None,
        help="how long each service may drain, for every service (default: each one's own: "
        "KVF_SHUTDOWN_GRACE_S, the configuration file, else 10)",
    ),
    models_: str = typer.Option(
        ",".join(DEFAULT_MODELS),
        "--models",
        help="models to serve, each by its own prefill and decode workers: names (kvfabric "
        "models list) or paths, comma separated",
    ),
    engine: str = typer.Option(
        "model",
        help="model: run it; mock: simulated timing, real KV events and usage; vllm: vLLM "
        "workers (prefill and decode in one, kvfabric's store as their KV connector) instead "
        "of prefill and decode (vLLM's venv is built on first use)",
    ),
    dev_api_key: str | None = typer.Option(
        None,
        envvar="KVF_DEV_API_KEY",
        help="an API key ingress accepts besides the keys of `kvfabric keys` (account 'dev')",
    ),
    trace_dir: Path | None = typer.Option(
        None, help="every service writes its spans here as JSON lines (read: kvfabric trace)"
    ),
    otlp_endpoint: str | None = typer.Option(
        None, help="every service exports its spans over OTLP/HTTP to this URL (.../v1/traces)"
    ),
    trace_sample_ratio: float = typer.Option(
        1.0, help="the share of requests traced when spans are exported (0..1)"
    ),
    restart_budget: int = typer.Option(
        5,
        help="restarts of one process within --restart-window-s before it is marked failed "
        "and left down (the rest serve on)",
    ),
    restart_window_s: float = typer.Option(60.0, help="the window of --restart-budget"),
    config: Path | None = typer.Option(
        None,
        "--config",
        is_eager=True,
        callback=_up_defaults_from_file,
        envvar="KVF_CONFIG",
        help="a TOML file: its [up] table gives this command's options (under flags and "
        "their variables), [shared] and [<service>] tables every service's settings (under "
        "their environment and the flags up passes: docs/operations.md)",
    ),
    nats_auth: bool = typer.Option(
        True,
        help="embedded servers take only clients with credentials: one nkey per role (each "
        "service kind, admin, client), made under STATE_DIR/nats-creds and kept, each role "
        "allowed only its own subjects (docs/security.md); commands against the cluster "
        "need KVF_NATS_CREDS=STATE_DIR/nats-creds/admin.nk",
    ),
    nats_tls: bool = typer.Option(
        False,
        help="embedded servers take TLS only, with a certificate from a private CA made under "
        "STATE_DIR/nats-tls (clients trust its ca.pem: KVF_NATS_TLS_CA)",
    ),
    nats_creds_dir: Path | None = typer.Option(
        None,
        help="the roles' nkey seeds (`kvfabric nats-creds`): for --nats-url, the credentials "
        "each service connects with; for embedded servers, used instead of STATE_DIR/nats-creds",
    ),
) -> None:
    """Run the whole cluster on this machine until Ctrl-C or SIGTERM. A process that exits on
    its own is started again (backoff 0.5 s doubling to 10 s; the embedded nats-server on the
    same port and store); `kvfabric status` shows restarts and failed instances."""
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
    if not 0 <= metrics_port < 65536:
        raise typer.BadParameter(
            f"must be in [0, 65536), got {metrics_port}", param_hint="--metrics-port"
        )
    spec.metrics_port = metrics_port
    apply_engine(spec, engine, models_)
    spec.dev_api_key = dev_api_key
    spec.trace_dir, spec.otlp_endpoint, spec.trace_sample_ratio = _tracing(
        trace_dir, otlp_endpoint, trace_sample_ratio
    )
    if restart_budget < 0 or restart_window_s <= 0:
        raise typer.BadParameter(
            "the budget must be >= 0 and the window > 0", param_hint="--restart-budget"
        )
    spec.restart_policy = RestartPolicy(budget=restart_budget, window_s=restart_window_s)
    if nats_cluster < 1 or (nats_url is not None and nats_cluster != 1):
        raise typer.BadParameter(
            "at least 1, and only for embedded servers (not with --nats-url)",
            param_hint="--nats-cluster",
        )
    if js_replicas is not None and not 1 <= js_replicas <= 5:
        raise typer.BadParameter("must be in 1..5", param_hint="--js-replicas")
    if js_replicas is not None and nats_url is None and js_replicas > nats_cluster:
        raise typer.BadParameter(
            f"{js_replicas} replicas need as many servers (--nats-cluster {js_replicas})",
            param_hint="--js-replicas",
        )
    spec.nats_cluster, spec.js_replicas = nats_cluster, js_replicas
    spec.nats_max_store_bytes = int(nats_max_store_gib * GIB)
    spec.nats_auth, spec.nats_creds_dir, spec.nats_tls = nats_auth, nats_creds_dir, nats_tls
    spec.config_file = config
    raise typer.Exit(asyncio.run(_up(spec, serve_forever=True)))


@app.command("audit")
def audit_command(
    nats_url: str = typer.Option(
        "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
    ),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT"),
    since_s: float | None = typer.Option(None, help="only records this many seconds old or newer"),
    limit: int = typer.Option(1000, min=1, help="at most this many, the newest"),
    fmt: str = format_option(),
) -> None:
    """The audit log: every admin action (keys, accounts, drain, cache) with who did it
    (user@host and the nkey the server checked), oldest first. Needs admin credentials."""

    check_format(fmt)

    async def collect() -> list[AuditRecord]:
        bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
        try:
            return await audit.read(bus, since_s=since_s, limit=limit)
        finally:
            await bus.close()

    try:
        records = asyncio.run(collect())
    except ServiceError as exc:
        typer.echo(f"audit: {exc.message}", err=True)
        raise typer.Exit(1) from exc

    def table() -> None:
        if not records:
            typer.echo("no admin action recorded")
        for entry in records:
            typer.echo(audit.describe(entry))

    emit(fmt, [msgspec.structs.asdict(r) for r in records], table)


@app.command("nats-creds")
def nats_creds(
    out: Path = typer.Argument(..., help="folder for the seeds (made 0700; seeds 0600)"),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root the permissions are for"),
) -> None:
    """Make an nkey seed per role (each service kind, admin, client) in OUT, keeping any
    already there, and write OUT/authorization.conf: the `authorization` block to include
    in your nats-servers' configuration (public keys and each role's subject permissions;
    no secret). Then `kvfabric up --nats-url ... --nats-creds-dir OUT`."""
    try:
        subjects = Subjects(root)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--root") from exc
    keys = ensure_credentials(out)
    conf = out / "authorization.conf"
    conf.write_text(authorization_conf(keys, subjects))
    for role in sorted(keys):
        print(f"{role:<13} {keys[role]}  {seed_path(out, role)}")
    print(f"include {conf.resolve()} in each nats-server's configuration")


@app.command(short_help="Bring the cluster up, serve an agent's two turns on SmolLM2, stop it.")
def demo(
    state_dir: Path | None = typer.Option(None, help="default: a fresh temporary directory"),
) -> None:
    """Bring the cluster up on free ports (SmolLM2 and tiny-coder), ask SmolLM2 a coding
    question, send the agent's second turn (the conversation and a tool's output, mostly
    from the store), show the cluster's status, stop it."""
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix="kvfabric-"))
    spec = ClusterSpec(state_dir=state_dir, nats_port=0, http_port=0)
    spec.models = _models(",".join(DEFAULT_MODELS))
    spec.dev_api_key = "kvf-demo-" + secrets.token_hex(16)  # this run's only key
    raise typer.Exit(asyncio.run(_up(spec, serve_forever=False)))


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],  # `serve <service> --help` lists that service's flags
    },
    short_help="Run one service instance against an existing NATS.",
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
    state_dir: Path = typer.Option(
        Path(".kvfabric"),
        help="the state dir of a `kvfabric up`: its supervision (restarts, crash-looping, "
        "failed and degraded services) is shown too, when it has any",
    ),
    fmt: str = format_option(),
    timeout_s: float = typer.Option(0.5, help="how long to collect discovery replies"),
) -> None:
    """List every live instance with its load and metrics URL (from NATS discovery); json
    and csv add each one's metrics (json also the launcher's supervision). Exit 1 when NATS
    cannot be reached."""
    check_format(fmt)

    async def collect() -> list:
        bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
        try:
            return await discover(bus, timeout_s=timeout_s)
        finally:
            await bus.close()

    supervision = load_state(state_dir)
    error = None
    try:
        instances = asyncio.run(collect())
    except ServiceError as exc:
        instances, error = [], exc.message
    if error:
        typer.echo(f"status: {error}", err=True)

    def table() -> None:
        if not error and not instances:
            typer.echo(f"no kvfabric instances under root {root!r} at {nats_url}")
        elif instances:
            typer.echo(render(instances))
        if supervision is not None:
            typer.echo("")
            typer.echo(render_supervision(supervision, instances))

    rows = [i.__dict__ for i in instances]
    document: dict | list = rows
    if supervision is not None or error:
        document = {"instances": rows, "supervision": supervision, "error": error}
    emit(fmt, rows, table, document=document)
    if error:
        raise typer.Exit(1)


@app.command(short_help="Drain one instance: no new work, what it has finishes, then it restarts.")
def drain(
    instance_id: str = typer.Argument(..., help="the instance, as `kvfabric status` names it"),
    nats_url: str = typer.Option(
        "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
    ),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT"),
    grace_s: float = typer.Option(
        60.0, help="how long its requests in flight may take to finish before it stops anyway"
    ),
    wait: bool = typer.Option(
        True, help="wait until it stopped and (under `kvfabric up`) serves again"
    ),
    timeout_s: float = typer.Option(120.0, help="how long --wait waits"),
) -> None:
    """Planned maintenance: the instance reports DRAINING (routers send it nothing new), lets
    what it has in flight finish within --grace-s, and exits cleanly; `kvfabric up` starts
    it again at once. Draining instances one at a time is a rolling restart that fails no
    request. Exit 1 when it cannot be reached or is not back within --timeout-s."""
    if grace_s < 0 or timeout_s <= 0:
        raise typer.BadParameter("--grace-s must be >= 0 and --timeout-s > 0")
    try:
        code = asyncio.run(_drain(nats_url, root, instance_id, grace_s, wait, timeout_s))
    except ServiceError as exc:
        typer.echo(f"drain: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


async def _drain(
    nats_url: str, root: str, instance_id: str, grace_s: float, wait: bool, timeout_s: float
) -> int:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        started = time.monotonic()
        try:
            accepted = await bus.request(
                bus.subjects.drain(instance_id),
                DrainRequest(grace_s=grace_s),
                DrainAccepted,
                timeout_s=5.0,
            )
        except NoResponders:
            await audit.record(bus, "drain", instance_id, "not found", {"grace_s": str(grace_s)})
            typer.echo(f"drain: no instance {instance_id!r} under root {root!r}", err=True)
            return 1
        await audit.record(bus, "drain", instance_id, "ok", {"grace_s": str(grace_s)})
        typer.echo(f"draining {instance_id}: {accepted.num_in_flight} in flight")
        if not wait:
            return 0
        was_gone = False
        while time.monotonic() - started < timeout_s:
            found = [i for i in await discover(bus, timeout_s=0.3) if i.instance_id == instance_id]
            state = str(found[0].load.get("state", "")) if found else ""
            if not found and not was_gone:
                was_gone = True
                typer.echo(f"{instance_id} stopped after {time.monotonic() - started:.1f}s")
            if was_gone and state == InstanceState.SERVING:
                typer.echo(f"{instance_id} serving again after {time.monotonic() - started:.1f}s")
                return 0
        typer.echo(
            f"drain: {instance_id} not {'back' if was_gone else 'stopped'} within {timeout_s}s",
            err=True,
        )
        return 1
    finally:
        await bus.close()


def _models(text: str, engine: str = "model") -> tuple[str, ...]:
    """The --models list, each a known model (fetched: a mock worker reads its config too)
    or an existing path; BadParameter naming what is wrong."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise typer.BadParameter("name at least one model", param_hint="--models")
    resolved = []
    for name in names:
        try:
            models.model_path(name)
        except models.ModelError as exc:
            raise typer.BadParameter(str(exc), param_hint="--models") from exc
        resolved.append(models.source(name).name if _is_known(name) else name)
    if len(set(resolved)) != len(resolved):
        raise typer.BadParameter(f"a model is named twice: {text}", param_hint="--models")
    return tuple(resolved)


def _is_known(name: str) -> bool:
    try:
        models.source(name)
    except models.ModelError:
        return False
    return True


def _tracing(
    trace_dir: Path | None, otlp_endpoint: str | None, ratio: float
) -> tuple[Path | None, str | None, float]:
    """The tracing options, checked before any process starts; the trace dir made."""
    if not 0.0 <= ratio <= 1.0:
        raise typer.BadParameter(
            f"must be in [0, 1], got {ratio}", param_hint="--trace-sample-ratio"
        )
    if otlp_endpoint is not None and not otlp_endpoint.startswith(("http://", "https://")):
        raise typer.BadParameter("must be an http(s) URL", param_hint="--otlp-endpoint")
    if trace_dir is not None:
        try:
            trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise typer.BadParameter(
                f"{trace_dir}: {exc.strerror}", param_hint="--trace-dir"
            ) from exc
    return trace_dir, otlp_endpoint, ratio


UP_ENGINES = (*ENGINES, "vllm")
VLLM_DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def apply_engine(spec: ClusterSpec, engine: str, models_text: str) -> None:
    """`up --engine E --models M`: what the workers run and serve. `vllm`: vLLM workers in
    place of prefill and decode (unless --replicas says otherwise), serving SmolLM2 unless
    --models names models (vLLM loads a llama model's export)."""
    spec.extra_args = _engine_args(engine)
    if engine != "vllm":
        spec.models = _models(models_text, engine)
        return
    if models_text == ",".join(DEFAULT_MODELS):
        models_text = VLLM_DEFAULT_MODEL
    spec.models = _models(models_text, engine)
    spec.replicas = {PREFILL: 0, DECODE: 0, VLLM_WORKER: 1} | spec.replicas


def _engine_args(engine: str) -> dict[str, list[str]]:
    if engine not in UP_ENGINES:
        raise typer.BadParameter(f"must be one of {', '.join(UP_ENGINES)}", param_hint="--engine")
    if engine == "vllm":
        return {}
    return {PREFILL: ["--engine", engine], DECODE: ["--engine", engine]}


def _spec(
    nats_url, nats_port, http_host, http_port, replicas, state_dir, root, log_level, grace
) -> ClusterSpec:  # noqa: ANN001
    try:
        parsed = parse_replicas(replicas)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--replicas") from exc
    return ClusterSpec(
        state_dir=state_dir,
        nats_url=nats_url,
        nats_port=nats_port,
        root=root,
        http_host=http_host,
        http_port=http_port,
        replicas=parsed,
        log_level=log_level,
        shutdown_grace_s=grace,
    )


async def serve_launcher_metrics(cluster: Cluster, spec: ClusterSpec) -> web.AppRunner:
    """The launcher's own /metrics (the supervisor's restarts and states), on the port after
    the services' when --metrics-port is given, else any free one."""
    metrics = cluster.supervisor_metrics()

    async def exposition(_: web.Request) -> web.Response:
        response = web.Response(body=metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = spec.metrics_port + len(cluster.children) if spec.metrics_port else 0
    await web.TCPSite(runner, "127.0.0.1", port).start()
    host, bound = runner.addresses[0][:2]
    cluster.supervisor.metrics_url = f"http://{host}:{bound}/metrics"
    cluster.supervisor.save()
    return runner


async def _up(spec: ClusterSpec, *, serve_forever: bool) -> int:
    cluster = Cluster(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    echo = lambda text: print(text, flush=True)  # noqa: E731
    bus = None
    try:
        num_processes = sum(len(spec.instances(s)) for s in START_ORDER)
        echo(f"starting {num_processes} service processes ({', '.join(spec.models)})")
        cluster.start()
        if cluster.nats_cluster is not None:
            pids = ", ".join(str(s.pid) for s in cluster.nats_cluster.servers)
            echo(
                f"nats-servers  {cluster.nats_url} (embedded JetStream cluster, "
                f"R{spec.stream_replicas()}, pids {pids})"
            )
        else:
            echo(
                f"nats-server   {cluster.nats_url}"
                + ("" if spec.nats_url else f" (embedded, pid {cluster.nats.pid})")
            )
        for child in cluster.children:
            echo(f"process       {child.instance_id} pid {child.process.pid} log {child.log_path}")
        if cluster.nats_creds is not None:
            echo(f"credentials   export KVF_NATS_CREDS={cluster.nats_creds.resolve()}  (admin)")
        if cluster.nats_tls_ca is not None:
            echo(f"TLS           export KVF_NATS_TLS_CA={cluster.nats_tls_ca.resolve()}")
        bus = await Bus.connect(
            cluster.nats_url,
            service="admin",
            root=spec.root,
            creds=cluster.nats_creds,
            tls_ca=cluster.nats_tls_ca,
        )
        # A vLLM worker answers once vLLM has started: minutes on this machine.
        timeout_s = 900.0 if spec.instances(VLLM_WORKER) else 60.0
        ready = asyncio.create_task(
            cluster.wait_ready(
                bus, timeout_s=timeout_s, on_progress=lambda text: echo(f"starting      {text}")
            )
        )
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            echo("interrupted during start-up")
            return 130
        instances = ready.result()
        echo(
            f"HTTP API      {', '.join(cluster.http_urls)}  (/v1/chat/completions, "
            "/v1/responses, /v1/messages; GET /health)"
        )
        width = max(map(len, cluster.metrics_urls), default=0)
        for instance_id, url in cluster.metrics_urls.items():
            echo(f"metrics       {instance_id.ljust(width)}  {url}")
        if spec.dev_api_key:
            echo("API key       the --dev-api-key given (account 'dev')")
        else:
            echo(
                f"API key       create one: kvfabric keys create --account NAME "
                f"--nats-url {cluster.nats_url} --root {spec.root}"
            )
        echo(f"ready         {len(instances)} instances under root {spec.root}")
        if serve_forever:
            launcher_http = await serve_launcher_metrics(cluster, spec)
            echo(f"metrics       launcher  {cluster.supervisor.metrics_url}")
            cluster.supervise_in_background(lambda event: echo(f"supervisor    {event}"))
            echo("Ctrl-C stops the cluster")
            await stop.wait()
            await launcher_http.cleanup()
            return 0
        return await demo_requests(cluster, bus, echo, spec.dev_api_key)
    except (RuntimeError, TimeoutError, ServiceError) as exc:
        echo(f"error: {exc}")
        return 1
    finally:
        if bus is not None:
            await bus.close()
        echo("stopping")
        await asyncio.to_thread(cluster.stop, echo)


if __name__ == "__main__":
    sys.exit(app())
