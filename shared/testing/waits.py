"""Waiting on a condition in an async test, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(check: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Wait until `check()` is true (polled every 10 ms); fail the test if it never is.
    The deadline only bounds a failing test, so it is generous (a loaded CI machine)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.01)
