"""Fair queueing on the router's side: a session's work sets its requests' queue level
(services/router/sessions.py), the ledger is bounded, and admission in front of a fair
prefill worker counts only the work queued at or below a request's level, so a light
session's request is admitted where a heavy one's is refused (services/router/policy.py)."""

from __future__ import annotations

import dataclasses

import msgspec

from services.router.policy import PolicyConfig, Rejection, RoutePolicy, queued_tokens_ahead
from services.router.sessions import LEVEL_TOKENS, SessionLedger, queue_level
from shared.client import build_request, session_digest
from shared.load_table import InflightDelta
from shared.schema.control import LoadReport
from shared.schema.errors import ErrorCode
from shared.schema.inference import RouteDecision
from tests.unit.router.helpers import decoder, facts, report, table_with
from worker.cost_model import CostModel
from worker.serving.fair_queue import NUM_QUEUE_LEVELS, OLDEST_EVERY_PASSES

COST = CostModel(prefill_tokens_per_s=1000.0, load_tokens_per_s=10_000.0)


def test_levels_are_fourfold_steps_of_work() -> None:
    assert [queue_level(n) for n in (0, 8191, 8192, 32_767, 32_768, 10**9)] == [0, 0, 1, 1, 2, 4]
    assert len(LEVEL_TOKENS) + 1 == NUM_QUEUE_LEVELS
    assert all(b == 4 * a for a, b in zip(LEVEL_TOKENS, LEVEL_TOKENS[1:], strict=False))


def test_a_session_moves_down_as_its_work_grows_and_a_big_job_starts_low() -> None:
    ledger = SessionLedger()
    assert ledger.level("s", 2000) == 0  # a new session's small turn
    assert ledger.level("s", 40_000) == 2  # a new session's huge cold prompt: its size decides
    for _ in range(4):
        ledger.charge("s", 2000)
    assert ledger.num_tokens("s") == 8000 and ledger.level("s", 2000) == 1
    assert ledger.level("other", 2000) == 0  # sessions apart


def test_without_a_session_a_request_is_its_own_and_is_not_remembered() -> None:
    ledger = SessionLedger()
    ledger.charge("", 100_000)
    assert len(ledger) == 0 and ledger.level("", 2000) == 0


def test_the_ledger_forgets_the_least_recently_routed_session_past_its_bound() -> None:
    ledger = SessionLedger(max_sessions=3)
    for name in ("a", "b", "c"):
        ledger.charge(name, 10_000)
    ledger.charge("a", 1)  # a routed again: b is now the least recent
    ledger.charge("d", 10_000)
    assert len(ledger) == 3
    assert ledger.num_tokens("b") == 0 and ledger.level("b", 0) == 0  # starts again, as new
    assert [ledger.num_tokens(n) for n in ("a", "c", "d")] == [10_001, 10_000, 10_000]
    for n in range(10_000):  # any number of sessions: the ledger stays at its bound
        ledger.charge(f"s{n}", 1)
    assert len(ledger) == 3


def test_requests_carry_a_digest_of_account_and_session_never_the_id() -> None:
    request = build_request([1, 2, 3], model="m", account="acme", session="agent-42")
    assert request.session == session_digest("acme", "agent-42")
    assert len(request.session) == 16 and "agent-42" not in request.session
    assert session_digest("other", "agent-42") != request.session  # accounts apart
    assert build_request([1, 2, 3], model="m", account="acme").session == ""


def fair_report(instance_id: str, by_level: tuple[int, ...]) -> LoadReport:
    queued = report(instance_id, queued_tokens=sum(by_level))
    return msgspec.structs.replace(queued, num_queued_tokens_by_level=by_level)


def test_a_fair_worker_counts_the_work_at_or_below_a_level_and_the_oldest_jobs_share() -> None:
    table = table_with(fair_report("p", (300, 0, 6000, 0, 0)), decoder())
    (worker,) = table.workers("prefill", 0.0)
    # level 0 waits for level 0 (300), and for the passes the oldest job leads (at most
    # 1 in OLDEST_EVERY_PASSES, so 1/(OLDEST_EVERY_PASSES - 1) of its own wait)
    assert queued_tokens_ahead(worker, 0) == 300 + 300 // (OLDEST_EVERY_PASSES - 1)
    assert queued_tokens_ahead(worker, 2) == 6300  # nothing above: all of it
    table.record_sent(InflightDelta("r1", "p", num_tokens=200, queue_level=0), 0.0)
    table.record_sent(InflightDelta("r1", "p", num_tokens=900, queue_level=3), 0.0)
    (worker,) = table.workers("prefill", 0.0)
    assert queued_tokens_ahead(worker, 0) == 500 + 500 // (OLDEST_EVERY_PASSES - 1)
    assert queued_tokens_ahead(worker, 3) == 7400
    fcfs = table_with(report("q", queued_tokens=6300)).workers("prefill", 0.0)[0]
    assert queued_tokens_ahead(fcfs, 0) == 6300  # first come, first served: everything


def test_under_overload_a_light_session_is_admitted_where_a_heavy_one_is_refused() -> None:
    policy = RoutePolicy(COST, PolicyConfig(ttft_objective_s=2.0, max_queued_tokens=10**9))
    small = facts(num_prompt_tokens=500)  # 0.5 s of compute
    light, heavy = (dataclasses.replace(small, queue_level=level) for level in (0, 2))
    # 4 s of work queued, nearly all of heavier sessions' (levels 1 and 2)
    fair = table_with(fair_report("p", (600, 1400, 2000, 0, 0)), decoder())
    decision = policy.choose(light, fair, set(), 0.0)
    assert isinstance(decision, RouteDecision)
    expected_s = (600 + 600 // (OLDEST_EVERY_PASSES - 1) + 500) / COST.prefill_tokens_per_s
    assert decision.estimated_ttft_ms / 1000 == expected_s
    refused = policy.choose(heavy, fair, set(), 0.0)
    assert isinstance(refused, Rejection) and refused.code == ErrorCode.OVERLOADED
    # a first-come-first-served worker with the same queue refuses both
    fcfs = table_with(report("p", queued_tokens=4000), decoder())
    assert isinstance(policy.choose(light, fcfs, set(), 0.0), Rejection)
    # what the router counts in flight keeps the job's level, for the next request's estimate
    prefill_delta, _ = policy.inflight_deltas("r1", decision, light)
    assert prefill_delta.queue_level == 0
