"""The simulated model (worker/mock_engine/simulated.py) under the real runner and engine:
real pages, windows and replay, deterministic tokens, time from the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.cost_model import CostModel
from worker.engine.checkpoint import Checkpoint
from worker.engine.engine import Engine
from worker.engine.runner import ModelRunner
from worker.engine.sampler import SamplingParams
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import replay_window
from worker.mock_engine.simulated import SimulatedCausalLM, simulated_output, token_kv

TINY_CODER = Path(__file__).parents[2] / "models" / "tiny-coder"
BLOCK = 16
# Fast enough that no test waits on the simulated time it checks.
COST = CostModel(prefill_tokens_per_s=1e6, decode_step_base_s=1e-4, decode_step_per_seq_s=1e-5)


@pytest.fixture(scope="module")
def config():
    return Checkpoint(TINY_CODER).config()


def runner_of(config, dtype: torch.dtype = torch.float32) -> ModelRunner:  # noqa: ANN001
    return ModelRunner(SimulatedCausalLM(config, COST, dtype=dtype), 64, BLOCK)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 8000 + 2 for i in range(n)]


def expected_kv(config, token_ids: list[int], start: int):  # noqa: ANN001
    positions = torch.arange(start, start + len(token_ids))
    return token_kv(torch.tensor(token_ids), positions, config)


def test_engine_generates_the_simulated_tokens_greedy_and_sampled(config) -> None:  # noqa: ANN001
    engine = Engine(runner_of(config), eos_token_ids=())
    prompts = [prompt(40), prompt(70)[5:]]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=12),
        SamplingParams(temperature=1.3, top_p=0.9, seed=4, max_new_tokens=12),
    ]
    outputs = engine.generate(prompts, params)
    for out, ids in zip(outputs, prompts, strict=True):
        assert out.completion_token_ids == simulated_output(ids, 12, config.vocab_size)
    assert len(set(outputs[0].completion_token_ids)) > 6  # not one token over and over


def test_prefill_writes_every_full_layer_page_and_the_window(config) -> None:  # noqa: ANN001
    runner = runner_of(config)
    seq = Sequence(0, prompt(100))
    runner.prefill([seq], num_new_tokens=[60])
    runner.prefill([seq])
    k, v = expected_kv(config, seq.token_ids, 0)
    for f in range(config.num_full_layers):
        slots = (
            torch.tensor([seq.block_table[p // BLOCK] for p in range(100)]),
            torch.arange(100) % BLOCK,
        )
        keys, values = runner.pool.gather(f, slots)
        assert torch.equal(keys, k) and torch.equal(values, v)
    window = seq.window
    assert window.end_position == 100 and window.num_tokens == config.sliding_window
    for s in range(config.num_sliding_layers):
        assert torch.equal(window.kv[s, 0], k[100 - config.sliding_window :])
        assert torch.equal(window.kv[s, 1], v[100 - config.sliding_window :])


def test_replay_rebuilds_the_window_the_pass_kept_at_the_boundary(config) -> None:  # noqa: ANN001
    runner = runner_of(config, torch.bfloat16)
    seq = Sequence(0, prompt(90))
    runner.prefill([seq], keep_boundary_window=True)
    boundary = 80  # the last block boundary before the last token
    assert seq.boundary_window is not None and seq.boundary_window.end_position == boundary
    model = runner.model
    before = model.simulated_s
    replayed = replay_window(
        model, runner.pool, seq.block_table, seq.token_ids, boundary, config.sliding_window
    )
    assert torch.equal(replayed.kv, seq.boundary_window.kv)
    assert model.simulated_s - before == pytest.approx(COST.prefill_s(0, 0, config.sliding_window))


def test_each_pass_charges_the_cost_model(config) -> None:  # noqa: ANN001
    runner = runner_of(config)
    model = runner.model
    seqs = [Sequence(0, prompt(50)), Sequence(1, prompt(30))]
    runner.prefill(seqs)
    assert model.simulated_s == pytest.approx(COST.prefill_s(80))
    for seq, token in zip(seqs, (5, 6), strict=True):
        seq.token_ids.append(token)
    before = model.simulated_s
    runner.decode(seqs)
    assert model.simulated_s - before == pytest.approx(COST.decode_step_s(2, 51 + 31))
