from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

import pytest

pytest_plugins = ["shared.testing.fixtures"]

# pytest-timeout (pyproject: 300 s) fails a stuck test, but the stack it shows for an async
# test is the event loop waiting in select: nothing says which await never returned. So a
# test still running this long first prints the stack of every task of every running loop.
STUCK_S = 240.0


def _dump_tasks(name: str) -> None:
    loops = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running()
    ]
    print(
        f"\n=== {name} still running after {STUCK_S:.0f} s: its asyncio tasks ===", file=sys.stderr
    )
    for loop in loops:
        # Read from this thread while the loop's thread waits: a snapshot for diagnosis.
        for task in asyncio.all_tasks(loop):
            task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _tasks_of_a_stuck_test(request: pytest.FixtureRequest) -> Iterator[None]:
    timer = threading.Timer(STUCK_S, _dump_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
