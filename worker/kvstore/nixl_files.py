"""NIXL file backend for the store: POSIX here, GDS / GDS_MT / HF3FS where their plugins and
drivers exist. One agent per store, staging buffers and files registered once, one NIXL
transfer request per batch (the agent transfers to itself: DRAM <-> FILE on one node).

Found on NIXL 1.5.1 (CPU-only machine): POSIX works (READ and WRITE, DRAM_SEG <-> FILE_SEG).
GDS and GDS_MT are listed as plugins but `createBackend` fails with NIXL_ERR_NOT_FOUND
without cuFile; HF3FS is not shipped in the wheel. A transfer that touches an unregistered
file range fails at request creation (NIXL_ERR_NOT_FOUND), so files are registered whole.

The POSIX plugin does its I/O inside `transfer()`, in the calling thread: called on the event
loop, a 25 MB batch write (127 blocks of 196 KB) held the loop for 246-275 ms, and a worker's
next request waited for it (a warm 8K tiny-coder turn right after a cold one: TTFT 351-433 ms
against 118-134 ms a second later). Every call on the agent therefore runs on one thread of
the backend's own, in order: the loop awaits a batch and keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shared.logging import get_logger
from worker.kvstore.backends import IoOp, coalesce
from worker.kvstore.errors import BackendUnavailable, DiskFull, StoreIOError
from worker.nixl import NixlUnavailable, import_nixl, release_handle

log = get_logger(__name__)

# A 4 MB chunk takes ~4 ms at 1 GB/s; polling starts fine and backs off to 1 ms so that two
# shared cores are not spent spinning on a slow disk, while the overshoot stays small.
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.001


class NixlFileIO:
    def __init__(
        self,
        plugin: str,
        *,
        agent_name: str,
        params: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        try:
            nixl_agent, nixl_agent_config = import_nixl()
        except NixlUnavailable as exc:
            raise BackendUnavailable(exc.message) from exc
        self.name = f"nixl:{plugin}"
        self.plugin = plugin
        self.timeout_s = timeout_s
        self._agent = nixl_agent(agent_name, nixl_agent_config(backends=[]))
        self._agent_name = agent_name
        available = self._agent.get_plugin_list()
        if plugin not in available:
            raise BackendUnavailable(
                f"NIXL plugin {plugin} is not available on this node (have: {sorted(available)})"
            )
        try:
            self._agent.create_backend(plugin, params or {})
        except Exception as exc:  # nixlBind errors share no importable base class
            raise BackendUnavailable(
                f"NIXL plugin {plugin} failed to start ({type(exc).__name__}: {exc}); "
                "GDS needs cuFile and a GPU, HF3FS a mounted 3FS with its client library"
            ) from exc
        self._buffers: list[object] = []
        self._files: dict[int, object] = {}
        # The agent's one thread: transfers off the event loop, registrations in order with them.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{plugin}")

    def _on_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        return self._thread.submit(call, *args).result()

    def register_buffer(self, buffer: np.ndarray) -> None:
        descs = [(buffer.ctypes.data, buffer.nbytes, 0, "")]
        registered = self._on_thread(self._agent.register_memory, descs, "DRAM", [self.plugin])
        self._buffers.append(registered)

    def register_file(self, fd: int, nbytes: int) -> None:
        if fd in self._files:
            return
        descs = [(0, nbytes, fd, "")]
        self._files[fd] = self._on_thread(self._agent.register_memory, descs, "FILE", [self.plugin])

    def deregister_file(self, fd: int) -> None:
        descs = self._files.pop(fd, None)
        if descs is not None:
            self._on_thread(self._agent.deregister_memory, descs, [self.plugin])

    async def read(self, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        await self._transfer("READ", buffer, ops)

    async def write(self, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        await self._transfer("WRITE", buffer, ops)

    async def _transfer(self, op: str, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        if not ops:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._transfer_blocking, op, buffer, ops)

    def _transfer_blocking(self, op: str, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        ops = coalesce(ops)
        local = np.empty((len(ops), 3), dtype=np.uint64)
        remote = np.empty((len(ops), 3), dtype=np.uint64)
        base = buffer.ctypes.data
        for i, io in enumerate(ops):
            local[i] = (base + io.buffer_offset, io.nbytes, 0)
            remote[i] = (io.file_offset, io.nbytes, io.fd)
        try:
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "FILE"),
                self._agent_name,
                backends=[self.plugin],
            )
        except Exception as exc:  # nixlBind errors share no importable base class
            raise StoreIOError(f"NIXL {op} request failed: {type(exc).__name__}: {exc}") from exc
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            delay_s = _POLL_MIN_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise StoreIOError(f"NIXL {op} of {len(ops)} slots ran past {self.timeout_s}s")
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, _POLL_MAX_S)
                state = self._agent.check_xfer_state(handle)
        finally:
            release_handle(handle)
        if state != "DONE":
            raise self._failure(op, ops)

    def _failure(self, op: str, ops: Sequence[IoOp]) -> StoreIOError:
        # NIXL reports a failed POSIX batch as one state, without the errno. Files are
        # preallocated, so ENOSPC is rare here; when it happens the filesystem is full.
        message = f"NIXL {op} of {len(ops)} slots failed"
        if op == "WRITE" and _is_full(ops[0].fd):
            return DiskFull(message + " (no space left on the filesystem)")
        return StoreIOError(message)

    def close(self) -> None:
        for fd in list(self._files):
            self.deregister_file(fd)
        for descs in self._buffers:
            self._on_thread(self._agent.deregister_memory, descs, [self.plugin])
        self._buffers.clear()
        self._thread.shutdown(wait=True)


def _is_full(fd: int) -> bool:
    try:
        stat = os.fstatvfs(fd)
    except OSError:
        return False
    return stat.f_bavail == 0
