"""Prefill -> decode KV over NIXL (UCX): one agent per worker, one registered host region,
agent metadata exchanged over NATS and cached per peer.

Each worker serves its agent's metadata on `Subjects.nixl_metadata(service)` (an ordinary
`shared.bus.Endpoint`, so also per instance). A sender asks the receiver's instance once,
loads the metadata into its agent, and then moves a batch of byte ranges from its region
into the peer's (`write`, push) or from the peer's into its own (`read`, pull) as one NIXL
request, with a notification the peer's `wait_notification` picks up after the bytes have
landed. Every wait has a timeout: a dead or stuck peer is a `TransferError` (the metadata
request found no responder, UCX failed) or a `TransferTimeout`, never a hang; the peer's
cached metadata is then dropped so the next transfer asks again.

Peers restart. An agent's name carries a per-process suffix, so a restarted worker (same
instance id) is a new agent, and what a peer cached about the old one fails at once when a
transfer is posted (NIXL_ERR_REMOTE_DISCONNECT). A transfer to a peer whose metadata was
cached asks for it again and retries once when posting fails: a worker's first request after
the worker it pulls from restarted succeeds (it used to fail). `connect_soon` fetches a peer's
metadata and wires up the UCX connection ahead of the first transfer (measured in one
process: loading the metadata 11-26 ms, the first 8 MB read 12-19 ms over the next ones
without `make_connection`, 3-4 ms with it): decode calls it when a job names its prefill
worker, so the wire-up overlaps that worker's prefill instead of delaying the pull.

Progress: NIXL's UCX progress thread polls without pause (measured: one whole core per idle
agent; three agents took the 2-core machine's compute 3x slower), so it is off. Whoever waits
for a transfer progresses the agent instead: the initiator while it polls the request's
state, the target through `serve()`'s pump -- every 0.5 ms inside `busy()` or
`expect_traffic(s)`, the windows in which a peer is known to read or write our region
(prefill waiting for decode's pull, a snapshot lease, a put the memcache pulls), and every
100 ms outside them (stray traffic). Opening a window wakes the pump at once: the first
transfer over a new connection does not complete until the target progresses (measured: it
hung without that; later ones completed with the target idle), and a pump left in its idle
wait could hold it up to 100 ms. With this and a staging buffer touched before use
(worker/serving/wiring.py), decode's pulls in a SmolLM2 cluster (28 requests, a restart of
both workers among them) took at most 8.5 ms; before, 4 of 28 took 20-86 ms. The idle pump
used to run every 5 ms: in a worker, in decode beside it and in swa-memcache that was ~600
wake-ups a second on 2 cores, each preempting an OpenMP thread of the prefill forward (~200
involuntary context switches a 263-token SmolLM2 pass, against ~5 in a process of its own).

UCX reads its transports from the environment (UCX_TLS) when the agent starts; this module
does not override them. Measured on one 2-core host (loadtest/bench_kv.py, without the
progress thread): 100 scattered 2 MB blocks moved at 7.1-7.4 GB/s (0.86-0.89x memcpy), 98 KB
blocks at 4.1-4.8 GB/s (0.46-0.49x); with the spinning progress threads it was 2.0-3.3 GB/s
and 0.12-0.42x. `UCX_TLS=shm,self` or `cma,self` fail at backend creation
(NIXL_ERR_BACKEND), since UCX then has no transport to wire the peers up with. A peer killed
after its metadata was cached fails the next transfer at once ("remote agent was
disconnected"), well before the timeout.

Nothing here binds or advertises an address: NIXL's listener thread is off, the metadata rides
NATS, and UCX puts in it the addresses of this node's interfaces (UCX_NET_DEVICES picks them;
loopback is left out). Network-namespace hosts on one kernel are one node to UCX, which then
moves KV with CMA; `UCX_TLS=tcp` makes it cross their network (tests/faults/test_hosts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.bus import Bus, Context, Endpoint
from shared.logging import get_logger
from shared.schema import DeadlineExceeded, ErrorCode, Unavailable
from shared.schema.transfer import NixlAgentInfo, NixlMetadataRequest, NixlRegion
from worker.nixl import NixlUnavailable, import_nixl, release_handle

log = get_logger(__name__)

# UCX completes a 10 MB same-host write in ~1-4 ms; start polling fine, back off to 1 ms.
_POLL_MIN_S = 0.00005
_POLL_MAX_S = 0.001
# The target side's pump (see the module docstring).
_PUMP_IDLE_S = 0.1
_PUMP_BUSY_S = 0.0005
_CLOSE_PROGRESS_ROUNDS = 20
# After `make_connection`: how long our side progresses fast while the wire-up completes.
_CONNECT_PROGRESS_S = 0.5


class TransferError(Unavailable):
    """A NIXL transfer to or from a peer failed: peer gone, metadata unavailable, UCX error,
    or NIXL not installed here."""


class TransferTimeout(TransferError):
    """A NIXL transfer or notification did not complete within its timeout."""

    code = ErrorCode.DEADLINE_EXCEEDED


@dataclass(frozen=True, slots=True)
class ByteRange:
    """`nbytes` at `local_offset` in our region <-> at `remote_offset` in the peer's."""

    local_offset: int
    remote_offset: int
    nbytes: int


