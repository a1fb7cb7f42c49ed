"""A NIXL transfer peer process for tests/service/test_kv_transfer.py.

    python -m tests.service.kv_transfer_peer receive URL ROOT INSTANCE NUM_BLOCKS BLOCK_NBYTES TAG
    python -m tests.service.kv_transfer_peer send URL ROOT PEER NUM_BLOCKS BLOCK_NBYTES TAG
    python -m tests.service.kv_transfer_peer serve URL ROOT INSTANCE NUM_BLOCKS BLOCK_NBYTES

`send` prints "ready", waits for a line on stdin, then writes block i of a known pattern
into the peer's block NUM_BLOCKS-1-i (a scatter) with notification TAG; `receive` waits for
it and prints a JSON verdict; `serve` only serves its metadata until stdin closes (the
dead-peer test kills it).
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from shared.bus import Bus
from worker.transfer import ByteRange, KvTransferAgent

SERVICE = "decode"


def pattern(num_blocks: int, block_nbytes: int) -> np.ndarray:
    return (np.arange(num_blocks * block_nbytes, dtype=np.uint64) * 7 % 251).astype(np.uint8)


async def main(
    mode: str, url: str, root: str, who: str, num_blocks: int, block_nbytes: int, tag: bytes
) -> None:
    nbytes = num_blocks * block_nbytes
    service = "prefill" if mode == "send" else SERVICE
    bus = await Bus.connect(
        url, service=service, root=root, instance_id=None if mode == "send" else who
    )
    buffer = pattern(num_blocks, block_nbytes) if mode == "send" else np.zeros(nbytes, np.uint8)
    agent = KvTransferAgent(bus, buffer, service=service)
    if mode == "send":
        print("ready", flush=True)  # started in parallel with the receiver: wait for "go"
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        ranges = [
            ByteRange(i * block_nbytes, (num_blocks - 1 - i) * block_nbytes, block_nbytes)
            for i in range(num_blocks)
        ]
        await agent.write(SERVICE, who, ranges, notification=tag, timeout_s=20.0)
        print(json.dumps({"sent": nbytes, "agent": agent.agent_name}), flush=True)
    else:
        await agent.serve()
        await bus.flush()
        print("ready", flush=True)
        if mode == "receive":
            sender, message = await agent.wait_notification(tag, timeout_s=30.0)
            expected = pattern(num_blocks, block_nbytes).reshape(num_blocks, block_nbytes)[::-1]
            ok = bool(np.array_equal(buffer.reshape(num_blocks, block_nbytes), expected))
            print(json.dumps({"sender": sender, "message": message.decode(), "ok": ok}), flush=True)
        else:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    agent.close()
    await bus.stop_serving(1.0)
    await bus.close()


if __name__ == "__main__":
    mode_arg, url_arg, root_arg, who_arg, blocks_arg, nbytes_arg = sys.argv[1:7]
    tag_arg = sys.argv[7].encode() if len(sys.argv) > 7 else b""
    asyncio.run(
        main(mode_arg, url_arg, root_arg, who_arg, int(blocks_arg), int(nbytes_arg), tag_arg)
    )
