"""A GPU-free engine with the real engine's surface (Dynamo's "mocker"): add_request, step,
abort, has_unfinished, with simulated timing and real KV bookkeeping.

    engine = MockEngine(MockEngineConfig(model_id="m", block_size_tokens=16))
    seq_id = engine.add_request(prompt_ids, MockSamplingParams(max_new_tokens=8),
                                num_cached_tokens=32, has_swa_snapshot=False)
    while engine.has_unfinished():
        await asyncio.sleep(engine.next_step_duration_s())  # the service's choice, not ours
        for out in engine.step():
            publish(out.new_block_hashes); stream(out.new_token_ids); bill(out.usage)

- Tokens are fake but deterministic: output token k of a prompt is a seeded hash of the
  prompt and k (`fake_tokens`), so tests know every output in advance.
- Timing follows `worker.cost_model.CostModel` (the router's own); `step` never sleeps, it
  adds its duration to `clock_s`.
- KV: a block is "computed" once all its tokens' K/V are (the last sampled token's are not
  until the next step, as in the real engine), and its hash continues the request's chain
  (`RequestBlocks`, taken from the request, not hashed again), so `new_block_hashes` can go
  straight into real `BlocksStored` events.
- Pages for prompt + max_new_tokens are taken from the model engine's own allocator
  (`BlockAllocator`: the one count of KV pages) when a request is admitted, so nothing is
  ever preempted; a request that does not fit waits (first come, first served). A caller
  that admits requests itself (the mock decode worker answers `DecodeJob` before the request
  reaches the engine) reserves their pages first (`reserve_pages`) and hands them to
  `add_request`: the allocator's free count then holds reservations too.

Nothing here imports torch (2 s to import), so tests and load generators start fast.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from shared.blocks import RequestBlocks
from worker.cost_model import CostModel
from worker.engine.block_allocator import BlockAllocator
from worker.mock_engine.requests import (
    FinishReason,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
    MockUsage,
    SamplingLike,
    fake_token,
    prompt_digest,
)


@dataclass(frozen=True)
class MockEngineConfig:
    model_id: str = "mock"
    block_size_tokens: int = 64  # also the KV page size
    vocab_size: int = 32_000
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # for requests without their own
    max_model_len: int = 131_072
    max_num_batched_tokens: int = 8192  # tokens per step: one per decode, the rest prefill
    max_num_seqs: int = 256
    num_kv_pages: int = 16_384


@dataclass(eq=False)
class _Seq:
    seq_id: int
    token_ids: list[int]
    params: SamplingLike
    seed: int
    blocks: RequestBlocks
    num_cached_tokens: int
    num_replay_tokens: int
    num_pages: int  # what it holds from admission to its end
    pages: list[int]  # held: reserved by the caller, or taken at admission ([]: not yet)
    num_prompt_tokens: int = field(init=False)
    digest: int = field(init=False)  # of the prompt: output token k hashes (digest, k)
    num_computed_tokens: int = 0
    is_loaded: bool = False  # its cached prefix has been loaded (charged once)
    num_blocks_published: int = 0  # the blocks already in step outputs (or cached)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.digest = prompt_digest(self.token_ids, self.seed)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def usage(self) -> MockUsage:
        num_hit = self.num_cached_tokens if self.is_loaded else 0
        num_miss = min(self.num_computed_tokens, self.num_prompt_tokens) - num_hit
        return MockUsage(num_hit, max(num_miss, 0), self.num_output_tokens)


@dataclass(frozen=True)
class _Plan:
    decode: list[_Seq]
    prefill: list[tuple[_Seq, int]]  # (sequence, tokens computed this step)
    admit: list[_Seq]
    duration_s: float


class MockEngine:
    def __init__(
        self, config: MockEngineConfig | None = None, cost: CostModel | None = None
    ) -> None:
        self.config = config or MockEngineConfig()
        self.cost = cost or CostModel()
        self.clock_s = 0.0  # simulated time: the sum of every step's duration
        self.last_step_duration_s = 0.0
        self.allocator = BlockAllocator(self.config.num_kv_pages)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._pending: list[MockStepOutput] = []
        self._next_seq_id = 0

    @property
    def num_kv_pages_free(self) -> int:
        return self.allocator.num_free_blocks

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    def pages_needed(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """Pages a request holds from admission to its end: all it can grow to."""
        max_len = min(num_prompt_tokens + max_new_tokens, self.config.max_model_len)
        return math.ceil(max_len / self.config.block_size_tokens)

    def reserve_pages(self, num_pages: int) -> list[int] | None:
        """Set pages aside for a request the caller admitted and will add with
        `pages=`; None (nothing reserved) when fewer are free."""
        if not self.allocator.can_allocate(num_pages):
            return None
        return self.allocator.allocate(num_pages)

    def release_pages(self, pages: list[int]) -> None:
        """Give back a reservation whose request never reached `add_request`."""
        self.allocator.free(pages)

    def add_request(
        self,
        token_ids: Seq[int],
        params: SamplingLike | None = None,
        *,
        num_cached_tokens: int = 0,
        has_swa_snapshot: bool = True,
        blocks: RequestBlocks | None = None,
        pages: Seq[int] | None = None,
    ) -> int:
        """Queue a request whose first `num_cached_tokens` (whole blocks) are loaded, not
        computed; without the SWA snapshot their window is rebuilt by bounded replay.
        `blocks`: the request's block layout (hashed here, in the engine's namespace, when a
        caller has none); `pages`: its pages, reserved (`reserve_pages`); the engine owns them
        from here, or they stay the caller's when this raises."""
        params = params or MockSamplingParams()
        block = self.config.block_size_tokens
        if not token_ids:
            raise MockRequestError("prompt is empty")
        if len(token_ids) >= self.config.max_model_len:
            raise MockRequestError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate "
                f"(max_model_len {self.config.max_model_len})"
            )
        if num_cached_tokens % block or not 0 <= num_cached_tokens < len(token_ids):
            raise MockRequestError(
                f"num_cached_tokens {num_cached_tokens} must be whole {block}-token blocks "
                f"shorter than the {len(token_ids)}-token prompt"
            )
        num_pages = self.pages_needed(len(token_ids), params.max_new_tokens)
        if num_pages > self.config.num_kv_pages:
            raise MockRequestError(
                f"needs {num_pages} KV pages, the engine has {self.config.num_kv_pages}"
            )
        if blocks is None:
            blocks = RequestBlocks.hash_prompt(
                token_ids, model=self.config.model_id, block_size_tokens=block
            )
        elif blocks.block_size != block:
            raise MockRequestError(f"blocks of {blocks.block_size} tokens, the engine's: {block}")
        if pages is not None and len(pages) != num_pages:
            raise MockRequestError(f"{len(pages)} pages reserved, the request holds {num_pages}")
        seq = _Seq(
            seq_id=self._next_seq_id,
            token_ids=list(token_ids),
            params=params,
            seed=self.config.seed if params.seed is None else params.seed,
            blocks=blocks,
            num_cached_tokens=num_cached_tokens,
            num_replay_tokens=self.cost.num_replay_tokens(num_cached_tokens, has_swa_snapshot),
            num_pages=num_pages,
            pages=list(pages or ()),
            num_blocks_published=num_cached_tokens // block,  # stored before it came here
        )
        self._next_seq_id += 1
        if params.max_new_tokens == 0:
            self._free_pages(seq)
            self._pending.append(
                MockStepOutput(seq.seq_id, (), True, FinishReason.LENGTH, usage=seq.usage())
            )
        else:
            self._waiting.append(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> bool:
        """Stop a request and free its pages; False if unknown or already finished."""
        seq = self._running.pop(seq_id, None)
        if seq is None:
            seq = next((s for s in self._waiting if s.seq_id == seq_id), None)
            if seq is None:
                return False
            self._waiting.remove(seq)
        self._free_pages(seq)
        self._pending.append(
            MockStepOutput(seq_id, (), True, FinishReason.ABORT, usage=seq.usage())
        )
        return True

    def next_step_duration_s(self) -> float:
        """How long the next `step` will take in simulated time (0 when it has nothing to do)."""
        return self._plan().duration_s

    def num_queued_tokens(self) -> int:
        """Prompt tokens still to compute (waiting and mid-prefill): a `LoadReport` field."""
        seqs = [*self._waiting, *self._running.values()]
        return sum(
            max(s.num_prompt_tokens - max(s.num_computed_tokens, s.num_cached_tokens), 0)
            for s in seqs
        )

    def num_running(self) -> int:
        return len(self._running)

    def step(self) -> list[MockStepOutput]:
        outputs, self._pending = self._pending, []
        plan = self._plan()
        for seq in plan.admit:
            self._waiting.popleft()
            self._running[seq.seq_id] = seq
            if not seq.pages:
                seq.pages = self.allocator.allocate(seq.num_pages)
        for seq in plan.decode:
            seq.num_computed_tokens += 1  # the token sampled last step is fed in now
            outputs.append(self._advance(seq, sample=True))
        for seq, num_tokens in plan.prefill:
            seq.is_loaded = True
            seq.num_computed_tokens = (
                max(seq.num_computed_tokens, seq.num_cached_tokens) + num_tokens
            )
            outputs.append(self._advance(seq, sample=not seq.is_prefilling))
        self.last_step_duration_s = plan.duration_s
        self.clock_s += plan.duration_s
        return [o for o in outputs if o.new_token_ids or o.new_block_hashes or o.finished]

    def _plan(self) -> _Plan:
        decode = [s for s in self._running.values() if not s.is_prefilling]
        budget = self.config.max_num_batched_tokens - len(decode)
        prefill: list[tuple[_Seq, int]] = []
        # Context: every token whose KV the step's attention reads, the one fed in included.
        context = sum(len(s.token_ids) for s in decode)
        duration_s = self.cost.decode_step_s(len(decode), context)
        for seq in self._running.values():  # mid-prefill first: they were admitted earlier
            if seq.is_prefilling and budget > 0:
                budget -= self._plan_prefill(seq, budget, prefill)
        admit = []
        free = self.allocator.num_free_blocks
        num_seqs = len(self._running)
        for seq in self._waiting:
            needed = 0 if seq.pages else seq.num_pages
            if budget <= 0 or needed > free or num_seqs >= self.config.max_num_seqs:
                break  # first come, first served: nobody overtakes the head
            admit.append(seq)
            free -= needed
            num_seqs += 1
            budget -= self._plan_prefill(seq, budget, prefill)
        for seq, num_tokens in prefill:
            loaded, replayed = 0, 0
            if not seq.is_loaded:
                loaded, replayed = seq.num_cached_tokens, seq.num_replay_tokens
            duration_s += self.cost.prefill_s(num_tokens, loaded, replayed)
        return _Plan(decode, prefill, admit, duration_s)

    def _free_pages(self, seq: _Seq) -> None:
        """Return what the sequence holds or had reserved (once)."""
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []

    @staticmethod
    def _plan_prefill(seq: _Seq, budget: int, prefill: list[tuple[_Seq, int]]) -> int:
        remaining = seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.num_cached_tokens)
        num_tokens = min(remaining, budget)
        prefill.append((seq, num_tokens))
        return num_tokens

    def _advance(self, seq: _Seq, *, sample: bool) -> MockStepOutput:
        new_tokens: tuple[int, ...] = ()
        reason = None
        if sample:
            token = fake_token(seq.digest, seq.num_output_tokens, seq.seed, self.config.vocab_size)
            seq.token_ids.append(token)
            new_tokens = (token,)
            if token in seq.params.stop_token_ids or token in self.config.eos_token_ids:
                reason = FinishReason.STOP
            elif (
                seq.num_output_tokens >= seq.params.max_new_tokens
                or len(seq.token_ids) >= self.config.max_model_len
            ):
                reason = FinishReason.LENGTH
        num_blocks = seq.num_computed_tokens // self.config.block_size_tokens
        new_hashes: list[int] = []
        if num_blocks > seq.num_blocks_published:
            chain = seq.blocks.extend(seq.token_ids, num_blocks)
            new_hashes = chain[seq.num_blocks_published :]
            seq.num_blocks_published = num_blocks
        usage = None
        if reason is not None:
            del self._running[seq.seq_id]
            self._free_pages(seq)
            usage = seq.usage()
        return MockStepOutput(
            seq.seq_id, new_tokens, reason is not None, reason, (), tuple(new_hashes), usage
        )
