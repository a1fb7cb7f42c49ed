"""One NATS connection with kvfabric's reconnect policy: the first connect is retried until a
timeout (a service may start before its server), then reconnects go on forever."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import nats
import nats.errors
from nats.aio.client import Client

from shared.logging import get_logger
from shared.schema import Unavailable

log = get_logger(__name__)


async def connect_nats(
    url: str, *, name: str, connect_timeout_s: float, reconnect_wait_s: float
) -> Client:
    """Connect, retrying until `connect_timeout_s` (`Unavailable` past it). `url` may list
    a cluster's servers, comma-separated: the client tries each and reconnects to any."""
    servers = split_urls(url)
    deadline = time.monotonic() + connect_timeout_s
    connected: list[Client] = []
    while True:
        try:
            # nats-py retries a first connection forever when reconnects are unlimited:
            # bound it ourselves, or a wrong URL hangs the caller.
            remaining_s = max(deadline - time.monotonic(), 0.1)
            nc = await asyncio.wait_for(
                nats.connect(
                    servers=servers,
                    name=name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=reconnect_wait_s,
                    connect_timeout=min(2.0, connect_timeout_s),
                    error_cb=_log_error,
                    disconnected_cb=_log_disconnected(connected),
                    reconnected_cb=_log_reconnected,
                ),
                remaining_s,
            )
            connected.append(nc)
            return nc
        except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
            if time.monotonic() >= deadline:
                raise Unavailable(f"cannot connect to NATS at {url}: {exc}") from exc
            await asyncio.sleep(reconnect_wait_s)


def split_urls(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` -> one URL per server (the seed list of a cluster)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def abandon_pings(nc: Client) -> None:
    """End the flushes waiting on a connection that lost its server. nats-py never fails
    the PONG futures of a dead connection, so each waits out its 10 s flush timeout -- and
    asyncio.run waits for them at exit (seen: services outliving a killed `kvfabric up` by
    10 s). Cancelling them ends those flushes at once."""
    for pong in nc._pongs:  # noqa: SLF001 - no public way; this package owns nats-py's quirks
        pong.cancel()
    nc._pongs.clear()  # noqa: SLF001


async def _log_error(exc: Exception) -> None:
    log.warning("nats error", error=str(exc) or type(exc).__name__)  # a timeout says nothing


def _log_disconnected(connected: list[Client]) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        # A disconnect while we drain or close is the plan, not news.
        if connected and not (connected[0].is_closed or connected[0].is_draining):
            log.warning("nats disconnected")

    return callback


async def _log_reconnected() -> None:
    log.info("nats reconnected")
