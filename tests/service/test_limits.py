"""Rate limits and quotas held across ingress replicas (services/ingress/limits.py): real
`Limiter`s on separate connections to a real nats-server, each standing for one replica,
with a window of a couple of seconds instead of a minute."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.ingress.errors import ApiError
from services.ingress.limits import Limiter, Scope, Window
from shared.accounts import Limits
from shared.testing.fixtures import BusFactory

pytestmark = pytest.mark.nats

WINDOW_S = 2.0


async def replica(bus_factory: BusFactory, name: str, **kwargs: float) -> Limiter:
    limiter = Limiter(await bus_factory("ingress", name), window_s=WINDOW_S, **kwargs)
    await limiter.start()
    return limiter


async def until(condition, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


async def admit(limiter: Limiter, scope: Scope, prompt: int = 10, output: int = 10):  # noqa: ANN201
    return await limiter.admit(
        [scope], num_prompt_tokens=prompt, max_output_tokens=output, protocol="openai"
    )


def test_a_window_slides_and_says_when_room_comes() -> None:
    window = Window(10.0)
    window.add(100.0, 3)
    window.add(104.0, 5)
    window.add(102.0, 1)  # a peer's, late: kept in order
    assert window.used(105.0) == 9
    assert window.wait_s(105.0, need=4, limit=10) == pytest.approx(5.0)  # once 100.0 leaves
    assert window.wait_s(105.0, need=5, limit=10) == pytest.approx(7.0)  # and 102.0
    assert window.wait_s(105.0, need=7, limit=10) == pytest.approx(9.0)  # and 104.0
    assert window.used(110.5) == 6
    assert window.used(114.5) == 0


async def test_two_replicas_under_three_times_the_limit_admit_the_limit(
    bus_factory: BusFactory,
) -> None:
    """Both replicas offer 3x the limit over one window: together they admit the limit
    within 5%, and refuse the rest with 429 and a Retry-After inside the window."""
    limit = 60
    a, b = await replica(bus_factory, "ingress-0"), await replica(bus_factory, "ingress-1")
    scope = Scope("account.acme", Limits(requests_per_minute=limit))
    admitted, refused = 0, []
    started = time.monotonic()
    interval_s = WINDOW_S / (3 * limit)
    turn = 0
    while time.monotonic() - started < WINDOW_S * 0.95:
        try:
            await admit((a, b)[turn % 2], scope)
            admitted += 1
        except ApiError as exc:
            refused.append(exc)
        turn += 1
        await asyncio.sleep(interval_s)
    print(f"admitted {admitted} of {turn} offered (limit {limit}) in one window by two replicas")
    assert abs(admitted - limit) <= 0.05 * limit, admitted
    assert refused and all(e.kind == "rate_limit" for e in refused)
    headers = refused[-1].headers()
    assert 1 <= int(headers["retry-after"]) <= WINDOW_S + 1
    assert headers["x-ratelimit-limit-requests"] == str(limit)
    assert headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_replica_that_starts_late_replays_the_window(bus_factory: BusFactory) -> None:
    scope = Scope("key.key_0123456789ab", Limits(requests_per_minute=5))
    a = await replica(bus_factory, "ingress-0")
    for _ in range(5):
        await admit(a, scope)
    await until(lambda: not a._outgoing)  # published
    late = await replica(bus_factory, "ingress-1")
    await until(lambda: late.used(scope.id, "requests") == 5)
    with pytest.raises(ApiError) as refused:
        await admit(late, scope)
    assert refused.value.kind == "rate_limit"


async def test_concurrency_is_shared_and_a_dead_replicas_slots_come_back(
    bus_factory: BusFactory,
) -> None:
    scope = Scope("account.acme", Limits(concurrent_requests=2))
    a = await replica(bus_factory, "ingress-0", open_ttl_s=1.0)
    b = await replica(bus_factory, "ingress-1", open_ttl_s=1.0)
    held = [await admit(a, scope), await admit(a, scope)]
    await until(lambda: b.num_open(scope.id, time.time()) == 2)
    with pytest.raises(ApiError, match="2 concurrent requests"):
        await admit(b, scope)
    await a.end(held[0], 5)
    await until(lambda: b.num_open(scope.id, time.time()) == 1)
    third = await admit(b, scope)
    # ingress-0 dies holding a slot: its reports stop, and within open_ttl_s it is forgotten.
    assert a._flusher is not None
    a._flusher.cancel()
    died_at = time.monotonic()
    await until(lambda: b.num_open(scope.id, time.time()) == 1, timeout_s=5)
    print(f"a dead replica's slot released after {time.monotonic() - died_at:.2f} s")
    await b.end(third, 5)


async def test_output_is_reserved_then_settled_to_what_was_produced(
    bus_factory: BusFactory,
) -> None:
    scope = Scope("account.acme", Limits(output_tokens_per_minute=100))
    a = await replica(bus_factory, "ingress-0")
    held = await admit(a, scope, output=80)
    with pytest.raises(ApiError, match="100 output tokens per minute"):
        await admit(a, scope, output=30)
    await a.end(held, 12)
    assert a.used(scope.id, "output_tokens") == 12
    await admit(a, scope, output=80)


async def test_a_quota_counts_input_and_output_and_refuses_until_the_period_ends(
    bus_factory: BusFactory,
) -> None:
    scope = Scope("account.acme", Limits(tokens_per_period=50, period="day"))
    a = await replica(bus_factory, "ingress-0", quota_cache_s=0.0)
    b = await replica(bus_factory, "ingress-1", quota_cache_s=0.0)
    await a.end(await admit(a, scope, prompt=30, output=40), 25)  # 55 of 50
    with pytest.raises(ApiError) as refused:
        await admit(b, scope)  # the other replica reads the same counter
    assert "50 tokens per day" in refused.value.message
    assert 0 < refused.value.retry_after_s <= 86400


async def test_what_no_window_could_admit_is_a_400_not_a_429(bus_factory: BusFactory) -> None:
    a = await replica(bus_factory, "ingress-0")
    scope = Scope("key.key_0123456789ab", Limits(input_tokens_per_minute=100, max_prompt_tokens=50))
    with pytest.raises(ApiError) as too_long:
        await admit(a, scope, prompt=60)
    assert too_long.value.kind == "invalid_request" and "at most 50" in too_long.value.message
    wide = Scope("key.key_0123456789ab", Limits(input_tokens_per_minute=100))
    with pytest.raises(ApiError) as never:
        await admit(a, wide, prompt=101)
    assert never.value.kind == "invalid_request" and "never be admitted" in never.value.message


async def test_anthropic_headers_name_each_dimension(bus_factory: BusFactory) -> None:
    a = await replica(bus_factory, "ingress-0")
    scope = Scope(
        "account.acme",
        Limits(requests_per_minute=10, input_tokens_per_minute=1000, output_tokens_per_minute=500),
    )
    admission = await a.admit(
        [scope], num_prompt_tokens=100, max_output_tokens=50, protocol="anthropic"
    )
    h = admission.headers
    assert h["anthropic-ratelimit-requests-remaining"] == "9"
    assert h["anthropic-ratelimit-input-tokens-remaining"] == "900"
    assert h["anthropic-ratelimit-output-tokens-remaining"] == "450"
    assert h["anthropic-ratelimit-requests-reset"].endswith("Z")
