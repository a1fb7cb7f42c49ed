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

from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
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


# A sort key of a view (ending with its instance id, so keys are unique), or None to leave
# the view out of that ordering.
OrderKey = Callable[[WorkerView], "tuple | None"]


class _Ordering:
    """A group's members in `key` order, re-sorted one member at a time as its view changes
    (a router asks for the best of ~1,200 workers on each request; sorting them then, or
    taking a minimum over all, was most of a decision)."""

    def __init__(self, key: OrderKey) -> None:
        self.key = key
        self.entries: list[tuple[tuple, str]] = []  # (key, instance id), ascending
        self.keys: dict[str, tuple] = {}

    def discard(self, instance_id: str) -> None:
        old = self.keys.pop(instance_id, None)
        if old is not None:
            del self.entries[bisect_left(self.entries, (old, instance_id))]

    def put(self, instance_id: str, view: WorkerView) -> None:
        new = self.key(view)
        if new == self.keys.get(instance_id):
            return  # most heartbeats change nothing the order depends on
        self.discard(instance_id)
        if new is not None:
            self.keys[instance_id] = new
            insort(self.entries, (new, instance_id))


@dataclass
class _Group:
    """The SERVING instances of one (service, model) (model None: of every model), stale or
    not (a heartbeat's age is the caller's clock, checked when asked), and orderings of them;
    kept up to date by every change once a caller asked for it."""

    members: dict[str, _Instance] = field(default_factory=dict)
    orderings: dict[OrderKey, _Ordering] = field(default_factory=dict)

    def drop(self, instance_id: str) -> None:
        self.members.pop(instance_id, None)
        for ordering in self.orderings.values():
            ordering.discard(instance_id)


