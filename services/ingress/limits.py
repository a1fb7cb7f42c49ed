"""Rate limits and quotas per API key and per account, held across every ingress replica
(shared/accounts.py `Limits`; `kvfabric keys limit`, `kvfabric accounts set`).

A request is admitted after tokenization and before anything is sent to the cluster, in
every scope that limits it (its key's and its account's), or refused with 429 in its
protocol's shape, `Retry-After` and the rate-limit headers the SDKs read:

- requests, input tokens and output tokens per minute: sums over a sliding 60 s window.
  Output is reserved at admission (`max_tokens`) and settled to what was produced when the
  request ends. Each replica applies its own admissions at once and publishes them at once
  (what comes while a publish is on its way goes in the next batch) on
  `Subjects.limits_use`; a JetStream stream keeps them for one window, so a replica that
  starts (or restarts) replays the window it joins. What two replicas admit in the moment
  before hearing of each other (a publish and a delivery: milliseconds) is the limit's only
  overshoot.
- concurrent requests: each replica's own open count plus what its peers report (on every
  change, and each second); a peer silent for `open_ttl_s` is forgotten, which is how a dead
  replica's slots are released.
- a token quota per UTC day or month (input, output, and what a pin keeps: the tokens it
  wrote times the hours it keeps them, rounded up): a counter per scope and period in a JetStream
  key-value bucket, added to (compare-and-set) when a request ends; read through a 1 s cache,
  so requests in flight may overshoot it by what they use.
- the largest body and prompt a key or account may send: 413 and 400, never retryable.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.ingress.errors import ApiError
from shared.accounts import Limits
from shared.bus import Bus
from shared.logging import get_logger
from shared.schema import LimitUse, OpenStreams

log = get_logger(__name__)

WINDOW_S = 60.0
REQUESTS, INPUT, OUTPUT = "requests", "input_tokens", "output_tokens"
_PER_MINUTE = {
    REQUESTS: "requests_per_minute",
    INPUT: "input_tokens_per_minute",
    OUTPUT: "output_tokens_per_minute",
}


@dataclass(frozen=True)
class Scope:
    """One set of limits a request counts against: "key.<key id>" or "account.<name>"."""

    id: str
    limits: Limits


class Window:
    """The sum of amounts over the last `window_s` seconds (event times are unix seconds)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, at_s: float, amount: float) -> None:
        if self._events and at_s < self._events[-1][0]:  # a peer's, a moment late: in order
            events = sorted([*self._events, (at_s, amount)])
            self._events = deque(events)
        else:
            self._events.append((at_s, amount))
        self._total += amount

    def used(self, now_s: float) -> float:
        horizon = now_s - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._total -= self._events.popleft()[1]
        return max(self._total, 0.0)

    def wait_s(self, now_s: float, need: float, limit: float) -> float:
        """Seconds until `need` more fits under `limit` as the window slides."""
        excess = self.used(now_s) + need - limit
        for at_s, amount in self._events:
            excess -= amount
            if excess <= 0:
                return max(at_s + self.window_s - now_s, 0.0)
        return self.window_s


@dataclass
class Admission:
    """What one admitted request holds, given back or settled when it ends."""

    scopes: list[Scope]
    num_prompt_tokens: int
    reserved_output: int
    headers: dict[str, str]
    ended: bool = False


@dataclass
class _Peer:
    open: dict[str, int] = field(default_factory=dict)
    seen_s: float = 0.0


