"""The simulator (simulator/): conservation of requests and tokens, determinism for a seed,
the production router and index in the loop, utilization against the arithmetic of the work
routed, and a hit rate that comes from the store rather than from any input."""

from __future__ import annotations

import dataclasses

import pytest

import services.kv_index.index as index_module
import services.router.policy as policy_module
import shared.load_table as load_table_module
import simulator.cluster
import simulator.simulation
from simulator import SimConfig, Simulation, WorkloadConfig

# Short sessions of short prompts on four GPUs a side: a run is a fraction of a second.
WORKLOAD = WorkloadConfig(
    num_system_prompts=4,
    system_prompt_tokens=2_000,
    first_context_tokens_mean=4_000.0,
    steps_mean=8.0,
    output_tokens_mean=200.0,
    tool_tokens_mean=600.0,
    think_time_mean_s=2.0,
    max_output_tokens=1_024,
    max_context_tokens=40_000,
)


def config(**changes: object) -> SimConfig:
    fields = {
        "gpus_per_prefill_server": 4,
        "load": 0.5,
        "duration_s": 20.0,
        "warmup_s": 5.0,
        "window_s": 5.0,
        "workload": WORKLOAD,
        **changes,
    }
    return SimConfig.scaled(1, 1, 4, **fields)


@pytest.fixture(scope="module")
def run() -> Simulation:
    return Simulation(config()).run()


def assert_conserved(sim: Simulation) -> None:
    ledger = sim.ledger
    assert ledger.num_issued > 0
    assert ledger.num_issued == ledger.num_finished + ledger.num_refused
    assert ledger.num_issued_prompt_tokens == (
        ledger.num_finished_prompt_tokens + ledger.num_refused_prompt_tokens
    )
    assert ledger.num_finished_prompt_tokens == ledger.num_hit_tokens + ledger.num_computed_tokens
    assert ledger.num_decoded_tokens == pytest.approx(ledger.num_requested_output_tokens, rel=1e-9)
    windows = sim.windows.ordered()
    assert sum(w.num_routed for w in windows) == ledger.num_finished
    assert sum(w.num_arrived for w in windows) == ledger.num_issued
    assert sum(w.num_refused for w in windows) == ledger.num_refused
    assert sum(w.num_prompt_tokens for w in windows) == ledger.num_finished_prompt_tokens
    assert sum(w.num_hit_tokens for w in windows) == ledger.num_hit_tokens
    assert sum(len(w.ttft_s) for w in windows) == ledger.num_finished
    decoded = sum(w.num_output_tokens for w in windows)
    assert decoded == pytest.approx(ledger.num_requested_output_tokens, rel=1e-9)
    # Every GPU gave back what it was given: no queued job, no page, no running sequence.
    assert all(g.num_jobs == 0 and g.num_queued_tokens == 0 for g in sim.prefill)
    assert all(g.num_pages_used == 0 and g.num_running == 0 for g in sim.decode)


def test_every_request_finishes_and_tokens_balance(run: Simulation) -> None:
    assert_conserved(run)
    assert run.ledger.num_refused == 0  # half the reference load: nothing turned away


def test_overload_refuses_and_still_balances() -> None:
    sim = Simulation(config(load=3.0, client_wait_s=1.0, duration_s=10.0)).run()
    assert sim.ledger.num_refused > 0
    assert sum(w.num_rejections for w in sim.windows.ordered()) >= sim.ledger.num_refused
    assert_conserved(sim)


def test_a_seed_gives_one_run(run: Simulation) -> None:
    again = Simulation(config()).run()
    other = Simulation(config(seed=1)).run()
    summaries = [again.summarize(w) for w in again.windows.ordered()]
    assert summaries == [run.summarize(w) for w in run.windows.ordered()]
    assert again.ledger == run.ledger
    assert other.ledger != run.ledger


def test_the_router_and_index_are_the_production_ones(run: Simulation) -> None:
    assert simulator.simulation.RoutePolicy is policy_module.RoutePolicy
    assert simulator.simulation.RequestFacts is policy_module.RequestFacts
    assert simulator.simulation.LoadTable is load_table_module.LoadTable
    assert simulator.cluster.KvIndex is index_module.KvIndex
    assert type(run.policy) is policy_module.RoutePolicy
    assert type(run.table) is load_table_module.LoadTable
    assert type(run.store.index) is index_module.KvIndex
    # And they were asked: a match per routing attempt, every block written indexed.
    counters = run.store.index.counters
    assert counters.num_matches == run.num_decisions
    assert counters.num_blocks_stored > 0
    assert counters.num_blocks_matched * run.config.block_size_tokens >= run.ledger.num_hit_tokens
    assert run.policy.store.bytes_read > 0  # the policy's own count of the reads it sent


def test_utilization_is_the_work_routed_over_capacity_at_low_load() -> None:
    sim = Simulation(config(load=0.2, duration_s=40.0, warmup_s=10.0)).run()
    steady = sim.steady()
    assert steady is not None
    cfg = sim.config
    span_s = steady.end_s - steady.start_s
    summary = sim.summarize(steady)
    computed = steady.num_prompt_tokens - steady.num_hit_tokens + steady.num_replayed_tokens
    offered_prefill = computed / cfg.prefill_tokens_per_s / (cfg.num_prefill_gpus * span_s)
    assert summary["prefill_util"] == pytest.approx(offered_prefill, rel=0.15)
    # At low load no decode GPU passes the sequences it runs at full speed, so each answer
    # takes output / 300 s and the GPUs' share is the output routed over their capacity.
    output = sum(
        r
        for r in (w.num_output_tokens for w in sim.windows.ordered() if steady.start_s <= w.start_s)
    )
    assert output > 0
    routed_rate = steady.num_routed / span_s
    mean_output = sim.ledger.num_requested_output_tokens / sim.ledger.num_finished
    offered_decode = routed_rate * mean_output / (cfg.num_decode_gpus * cfg.decode_tokens_per_s)
    assert summary["decode_util"] == pytest.approx(offered_decode, rel=0.15)
    assert summary["ttft_p50_s"] < 0.5  # nothing queues long at a fifth of the load


def test_hit_rate_rises_with_the_steps_and_is_no_input() -> None:
    names = {f.name for f in dataclasses.fields(SimConfig)}
    names |= {f.name for f in dataclasses.fields(WorkloadConfig)}
    assert not [n for n in names if "hit" in n]
    sim = Simulation(config(start_in_progress=False, duration_s=40.0)).run()
    rate = {step: hit / prompt for step, (hit, prompt) in sim.hits_by_step.items()}
    # A first request shares only its agent's system prompt; each later one re-sends the
    # last prompt and answer, which its writers stored.
    assert rate[0] < 0.5
    assert rate[0] < rate[1] < rate[3]
    assert rate[3] > 0.8


def test_hit_rate_follows_the_store() -> None:
    roomy = Simulation(config(start_in_progress=False)).run()
    # A store of 64 blocks, swept twice a second: what a step wrote is gone by the next.
    tiny = config(start_in_progress=False, evict_interval_s=0.5)
    tiny = tiny.replace(store_bytes=64 * tiny.block_bytes)
    cramped = Simulation(tiny).run()
    assert cramped.store.num_blocks_evicted > 0
    hit = roomy.ledger.num_hit_tokens / roomy.ledger.num_finished_prompt_tokens
    cramped_hit = cramped.ledger.num_hit_tokens / cramped.ledger.num_finished_prompt_tokens
    assert cramped_hit < hit / 2
    assert_conserved(cramped)
