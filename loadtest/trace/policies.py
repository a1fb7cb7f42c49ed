"""The baselines the offline replay compares kvfabric's `RoutePolicy` ("ours") against:
placements of a request's prefill that ignore the cache.

The replay still asks `RoutePolicy.choose` for every request, so the decode worker and the
in-flight accounting are the router's whatever the policy; a baseline replaces only the
prefill worker. Baselines see the `LoadTable` views the router sees (heartbeats plus work in
flight), so least-loaded is exactly as well informed as ours.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from shared.load_table import WorkerView

OURS = "ours"  # RoutePolicy.choose on the router's facts
# What if the router knew each worker's own hit: RoutePolicy's estimate per worker, each with
# its own cache's hit (the writers of a match's blocks say where they lie).
OURS_PER_WORKER = "ours-per-worker-hit"


class Baseline(Protocol):
    name: str

    def pick(self, workers: Sequence[WorkerView]) -> str:
        """The prefill worker's id among `workers` (the serving ones, sorted by id)."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[WorkerView]) -> str:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker.instance_id


class Uniform:
    """A worker drawn uniformly at random (seeded: the same draws at every capacity)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def pick(self, workers: Sequence[WorkerView]) -> str:
        return self._rng.choice(workers).instance_id


class LeastLoaded:
    """The fewest queued prefill tokens (reported plus in flight); ties go round the workers
    in turn, so an idle cluster is not all sent to the first one."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._start = 0

    def pick(self, workers: Sequence[WorkerView]) -> str:
        n = len(workers)
        turn = [workers[(self._start + i) % n] for i in range(n)]
        self._start += 1
        return min(turn, key=lambda w: w.num_queued_tokens).instance_id


BASELINES: dict[str, type[RoundRobin] | type[Uniform] | type[LeastLoaded]] = {
    b.name: b for b in (RoundRobin, Uniform, LeastLoaded)
}
POLICY_NAMES = (OURS, *BASELINES, OURS_PER_WORKER)


def baseline(name: str, seed: int = 0) -> Baseline:
    """A fresh baseline by name (each replay starts its own turn and draws)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    return Uniform(seed) if name == Uniform.name else BASELINES[name]()
