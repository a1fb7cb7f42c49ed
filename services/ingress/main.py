"""ingress: the HTTP front door (OpenAI Chat Completions, OpenAI Responses, Anthropic
Messages). docs/design.md, 'Services' and 'HTTP APIs'; the routes are in app.py.

Wiring only: the served-model table (from discovery), the pipeline (tokenize, send to the
router, read the stream), the stored-responses and API-key buckets in JetStream, a usage
outbox for streams whose decode worker dies, and uvicorn serving the FastAPI app on this
process's event loop. The bound URL is published as `http_url` in discovery metadata, which
is how `kvfabric up` learns where the API is served. Its metrics (metrics.py: requests by
protocol and status, latency, time to first token) are served with every process's on the
runtime's own port (`--metrics-port`, `metrics_url`), not on the public API port. Stateless:
run as many replicas as wanted behind any HTTP load balancer.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from services.ingress.app import Services, build_app
from services.ingress.config import IngressConfig
from services.ingress.diagnosis import Explanations, SessionTurns
from services.ingress.http import NoDelayH11Protocol
from services.ingress.limits import Limiter
from services.ingress.models import ModelTable
from services.ingress.openai_responses import ResponseStore
from services.ingress.pipeline import Pipeline
from services.ingress.staging import StagingPolicy
from shared.accounts import AccountStore
from shared.api_keys import KeyStore
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import INGRESS
from shared.usage import open_usage_outbox
from worker.serving.metrics import observe_outbox

MAX_HEADER_BYTES = 64 * 1024
STARTUP_STALL_S = 0.1


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, IngressConfig)  # service_main built it from IngressConfig
    bus = runtime.bus
    models = ModelTable(
        bus,
        cache_tokens=config.segment_cache_tokens,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
    )
    config.usage_outbox_dir.mkdir(parents=True, exist_ok=True)
    outbox = await open_usage_outbox(bus, INGRESS, config.usage_outbox_dir, runtime.instance_id)
    runtime.on_stop(lambda: outbox.close(timeout_s=config.shutdown_grace_s))
    observe_outbox(runtime.metrics, outbox)
    sessions = SessionTurns(bus, config.session_ttl_s)
    await sessions.start()
    explanations = Explanations(bus, config.explain_ttl_s)
    await explanations.start()
    pipeline = Pipeline(
        bus,
        models,
        outbox=outbox,
        sessions=sessions,
        explanations=explanations,
        default_max_tokens=config.default_max_tokens,
        keepalive_s=config.keepalive_s,
        metrics=runtime.metrics,
        staging=(
            StagingPolicy(config.stage_default_s, config.stage_max_s)
            if config.stage_max_s > 0
            else None
        ),
    )
    responses = ResponseStore(bus, config.responses_ttl_s)
    await responses.start()
    keys = KeyStore(bus) if config.require_api_key else None
    accounts = AccountStore(bus) if keys is not None else None
    limiter = Limiter(bus, window_s=config.limit_window_s) if keys is not None else None
    if keys is not None and accounts is not None and limiter is not None:
        await keys.start()
        await accounts.start()
        await limiter.start()
        runtime.on_stop(limiter.stop)
    app = build_app(
        Services(
            pipeline,
            responses,
            keys,
            accounts,
            limiter,
            config.dev_api_key,
            config.max_body_bytes,
            runtime.health,
            config.body_timeout_s,
            config.stream_write_timeout_s,
        )
    )

    # Bind first (port 0 picks a free one), then hand uvicorn the socket. Its own serve()
    # would install signal handlers over the runtime's; startup/main_loop/shutdown do not.
    sock = socket.create_server((config.http_host, config.http_port), reuse_port=False)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=NoDelayH11Protocol,
            # Request line and headers past this: 400 and the connection closed (a client
            # still sending may see the close first); the same on every network.
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            timeout_graceful_shutdown=int(config.shutdown_grace_s),
        )
    )
    server.config.load()
    server.lifespan = server.config.lifespan_class(server.config)
    await server.startup(sockets=[sock])
    serving = asyncio.create_task(server.main_loop())
    host, port = sock.getsockname()[:2]
    runtime.metadata["http_url"] = f"http://{host}:{port}"
    # A restarted ingress serves as soon as its first round's burst of replies is in (a
    # restart's budget is 3 s); a model whose worker answered late is found by the next
    # round, or at once by the round a request for an unknown name starts (ModelTable.get).
    await models.refresh(stall_s=STARTUP_STALL_S)
    await models.follow_heartbeats()
    runtime.every(5.0, models.refresh)

    async def stop() -> None:
        server.should_exit = True
        await serving
        await server.shutdown(sockets=[sock])

    runtime.on_stop(stop)


def main(argv: list[str] | None = None) -> int:
    return service_main(INGRESS, IngressConfig, setup, argv, description=__doc__ or "")
