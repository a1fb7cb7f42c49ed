"""Staging across tool calls (services/ingress/staging.py, worker/engine/host_tier.py): how
long a session is held, learned per tool from its own calls, and what the host tier keeps."""

from __future__ import annotations

import msgspec
import numpy as np

from services.ingress.diagnosis import TurnDigest, compare, digest
from services.ingress.staging import MAX_TOOL_NAMES, StagingPolicy, learned
from services.swa_memcache.cache import SnapshotCache
from shared.tokenizer.chat import Chat, Message
from worker.engine.host_tier import HostTier


def test_a_tool_is_held_for_its_learned_wait_with_a_margin_and_a_cap() -> None:
    policy = StagingPolicy(default_s=120, max_s=600)
    assert policy.hold_s({}, ["run_tests"]) == 120  # never seen: the default
    waits = learned({}, ["run_tests"], 200.0)
    assert waits == {"run_tests": 200.0} and policy.hold_s(waits, ["run_tests"]) == 300
    waits = learned(waits, ["run_tests"], 100.0)  # a running mean
    assert waits["run_tests"] == 150.0
    waits = learned(waits, ["read_file"], 1.0)
    assert policy.hold_s(waits, ["read_file", "run_tests"]) == 225  # the longest expected
    assert policy.hold_s(learned({}, ["build"], 3000.0), ["build"]) == 600  # capped
    many = learned({}, [f"tool{i}" for i in range(40)], 5.0)
    assert len(many) == MAX_TOOL_NAMES and "tool39" in many and "tool0" not in many


def test_the_next_turn_learns_how_long_the_last_ones_tools_took() -> None:
    chat = Chat((Message("system", "s"), Message("user", "u")))
    first = compare(None, digest(chat, "", 100))
    ended = msgspec_replace(first, tools_called=("run_tests",), ended_ms=first.ts_ms)
    later = msgspec_replace(digest(chat, "", 120), ts_ms=first.ts_ms + 42_000)
    assert compare(ended, later).tool_waits == {"run_tests": 42.0}
    assert compare(first, later).tool_waits == {}  # no tool call: nothing learned


def msgspec_replace(struct: TurnDigest, **changes: object) -> TurnDigest:
    return msgspec.structs.replace(struct, **changes)


class _Layout:
    block_nbytes = 16


class _Pool:
    layout = _Layout()

    def block_view(self, block_id: int) -> np.ndarray:
        return np.full(16, block_id, np.uint8)


def test_the_host_tier_keeps_staged_blocks_until_their_hold_ends_at_most_half_of_it() -> None:
    tier = HostTier(_Pool(), 16 * 8)  # 8 blocks
    tier.stage([1, 2, 3], hold_s=60)  # 1..3: staged before they are saved
    for block_hash in range(1, 20):
        tier.save(block_hash, block_hash)
    assert all(tier.holds(h) for h in (1, 2, 3))  # the oldest, yet kept
    assert tier.num_blocks == 8 and tier.holds(19) and not tier.holds(4)
    tier.stage(list(range(100, 110)), hold_s=60)  # more than half the tier: oldest give way
    assert tier.num_staged_blocks == 4 and not tier._staged.get(1)


def test_a_held_snapshot_outlives_its_ttl() -> None:
    cache = SnapshotCache(capacity_bytes=1 << 16, ttl_s=10)
    assert cache.put(7, b"window", now=0.0) and cache.put(8, b"other", now=0.0)
    assert cache.hold(7, until=100.0, now=5.0) and not cache.hold(9, until=100.0, now=5.0)
    assert cache.get(7, now=50.0) == b"window" and cache.get(8, now=50.0) is None
    assert cache.get(7, now=101.0) is None
