"""A NATS peer process for tests/faults/test_hosts.py, run inside one of its hosts.

    python -m tests.faults.host_peer echo URL ROOT
    python -m tests.faults.host_peer client URL ROOT

`echo` publishes every ping it hears back as a pong. `client` connects, then answers each
line on stdin with a JSON line: `roundtrip T` publishes a ping over its connection and says
whether the pong came back within T seconds; `connect URL T` says whether a fresh connection
to URL succeeds within T seconds. Both print "ready" first.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

from shared.bus import Bus, RawMessage
from shared.logging import configure_logging
from shared.schema import Unavailable


async def echo(bus: Bus, root: str) -> None:
    async def answer(message: RawMessage) -> None:
        await bus.publish_raw(f"{root}.pong", message.data)

    await bus.subscribe_raw(f"{root}.ping", answer)
    await bus.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def client(bus: Bus, root: str) -> None:
    pongs: asyncio.Queue[bytes] = asyncio.Queue()

    async def heard(message: RawMessage) -> None:
        await pongs.put(message.data)

    await bus.subscribe_raw(f"{root}.pong", heard)
    await bus.flush()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command, *args = line.split()
        if command == "roundtrip":
            reply = {"ok": await roundtrip(bus, root, pongs, float(args[0]))}
        else:
            reply = await connect(args[0], float(args[1]))
        print(json.dumps(reply), flush=True)


async def roundtrip(bus: Bus, root: str, pongs: asyncio.Queue[bytes], timeout_s: float) -> bool:
    token = uuid.uuid4().hex.encode()
    await bus.publish_raw(f"{root}.ping", token)
    try:
        async with asyncio.timeout(timeout_s):
            while await pongs.get() != token:  # a late pong of an earlier round trip
                pass
    except TimeoutError:
        return False
    return True


async def connect(url: str, timeout_s: float) -> dict[str, object]:
    try:
        bus = await Bus.connect(url, service="hosts-test", connect_timeout_s=timeout_s)
    except Unavailable as exc:
        return {"ok": False, "error": exc.message}
    await bus.close()
    return {"ok": True}


async def main(mode: str, url: str, root: str) -> None:
    configure_logging(service="hosts-test", instance_id=mode)  # on stderr: stdout is for replies
    bus = await Bus.connect(url, service="hosts-test", root=root, connect_timeout_s=10.0)
    await (echo if mode == "echo" else client)(bus, root)
    await bus.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
