"""The load table: heartbeats, staleness, draining, in-flight work shared between routers."""

from __future__ import annotations

import msgspec
import pytest

from shared.load_table import InflightDelta, LoadTable
from shared.schema.control import InstanceState
from shared.subjects import PREFILL
from tests.unit.router.helpers import decoder, report, table_with
from worker.cost_model import CostModel, CostModelError


def ids(table: LoadTable, now_s: float, service: str = PREFILL) -> list[str]:
    return [w.instance_id for w in table.workers(service, now_s)]


def test_stale_heartbeats_are_dropped():
    table = table_with(report("a"), report("b"), now_s=0.0)
    table.observe(report("b"), 2.0)
    assert ids(table, 3.0) == ["a", "b"]  # a's is 3.0 s old: at the timeout, still fresh
    assert ids(table, 3.5) == ["b"]  # hidden before any prune
    assert table.view("a", 3.5) is None
    assert table.prune(3.5) == ["a"]
    assert len(table) == 1
    table.observe(report("a"), 4.0)  # it came back
    assert ids(table, 4.0) == ["a", "b"]


def test_draining_and_starting_instances_get_no_new_work():
    table = table_with(
        report("a", state=InstanceState.DRAINING),
        report("b", state=InstanceState.STARTING),
        report("c"),
        decoder("d"),
    )
    assert ids(table, 0.0) == ["c"]
    assert table.view("a", 0.0).state == InstanceState.DRAINING  # still known, still fresh


def test_reordered_or_repeated_heartbeats_are_ignored():
    table = LoadTable("r1")
    newer = report("a", queued_tokens=10)
    older = msgspec.structs.replace(newer, seq=newer.seq - 1, num_queued_tokens=999)
    assert table.observe(newer, 0.0)
    assert not table.observe(older, 0.1)
    assert not table.observe(newer, 0.2)
    assert table.view("a", 0.2).num_queued_tokens == 10


def test_an_instance_restarted_under_its_id_is_taken_at_its_first_heartbeat():
    """Its sequence starts over, later: not a reordered heartbeat. Before, its reports were
    ignored until the old process's entry went stale (the last one said DRAINING)."""
    table = LoadTable("r1")
    last = msgspec.structs.replace(
        report("a"), seq=40, ts_ms=1_000_000, state=InstanceState.DRAINING
    )
    assert table.observe(last, 0.0)
    assert table.record_sent(InflightDelta("r1", "a", num_tokens=300), 0.48)  # not settled
    first = msgspec.structs.replace(report("a"), seq=1, ts_ms=1_004_000, num_queued_tokens=7)
    assert table.observe(first, 0.5)
    view = table.view("a", 0.5)
    assert view.state == InstanceState.SERVING
    assert view.num_reported_queued_tokens == 7
    assert view.num_inflight_tokens == 0  # sent to the process that is gone
    assert ids(table, 0.5) == ["a"]
    assert not table.observe(msgspec.structs.replace(last, seq=39, ts_ms=999_000), 0.6)


def test_a_restart_gives_another_incarnation_and_a_heartbeat_the_same():
    """What the router's watch on a job's prefill worker compares: a new process beating
    under the id within the timeout is not the one that held the job."""
    table = LoadTable("r1", heartbeat_timeout_s=3.0)
    assert table.incarnation("a", 0.0) is None
    table.observe(msgspec.structs.replace(report("a"), seq=5, ts_ms=1_000), 0.0)
    old = table.incarnation("a", 0.0)
    table.observe(msgspec.structs.replace(report("a"), seq=6, ts_ms=2_000), 1.0)
    assert table.incarnation("a", 1.0) is old
    table.observe(msgspec.structs.replace(report("a"), seq=1, ts_ms=3_000), 2.0)
    assert table.incarnation("a", 2.0) not in (None, old)
    assert table.incarnation("a", 5.5) is None  # stale


def test_inflight_from_two_routers_adds_up_and_settles_on_the_next_heartbeat():
    r1 = table_with(report("a", queued_tokens=100), router_id="r1")
    r2 = table_with(report("a", queued_tokens=100), router_id="r2")
    sent_by_r1 = InflightDelta("r1", "a", num_tokens=300)
    sent_by_r2 = InflightDelta("r2", "a", num_tokens=500, num_kv_pages=0, num_requests=2)
    assert r1.record_sent(sent_by_r1, 1.0)
    assert r2.record_sent(sent_by_r2, 1.0)
    # Each announces to every replica, itself included: the echo is not counted twice.
    for table in (r1, r2):
        for delta in (sent_by_r1, sent_by_r2):
            table.apply_peer(delta, 1.01)
    for table in (r1, r2):
        view = table.view("a", 1.01)
        assert view.num_queued_tokens == 100 + 300 + 500
        assert view.num_inflight_requests == 3
    # A heartbeat within the settle time may predate the jobs: they still count.
    heartbeat = report("a", queued_tokens=900)
    r1.observe(heartbeat, 1.03)
    assert r1.view("a", 1.03).num_queued_tokens == 900 + 800
    # One later than that shows them; in flight is then empty.
    r1.observe(report("a", queued_tokens=900), 1.2)
    assert r1.view("a", 1.2).num_queued_tokens == 900


def test_work_withdrawn_before_it_settles_no_longer_counts():
    table = table_with(report("a", queued_tokens=100), router_id="r1")
    refused = InflightDelta("r1", "a", num_tokens=1800)
    kept = InflightDelta("r1", "a", num_tokens=300)
    table.record_sent(refused, 1.0)
    table.record_sent(kept, 1.0)
    assert table.withdraw(refused)
    assert not table.withdraw(refused)  # once only
    assert table.view("a", 1.0).num_queued_tokens == 100 + 300
    assert table.view("a", 1.0).num_inflight_requests == 1
    # A peer's negated notice (how a withdrawal reaches the other replicas) cancels out.
    table.apply_peer(InflightDelta("r2", "a", num_tokens=50), 1.0)
    table.apply_peer(InflightDelta("r2", "a", num_tokens=-50, num_requests=-1), 1.0)
    assert table.view("a", 1.0).num_queued_tokens == 100 + 300
    table.observe(report("a", queued_tokens=0), 2.0)  # settled: nothing left to withdraw
    assert not table.withdraw(kept)


def test_inflight_to_an_unknown_instance_is_not_counted():
    table = LoadTable("r1")
    assert not table.record_sent(InflightDelta("r1", "ghost", num_tokens=5), 0.0)
    assert not table.apply_peer(InflightDelta("r2", "ghost", num_tokens=5), 0.0)


def test_decode_pages_in_flight_reduce_free_pages_but_never_below_zero():
    table = table_with(decoder("d", pages_free=10, running=3))
    table.record_sent(InflightDelta("r1", "d", num_kv_pages=25), 0.0)
    view = table.view("d", 0.0)
    assert (view.num_kv_pages_free, view.num_batch_seqs) == (0, 4)


@pytest.mark.parametrize(
    "kwargs",
    [{"prefill_tokens_per_s": 0.0}, {"load_tokens_per_s": -1.0}, {"replay_tokens": -1}],
)
def test_cost_model_rejects_bad_rates(kwargs):
    with pytest.raises(CostModelError):
        CostModel(**kwargs)


def test_table_rejects_bad_timeouts():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        LoadTable("r", heartbeat_timeout_s=0)
