"""uvicorn's HTTP/1.1 protocol with Nagle's algorithm off on every connection.

asyncio turns Nagle off only for sockets whose protocol number says TCP, and a listening
socket made by `socket.create_server` (main.py binds its own, so port 0 can be published)
says 0, and so do the connections it accepts. uvicorn writes a response's headers and body
separately; with Nagle on, the body waits for the client to acknowledge the headers, which a
kept-alive connection's client delays by up to 40 ms. Measured through ingress on the mock
engine: 60-68 ms a request on a kept-alive connection, 23 ms on a fresh one, before this.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


class NoDelayH11Protocol(H11Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # closing already: nothing to speed up
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)  # type: ignore[arg-type]
