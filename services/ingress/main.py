"""ingress: the HTTP front door (OpenAI Chat Completions, OpenAI Responses, Anthropic
Messages). DESIGN.md sections 1 and 3.

Runs today: `GET /health` (200 while connected to NATS and SERVING; 503 while starting,
draining or disconnected), and the bound HTTP URL published as `http_url` in its discovery
metadata, which is how `kvfabric up` learns where the API is served. The protocol endpoints
are wired here as they land.
"""

from __future__ import annotations

from aiohttp import web

from services.ingress.config import IngressConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import INGRESS


def build_app(runtime: ServiceRuntime) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        status, body = runtime.health()
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/health", health)
    return app


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, IngressConfig)  # service_main built it from IngressConfig
    runner = web.AppRunner(build_app(runtime), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.http_host, config.http_port)
    await site.start()
    host, port = runner.addresses[0][:2]
    runtime.metadata["http_url"] = f"http://{host}:{port}"
    runtime.on_stop(runner.cleanup)


def main(argv: list[str] | None = None) -> int:
    return service_main(INGRESS, IngressConfig, setup, argv, description=__doc__ or "")
