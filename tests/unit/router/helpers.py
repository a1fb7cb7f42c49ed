"""Builders shared by the router tests: heartbeats, tables, requests."""

from __future__ import annotations

from services.router.policy import RequestFacts
from shared.load_table import LoadTable
from shared.schema.control import InstanceState, LoadReport
from shared.subjects import DECODE, PREFILL

_seqs: dict[str, int] = {}


def report(
    instance_id: str,
    *,
    service: str = PREFILL,
    node_id: str = "",
    queued_tokens: int = 0,
    running: int = 0,
    pages_free: int = 1000,
    pages_total: int = 1000,
    state: InstanceState = InstanceState.SERVING,
) -> LoadReport:
    seq = _seqs[instance_id] = _seqs.get(instance_id, 0) + 1
    return LoadReport(
        service=service,
        instance_id=instance_id,
        seq=seq,
        ts_ms=0,
        state=state,
        node_id=node_id or f"node-{instance_id}",
        num_queued_tokens=queued_tokens,
        num_running=running,
        num_kv_pages_free=pages_free,
        num_kv_pages_total=pages_total,
    )


def table_with(*reports: LoadReport, now_s: float = 0.0, router_id: str = "r1") -> LoadTable:
    table = LoadTable(router_id, heartbeat_timeout_s=3.0, inflight_settle_s=0.05)
    for r in reports:
        table.observe(r, now_s)
    return table


def decoder(instance_id: str = "d1", **kwargs: object) -> LoadReport:
    return report(instance_id, service=DECODE, **kwargs)  # type: ignore[arg-type]


def facts(
    num_prompt_tokens: int = 10_000, num_cached_tokens: int = 0, max_tokens: int = 256
) -> RequestFacts:
    return RequestFacts("req-1", num_prompt_tokens, num_cached_tokens, max_tokens)
