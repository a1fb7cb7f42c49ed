"""pytest fixtures (load with `pytest_plugins = ["shared.testing.fixtures"]`).

- `nats_server`: one real nats-server per test session, random port, JetStream on, stopped
  through its handle.
- `subject_root`: a root unique to the test, so tests share one server without crosstalk.
- `bus_factory`: connects `Bus`es under that root and closes them after the test.
- `transformers_smollm2`: transformers' SmolLM2-135M-Instruct from the same GGUF, the
  reference the engine is checked against; loaded once per session.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shared.bus import Bus
from shared.natsd import NatsServer
from shared.subjects import DEFAULT_ROOT

SESSION_STORE_BYTES = 1 << 44  # 16 TiB of reservations: streams hold little; it is never used


def unique_root() -> str:
    return f"t{uuid.uuid4().hex[:10]}.{DEFAULT_ROOT}"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    # One server for the whole session, a fresh root per test: every kv-index started on a
    # new root creates an event log whose max_bytes (1 GiB) JetStream reserves for good, so the
    # default ceiling (75% of the free disk) would refuse streams once enough tests have run.
    server = NatsServer(
        Path(tmp_path_factory.mktemp("nats")), max_file_store_bytes=SESSION_STORE_BYTES
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def subject_root() -> str:
    return unique_root()


BusFactory = Callable[..., Awaitable[Bus]]


@pytest_asyncio.fixture
async def bus_factory(nats_server: NatsServer, subject_root: str) -> AsyncIterator[BusFactory]:
    buses: list[Bus] = []

    async def connect(service: str = "test", instance_id: str | None = None) -> Bus:
        bus = await Bus.connect(
            nats_server.url, service=service, instance_id=instance_id, root=subject_root
        )
        buses.append(bus)
        return bus

    yield connect
    for bus in buses:
        await bus.stop_serving(grace_s=1.0)
        await bus.close()


@pytest.fixture(scope="session")
def transformers_smollm2() -> Any:
    """transformers' model of SmolLM2-135M-Instruct from our GGUF (dequantized, float32, eager
    attention), in eval mode; read-only. One load a session: transformers parses the GGUF's
    metadata twice and maps its tensor names once per tensor, ~38 s here each time."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.models import ModelError, model_path

    try:
        path = model_path("SmolLM2-135M-Instruct")
    except ModelError as exc:  # `make test` fetches it: a missing file is a broken set-up
        pytest.fail(str(exc))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.float32,
            attn_implementation="eager",
        )
    return model.eval()
