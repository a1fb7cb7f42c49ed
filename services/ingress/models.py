"""The models the cluster serves, as ingress needs them: from discovery, each with its
tokenizer and chat format loaded once.

Decode workers name their model, its checkpoint path, context length and KV block size in
discovery metadata. Ingress reads the same checkpoint (a shared filesystem in a cluster; the
model cache on one machine) for its tokenizer and chat template, never the weights. The table
refreshes every few seconds in the background, and at once when a request names a model it
does not know yet, so a model whose workers just came up is served without waiting.

Which models are served is the router's rule, from the router's table (shared/load_table.py):
a model is served while a SERVING worker of it has beaten (`LoadReport`, one a second) within
`heartbeat_timeout_s`. Discovery rounds count as beats (their STATS carry each instance's
report). So ingress accepts a model exactly while the router has a worker to route it to.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shared.bus import Bus
from shared.discovery import discover
from shared.load_table import HEARTBEAT_TIMEOUT_S, LoadTable
from shared.logging import get_logger
from shared.schema.control import LoadReport
from shared.subjects import DECODE, ROUTER, VLLM_WORKER
from shared.tokenizer import ChatFormat, PromptTokenizer, format_for
from worker.engine.checkpoint import Checkpoint

log = get_logger(__name__)

STREAMERS = frozenset({DECODE, VLLM_WORKER})  # the workers whose metadata names a model


@dataclass(frozen=True)
class ServedModel:
    name: str
    checkpoint: Path
    max_model_len: int
    block_size_tokens: int
    tokenizer: PromptTokenizer
    chat_format: ChatFormat
    created: int  # epoch seconds ingress first saw it (OpenAI's `created`)


class ModelTable:
    def __init__(
        self,
        bus: Bus,
        *,
        cache_tokens: int = 4_000_000,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ):
        self.bus = bus
        self.cache_tokens = cache_tokens
        self._models: dict[str, ServedModel] = {}
        self._workers = LoadTable(bus.instance_id, heartbeat_timeout_s=heartbeat_timeout_s)
        self._refreshed_at = 0.0
        self._round_started_at = 0.0  # when the last discovery round began
        self._lock = asyncio.Lock()
        self._num_routed = 0
        self._router_seq: dict[str, int] = {}  # each router's last heartbeat's seq

    def _served(self) -> set[str]:
        now = time.monotonic()
        return {m for service in STREAMERS for m in self._workers.models(service, now)}

    def served(self) -> list[ServedModel]:
        return sorted(
            (self._models[n] for n in self._served() if n in self._models), key=lambda m: m.name
        )

    async def follow_heartbeats(self) -> None:
        """Take every streaming worker's heartbeat into the table."""
        await self.bus.subscribe(self.bus.subjects.load_all, LoadReport, self.on_load_report)

    async def on_load_report(self, report: LoadReport) -> None:
        if report.service in STREAMERS or report.service == ROUTER:
            self._workers.observe(report, time.monotonic())
        if report.service == ROUTER:
            self._router_seq[report.instance_id] = report.seq

    def router(self) -> tuple[str | None, int]:
        """A router instance to send the next request to (and watch until it answers), in
        turn among those beating and SERVING, with the seq of its last heartbeat; None when
        none is known (any router, then)."""
        routers = self._workers.workers(ROUTER, time.monotonic())
        if not routers:
            return None, 0
        self._num_routed += 1
        router_id = routers[self._num_routed % len(routers)].instance_id
        return router_id, self._router_seq.get(router_id, 0)

    async def get(self, name: str) -> ServedModel | None:
        """The model, asking discovery again if it is not (or no longer) known."""
        # Known models never wait for discovery (main.py refreshes the table every few
        # seconds in the background). An unknown name is answered from a discovery round
        # that began after it was asked, waiting longer for replies than the background
        # round: a worker that is busy (a model loading, a long prefill) answers late, and
        # one that joined a moment ago is in no earlier round (the demo's first request
        # right after its workers came up got a 404 that way). Rounds for unknown names
        # start at most 4 times a second, however many ask.
        # A heartbeat can name a model before any round has loaded its tokenizer (the
        # demo's first request came while the round that found it was still loading).
        if not self._ready(name):
            asked_at = time.monotonic()
            await asyncio.sleep(max(0.0, self._refreshed_at + 0.25 - asked_at))
            async with self._lock:  # a round already under way ends first
                pass
            if not self._ready(name) and self._round_started_at < asked_at:
                await self.refresh(timeout_s=1.0)
        return self._models[name] if self._ready(name) else None

    def _ready(self, name: str) -> bool:
        return name in self._models and name in self._served()

    async def refresh(self, timeout_s: float = 0.5, stall_s: float | None = None) -> None:
        """One discovery round (`stall_s`: ended early once the replies pause, `discover`)."""
        async with self._lock:
            self._round_started_at = time.monotonic()
            found = await discover(self.bus, timeout_s=timeout_s, stall_s=stall_s)
            # The workers that stream tokens: decode workers and aggregated vLLM workers.
            instances = [i for i in found if i.service in STREAMERS]
            for instance in instances:
                meta = instance.metadata
                name = meta.get("model")
                if not name:
                    continue
                if name not in self._models and meta.get("model_path"):
                    try:
                        self._models[name] = await asyncio.to_thread(self._load, meta)
                    except Exception:  # one unreadable checkpoint must not hide the others
                        log.exception(
                            "cannot load a served model's tokenizer",
                            model=name,
                            path=meta.get("model_path"),
                        )
                        continue
                if instance.load:  # its report, as a heartbeat of its own
                    try:
                        report = msgspec.convert(instance.load, LoadReport)
                    except msgspec.ValidationError:
                        log.warning(
                            "malformed load report in discovery", instance_id=instance.instance_id
                        )
                    else:
                        self._workers.observe(report, time.monotonic())
            self._refreshed_at = time.monotonic()

    def _load(self, meta: dict[str, str]) -> ServedModel:
        checkpoint = Checkpoint(Path(meta["model_path"]))
        chat_format = format_for(checkpoint)
        tokenizer = PromptTokenizer(
            checkpoint.tokenizer(), chat_format, cache_tokens=self.cache_tokens
        )
        model = ServedModel(
            name=meta["model"],
            checkpoint=checkpoint.path,
            max_model_len=int(meta.get("max_model_len") or 0)
            or checkpoint.config().max_position_embeddings,
            block_size_tokens=int(meta.get("kv_block_size_tokens") or 64),
            tokenizer=tokenizer,
            chat_format=chat_format,
            created=int(time.time()),
        )
        log.info(
            "serving model",
            model=model.name,
            format=chat_format.name,
            max_model_len=model.max_model_len,
        )
        return model
