"""State staged across tool calls: an agent's turn that ends in a tool call comes back after
the tool ran, with everything it sent before as its prefix. While the tool runs, other
sessions' traffic pushes that prefix out of the serving worker's memory, and its window
snapshot ages out of swa-memcache (180 s); the next turn then reads the store and replays the
window. So, when a turn ends in a tool call, ingress asks the prefill worker that served it
(the one the router will most likely pick again: it holds the prefix in its own memory) to
keep the turn's blocks in its host tier, and the window at their end in its node's memcache,
for as long as the tool is expected to take (`StageRequest`; worker/engine/host_tier.py).

How long: learned per tool name, per session. The session's digest (diagnosis.py) keeps the
tools its last turn called and when that turn ended; the next turn's arrival gives how long
they took, folded into a running mean per name (the last 16 names). A tool held for 1.5x its
mean, capped by `max_s`; one never seen yet for `default_s`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_TOOL_NAMES = 16  # a session's learned tool waits, most recent names kept
MARGIN = 1.5  # hold a tool's learned wait this many times over
WEIGHT = 0.5  # of a new observation in the running mean


@dataclass(frozen=True)
class StagingPolicy:
    default_s: float = 120.0  # a tool the session has not called before
    max_s: float = 1800.0

    def hold_s(self, waits: Mapping[str, float], tools: Iterable[str]) -> float:
        """How long to keep a session staged after a turn calling `tools`."""
        expected = [waits[t] * MARGIN if t in waits else self.default_s for t in tools]
        return min(max(expected, default=self.default_s), self.max_s)


def learned(waits: Mapping[str, float], tools: Iterable[str], waited_s: float) -> dict[str, float]:
    """`waits` with the calls of `tools` having taken `waited_s` folded in (bounded)."""
    out = dict(waits)
    for tool in tools:
        before = out.pop(tool, None)
        out[tool] = waited_s if before is None else (1 - WEIGHT) * before + WEIGHT * waited_s
    while len(out) > MAX_TOOL_NAMES:
        del out[next(iter(out))]  # the name least recently called
    return out
