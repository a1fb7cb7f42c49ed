"""Agent load under faults, for the fault suite (tests/faults) and `kvfabric bench faults`:
sessions that re-send their growing context every step, through the official SDKs (OpenAI's
and Anthropic's, no retries of their own), against every ingress in turn, each request's
outcome recorded; and what a fault cost, measured from those outcomes, discovery and the
ledger: requests failed (and how), the time until the cluster serves fully again, usage lost.

A step's prompt depends only on (session, step), and the mock engine's answer only on the
prompt, so every answer to the same prompt must be the same text: a wrong output is one that
differs from another answer to its prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anthropic
import openai

from services.admin.launcher import Cluster
from services.billing.ledger import open_ledger
from shared.bus import Bus
from shared.discovery import discover
from shared.schema import InstanceState, UsageRecord

T = TypeVar("T")

SYSTEM = "You are a coding agent. You write small, tested Python functions. " * 12
NUM_STEPS = 6  # then the session starts over: contexts stay a few blocks long
MAX_TOKENS = 8
# A failure the suite accepts: the protocol's own retryable error (UNAVAILABLE, OVERLOADED,
# a deadline), never a 500 (which would mean a bug, a stack trace) nor a hang.
PROTOCOL_ERRORS = frozenset({429, 503, 504, 529})


@dataclass
class Outcome:
    session: int
    step: int
    ingress: str
    sdk: str
    started: float  # monotonic
    seconds: float
    status: int  # HTTP status; 0: no HTTP answer (connection refused or reset, timeout)
    request_id: str = ""
    text: str = ""
    usage: tuple[int, int, int] = (0, 0, 0)  # (cached, uncached prompt tokens, output)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def prompt(session: int, step: int) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": f"Session {session}: write a function that sorts."}]
    for i in range(step):
        turns.append({"role": "assistant", "content": f"def f{i}(xs): return sorted(xs)"})
        turns.append({"role": "user", "content": f"Tool output {i}: 3 tests passed. Next."})
    return turns


@dataclass
class AgentLoad:
    """`start()` runs `num_sessions` agents on threads of their own until `stop()`."""

    ingress_urls: list[str]
    api_key: str
    model: str = "tiny-coder"
    num_sessions: int = 4
    timeout_s: float = 30.0  # the client's own: a request still unanswered by then hung
    # Puts an agent's thread on the client host (the cluster's hosts are network namespaces).
    enter: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> AgentLoad:
        self._stop.clear()
        for session in range(self.num_sessions):
            thread = threading.Thread(target=self._agent, args=(session,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        self._threads.clear()
        return list(self.outcomes)

    def num_ok_since(self, since: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok and o.started >= since)

    def _agent(self, session: int) -> None:
        with self.enter():
            self._run_agent(session)

    def _run_agent(self, session: int) -> None:
        step = 0
        turn = 0
        while not self._stop.is_set():
            url = self.ingress_urls[(session + turn) % len(self.ingress_urls)]
            sdk = "anthropic" if (session + turn) % 2 else "openai"
            outcome = self.send(session, step, url, sdk)
            with self._lock:
                self.outcomes.append(outcome)
            turn += 1
            step = (step + 1) % NUM_STEPS if outcome.ok else step

    def send(self, session: int, step: int, url: str, sdk: str) -> Outcome:
        started = time.monotonic()
        outcome = Outcome(session, step, url, sdk, started, 0.0, 0)
        try:
            if sdk == "openai":
                self._openai(url, prompt(session, step), outcome)
            else:
                self._anthropic(url, prompt(session, step), outcome)
            outcome.status = 200
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            outcome.status, outcome.error = exc.status_code, str(exc)[:300]
        except (openai.APIConnectionError, anthropic.APIConnectionError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # anything else is the suite's to report, not to crash on
            outcome.status, outcome.error = -1, f"{type(exc).__name__}: {exc}"[:300]
        outcome.seconds = time.monotonic() - started
        return outcome

    def _openai(self, url: str, messages: list[dict[str, str]], outcome: Outcome) -> None:
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=self.api_key, max_retries=0, timeout=self.timeout_s
        )
        with client:
            reply = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "system", "content": SYSTEM}, *messages],  # type: ignore[list-item]
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
        usage = reply.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        outcome.request_id = reply.id.removeprefix("chatcmpl-")
        outcome.text = reply.choices[0].message.content or ""
        outcome.usage = (cached or 0, usage.prompt_tokens - (cached or 0), usage.completion_tokens)

    def _anthropic(self, url: str, messages: list[dict[str, str]], outcome: Outcome) -> None:
        client = anthropic.Anthropic(
            base_url=url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s
        )
        with client:
            reply = client.messages.create(
                model=self.model,
                system=SYSTEM,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
            )
        outcome.request_id = reply.id.removeprefix("msg_")
        outcome.text = "".join(b.text for b in reply.content if b.type == "text")
        cached = reply.usage.cache_read_input_tokens or 0
        outcome.usage = (cached, reply.usage.input_tokens, reply.usage.output_tokens)


@dataclass
class Streamed:
    """One streamed answer as its client saw it: text, when each content chunk came."""

    outcome: Outcome
    chunk_times: list[float] = field(default_factory=list)  # monotonic, per content chunk

    def first_chunk_after(self, moment: float) -> float | None:
        return next((t for t in self.chunk_times if t > moment), None)


def stream_openai(
    url: str,
    api_key: str,
    messages: list[dict[str, str]],
    *,
    model: str = "tiny-coder",
    max_tokens: int = 256,
    on_chunk: Callable[[int], object] = lambda _: None,
    timeout_s: float = 120.0,
) -> Streamed:
    """A greedy streamed chat completion through the OpenAI SDK, usage included;
    `on_chunk(n)` after the n-th content chunk (a test kills a worker from there)."""
    streamed = Streamed(Outcome(0, 0, url, "openai", time.monotonic(), 0.0, 0))
    outcome, texts = streamed.outcome, []
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
    try:
        with client:
            stream = client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                outcome.request_id = chunk.id.removeprefix("chatcmpl-")
                if chunk.choices and chunk.choices[0].delta.content:
                    texts.append(chunk.choices[0].delta.content)
                    streamed.chunk_times.append(time.monotonic())
                    on_chunk(len(texts))
                if chunk.usage is not None:
                    usage = chunk.usage
                    details = usage.prompt_tokens_details
                    cached = (details.cached_tokens if details else 0) or 0
                    outcome.usage = (cached, usage.prompt_tokens - cached, usage.completion_tokens)
        outcome.status = 200
    except openai.APIStatusError as exc:
        outcome.status, outcome.error = exc.status_code, str(exc)[:300]
    except openai.APIConnectionError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    except openai.APIError as exc:  # an error event inside the stream
        outcome.status, outcome.error = -1, f"{type(exc).__name__}: {exc}"[:300]
    outcome.text = "".join(texts)
    outcome.seconds = time.monotonic() - outcome.started
    return streamed


# -- what a fault cost -------------------------------------------------------------------
Runner = Callable[[Coroutine[Any, Any, T]], T]


def run_here(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def serving_instances(cluster: Cluster) -> set[str]:
    """The instances discovery finds SERVING now."""
    bus = await Bus.connect(
        cluster.nats_url, service="faults", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        instances = await discover(bus, timeout_s=0.3)
    finally:
        await bus.close()
    return {i.instance_id for i in instances if i.load.get("state") == InstanceState.SERVING}


def time_to_full_service(
    cluster: Cluster,
    load: AgentLoad,
    since: float,
    bound_s: float,
    run: Runner = run_here,
    enter: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
) -> float | None:
    """Seconds from `since` until every instance the supervisor keeps (not the failed ones)
    serves again and a request succeeds through every ingress; None past `bound_s`."""
    failed = {r.instance_id for r in cluster.supervisor.failed()}
    while time.monotonic() < since + bound_s:
        expected = {c.instance_id for c in cluster.children} - failed
        try:
            serving = run(serving_instances(cluster))
        except Exception:  # NATS itself may still be coming back
            serving = set()
        if expected <= serving:
            with enter():
                probes = [load.send(99, 0, url, "openai") for url in cluster.http_urls]
            if all(p.ok for p in probes):
                return time.monotonic() - since
        time.sleep(0.2)
    return None


def wrong_answers(outcomes: list[Outcome]) -> dict[tuple[int, int], set[str]]:
    """Prompts answered with more than one text."""
    answers: dict[tuple[int, int], set[str]] = defaultdict(set)
    for o in outcomes:
        if o.ok:
            answers[(o.session, o.step)].add(o.text)
    return {k: v for k, v in answers.items() if len(v) > 1}


def outside_protocol(
    outcomes: list[Outcome], refused_at: str | Collection[str] = ()
) -> list[Outcome]:
    """Failures that are not the protocol's retryable errors (a refused connection counts
    only at `refused_at`: the URL of an ingress that was killed, or several)."""
    refused = {refused_at} if isinstance(refused_at, str) else set(refused_at)
    return [
        o
        for o in outcomes
        if not o.ok
        and o.status not in PROTOCOL_ERRORS
        and not (o.status == 0 and o.ingress in refused and "Connection" in o.error)
    ]


@dataclass
class Billing:
    """Answered requests against the usage log and the ledger."""

    missing: list[str]  # answered, never billed
    doubled: dict[str, int]  # usage records per request where more than one
    mismatched: list[str]  # billed other tokens than the client was told


async def usage_log(
    bus: Bus, request_ids: set[str], timeout_s: float
) -> tuple[dict[str, list[UsageRecord]], bool]:
    """Every usage record on JetStream, by request id, read to the log's end once each of
    `request_ids` has one, and whether that happened within `timeout_s` (False: some id has
    none, or the log was not read to its end)."""
    records: dict[str, list[UsageRecord]] = defaultdict(list)
    last_read = 0

    async def on_record(record: UsageRecord, seq: int) -> None:
        nonlocal last_read
        records[record.request_id].append(record)
        last_read = seq

    subjects = bus.subjects
    subscription = await bus.js.consume(
        subjects.usage_stream, subjects.usage_all, UsageRecord, on_record
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not request_ids <= records.keys():
            if time.monotonic() > deadline:
                return records, False
            await asyncio.sleep(0.05)
        _, last_seq = await bus.js.stream_bounds(subjects.usage_stream)
        while last_read < last_seq:
            if time.monotonic() > deadline:
                return records, False
            await asyncio.sleep(0.05)
        return records, True
    finally:
        await bus.unsubscribe(subscription)


async def usage_counts(cluster: Cluster, request_ids: set[str], timeout_s: float) -> dict[str, int]:
    """Usage records per request on JetStream, read to the log's end once every id has one
    (or `timeout_s` passed)."""
    bus = await Bus.connect(
        cluster.nats_url, service="faults", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        records, _ = await usage_log(bus, request_ids, timeout_s)
    finally:
        await bus.close()
    return {rid: len(records.get(rid, ())) for rid in request_ids}


def billing(
    cluster: Cluster, outcomes: list[Outcome], run: Runner = run_here, timeout_s: float = 60.0
) -> Billing:
    told = {o.request_id: o.usage for o in outcomes if o.ok}
    counts = run(usage_counts(cluster, set(told), timeout_s))
    ledger = open_ledger(f"sqlite:///{cluster.spec.state_dir.resolve()}/billing/ledger.db")
    try:
        deadline = time.monotonic() + timeout_s
        missing = set(told)
        while missing and time.monotonic() < deadline:
            missing = {rid for rid in missing if ledger.get(rid) is None}
            time.sleep(0.2)
        mismatched = []
        for rid, usage in told.items():
            row = ledger.get(rid)
            if row is not None and usage != (
                row.num_cache_hit_tokens,
                row.num_cache_miss_tokens,
                row.num_output_tokens,
            ):
                mismatched.append(rid)
    finally:
        ledger.close()
    return Billing(
        missing=sorted(missing | {rid for rid, n in counts.items() if n == 0}),
        doubled={rid: n for rid, n in counts.items() if n > 1},
        mismatched=mismatched,
    )