class Limiter:
    def __init__(
        self,
        bus: Bus,
        *,
        window_s: float = WINDOW_S,
        retry_s: float = 0.25,
        open_ttl_s: float = 3.0,
        quota_cache_s: float = 1.0,
    ) -> None:
        self.bus = bus
        self.replica = bus.instance_id
        self.window_s = window_s
        self.retry_s = retry_s  # between tries while NATS is away
        self.open_ttl_s = open_ttl_s
        self.quota_cache_s = quota_cache_s
        self._windows: dict[tuple[str, str], Window] = {}
        self._open: dict[str, int] = {}
        self._peers: dict[str, _Peer] = {}
        self._outgoing: list[tuple[str, str, float, float]] = []
        self._open_changed = False
        self._quota: dict[str, tuple[float, int]] = {}  # quota key -> (read at, tokens used)
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        subjects = self.bus.subjects
        await self.bus.js.ensure_stream(
            subjects.limits_stream,
            [subjects.limits_use],
            max_age_s=self.window_s,
            duplicate_window_s=min(self.window_s, 120.0),  # JetStream: at most max_age
        )
        await self.bus.js.ensure_kv(subjects.quota_bucket, ttl_s=32 * 86400.0)
        await self.bus.js.consume(
            subjects.limits_stream, subjects.limits_use, LimitUse, self._on_use
        )
        await self.bus.subscribe(subjects.limits_open, OpenStreams, self._on_open)
        self._flusher = asyncio.create_task(self._flush_forever())

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        with contextlib.suppress(Exception):
            await self._flush()

    # -- admission -----------------------------------------------------------------------
    async def admit(
        self,
        scopes: list[Scope],
        *,
        num_prompt_tokens: int,
        max_output_tokens: int,
        protocol: str,
    ) -> Admission:
        """Admit the request in every scope, or raise ApiError (429 with Retry-After; 400
        for a prompt that no window could ever admit)."""
        now = time.time()
        needs = {REQUESTS: 1, INPUT: num_prompt_tokens, OUTPUT: max_output_tokens}
        limited = [s for s in scopes if s.limits != Limits()]
        # Every read that waits first: from here to the last use recorded nothing yields,
        # so two requests of this replica cannot both take the last unit.
        quota_used = {
            s.id: await self._quota_used(s, now) for s in limited if s.limits.tokens_per_period
        }
        for scope in limited:
            refusal = self._refusal(scope, needs, quota_used.get(scope.id, 0), now)
            if refusal is not None:
                what, wait_s = refusal
                raise self._refused(scope, what, wait_s, protocol, limited, now)
        for scope in limited:
            for dimension, need in needs.items():
                if getattr(scope.limits, _PER_MINUTE[dimension]) is not None:
                    self._use(scope.id, dimension, need, now)
            if scope.limits.concurrent_requests is not None:
                self._open[scope.id] = self._open.get(scope.id, 0) + 1
                self._open_changed = True
                self._wake.set()
        headers = rate_headers(self, limited, protocol, now)
        return Admission(limited, num_prompt_tokens, max_output_tokens, headers)

    def _refusal(
        self, scope: Scope, needs: dict[str, int], quota_used: int, now: float
    ) -> tuple[str, float] | None:
        """What of `scope`'s limits the request would break now and how long until it
        would not; None if none. A request no window could admit is a 400 at once."""
        limits = scope.limits
        num_prompt_tokens = needs[INPUT]
        if limits.max_prompt_tokens and num_prompt_tokens > limits.max_prompt_tokens:
            raise ApiError(
                "invalid_request",
                f"the prompt has {num_prompt_tokens} tokens; this {_noun(scope)} may send "
                f"at most {limits.max_prompt_tokens}",
                param="messages",
            )
        for dimension, need in needs.items():
            limit = getattr(limits, _PER_MINUTE[dimension])
            if limit is None:
                continue
            what = f"{limit} {dimension.replace('_', ' ')} per minute"
            if need > limit:
                raise ApiError(
                    "invalid_request",
                    f"the request needs {need} {dimension.replace('_', ' ')}; this "
                    f"{_noun(scope)} may use {what}, so it can never be admitted (ask for "
                    "fewer)",
                )
            window = self._window(scope.id, dimension)
            if window.used(now) + need > limit:
                return what, window.wait_s(now, need, limit)
        concurrent = limits.concurrent_requests
        if concurrent is not None and self.num_open(scope.id, now) + 1 > concurrent:
            return f"{concurrent} concurrent requests", 1.0
        quota = limits.tokens_per_period
        if quota is not None and quota_used >= quota:
            return f"{quota} tokens per {limits.period}", _period_end(limits.period, now) - now
        return None

    async def end(
        self, admission: Admission, num_output_tokens: int | None, num_pinned_tokens: int = 0
    ) -> None:
        """The request ended: its open slot back, its output reservation settled to what it
        produced (None: unknown, the reservation stands), its tokens on the quota, with what
        its pin keeps (`num_pinned_tokens`: the tokens it wrote times the hours it keeps
        them, rounded up)."""
        if admission.ended:
            return
        admission.ended = True
        now = time.time()
        output = admission.reserved_output if num_output_tokens is None else num_output_tokens
        for scope in admission.scopes:
            limits = scope.limits
            if limits.output_tokens_per_minute is not None and output != admission.reserved_output:
                self._use(scope.id, OUTPUT, output - admission.reserved_output, now)
            if limits.concurrent_requests is not None:
                self._open[scope.id] = max(self._open.get(scope.id, 0) - 1, 0)
                self._open_changed = True
                self._wake.set()
            if limits.tokens_per_period is not None:
                key = _quota_key(scope, now)
                try:
                    total = await self.bus.js.kv_add(
                        self.bus.subjects.quota_bucket,
                        key,
                        admission.num_prompt_tokens + output + num_pinned_tokens,
                    )
                except Exception:  # the answer is out: a quota undercounts, never a request
                    log.exception("adding to a quota failed", scope=scope.id)
                    continue
                self._quota[key] = (time.monotonic(), total)

    def num_open(self, scope_id: str, now_s: float) -> int:
        peers = sum(
            p.open.get(scope_id, 0)
            for p in self._peers.values()
            if now_s - p.seen_s < self.open_ttl_s
        )
        return self._open.get(scope_id, 0) + peers

    def used(self, scope_id: str, dimension: str, now_s: float | None = None) -> float:
        return self._window(scope_id, dimension).used(now_s or time.time())

    def _refused(
        self,
        scope: Scope,
        what: str,
        wait_s: float,
        protocol: str,
        scopes: list[Scope],
        now: float,
    ) -> ApiError:
        return ApiError(
            "rate_limit",
            f"rate limit reached: this {_noun(scope)} may send {what}; retry after "
            f"{math.ceil(wait_s)} s",
            code="rate_limit_exceeded",
            retry_after_s=max(wait_s, 1.0),
            extra_headers={
                **rate_headers(self, scopes, protocol, now),
                "retry-after-ms": str(max(math.ceil(wait_s * 1000), 1)),
            },
        )

    # -- shared state --------------------------------------------------------------------
    def _window(self, scope_id: str, dimension: str) -> Window:
        key = (scope_id, dimension)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = Window(self.window_s)
        return window

    def _use(self, scope_id: str, dimension: str, amount: float, at_s: float) -> None:
        self._window(scope_id, dimension).add(at_s, amount)
        self._outgoing.append((scope_id, dimension, float(amount), at_s))
        self._wake.set()

    async def _on_use(self, batch: LimitUse, seq: int) -> None:
        if batch.replica == self.replica:
            return  # applied when admitted
        for scope_id, dimension, amount, at_s in batch.uses:
            self._window(scope_id, dimension).add(at_s, amount)

    async def _on_open(self, report: OpenStreams) -> None:
        if report.replica != self.replica:
            self._peers[report.replica] = _Peer(dict(report.open), time.time())

    async def _flush_forever(self) -> None:
        """Publish what was used as soon as there is something (what comes while a publish
        is on its way goes in the next batch), and the open counts on change and each second."""
        last_open_s = 0.0
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancel that
            # stop() sends when the event is set at the same moment, and never return.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush()
                if self._open_changed or time.monotonic() - last_open_s >= 1.0:
                    self._open_changed = False
                    last_open_s = time.monotonic()
                    open_now = {k: v for k, v in self._open.items() if v}
                    await self.bus.publish(
                        self.bus.subjects.limits_open,
                        OpenStreams(replica=self.replica, open=open_now),
                    )
            except Exception:  # NATS away: kept, sent once it is back
                log.warning("publishing rate-limit use failed; will retry", exc_info=True)
                self._wake.set()
                await asyncio.sleep(self.retry_s)

    async def _flush(self) -> None:
        if not self._outgoing:
            return
        uses, self._outgoing = self._outgoing, []
        try:
            await self.bus.js.publish(
                self.bus.subjects.limits_use, LimitUse(replica=self.replica, uses=uses)
            )
        except BaseException:
            self._outgoing[:0] = uses
            raise

    async def _quota_used(self, scope: Scope, now: float) -> int:
        key = _quota_key(scope, now)
        cached = self._quota.get(key)
        if cached is not None and time.monotonic() - cached[0] < self.quota_cache_s:
            return cached[1]
        raw = await self.bus.js.kv_get(self.bus.subjects.quota_bucket, key)
        used = int(raw) if raw else 0
        self._quota[key] = (time.monotonic(), used)
        return used


