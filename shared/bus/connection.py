"""One NATS connection with kvfabric's reconnect policy: the first connect is retried until a
timeout (a service may start before its server), then reconnects go on forever.

Credentials: an nkey seed file (`creds`, else `$KVF_NATS_CREDS`; shared/nats_auth.py makes
them) and, for `tls://` servers, the CA that signed the server's certificate (`tls_ca`, else
`$KVF_NATS_TLS_CA`). A server that refuses the credentials is not retried: the caller gets
`Unauthorized` at once, saying so."""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
import time
from collections.abc import Awaitable, Callable

import nats
import nats.errors
from nats.aio.client import Client

from shared.logging import get_logger
from shared.schema import Unauthorized, Unavailable
from shared.tasks import cancel_and_wait

log = get_logger(__name__)

# What the servers refused this process lately (permissions violations, newest last): a
# request whose publish was refused gets no answer, only a timeout, and a command line tool
# says why from here.
refusals: collections.deque[str] = collections.deque(maxlen=16)
_num_refusals = 0


def num_refusals() -> int:
    """Permissions violations this process has been told of so far."""
    return _num_refusals


CREDS_ENV = "KVF_NATS_CREDS"
TLS_CA_ENV = "KVF_NATS_TLS_CA"


def _auth_options(
    creds: str | os.PathLike[str] | None, tls_ca: str | os.PathLike[str] | None
) -> dict:
    options: dict[str, object] = {}
    creds = creds or os.environ.get(CREDS_ENV) or None
    if creds:
        if not os.path.isfile(creds):
            raise Unauthorized(f"NATS credentials {creds} not found (an nkey seed file)")
        options["nkeys_seed"] = str(creds)
    tls_ca = tls_ca or os.environ.get(TLS_CA_ENV) or None
    if tls_ca:
        if not os.path.isfile(tls_ca):
            raise Unauthorized(f"NATS TLS CA {tls_ca} not found")
        options["tls"] = ssl.create_default_context(cafile=str(tls_ca))
    return options


def _refused(exc: Exception) -> bool:
    """The server turned the credentials away, or its certificate is not one we trust:
    retrying cannot help."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


async def connect_nats(
    url: str,
    *,
    name: str,
    connect_timeout_s: float,
    reconnect_wait_s: float,
    creds: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
) -> Client:
    """Connect, retrying until `connect_timeout_s` (`Unavailable` past it; `Unauthorized`
    at once when the server refuses the credentials). `url` may list a cluster's servers,
    comma-separated: the client tries each and reconnects to any."""
    servers = split_urls(url)
    options = _auth_options(creds, tls_ca)
    who = options.get("nkeys_seed") or "no credentials"
    deadline = time.monotonic() + connect_timeout_s
    connected: list[Client] = []
    # nats-py retries a refused first connection as it retries an unreachable one; its
    # error callback is where a refusal shows, and it ends the wait.
    refusal: list[Exception] = []
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        if not connected and _refused(exc):
            refusal.append(exc)
            refused.set()
        await _log_error(exc)

    while True:
        # nats-py retries a first connection forever when reconnects are unlimited: bound
        # it ourselves, or a wrong URL hangs the caller.
        remaining_s = max(deadline - time.monotonic(), 0.1)
        connecting = asyncio.ensure_future(
            nats.connect(
                servers=servers,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,
                connect_timeout=min(2.0, connect_timeout_s),
                error_cb=on_error,
                disconnected_cb=_log_disconnected(connected),
                reconnected_cb=_log_reconnected,
                **options,
            )
        )
        refusing = asyncio.ensure_future(refused.wait())
        await asyncio.wait(
            {connecting, refusing}, timeout=remaining_s, return_when="FIRST_COMPLETED"
        )
        await cancel_and_wait(refusing)
        if refusal:
            await cancel_and_wait(connecting)
            raise _refusal(url, who, refusal[0])
        try:
            if not connecting.done():
                await cancel_and_wait(connecting)
                raise TimeoutError(f"no server answered within {remaining_s:.1f}s")
            nc = connecting.result()
            connected.append(nc)
            return nc
        except nats.errors.Error as exc:
            if _refused(exc):
                raise _refusal(url, who, exc) from exc
            if not isinstance(exc, nats.errors.NoServersError) or time.monotonic() >= deadline:
                raise Unavailable(f"cannot connect to NATS at {url}: {exc}") from exc
        except (TimeoutError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise Unavailable(f"cannot connect to NATS at {url}: {exc}") from exc
        await asyncio.sleep(reconnect_wait_s)


def _refusal(url: str, who: object, exc: Exception) -> Unauthorized:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Unauthorized(f"NATS at {url} is not trusted (KVF_NATS_TLS_CA): {exc}")
    return Unauthorized(f"NATS at {url} refused the connection ({who}): {exc}")


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
    text = str(exc) or type(exc).__name__  # a timeout says nothing
    if "permissions violation" in text.lower():
        # This role may not publish or subscribe there: a bug in its permissions, or a
        # process doing what its role forbids. Either way an operator must see it.
        global _num_refusals
        _num_refusals += 1
        refusals.append(text)
        log.error("nats refused: outside this process's permissions", error=text)
        return
    log.warning("nats error", error=text)


def _log_disconnected(connected: list[Client]) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        # A disconnect while we drain or close is the plan, not news.
        if connected and not (connected[0].is_closed or connected[0].is_draining):
            log.warning("nats disconnected")

    return callback


async def _log_reconnected() -> None:
    log.info("nats reconnected")
