"""Agent sessions: a shared system prompt, the session's first message, then steps that each
re-send the previous prompt + the answer + the tool's result (docs/simulator.md).

The generator shapes sessions only -- lengths, steps, think times -- and never says what hits:
whether a prompt's blocks are cached is for the store and the index to answer. Token ids are
synthetic (drawn from the session's own generator, so that they do not depend on event
order); the block hashes are the production chain (`shared.blocks.RequestBlocks`, hashed
once per new block as a caller hashes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shared.block_hashing import BlockHasher
from shared.blocks import RequestBlocks
from simulator.config import SimConfig, WorkloadConfig


def lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    """A lognormal draw with this mean (not median)."""
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


@dataclass(eq=False)
class Session:
    """One agent's conversation: its token stream as a chain of block hashes."""

    session_id: int
    rng: np.random.Generator
    hasher: BlockHasher
    num_steps: int
    hashes: list[int]
    tail: np.ndarray  # the tokens after the last complete block
    num_tokens: int
    step: int = 0
    # In progress at the start: the tokens its earlier steps had sent and been answered,
    # which their writers left in the store (all but the last tool result).
    num_served_tokens: int = 0

    def append(self, num_tokens: int, vocab_size: int) -> None:
        """The stream grows by `num_tokens` synthetic tokens; new complete blocks are hashed."""
        new = self.rng.integers(0, vocab_size, num_tokens, dtype=np.uint32)
        tokens = np.concatenate((self.tail, new))
        size = self.hasher.block_size_tokens
        num_full = len(tokens) // size * size
        parent = self.hashes[-1] if self.hashes else 0
        if num_full:
            self.hashes += self.hasher.hashes(tokens[:num_full], parent_hash=parent)
        self.tail = tokens[num_full:]
        self.num_tokens += num_tokens

    def blocks(self) -> RequestBlocks:
        """The current prompt's layout, as the caller's `RequestBlocks.hash_prompt` gives it."""
        return RequestBlocks(self.hasher, self.num_tokens, list(self.hashes))


@dataclass
class Workload:
    config: SimConfig
    seed: int
    _prompts: list[tuple[list[int], np.ndarray]] = field(default_factory=list, init=False)
    _hasher: BlockHasher = field(init=False)

    def __post_init__(self) -> None:
        shape = self.config.workload
        self._hasher = RequestBlocks.namespace(self.config.model, self.config.block_size_tokens)
        for index in range(shape.num_system_prompts):
            rng = np.random.default_rng((self.seed, 1, index))
            tokens = rng.integers(0, shape.vocab_size, shape.system_prompt_tokens, dtype=np.uint32)
            size = self._hasher.block_size_tokens
            num_full = len(tokens) // size * size
            self._prompts.append((self._hasher.hashes(tokens[:num_full]), tokens[num_full:]))

    @property
    def shape(self) -> WorkloadConfig:
        return self.config.workload

    def session(self, session_id: int, *, in_progress: bool = False) -> Session:
        """Session `session_id` with its first prompt; the same for a seed, whatever order
        sessions are asked for in. `in_progress`: a session already running when the run
        starts, its age drawn as a live session's (steps are geometric, so it has as many
        left as a new one): its earlier steps grow its prompt, and what they stored is
        `num_served_tokens` (the caller puts it in the store as their writers had)."""
        shape = self.shape
        rng = np.random.default_rng((self.seed, 2, session_id))
        hashes, tail = self._prompts[int(rng.integers(0, shape.num_system_prompts))]
        num_steps = int(rng.geometric(1.0 / shape.steps_mean))
        session = Session(
            session_id,
            rng,
            self._hasher,
            num_steps,
            list(hashes),
            tail.copy(),
            shape.system_prompt_tokens,
        )
        first = max(round(lognormal(rng, shape.first_context_tokens_mean, shape.sigma)), 1)
        session.append(first, shape.vocab_size)
        if in_progress:
            for _ in range(int(rng.geometric(1.0 / shape.steps_mean)) - 1):
                output, tool = self.output_tokens(session), self._tool_tokens(session)
                if session.num_tokens + output + tool > shape.max_context_tokens:
                    break
                session.append(output, shape.vocab_size)
                session.num_served_tokens = session.num_tokens
                session.append(tool, shape.vocab_size)
        return session

    def output_tokens(self, session: Session) -> int:
        shape = self.shape
        drawn = lognormal(session.rng, shape.output_tokens_mean, shape.sigma)
        return min(max(round(drawn), 1), shape.max_output_tokens)

    def _tool_tokens(self, session: Session) -> int:
        shape = self.shape
        drawn = lognormal(session.rng, shape.tool_tokens_mean, shape.sigma)
        return min(max(round(drawn), 1), shape.max_tool_tokens)

    def step_period_s(self, user_tokens_per_s: float) -> float:
        """A step's mean time, think time and answer (prefill's share is small)."""
        shape = self.shape
        return shape.think_time_mean_s + shape.output_tokens_mean / user_tokens_per_s

    def next_step(self, session: Session, num_output_tokens: int) -> float | None:
        """After an answer: the answer joins the stream (always: decode stores its blocks),
        then the tool's result; returns the think time before the next request, None when
        the session has ended."""
        shape = self.shape
        session.step += 1
        session.append(num_output_tokens, shape.vocab_size)  # decode writes its blocks
        if session.step >= session.num_steps:
            return None
        tool = self._tool_tokens(session)
        if session.num_tokens + tool > shape.max_context_tokens:
            return None
        session.append(tool, shape.vocab_size)
        return lognormal(session.rng, shape.think_time_mean_s, shape.sigma)