class KvTransferAgent:
    def __init__(self, bus: Bus, buffer: np.ndarray, *, service: str) -> None:
        try:
            nixl_agent, nixl_agent_config = import_nixl()
        except NixlUnavailable as exc:
            raise TransferError(exc.message) from exc
        self.bus = bus
        self.service = service
        self.buffer = buffer
        # Unique per process: a restarted instance is a new agent to its peers.
        self.agent_name = f"{service}-{bus.instance_id}-{secrets.token_hex(4)}"
        self._agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        if "UCX" not in self._agent.backends:
            raise TransferError("the NIXL UCX plugin is not available on this node")
        region = (buffer.ctypes.data, buffer.nbytes, 0, "")
        self._registered = self._agent.register_memory([region], "DRAM", ["UCX"])
        self.info = NixlAgentInfo(
            agent_name=self.agent_name,
            metadata=self._agent.get_agent_metadata(),
            regions=(NixlRegion(buffer.ctypes.data, buffer.nbytes),),
        )
        self._peers: dict[tuple[str, str], NixlAgentInfo] = {}  # by (service, instance id)
        self._fetching: dict[tuple[str, str], asyncio.Task[NixlAgentInfo]] = {}
        self._connecting: set[asyncio.Task[None]] = set()
        self._notifications: dict[str, list[bytes]] = {}
        self._num_busy = 0
        self._busy_until = 0.0
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # set: the pump goes fast now, not at its next round

    async def serve(self) -> None:
        """Answer metadata requests (pooled subject and this instance's own) and progress
        transfers peers make into or out of our region (the pump)."""
        if self._pump is None:
            self._pump = asyncio.create_task(self._progress_pump())

        async def handle(request: NixlMetadataRequest, ctx: Context) -> NixlAgentInfo:
            return self.info

        subject = self.bus.subjects.nixl_metadata(self.service)
        await self.bus.serve(Endpoint("nixl-metadata", subject, NixlMetadataRequest, handle))

    async def peer(
        self, service: str, instance_id: str, *, timeout_s: float = 2.0
    ) -> NixlAgentInfo:
        """The peer's metadata, loaded into our agent; asked over NATS once, then cached.
        Callers asking at the same time share one request."""
        key = (service, instance_id)
        cached = self._peers.get(key)
        if cached is not None:
            return cached
        fetching = self._fetching.get(key)
        if fetching is None:
            fetching = asyncio.create_task(self._fetch(service, instance_id, timeout_s))
            self._fetching[key] = fetching
            fetching.add_done_callback(lambda task, key=key: self._fetched(key, task))
        return await asyncio.shield(fetching)

    def _fetched(self, key: tuple[str, str], task: asyncio.Task[NixlAgentInfo]) -> None:
        self._fetching.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here: a caller that gave up no longer awaits it

    async def _fetch(self, service: str, instance_id: str, timeout_s: float) -> NixlAgentInfo:
        subject = self.bus.subjects.instance(self.bus.subjects.nixl_metadata(service), instance_id)
        try:
            info = await self.bus.request(
                subject,
                NixlMetadataRequest(requester_agent=self.agent_name),
                NixlAgentInfo,
                timeout_s=timeout_s,
            )
        except DeadlineExceeded as exc:
            raise TransferTimeout(f"no NIXL metadata from {instance_id}: {exc.message}") from exc
        except Unavailable as exc:
            raise TransferError(f"no NIXL metadata from {instance_id}: {exc.message}") from exc
        try:
            self._agent.add_remote_agent(info.metadata)
        except Exception as exc:  # nixlBind errors share no importable base class
            raise TransferError(f"cannot load NIXL metadata of {info.agent_name}: {exc}") from exc
        self._peers[(service, instance_id)] = info
        return info

    def connect_soon(self, service: str, instance_id: str, *, timeout_s: float = 2.0) -> None:
        """In the background: the peer's metadata and its UCX connection, so that the first
        transfer finds them ready. Nothing to do for a peer already known; a failure is only
        logged (the transfer asks again and reports it)."""
        if (service, instance_id) in self._peers or (service, instance_id) in self._fetching:
            return
        task = asyncio.create_task(self._connect(service, instance_id, timeout_s))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, service: str, instance_id: str, timeout_s: float) -> None:
        try:
            info = await self.peer(service, instance_id, timeout_s=timeout_s)
            self._agent.make_connection(info.agent_name)
        except Exception as exc:  # TransferError, or nixlBind's own
            log.info("NIXL peer not connected ahead", peer=instance_id, error=str(exc))
            return
        # The wire-up completes as both agents progress: ours fast for a moment.
        self.expect_traffic(_CONNECT_PROGRESS_S)

    @contextlib.asynccontextmanager
    async def busy(self) -> AsyncIterator[None]:
        """While inside, a peer may be moving bytes through our region: progress fast."""
        self._num_busy += 1
        self._wake.set()
        try:
            yield
        finally:
            self._num_busy -= 1

    def expect_traffic(self, seconds: float) -> None:
        """A peer may move bytes through our region for the next `seconds` (a lease)."""
        self._busy_until = max(self._busy_until, time.monotonic() + seconds)
        self._wake.set()

    async def _progress_pump(self) -> None:
        while True:
            self._collect_notifications()
            if self._num_busy > 0 or time.monotonic() < self._busy_until:
                await asyncio.sleep(_PUMP_BUSY_S)
                continue
            # Idle: until the next round, or at once when a window opens (a peer's first
            # transfer over a new connection waits for our progress).
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_PUMP_IDLE_S):
                    await self._wake.wait()

    def _collect_notifications(self) -> None:
        """Progress the agent and keep what arrived (NIXL hands each notification once)."""
        for sender, messages in self._agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else sender
            self._notifications.setdefault(name, []).extend(messages)

    def forget_peer(self, service: str, instance_id: str) -> None:
        info = self._peers.pop((service, instance_id), None)
        if info is None:
            return
        try:
            self._agent.remove_remote_agent(info.agent_name)
        except Exception as exc:  # already gone on the NIXL side: nothing left to drop
            log.info("NIXL peer already removed", peer=info.agent_name, error=str(exc))

    async def write(
        self,
        service: str,
        instance_id: str,
        ranges: Sequence[ByteRange],
        *,
        notification: bytes,
        timeout_s: float = 5.0,
    ) -> None:
        """Push our bytes into the peer's region; the peer is notified once they landed."""
        await self._transfer("WRITE", service, instance_id, ranges, notification, timeout_s)

    async def read(
        self,
        service: str,
        instance_id: str,
        ranges: Sequence[ByteRange],
        *,
        notification: bytes = b"",
        timeout_s: float = 5.0,
    ) -> None:
        """Pull the peer's bytes into our region (the peer is notified when done)."""
        await self._transfer("READ", service, instance_id, ranges, notification, timeout_s)

    async def _transfer(
        self,
        op: str,
        service: str,
        instance_id: str,
        ranges: Sequence[ByteRange],
        notification: bytes,
        timeout_s: float,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        was_cached = (service, instance_id) in self._peers
        info = await self.peer(service, instance_id, timeout_s=timeout_s)
        try:
            handle, state = self._post(op, info, ranges, notification)
        except TransferError as exc:
            self.forget_peer(service, instance_id)
            if not was_cached:
                raise
            # Most likely the peer restarted since we cached it: ask again, once.
            log.info(
                "NIXL peer changed: asking for its metadata again", peer=instance_id, error=str(exc)
            )
            info = await self.peer(
                service, instance_id, timeout_s=max(deadline - time.monotonic(), _POLL_MAX_S)
            )
            try:
                handle, state = self._post(op, info, ranges, notification)
            except TransferError:
                self.forget_peer(service, instance_id)
                raise
        try:
            delay_s = _POLL_MIN_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    self.forget_peer(service, instance_id)
                    raise TransferTimeout(
                        f"NIXL {op} to {info.agent_name} not done within {timeout_s}s"
                    )
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, _POLL_MAX_S)
                state = self._xfer_state(handle)
        finally:
            release_handle(handle)
        if state != "DONE":
            self.forget_peer(service, instance_id)
            raise TransferError(f"NIXL {op} to {info.agent_name} failed (state {state})")

    def _xfer_state(self, handle: Any) -> str:
        # A peer that dies mid-transfer makes NIXL raise from the status call (UCX endpoint
        # errors) instead of answering "ERR"; both mean the same to the caller.
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:  # nixlBind errors share no importable base class
            log.info("NIXL transfer status failed", error=str(exc))
            return "ERR"

    def _post(
        self, op: str, info: NixlAgentInfo, ranges: Sequence[ByteRange], notification: bytes
    ) -> tuple[Any, str]:
        """Create and post one transfer: (its handle, its first state)."""
        local, remote = self._descriptors(info, ranges)
        handle = None
        try:
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                info.agent_name,
                notification,
            )
            return handle, self._agent.transfer(handle)
        except Exception as exc:  # nixlBind errors share no importable base class
            if handle is not None:
                release_handle(handle)
            raise TransferError(f"NIXL {op} to {info.agent_name} failed: {exc}") from exc

    def _descriptors(
        self, info: NixlAgentInfo, ranges: Sequence[ByteRange]
    ) -> tuple[np.ndarray, np.ndarray]:
        if not ranges or not info.regions:
            raise ValueError("a transfer needs at least one range and a peer region")
        region = info.regions[0]
        local = np.empty((len(ranges), 3), dtype=np.uint64)
        remote = np.empty((len(ranges), 3), dtype=np.uint64)
        for i, r in enumerate(ranges):
            if r.local_offset + r.nbytes > self.buffer.nbytes or r.remote_offset + r.nbytes > (
                region.num_bytes
            ):
                raise ValueError(f"range {r} is outside the registered regions")
            local[i] = (self.buffer.ctypes.data + r.local_offset, r.nbytes, 0)
            remote[i] = (region.addr + r.remote_offset, r.nbytes, region.device_id)
        return local, remote

    async def wait_notification(self, tag: bytes, *, timeout_s: float) -> tuple[str, bytes]:
        """(sender agent name, message) of the first notification starting with `tag`."""
        deadline = time.monotonic() + timeout_s
        delay_s = _POLL_MIN_S
        while True:
            self._collect_notifications()
            for sender, messages in self._notifications.items():
                for message in messages:
                    if message.startswith(tag):
                        messages.remove(message)
                        return sender, message
            if time.monotonic() > deadline:
                raise TransferTimeout(f"no NIXL notification {tag!r} within {timeout_s}s")
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _POLL_MAX_S)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        for task in [*self._connecting, *self._fetching.values()]:
            task.cancel()
        for service, instance_id in list(self._peers):
            self.forget_peer(service, instance_id)
        # Without a progress thread, operations to a peer that died stay queued in UCX until
        # something progresses it; destroying the agent with them queued aborts the process
        # (UCX asserts on a non-empty arbiter group). Progress until they are failed out.
        for _ in range(_CLOSE_PROGRESS_ROUNDS):
            self._collect_notifications()
            time.sleep(_POLL_MAX_S)
        self._agent.deregister_memory(self._registered, ["UCX"])
        # Destroy the NIXL agent now rather than at garbage collection: its UCX worker closes
        # its connections, so a peer still holding our metadata fails at once, not on timeout.
        del self._agent
