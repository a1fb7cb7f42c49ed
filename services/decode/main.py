"""decode: continuous batching over a paged KV pool, streams tokens, writes completed
blocks to the store and emits usage. DESIGN.md section 3.

Runs today: loads the model (`--model-dir`, the bundled tiny-coder by default) into a paged
KV pool, publishes the model and its KV block layout in discovery metadata and the pool's
pages in `LoadReport` heartbeats, drains on SIGTERM. Its request endpoints are wired here as
they land.
"""

from __future__ import annotations

import asyncio

from services.decode.config import DecodeConfig
from shared.engine.worker import build_runner, describe, kv_load
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import DECODE


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, DecodeConfig)  # service_main built it from DecodeConfig
    runner = await asyncio.to_thread(build_runner, config)
    runtime.metadata |= describe(runner, config)
    runtime.load_fields = lambda: kv_load(runner)


def main(argv: list[str] | None = None) -> int:
    return service_main(DECODE, DecodeConfig, setup, argv, description=__doc__ or "")
