"""prefill: loads the cached prefix KV, restores the sliding-window state, computes the
uncached suffix and hands it to decode. DESIGN.md sections 3 and 5.

Runs today: loads the model (`--model-dir`, the bundled tiny-coder by default) into a paged
KV pool, publishes the model and its KV block layout in discovery metadata and the pool's
pages in `LoadReport` heartbeats, drains on SIGTERM. Its request endpoints are wired here as
they land.
"""

from __future__ import annotations

import asyncio

from services.prefill.config import PrefillConfig
from shared.engine.worker import build_runner, describe, kv_load
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import PREFILL


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, PrefillConfig)  # service_main built it from PrefillConfig
    runner = await asyncio.to_thread(build_runner, config)
    runtime.metadata |= describe(runner, config)
    runtime.load_fields = lambda: kv_load(runner)


def main(argv: list[str] | None = None) -> int:
    return service_main(PREFILL, PrefillConfig, setup, argv, description=__doc__ or "")
