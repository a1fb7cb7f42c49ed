"""What the cluster's heartbeats say of each instance: its latest `LoadReport` plus work in
flight. The router routes on it; ingress serves the models it lists (`models`), so both take
an instance as gone after the same silence (`heartbeat_timeout_s`, one setting of every
service) and ingress never accepts a model the router would refuse for want of workers.

Pure and synchronous; the caller passes `now_s` (a monotonic clock of its own) everywhere, so
heartbeat ages are measured on the router's clock, never against a worker's `ts_ms` (clocks of
two hosts can be off by more than a heartbeat).

In flight: a job the router just sent is not in the worker's heartbeat until the worker has
received it and published its next report (every `heartbeat_s`, 1 s by default). Without
counting it, a burst of requests within one heartbeat would all see the same idle worker and
pile onto it. Each job sent is recorded (`record_sent`) and announced to the other router
replicas (`InflightDelta`, applied with `apply_peer`), and counts until a heartbeat arrives
`inflight_settle_s` after it was sent: by then the worker holds the job and its report shows
it (queued or done). One NATS hop on one host is ~0.1 ms; the 50 ms default leaves room for
a worker whose event loop is busy in a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.schema.control import InstanceState, LoadReport

# An instance silent this long is gone (heartbeats come every second by default).
HEARTBEAT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class InflightDelta:
    """Work one router replica sent to one instance. It travels to the other replicas as an
    `InflightNotice` (shared/schema/control.py), negated when the work is withdrawn."""

    router_id: str
    instance_id: str
    num_tokens: int = 0  # prefill: tokens the job adds to the worker's compute queue
    num_kv_pages: int = 0  # decode: KV pages the job will hold
    num_requests: int = 1
    queue_level: int = 0  # prefill: the job's (a fair worker serves lower levels first)


@dataclass(frozen=True)
class WorkerView:
    """One instance as the policy sees it: reported load plus what is in flight to it."""

    instance_id: str
    service: str
    node_id: str
    state: InstanceState
    num_reported_queued_tokens: int
    num_running: int
    num_kv_pages_total: int
    num_kv_pages_free_reported: int
    model: str = ""
    num_inflight_tokens: int = 0
    num_inflight_kv_pages: int = 0
    num_inflight_requests: int = 0
    # A fair prefill worker's queue by level (index 0 is served first), reported and in
    # flight; both empty for a first-come-first-served worker.
    reported_tokens_by_level: tuple[int, ...] = ()
    inflight_tokens_by_level: tuple[int, ...] = ()

    @property
    def num_queued_tokens(self) -> int:
        # Withdrawn work reaches peers as negative notices, which may outlive what they undo.
        return max(self.num_reported_queued_tokens + self.num_inflight_tokens, 0)

    def num_queued_tokens_at_or_below(self, level: int) -> int:
        """A fair worker's queued tokens of levels 0..`level`, reported and in flight."""
        ahead = sum(self.reported_tokens_by_level[: level + 1])
        return max(ahead + sum(self.inflight_tokens_by_level[: level + 1]), 0)

    @property
    def num_kv_pages_free(self) -> int:
        return max(self.num_kv_pages_free_reported - self.num_inflight_kv_pages, 0)

    @property
    def num_batch_seqs(self) -> int:
        """Sequences a decode worker will be stepping once what is in flight lands."""
        return self.num_running + self.num_inflight_requests


@dataclass
class _Instance:
    report: LoadReport
    received_s: float
    # (sent_s, delta) of work not yet reflected in a heartbeat, oldest first.
    inflight: list[tuple[float, InflightDelta]] = field(default_factory=list)
    # Its view, built once per change (a router over ~1,200 workers asks for every view on
    # each request; most did not change since the last).
    view: WorkerView | None = None


