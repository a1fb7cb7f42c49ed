from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from services.router.config import RouterConfig
from services.router.handler import Router
from shared.subjects import ROUTER
from shared.testing.fixtures import BusFactory
from tests.service.router.fakes import StartRouter


@pytest_asyncio.fixture
async def start_router(bus_factory: BusFactory) -> AsyncIterator[StartRouter]:
    """Routers in this process, each on its own Bus (`router-a`, ...), stopped after the test."""
    routers: list[Router] = []

    async def start(instance_id: str = "router-a", **config: object) -> Router:
        bus = await bus_factory(ROUTER, instance_id)
        router = Router(bus, RouterConfig(**config))  # type: ignore[arg-type]
        router.config.validate()
        await router.start()
        routers.append(router)
        return router

    yield start
    for router in routers:
        await router.stop()
