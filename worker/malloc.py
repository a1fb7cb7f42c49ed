"""glibc's malloc, told to keep what a process frees for its next use (model workers)."""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt(3) parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAX_MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

# The same, for a child process (glibc reads these at its start): what every vLLM server
# kvfabric starts runs with, the plain one it is measured against included (vLLM's CPU
# build asks for a caching allocator, tcmalloc, in LD_PRELOAD; this is glibc's own).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a forward pass frees for the next one; whether it
    took (False off glibc).

    A pass allocates and frees its activations (a few MiB each, dozens live at once). By
    default glibc serves the larger ones with fresh mmaps and hands a freed heap top back to
    the OS, so every pass faults its working set in again: ~36,000 minor faults (~140 MB of
    zeroed pages) per 263-token SmolLM2 chunk after 1,856 restored tokens. Its threshold also
    adapts only as chunks are freed, so the first passes after a start, which see new sizes,
    were the slowest. Measured (float32, 2 threads, in a model thread as a worker runs): the
    first such pass after warm-up 800-940 ms by default, 550-720 ms with this; later passes
    620-670 ms and 550-640 ms; 0-400 faults a pass. The cost: the heap keeps its peak (one
    chunk's activations) instead of shrinking between passes.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Setting either turns glibc's adaptive thresholds off: every size under 32 MiB comes
    # from the heap, which is never trimmed below 1 GiB of free top.
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