class LoadTable:
    def __init__(
        self,
        router_id: str,
        *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        inflight_settle_s: float = 0.05,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        if inflight_settle_s < 0:
            raise ValueError(f"inflight_settle_s must be >= 0, got {inflight_settle_s}")
        self.router_id = router_id
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.inflight_settle_s = inflight_settle_s
        self._instances: dict[str, _Instance] = {}
        # (service, model) -> its instances' ids, sorted; cleared when the set changes.
        self._ids: dict[tuple[str, str | None], list[str]] = {}

    def __len__(self) -> int:
        return len(self._instances)

    def observe(self, report: LoadReport, now_s: float) -> bool:
        """Take a heartbeat; False if it is older than one already seen (reordered, repeated).

        Order is the send time (`ts_ms`, the node's clock), then `seq`. `seq` counts per
        process: a lower one sent later is the instance restarted under its id, taken at once
        as a new start (the work counted in flight to the old process went with it), and a
        straggler of the old process after it is older."""
        known = self._instances.get(report.instance_id)
        if known is None:
            self._instances[report.instance_id] = _Instance(report, now_s)
            self._ids.clear()
            return True
        last = known.report
        if (report.ts_ms, report.seq) <= (last.ts_ms, last.seq):
            return False
        if report.seq < last.seq:
            self._instances[report.instance_id] = _Instance(report, now_s)
            self._ids.clear()
            return True
        if (report.service, report.model) != (last.service, last.model):
            self._ids.clear()
        known.report = report
        known.received_s = now_s
        settled_before_s = now_s - self.inflight_settle_s
        known.inflight = [(t, d) for t, d in known.inflight if t > settled_before_s]
        known.view = None
        return True

    def record_sent(self, delta: InflightDelta, now_s: float) -> bool:
        """Count work this router sent; False if the instance is unknown (nothing counted)."""
        return self._add(delta, now_s)

    def apply_peer(self, delta: InflightDelta, now_s: float) -> bool:
        """Count work another router replica announced; our own announcements echo back and
        are ignored (they were counted when sent)."""
        if delta.router_id == self.router_id:
            return False
        return self._add(delta, now_s)

    def _add(self, delta: InflightDelta, now_s: float) -> bool:
        known = self._instances.get(delta.instance_id)
        if known is None:
            return False
        known.inflight.append((now_s, delta))
        known.view = None
        return True

    def withdraw(self, delta: InflightDelta) -> bool:
        """Undo `record_sent(delta)` (the very same object); False if it already settled."""
        known = self._instances.get(delta.instance_id)
        if known is None:
            return False
        for i, (_, recorded) in enumerate(known.inflight):
            if recorded is delta:
                del known.inflight[i]
                known.view = None
                return True
        return False

    def remove(self, instance_id: str) -> bool:
        """Forget an instance known to be gone (its job failed with no responders)."""
        self._ids.clear()
        return self._instances.pop(instance_id, None) is not None

    def prune(self, now_s: float) -> list[str]:
        """Drop the instances whose heartbeats stopped; returns their ids, sorted."""
        dead = sorted(i for i, known in self._instances.items() if self._is_stale(known, now_s))
        for instance_id in dead:
            del self._instances[instance_id]
        if dead:
            self._ids.clear()
        return dead

    def _is_stale(self, known: _Instance, now_s: float) -> bool:
        return now_s - known.received_s > self.heartbeat_timeout_s

    def view(self, instance_id: str, now_s: float) -> WorkerView | None:
        """The instance if its heartbeat is fresh (whatever its state), else None."""
        known = self._instances.get(instance_id)
        if known is None or self._is_stale(known, now_s):
            return None
        return self._view_of(known)

    def incarnation(self, instance_id: str, now_s: float) -> object | None:
        """A token of the process heartbeating under `instance_id` now (a process restarted
        under the id gives another), None if its heartbeat is stale or unknown."""
        known = self._instances.get(instance_id)
        if known is None or self._is_stale(known, now_s):
            return None
        return known

    @staticmethod
    def _view_of(known: _Instance) -> WorkerView:
        if known.view is not None:
            return known.view
        report = known.report
        deltas = [d for _, d in known.inflight]
        known.view = WorkerView(
            instance_id=report.instance_id,
            service=report.service,
            node_id=report.node_id,
            state=report.state,
            num_reported_queued_tokens=report.num_queued_tokens,
            num_running=report.num_running,
            num_kv_pages_total=report.num_kv_pages_total,
            num_kv_pages_free_reported=report.num_kv_pages_free,
            model=report.model,
            num_inflight_tokens=sum(d.num_tokens for d in deltas),
            num_inflight_kv_pages=sum(d.num_kv_pages for d in deltas),
            num_inflight_requests=sum(d.num_requests for d in deltas),
            reported_tokens_by_level=report.num_queued_tokens_by_level,
            inflight_tokens_by_level=_by_level(deltas) if report.num_queued_tokens_by_level else (),
        )
        return known.view

    def workers(self, service: str, now_s: float, model: str | None = None) -> list[WorkerView]:
        """Instances of `service` that take new work: fresh heartbeat and SERVING (draining
        and starting ones get none), serving `model` when given, sorted by instance id."""
        # Filtered before views are built: the table also holds every swa-memcache (~150 at
        # the reference deployment), and building all their views on each call was most of
        # the router's CPU per request (measured: 3.2 of 4.1 ms, loadtest/bench_router.py).
        return [self._view_of(known) for known in self._serving(service, now_s, model)]

    def has_workers(self, service: str, now_s: float, model: str | None = None) -> bool:
        """Whether `workers(service, now_s, model)` is non-empty, without building it."""
        return next(self._serving(service, now_s, model), None) is not None

    def _serving(self, service: str, now_s: float, model: str | None) -> Iterator[_Instance]:
        """Instances of `service` (serving `model`) with a fresh heartbeat, SERVING, by id."""
        for instance_id in self._ids_of(service, model):
            known = self._instances[instance_id]
            if known.report.state == InstanceState.SERVING and not self._is_stale(known, now_s):
                yield known

    def _ids_of(self, service: str, model: str | None) -> list[str]:
        ids = self._ids.get((service, model))
        if ids is None:
            ids = self._ids[service, model] = sorted(
                i
                for i, k in self._instances.items()
                if k.report.service == service and (model is None or k.report.model == model)
            )
        return ids

    def models(self, service: str, now_s: float) -> list[str]:
        """The models instances of `service` taking new work serve, sorted."""
        return sorted({w.model for w in self.workers(service, now_s)})


def _by_level(deltas: list[InflightDelta]) -> tuple[int, ...]:
    """The tokens of `deltas` summed per queue level, index = level."""
    if not deltas:
        return ()
    levels = [0] * (max(d.queue_level for d in deltas) + 1)
    for delta in deltas:
        levels[delta.queue_level] += delta.num_tokens
    return tuple(levels)
