"""A prefill-like caller of swa-memcache for test_swa_nixl.py, as its own process:

    python -m tests.service.swa_memcache.swa_peer URL ROOT INSTANCE MEMCACHE_ID NBYTES

It serves its NIXL metadata, puts a NBYTES snapshot (block hash 1) through NIXL, prints
{"stored": ..., "checksum": ...}, then holds its region until stdin closes or it is killed
(the test kills it to play a caller that died before the memcache pulled its bytes).
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import xxhash

from shared.bus import Bus
from shared.schema import NoResponders
from worker.swa_client import SwaClient
from worker.transfer import KvTransferAgent


def pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) * 13 % 251).astype(np.uint8)


async def main(url: str, root: str, instance_id: str, memcache_id: str, nbytes: int) -> None:
    bus = await Bus.connect(url, service="prefill", root=root, instance_id=instance_id)
    agent = KvTransferAgent(bus, pattern(nbytes), service="prefill")
    await agent.serve()
    await bus.flush()
    client = SwaClient(bus, agent, memcache_instance_id=memcache_id, inline_max_bytes=0)
    for _ in range(300):  # the memcache starts alongside us
        try:
            stored = await client.put_from(1, 0, nbytes)
            break
        except NoResponders:
            await asyncio.sleep(0.1)
    else:
        stored = False
    print(
        json.dumps({"stored": stored, "checksum": xxhash.xxh3_64_intdigest(agent.buffer)}),
        flush=True,
    )
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    agent.close()
    await bus.stop_serving(1.0)
    await bus.close()


if __name__ == "__main__":
    url_arg, root_arg, instance_arg, memcache_arg, nbytes_arg = sys.argv[1:6]
    asyncio.run(main(url_arg, root_arg, instance_arg, memcache_arg, int(nbytes_arg)))