@dataclass
class _Instance:
    report: LoadReport
    received_s: float
    # (sent_s, delta) of work not yet reflected in a heartbeat, oldest first.
    inflight: list[tuple[float, InflightDelta]] = field(default_factory=list)
    # Its view, built once per change (the orderings and each request read it; most
    # instances did not change since the last request).
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
        # Maintained on each change rather than rebuilt per request (O(1) or O(log n) each):
        # the groups callers asked for, each instance's node, each service's models.
        self._groups: dict[tuple[str, str | None], _Group] = {}
        self._by_node: dict[str, set[str]] = {}
        self._models: dict[str, dict[str, int]] = {}  # service -> model -> instances

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
            self._reindex(report.instance_id, None)
            return True
        last = known.report
        if (report.ts_ms, report.seq) <= (last.ts_ms, last.seq):
            return False
        if report.seq < last.seq:
            self._instances[report.instance_id] = _Instance(report, now_s)
            self._ids.clear()
            self._reindex(report.instance_id, last)
            return True
        moved = (report.service, report.model) != (last.service, last.model)
        if moved:
            self._ids.clear()
        known.report = report
        known.received_s = now_s
        settled_before_s = now_s - self.inflight_settle_s
        if known.inflight:
            known.inflight = [(t, d) for t, d in known.inflight if t > settled_before_s]
        known.view = None
        if (report.node_id, report.state) == (last.node_id, last.state) and not moved:
            self._reorder(known)  # most heartbeats: only its load changed
        else:
            self._reindex(report.instance_id, last)
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
        self._reorder(known)
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
                self._reorder(known)
                return True
        return False

    def remove(self, instance_id: str) -> bool:
        """Forget an instance known to be gone (its job failed with no responders)."""
        self._ids.clear()
        known = self._instances.pop(instance_id, None)
        if known is None:
            return False
        self._reindex(instance_id, known.report)
        return True

    def prune(self, now_s: float) -> list[str]:
        """Drop the instances whose heartbeats stopped; returns their ids, sorted."""
        dead = sorted(i for i, known in self._instances.items() if self._is_stale(known, now_s))
        for instance_id in dead:
            last = self._instances.pop(instance_id).report
            self._reindex(instance_id, last)
        if dead:
            self._ids.clear()
        return dead

    def _reindex(self, instance_id: str, last: LoadReport | None) -> None:
        """Bring the maintained indexes up to date after a change to `instance_id`, whose
        report was `last` before it (None: it was unknown)."""
        known = self._instances.get(instance_id)
        report = known.report if known is not None else None
        if last is not None and (report is None or last.node_id != report.node_id):
            on_node = self._by_node[last.node_id]
            on_node.discard(instance_id)
            if not on_node:
                del self._by_node[last.node_id]
        if report is not None and (last is None or last.node_id != report.node_id):
            self._by_node.setdefault(report.node_id, set()).add(instance_id)
        moved = (
            last is None
            or report is None
            or (last.service, last.model) != (report.service, report.model)
        )
        if moved and last is not None:
            models = self._models[last.service]
            models[last.model] -= 1
            if not models[last.model]:
                del models[last.model]
            for group in self._groups_of(last):
                group.drop(instance_id)
        if report is None:
            return
        if moved:
            models = self._models.setdefault(report.service, {})
            models[report.model] = models.get(report.model, 0) + 1
        serving = report.state == InstanceState.SERVING
        for group in self._groups_of(report):
            if not serving:
                group.drop(instance_id)
                continue
            assert known is not None
            group.members[instance_id] = known
            if group.orderings:
                view = self._view_of(known)
                for ordering in group.orderings.values():
                    ordering.put(instance_id, view)

    def _reorder(self, known: _Instance) -> None:
        """Re-sort an instance whose load changed (nothing else) in the orderings kept."""
        report = known.report
        if report.state != InstanceState.SERVING:
            return
        for group in self._groups_of(report):
            if group.orderings:
                view = self._view_of(known)
                for ordering in group.orderings.values():
                    ordering.put(report.instance_id, view)

    def _groups_of(self, report: LoadReport) -> Iterator[_Group]:
        for key in ((report.service, report.model), (report.service, None)):
            group = self._groups.get(key)
            if group is not None:
                yield group

    def _group(self, service: str, model: str | None) -> _Group:
        group = self._groups.get((service, model))
        if group is None:
            group = _Group()
            if model is not None and model not in self._models.get(service, {}):
                return group  # none serves it: not kept (a caller may name any model)
            self._groups[service, model] = group
            for instance_id, known in self._instances.items():
                report = known.report
                if (
                    report.service == service
                    and (model is None or report.model == model)
                    and report.state == InstanceState.SERVING
                ):
                    group.members[instance_id] = known
        return group

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
        models = self._models.get(service, {})
        return sorted(m for m in models if self.has_workers(service, now_s, m))

    # -- what a router asks on each request, without building every view ----------------------
    def serving_view(
        self, instance_id: str, service: str, now_s: float, model: str | None = None
    ) -> WorkerView | None:
        """The instance's view if `workers(service, now_s, model)` lists it, else None."""
        known = self._group(service, model).members.get(instance_id)
        if known is None or self._is_stale(known, now_s):
            return None
        return self._view_of(known)

    def serving_among(
        self, instance_ids: Iterable[str], service: str, now_s: float, model: str | None = None
    ) -> list[WorkerView]:
        """Of `instance_ids`, those `workers(service, now_s, model)` lists (in the order
        given, each once per time given)."""
        members = self._group(service, model).members
        timeout_s, views = self.heartbeat_timeout_s, []
        for instance_id in instance_ids:
            known = members.get(instance_id)
            # Not stale, as `_is_stale` says it (the same float expression).
            if known is not None and not now_s - known.received_s > timeout_s:
                views.append(known.view or self._view_of(known))
        return views

    def serving_on_nodes(
        self, node_ids: Collection[str], service: str, now_s: float, model: str | None = None
    ) -> list[WorkerView]:
        """Those `workers(service, now_s, model)` lists on the nodes `node_ids`, by id."""
        on_nodes = sorted(i for n in node_ids for i in self._by_node.get(n, ()))
        return self.serving_among(on_nodes, service, now_s, model)

    def ordered(
        self, service: str, now_s: float, model: str | None, key: OrderKey
    ) -> Iterator[WorkerView]:
        """Those `workers(service, now_s, model)` lists for which `key` is not None, in
        `key` order. The ordering is kept from the first call on (pass the same function
        each time), so taking the first few costs O(log n) per change, not O(n) per call."""
        ordering = self._ordering(service, model, key)
        instances, timeout_s = self._instances, self.heartbeat_timeout_s
        for _, instance_id in ordering.entries:
            known = instances[instance_id]
            if not now_s - known.received_s > timeout_s:
                yield known.view or self._view_of(known)

    def firsts(
        self,
        service: str,
        now_s: float,
        model: str | None,
        key: OrderKey,
        labels: Mapping[str, Hashable],
        skip: Collection[str] = (),
    ) -> dict[Hashable, WorkerView]:
        """Per label, the first in `ordered(service, now_s, model, key)` of the instances
        `labels` names (those in `skip` aside): one dict lookup per instance named, where
        the views of hundreds would cost several times as much."""
        keys = self._ordering(service, model, key).keys
        instances, timeout_s = self._instances, self.heartbeat_timeout_s
        best: dict[Hashable, tuple[tuple, str]] = {}
        for instance_id, label in labels.items():
            order = keys.get(instance_id)
            if order is None or instance_id in skip:
                continue
            first = best.get(label)
            if first is not None and not order < first[0]:
                continue
            if not now_s - instances[instance_id].received_s > timeout_s:  # `_is_stale`'s
                best[label] = (order, instance_id)
        return {
            label: self._view_of(instances[instance_id]) for label, (_, instance_id) in best.items()
        }

    def _ordering(self, service: str, model: str | None, key: OrderKey) -> _Ordering:
        group = self._group(service, model)
        ordering = group.orderings.get(key)
        if ordering is None:
            ordering = group.orderings[key] = _Ordering(key)
            for instance_id, known in group.members.items():
                ordering.put(instance_id, self._view_of(known))
        return ordering


def _by_level(deltas: list[InflightDelta]) -> tuple[int, ...]:
    """The tokens of `deltas` summed per queue level, index = level."""
    if not deltas:
        return ()
    levels = [0] * (max(d.queue_level for d in deltas) + 1)
    for delta in deltas:
        levels[delta.queue_level] += delta.num_tokens
    return tuple(levels)
