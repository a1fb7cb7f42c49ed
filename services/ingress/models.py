"""The models the cluster serves, as ingress needs them: from discovery, each with its
tokenizer and chat format loaded once.

Decode workers name their model, its checkpoint path, context length and KV block size in
discovery metadata. Ingress reads the same checkpoint (a shared filesystem in a cluster; the
model cache on one machine) for its tokenizer and chat template, never the weights. The table
refreshes every few seconds in the background, and at once when a request names a model it
does not know yet, so a model whose workers just came up is served without waiting. Between
rounds, the workers' heartbeats (`LoadReport`, one a second) keep a known model marked as
served: a model stays served while any of its workers beats.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from shared.bus import Bus
from shared.discovery import discover
from shared.engine.checkpoint import Checkpoint
from shared.logging import get_logger
from shared.schema.control import InstanceState, LoadReport
from shared.subjects import DECODE, VLLM_WORKER
from shared.tokenizer import ChatFormat, PromptTokenizer, format_for

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
    def __init__(self, bus: Bus, *, cache_tokens: int = 4_000_000, forget_after_s: float = 15.0):
        self.bus = bus
        self.cache_tokens = cache_tokens
        # A model stays served until no worker of it has answered discovery for this long:
        # one busy worker missing one discovery round must not turn requests into 404s.
        self.forget_after_s = forget_after_s
        self._models: dict[str, ServedModel] = {}
        self._seen_at: dict[str, float] = {}  # name -> when a decode worker last answered
        self._refreshed_at = 0.0
        self._round_started_at = 0.0  # when the last discovery round began
        self._lock = asyncio.Lock()

    def _served(self) -> set[str]:
        now = time.monotonic()
        return {n for n, at in self._seen_at.items() if now - at < self.forget_after_s}

    def served(self) -> list[ServedModel]:
        return sorted(
            (self._models[n] for n in self._served() if n in self._models), key=lambda m: m.name
        )

    async def follow_heartbeats(self) -> None:
        """Mark a known model seen at each heartbeat of a worker serving it. Without this, a
        model was seen only by discovery rounds: after its workers restarted, a request could
        find the last round's sighting older than `forget_after_s` and wait a whole round
        (1 s) for its model, though the restarted workers were beating again."""
        await self.bus.subscribe(self.bus.subjects.load_all, LoadReport, self.on_load_report)

    async def on_load_report(self, report: LoadReport) -> None:
        if (
            report.service in STREAMERS
            and report.state == InstanceState.SERVING
            and report.model in self._models
        ):
            self._seen_at[report.model] = time.monotonic()

    async def get(self, name: str) -> ServedModel | None:
        """The model, asking discovery again if it is not (or no longer) known."""
        # Known models never wait for discovery (main.py refreshes the table every few
        # seconds in the background). An unknown name is answered from a discovery round
        # that began after it was asked, waiting longer for replies than the background
        # round: a worker that is busy (a model loading, a long prefill) answers late, and
        # one that joined a moment ago is in no earlier round (the demo's first request
        # right after its workers came up got a 404 that way). Rounds for unknown names
        # start at most 4 times a second, however many ask.
        if name not in self._served():
            asked_at = time.monotonic()
            await asyncio.sleep(max(0.0, self._refreshed_at + 0.25 - asked_at))
            async with self._lock:  # a round already under way ends first
                pass
            if name not in self._served() and self._round_started_at < asked_at:
                await self.refresh(timeout_s=1.0)
        return self._models.get(name) if name in self._served() else None

    async def refresh(self, timeout_s: float = 0.5) -> None:
        async with self._lock:
            self._round_started_at = time.monotonic()
            # The workers that stream tokens: decode workers and aggregated vLLM workers.
            instances = [
                i for i in await discover(self.bus, timeout_s=timeout_s) if i.service in STREAMERS
            ]
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
                self._seen_at[name] = time.monotonic()
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
