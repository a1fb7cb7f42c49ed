"""A simulated model for the real engine (`--engine mock`, Dynamo's "mocker"): the served
model's geometry from its config, none of its weights.

It stands where `worker.engine.model.CausalLM` stands, under the same `ModelRunner`,
scheduler, engine and workers, so a mock worker restores, computes, hands off and persists
through the very code the model's does. What it simulates is the arithmetic:

- K/V: every layer's K/V of a token is a function of the token id and its position
  (`token_kv`), written through the attention backend's store-only path (`store`): the pages,
  the sliding windows, their snapshots and the handoff carry real bytes of the real sizes,
  and nothing attends to them.
- Tokens: the logits of position p name one token, `next_token(token id at p, p)`, with all
  the mass: greedy and seeded sampling alike pick it, so tests know every output in advance.
- Time: each pass sleeps what `worker.cost_model.CostModel` says it costs (the router's own
  model), divided by `speedup`, in the thread that runs the model -- where a real forward
  pass would spend it.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from shared.config import EngineWorkerConfig
from worker.cost_model import CostModel
from worker.engine.attention import DecodeAttention
from worker.engine.checkpoint import Checkpoint
from worker.engine.config import ModelConfig

# Multiplicative hashing constants (Knuth; MurmurHash3's finalizer): cheap, vectorized and
# well spread over the vocabulary, which is all a fake token needs.
_TOKEN_MIX = 0x9E3779B1
_POSITION_MIX = 0x85EBCA77
# The logit of the named token: softmax gives every other token exp(-1e4 / T) = 0.
_NAMED_LOGIT = 1e4


class StoringBackend(Protocol):
    """The attention backends' store-only path (worker/engine/attention.py)."""

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None: ...


def next_token(token_id: int, position: int, vocab_size: int) -> int:
    """The token the simulated model predicts after `token_id` at `position`."""
    return int(_next_tokens(torch.tensor([token_id]), torch.tensor([position]), vocab_size))


def _next_tokens(token_ids: torch.Tensor, positions: torch.Tensor, vocab_size: int):
    mixed = (token_ids * _TOKEN_MIX) ^ (positions * _POSITION_MIX)
    return (mixed ^ (mixed >> 15)) % vocab_size


def simulated_output(prompt_ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """What the simulated model generates after `prompt_ids`, greedy or sampled."""
    token_ids = list(prompt_ids)
    for _ in range(num_tokens):
        token_ids.append(next_token(token_ids[-1], len(token_ids) - 1, vocab_size))
    return token_ids[len(prompt_ids) :]


def token_kv(
    token_ids: torch.Tensor, positions: torch.Tensor, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_tokens, kv_heads, head_dim] of every layer for these tokens: distinct
    per (token, position), so a page or window holding the wrong position shows."""
    value = ((token_ids * 31 + positions) % 65_521).float() / 65_521
    shape = (len(token_ids), config.num_kv_heads, config.head_dim)
    k = value[:, None, None].expand(shape)
    return k, -k


class SimulatedCausalLM:
    """`CausalLM`'s surface (called with packed tokens and an attention backend,
    `compute_logits`, `replay`) over simulated arithmetic and simulated time."""

    def __init__(
        self,
        config: ModelConfig,
        cost: CostModel,
        speedup: float = 1.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.dtype = dtype  # the pool's and windows' (the served model's weights' would be)
        self.cost = cost
        self.speedup = speedup
        self.simulated_s = 0.0  # every pass's simulated time, summed

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: StoringBackend
    ) -> torch.Tensor:
        """-> [num_tokens, 1]: each row the id of the token its position predicts (what
        `compute_logits` turns into logits)."""
        k, v = token_kv(token_ids, positions, self.config)
        for layer_id in range(self.config.num_layers):
            backend.store(layer_id, k, v)
        if isinstance(backend, DecodeAttention):
            num_context = int(positions.sum()) + len(positions)
            self._sleep(self.cost.decode_step_s(len(positions), num_context))
        else:  # a prefill chunk, or a speculative draft scored in one pass
            self._sleep(self.cost.prefill_s(len(positions)))
        predicted = _next_tokens(token_ids, positions, self.config.vocab_size)
        return predicted.to(torch.float32)[:, None]  # exact: vocabularies are under 2^24

    def replay(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: StoringBackend
    ) -> None:
        """The sliding layers' K/V of the replayed tokens (swa_restore.replay_window)."""
        k, v = token_kv(token_ids, positions, self.config)
        for layer_id in self.config.sliding_layer_ids:
            backend.store(layer_id, k, v)
        self._sleep(self.cost.prefill_s(0, 0, len(positions)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros((hidden.shape[0], self.config.vocab_size))
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = _NAMED_LOGIT
        return logits

    def _sleep(self, simulated_s: float) -> None:
        self.simulated_s += simulated_s
        time.sleep(simulated_s / self.speedup)


def simulated_model(config: EngineWorkerConfig, dtype: torch.dtype) -> SimulatedCausalLM:
    """`--engine mock`'s model for the worker `config` describes: the checkpoint's config
    only (no weights read), the router's cost model, the configured speed-up."""
    model = Checkpoint(config.model_path).config()
    return SimulatedCausalLM(model, CostModel(), config.mock_speedup, dtype)
