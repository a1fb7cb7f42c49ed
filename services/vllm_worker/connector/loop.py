"""An asyncio loop on a thread of its own, for vLLM's synchronous connector hooks to use our
async clients (the bus, the store) without blocking on an event loop they do not own.

    loop = LoopThread("kvfabric-connector")
    bus = loop.call(Bus.connect(url, service="vllm-connector"), timeout_s=10)
    matches = loop.call(index_client.match(bus, hashes, num_shards=1), timeout_s=1)
    loop.submit(publisher.store_blocks(pairs))  # runs on; the future says how it ended
    loop.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from shared.logging import get_logger

T = TypeVar("T")
log = get_logger(__name__)


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        """Run `coro` on the loop and wait for its result; TimeoutError (the coroutine is
        cancelled) after `timeout_s`."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout_s} s") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel what still runs and stop the loop (idempotent)."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel_all(), timeout_s=timeout_s)
        except TimeoutError:  # a task that ignores cancellation: the daemon thread ends with us
            log.warning("tasks still running at stop", thread=self._thread.name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
