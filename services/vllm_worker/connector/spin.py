"""vLLM's model process spins after each step; on a shared host that steals another's cores.

vLLM's multiprocess executor (the only one its CPU build runs with OpenMP) hands each step to
its model process through a shared-memory queue. After every message it reads, the reader
busy-polls the queue with `sched_yield` for `busy_loop_s` (1 s, fixed in vLLM 0.32) before
it sleeps on a socket. On a GPU node that keeps a core warm for the next step. Where two vLLM
workers share the host's cores, as on this 2-core machine, the one that just answered spins
for a second while the other computes the next request: in `kvfabric bench peers`, a step
right after another worker's measured 1.8 s against 0.9 s, and that idle worker's process
used 0.9 s of CPU meanwhile (per-thread /proc accounting, docs/vllm.md).

`shorten_idle_spin` lowers that window in the process it runs in (the connector's worker
side, inside vLLM's model process). Between the steps of a running generation the queue is
read again within milliseconds, so a window of 50 ms still catches every one of them; only
an idle worker goes to sleep sooner.
"""

from __future__ import annotations

import gc

from shared.logging import get_logger

log = get_logger(__name__)


def shorten_idle_spin(seconds: float) -> int:
    """Every shared-memory queue reader of vLLM in this process spins at most `seconds`
    after a read; how many readers it changed (0 where this vLLM has none of them)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: nothing to change, said once in the log
        log.warning("vLLM has no SpinCondition here: its idle spin is left as it is")
        return 0
    changed = 0
    for obj in gc.get_objects():
        # By type, not isinstance: isinstance falls back to `obj.__class__`, which some of
        # torch's objects compute (with a deprecation warning); over the ~650K objects of a
        # vLLM model process here that took 3.0 s of every start, against 0.17 s this way.
        if (
            issubclass(type(obj), SpinCondition)
            and getattr(obj, "is_reader", False)
            and getattr(obj, "busy_loop_s", 0) > seconds
        ):
            obj.busy_loop_s = seconds
            changed += 1
    return changed
