"""Stand-ins for the services around the router, each on its own Bus: workers that heartbeat
and record the jobs they get, a kv-index shard, a node's swa-memcache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

import numpy as np

from services.router.handler import Router
from shared.blocks import RequestBlocks
from shared.bus import Bus, Context, Endpoint
from shared.kv_index_client import to_wire
from shared.schema import (
    BlockLocations,
    CancelRequest,
    DecodeJob,
    GenerateRequest,
    InstanceState,
    JobAccepted,
    LoadReport,
    MatchReply,
    MatchRequest,
    PrefillDone,
    PrefillJob,
    SamplingParams,
    SwaContains,
    SwaContainsReply,
    SwaHeld,
    SwaResync,
    pack_block_hashes,
    pack_token_ids,
    unpack_block_hashes,
)
from shared.subjects import PREFILL
from shared.tasks import cancel_and_wait
from shared.testing.waits import eventually

StartRouter = Callable[..., Awaitable[Router]]  # the `start_router` fixture

MODEL = "tiny-coder"
BLOCK = 16


def make_request(
    request_id: str = "req-1",
    num_tokens: int = 4 * BLOCK + 5,
    *,
    with_hashes: bool = True,
    max_tokens: int = 32,
    first_token: int = 1,
) -> GenerateRequest:
    tokens = list(range(first_token, first_token + num_tokens))
    blocks = RequestBlocks.hash_prompt(tokens, model=MODEL, block_size_tokens=BLOCK)
    return GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=pack_token_ids(tokens),
        block_hashes=blocks.packed() if with_hashes else b"",
        block_size_tokens=BLOCK,
        sampling=SamplingParams(max_tokens=max_tokens),
        stream_inbox="_INBOX.caller",
    )


def hashes_of(request: GenerateRequest) -> list[int]:
    return RequestBlocks.hash_prompt(
        request.prompt_token_ids, model=MODEL, block_size_tokens=BLOCK
    ).hashes


async def known(router: Router, *instance_ids: str) -> None:
    """Wait until `router` has a fresh heartbeat of every one of `instance_ids`."""
    await eventually(
        lambda: all(router.table.view(i, time.monotonic()) is not None for i in instance_ids)
    )


class FakeWorker:
    """A prefill or decode worker: heartbeats with the load it is told to report and, once
    serving, records each job and answers it (a held prefill worker never answers)."""

    def __init__(
        self,
        bus: Bus,
        *,
        node_id: str = "",
        queued_tokens: int = 0,
        pages_free: int = 1000,
        pages_total: int = 1000,
        model: str = MODEL,
    ) -> None:
        self.bus = bus
        self.model = model
        self.node_id = node_id or f"node-{bus.instance_id}"
        self.queued_tokens = queued_tokens
        self.pages_free = pages_free
        self.pages_total = pages_total
        self.jobs: list[PrefillJob | DecodeJob] = []
        self.hold = False
        self._released = asyncio.Event()
        self._seq = 0
        self._num_beats = 0
        self._beating: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self.bus.instance_id

    async def beat(self) -> None:
        self._seq += 1
        self._num_beats += 1
        report = LoadReport(
            service=self.bus.service,
            instance_id=self.instance_id,
            seq=self._seq,
            ts_ms=self._num_beats,  # the send time's order, across restarts
            state=InstanceState.SERVING,
            node_id=self.node_id,
            num_queued_tokens=self.queued_tokens,
            num_kv_pages_total=self.pages_total,
            num_kv_pages_free=self.pages_free,
            model=self.model,
        )
        await self.bus.publish(self.bus.subjects.load(self.bus.service, self.instance_id), report)
        await self.bus.flush()

    def restart(self) -> None:
        """From the next heartbeat on, a new process under the same id (its seq starts over);
        the jobs the old one held are never answered."""
        self._seq = 0

    def beat_every(self, interval_s: float) -> None:
        async def loop() -> None:
            while True:
                await self.beat()
                await asyncio.sleep(interval_s)

        self._beating = asyncio.create_task(loop())

    async def stop_beating(self) -> None:
        await cancel_and_wait(self._beating)

    def release(self) -> None:
        """Let held jobs answer (so the bus drains at once when the test ends)."""
        self._released.set()

    async def serve(self, *, hold: bool = False) -> None:
        self.hold = hold
        subjects = self.bus.subjects
        if self.bus.service == PREFILL:
            endpoint = Endpoint("run", subjects.prefill_run, PrefillJob, self._prefill)
        else:
            endpoint = Endpoint("run", subjects.decode_run, DecodeJob, self._decode)
        await self.bus.serve(endpoint)
        await self.bus.flush()

    async def _prefill(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        self.jobs.append(job)
        if self.hold:
            await self._released.wait()
        return PrefillDone(request_id=job.request.request_id)

    async def _decode(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        self.jobs.append(job)
        return JobAccepted(request_id=job.request.request_id, instance_id=self.instance_id)


async def start_workers(
    bus_factory: Callable[..., Awaitable[Bus]], service: str, *loads: dict[str, object]
) -> list[FakeWorker]:
    """One worker per `loads` entry, named `<service>-1`, `<service>-2`, ...; heartbeats
    once (tests that need more beat themselves)."""
    workers = []
    for number, load in enumerate(loads, start=1):
        worker = FakeWorker(await bus_factory(service, f"{service}-{number}"), **load)  # type: ignore[arg-type]
        await worker.beat()
        workers.append(worker)
    return workers


class FakeKvIndex:
    """One kv-index shard holding `stored` (hash -> slot); a request's prefix hits until the
    first hash it does not hold."""

    def __init__(self, bus: Bus, stored: list[int], writer_id: str = "prefill-9") -> None:
        self.bus = bus
        self.slots = {h: slot for slot, h in enumerate(stored)}
        self.writer_id = writer_id

    async def serve(self) -> None:
        subject = self.bus.subjects.kv_index_match_shard(0)
        await self.bus.serve(Endpoint("match", subject, MatchRequest, self._match))
        await self.bus.flush()

    async def _match(self, request: MatchRequest, ctx: Context) -> MatchReply:
        hashes = unpack_block_hashes(request.block_hashes).tolist()
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.slots:
            hits += 1
        n = np.arange(hits)
        columns = {
            "block_hash": np.array(hashes[:hits], dtype=np.uint64),
            "writer": np.zeros(hits, np.uint16),
            "file_id": np.ones(hits, np.uint32),
            "slot": np.array([self.slots[h] for h in hashes[:hits]], np.uint32),
            "generation": np.ones(hits, np.uint32),
            "num_bytes": np.full(hits, 1000, np.uint32),
        }
        locations = BlockLocations.from_columns("ssd", (self.writer_id,), columns)
        tier = to_wire("ssd", hits, n.tolist(), locations)
        return MatchReply(shard_id=0, num_shards=1, tiers=(tier,))


class FakeMemcache:
    """A node's swa-memcache: heartbeats (service swa-memcache), tells the routers what it
    holds (`SwaHeld`: its full state at start and whenever a `SwaResync` names it or every
    memcache), and counts the `contains` questions it is asked (the router asks none)."""

    def __init__(self, bus: Bus, node_id: str, held: set[int]) -> None:
        self.bus = bus
        self.node_id = node_id
        self.held = held
        self.seq = 1_000  # of its SwaHeld batches
        self.num_beats = 0
        self.num_asked = 0
        self.resyncs: list[SwaResync] = []

    @property
    def instance_id(self) -> str:
        return self.bus.instance_id

    async def start(self, *, announce: bool = True) -> None:
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.swa_resync, SwaResync, self._on_resync)
        await self.bus.serve(
            Endpoint("contains", subjects.swa_contains, SwaContains, self._contains)
        )
        await self.beat()
        if announce:
            await self.publish(self.held, is_full=True)

    async def beat(self) -> None:
        self.num_beats += 1
        report = LoadReport(
            service=self.bus.service,
            instance_id=self.instance_id,
            seq=self.num_beats,
            ts_ms=0,
            node_id=self.node_id,
        )
        await self.bus.publish(self.bus.subjects.load(self.bus.service, self.instance_id), report)
        await self.bus.flush()

    async def publish(
        self,
        added: Iterable[int] = (),
        removed: Iterable[int] = (),
        *,
        is_full: bool = False,
        num_lost: int = 0,
    ) -> None:
        """One batch; `num_lost` batches before it never reach anyone (a gap)."""
        self.seq += 1 + num_lost
        batch = SwaHeld(
            instance_id=self.instance_id,
            node_id=self.node_id,
            seq=self.seq,
            is_full=is_full,
            added=pack_block_hashes(list(added)),
            removed=pack_block_hashes(list(removed)),
        )
        await self.bus.publish(self.bus.subjects.swa_events(self.instance_id), batch)
        await self.bus.flush()

    async def _on_resync(self, request: SwaResync) -> None:
        if request.instance_id in ("", self.instance_id):
            self.resyncs.append(request)
            await self.publish(self.held, is_full=True)

    async def _contains(self, request: SwaContains, ctx: Context) -> SwaContainsReply:
        self.num_asked += 1
        hashes = unpack_block_hashes(request.block_hashes).tolist()
        return SwaContainsReply(found=bytes(int(h in self.held) for h in hashes))


class CancelListener:
    """Records every `CancelRequest` broadcast, as a prefill or decode worker hears them."""

    def __init__(self) -> None:
        self.cancels: list[CancelRequest] = []

    async def start(self, bus: Bus) -> None:
        await bus.subscribe(bus.subjects.cancel, CancelRequest, self._on_cancel)
        await bus.flush()

    async def _on_cancel(self, cancel: CancelRequest) -> None:
        self.cancels.append(cancel)
