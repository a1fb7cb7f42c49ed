"""The vLLM server a vllm-worker runs, seen through its OpenAI-compatible HTTP API: token ids in
(`/v1/completions` takes a prompt of ids), token ids out (`return_token_ids`, streamed), the
usage at the end (`stream_options.include_usage`, with `prompt_tokens_details.cached_tokens`:
the prompt tokens vLLM did not compute, from its own prefix cache or from the connector), and
its load from `/metrics`.

Closing a stream early (the caller cancelled, a stop string matched, the deadline passed)
closes the HTTP connection, and vLLM aborts the request: its blocks are freed at once.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from shared.schema import SamplingParams


class VllmError(RuntimeError):
    """vLLM answered with an error status or a malformed stream."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Delta:
    """One streamed chunk: new token ids, and on the last one why it ended and the usage."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # stop | length (vLLM's; abort shows as a closed stream)
    num_prompt_tokens: int | None = None  # the usage, on the last chunk
    num_cached_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class VllmLoad:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    kv_cache_usage: float  # 0..1


def completion_body(
    model: str,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    request_id: str,
    cache_salt: str = "",
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `/v1/completions` request for a prompt of ids. Stop strings are ours: the worker
    matches them on its own detokenizer's text (as the kvfabric engine does) and closes the
    stream, so vLLM gets none. `kv_transfer_params` reach the connector with the request
    (`services.vllm_worker.connector.params`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(token_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
        "request_id": request_id,
    }
    if sampling.top_k is not None:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if cache_salt:
        body["cache_salt"] = cache_salt
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return body


# The block-hash namespace of the worker's warm-up prompt (VllmClient.warm_up).
WARMUP_CACHE_SALT = "kvfabric-warmup"


class VllmClient:
    def __init__(self, base_url: str, *, connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")  # http://127.0.0.1:<port>
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        )

    async def close(self) -> None:
        await self._http.close()

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[Delta]:
        """The completion's chunks as they come; VllmError for an error answer."""
        async with self._http.post(f"{self.base_url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                text = await reply.text()
                raise VllmError(f"vLLM answered {reply.status}: {text[:500]}", reply.status)
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield _delta(json.loads(data))

    async def warm_up(self, model: str, num_tokens: int) -> float:
        """One greedy completion of the same `num_tokens` prompt at every start, in a block
        namespace of its own (`WARMUP_CACHE_SALT`: no client prompt shares its blocks); the
        seconds it took. The first start computes it and the connector saves its blocks;
        every later start, of any worker of the model, loads them back from the store, so
        the connector's load path is warm too."""
        # Ids past the first thousand: no special tokens, every one a distinct text piece.
        prompt = [1000 + (i * 7919) % 30000 for i in range(num_tokens)]
        sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        body = completion_body(
            model,
            prompt,
            sampling,
            request_id=f"kvfabric-warmup-{time.time_ns()}",
            cache_salt=WARMUP_CACHE_SALT,
        )
        started = time.perf_counter()
        async for _ in self.generate(body):
            pass
        return time.perf_counter() - started

    async def load(self) -> VllmLoad:
        async with self._http.get(f"{self.base_url}/metrics") as reply:
            if reply.status != 200:
                raise VllmError(f"vLLM /metrics answered {reply.status}", reply.status)
            return parse_load(await reply.text())


def _delta(chunk: dict[str, Any]) -> Delta:
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise VllmError(f"vLLM stream error: {message}")
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    choices = chunk.get("choices") or []
    token_ids: tuple[int, ...] = ()
    finish_reason = None
    if choices:
        choice = choices[0]
        token_ids = tuple(choice.get("token_ids") or ())
        finish_reason = choice.get("finish_reason")
    return Delta(
        token_ids=token_ids,
        finish_reason=finish_reason,
        num_prompt_tokens=usage.get("prompt_tokens"),
        num_cached_tokens=details.get("cached_tokens") if usage else None,
        num_output_tokens=usage.get("completion_tokens"),
    )


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_NUM_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


def parse_load(text: str) -> VllmLoad:
    """The figures the router needs, from vLLM's Prometheus text: sequences running and
    waiting, its KV blocks in all (`vllm:cache_config_info`'s label) and in use."""
    values: dict[str, float] = {}
    num_blocks = 0
    for name, labels, value in _SAMPLE.findall(text):
        if name == "vllm:cache_config_info" and labels:
            found = _NUM_BLOCKS.search(labels)
            if found:
                num_blocks = int(found.group(1))
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return VllmLoad(
        num_running=int(values.get("vllm:num_requests_running", 0)),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        num_kv_blocks_total=num_blocks,
        kv_cache_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
    )
