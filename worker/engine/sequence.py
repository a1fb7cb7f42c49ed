"""Per-request state the runner reads and advances."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.kv_cache import SlidingWindowState
from worker.engine.sampler import SamplingParams


@dataclass(eq=False)
class Sequence:
    """Tokens plus where their KV lives.

    `num_computed_tokens`: how many leading tokens have K/V cached (full layers in the pages of
    `block_table`, sliding layers in `window`). In decode the last token is the one not yet
    computed: it was just sampled.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    window: SlidingWindowState | None = None
    generator: torch.Generator | None = None
    # The window as it was at the last block boundary reached (engines that track them).
    boundary_window: SlidingWindowState | None = None
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
