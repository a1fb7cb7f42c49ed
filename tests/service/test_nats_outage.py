"""A NATS server that dies under its clients: callers learn it within a second (UNAVAILABLE),
never at their timeout; once the server is back on the same port the same connections serve
again, their endpoints included, without anyone reconnecting by hand."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.bus.core import RECONNECT_WAIT_S
from shared.natsd import NatsServer
from shared.schema import Unavailable
from shared.testing import unique_root
from shared.testing.waits import eventually
from tests.service.messages import Echo, EchoReply
from tests.service.test_bus import serve_echo

pytestmark = [pytest.mark.nats]


async def test_callers_get_unavailable_within_a_second_and_recover(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    root = unique_root()
    try:
        caller = await Bus.connect(server.url, service="caller", root=root)
        echo = await Bus.connect(server.url, service="echo-svc", root=root)
        endpoint = await serve_echo(echo)
        reply = await caller.request(endpoint.subject, Echo(text="hi"), EchoReply, timeout_s=5)
        assert reply.text == "hi"

        # In flight when the server dies: a request whose handler takes 10 s, a stream reader.
        slow = asyncio.create_task(
            caller.request(endpoint.subject, Echo(text="slow", delay_s=10), EchoReply, timeout_s=30)
        )
        inbox = await caller.open_inbox()
        reading = asyncio.create_task(inbox.next(timeout_s=30))
        await asyncio.sleep(0.1)  # let both reach the server before it dies
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        started = time.monotonic()
        for task in (slow, reading):
            with pytest.raises(Unavailable) as caught:
                await task
            assert caught.value.retry_after_s == 1.0
        assert time.monotonic() - started < 1.0

        started = time.monotonic()
        with pytest.raises(Unavailable):  # a new request while the server is away
            await caller.request(endpoint.subject, Echo(text="x"), EchoReply, timeout_s=30)
        # It waited for a reconnect (RECONNECT_WAIT_S), not for its own 30 s.
        assert RECONNECT_WAIT_S <= time.monotonic() - started < 1.0

        server.start()  # the same port and store, as the launcher's supervisor does
        await eventually(lambda: caller.is_connected and echo.is_connected, timeout_s=30)
        await echo.flush()
        reply = await caller.request(endpoint.subject, Echo(text="again"), EchoReply, timeout_s=5)
        assert reply.text == "again"
        await inbox.close()
        await caller.close()
        await echo.close()
    finally:
        server.stop()