def rate_headers(
    limiter: Limiter, scopes: Iterable[Scope], protocol: str, now: float
) -> dict[str, str]:
    """The rate-limit headers of the tightest scope in each dimension: OpenAI's
    `x-ratelimit-*` (requests, and input tokens as "tokens"), Anthropic's
    `anthropic-ratelimit-*` (requests, input and output tokens)."""
    headers: dict[str, str] = {}
    for dimension, per_minute in _PER_MINUTE.items():
        tightest: tuple[float, int, float] | None = None  # (remaining, limit, reset in s)
        for scope in scopes:
            limit = getattr(scope.limits, per_minute)
            if limit is None:
                continue
            window = limiter._window(scope.id, dimension)
            remaining = max(limit - window.used(now), 0.0)
            reset_s = window.wait_s(now, limit - remaining, limit) if remaining < limit else 0.0
            if tightest is None or remaining < tightest[0]:
                tightest = (remaining, limit, reset_s)
        if tightest is None:
            continue
        remaining, limit, reset_s = tightest
        if protocol == "anthropic":
            name = dimension.replace("_", "-")
            reset = datetime.datetime.fromtimestamp(now + reset_s, datetime.UTC)
            headers[f"anthropic-ratelimit-{name}-limit"] = str(limit)
            headers[f"anthropic-ratelimit-{name}-remaining"] = str(int(remaining))
            headers[f"anthropic-ratelimit-{name}-reset"] = reset.strftime("%Y-%m-%dT%H:%M:%SZ")
        elif dimension != OUTPUT:
            name = "requests" if dimension == REQUESTS else "tokens"
            headers[f"x-ratelimit-limit-{name}"] = str(limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(int(remaining))
            headers[f"x-ratelimit-reset-{name}"] = f"{reset_s:.3f}s"
    return headers


def scopes_of(key_id: str, key_limits: Limits, account: str, account_limits: Limits) -> list[Scope]:
    return [Scope(f"key.{key_id}", key_limits), Scope(f"account.{account}", account_limits)]


def _noun(scope: Scope) -> str:
    return "API key" if scope.id.startswith("key.") else "account"


def _quota_key(scope: Scope, now: float) -> str:
    day = datetime.datetime.fromtimestamp(now, datetime.UTC)
    period = day.strftime("%Y-%m") if scope.limits.period == "month" else day.strftime("%Y-%m-%d")
    return f"{scope.id}.{period}"


def _period_end(period: str, now: float) -> float:
    day = datetime.datetime.fromtimestamp(now, datetime.UTC).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    if period == "month":
        end = (day.replace(day=1) + datetime.timedelta(days=32)).replace(day=1)
    else:
        end = day + datetime.timedelta(days=1)
    return end.timestamp()
