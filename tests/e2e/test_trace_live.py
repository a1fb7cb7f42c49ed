"""The production trace replayed live (loadtest/trace/live.py): its first 200 requests (72 s
of trace, 7 of them reusing more than the first block) through a mock-engine cluster of real
processes (kv-index, swa-memcache, router, 2 prefill and 2 decode workers, started and
stopped by the replay), at 2x the trace's pace (LiveConfig.speed says why not faster).

Every request is answered, with usage for exactly the prompt sent, and the hit share the
cluster reports is the offline replay's prediction for the same requests. Tolerance: the
two can differ only where timing does, a request routed within the cluster's own overhead
(NATS hops, kv-index applying the event: milliseconds) of the end of the prefill storing
its prefix. The longer hits here come 27 s of trace or more after that (13.5 s at 2x); the
first block (512 tokens) is everyone's, and only the 10 requests of the trace's first
instant race the first prefill for it: at most 10 requests may differ, by 512 tokens each,
0.0023 of the 2.27M prompt tokens, so the shares must agree within 0.005.

That argument holds while the cluster keeps the trace's pace, and on two cores it does only
with the machine to itself: run beside another test file in CI, the replay ended 20 s behind
its prediction (56.6 s for 36.1 s), the first prefill stored the common block seconds late and
17 requests missed it. So the test is serial (make test runs it alone, after the rest).
"""

from __future__ import annotations

import pytest

from loadtest.trace.live import LiveConfig, run_live
from loadtest.trace.synth import load_trace

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.serial]

NUM_REQUESTS = 200


@pytest.mark.timeout(180)
def test_live_replay_answers_every_request_with_the_predicted_hits() -> None:
    config = LiveConfig(num_requests=NUM_REQUESTS)
    result = run_live(load_trace(limit=NUM_REQUESTS), config)
    assert not result.errors, result.errors
    assert len(result.answered) == NUM_REQUESTS
    sent = {r.index: r.input_length for r in result.requests}
    assert all(o.num_prompt_tokens == sent[o.index] for o in result.outcomes)
    assert all(o.ttft_s is not None and o.ttft_s > 0 for o in result.outcomes)
    assert result.num_cut > 0  # the longest prompts were cut to the context, and said so
    assert any(f"{result.num_cut} prompts cut" in line for line in result.reductions())

    assert sum(o.num_cached_tokens > 512 for o in result.outcomes) >= 5  # real prefix reuse
    assert abs(result.hit_share - result.predicted_share) <= 0.005
    behind = f"replay {result.wall_s:.1f} s for the prediction's {result.predicted.end_s:.1f} s"
    assert result.num_exact >= NUM_REQUESTS - 10, behind
