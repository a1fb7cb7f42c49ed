"""One generation, protocol-neutral: a `Completion` (what any of the three protocols asked
for) in, a stream of events out.

    prepare(): the model, the prompt ids (segmented, cached tokenization), the limits
               (context length and max tokens: 400 with the numbers), the GenerateRequest;
    Generation.start(): send it and wait for the router's decision, so every refusal (unknown
               model, overloaded, bad request) is still an HTTP error in the caller's shape;
    Generation.next(): the next event (text, tool-call begin / delta / end, finished), or
               KEEPALIVE when nothing came for `keepalive_s`;
    Generation.close(): stop; if the stream has not ended (the client went away) the request
               is cancelled downstream and decode bills what it produced.

Usage comes from the final chunk: decode's own account of the store hits it used, not the
router's estimate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field

import msgspec

from services.ingress.diagnosis import (
    EXCERPT_TOKENS,
    NEVER_SEEN,
    VOLATILE_SPAN,
    Diagnosis,
    Explanation,
    Explanations,
    SessionTurns,
    TurnDigest,
    compare,
    digest,
    probe,
    session_key,
)
from services.ingress.errors import ApiError, from_service_error, invalid
from services.ingress.metrics import IngressMetrics
from services.ingress.models import ModelTable, ServedModel
from services.ingress.stability import REWRITE_ACTION, Rewrite, canonical
from services.ingress.staging import StagingPolicy
from shared import audit, telemetry
from shared.bus import Bus, now_ms
from shared.client import GenerateResult, build_request, generate
from shared.logging import bind_request, get_logger
from shared.metrics import Metrics
from shared.schema import (
    CacheProbe,
    Eviction,
    GenerateRequest,
    Pin,
    RouteDecision,
    ServiceError,
    StageRequest,
    TokenChunk,
    num_packed_tokens,
    unpack_token_ids,
)
from shared.subjects import INGRESS
from shared.telemetry import REQUEST_ID
from shared.tokenizer import PromptError
from shared.tokenizer.chat import Chat, Message, ToolCall
from shared.tokenizer.tool_parsers import (
    ParseEvent,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallParser,
    parser_for,
)
from shared.usage import cache_write_tokens
from shared.usage_outbox import UsageOutbox

log = get_logger(__name__)

__all__ = [
    "KEEPALIVE",
    "Completion",
    "Finished",
    "Generation",
    "Pipeline",
    "Prepared",
    "TextDelta",
    "ToolCallBegin",
    "ToolCallDelta",
    "ToolCallEnd",
    "Usage",
]

KEEPALIVE = object()  # Generation.next(): nothing new for keepalive_s


@dataclass(frozen=True)
class Completion:
    """What a protocol request asks for, once parsed."""

    model: str
    chat: Chat
    max_tokens: int | None = None  # None: what the context leaves, up to the default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    api_key_id: str = ""
    account: str = ""
    cache_salt: str = ""  # the namespace of its block hashes: its account's (shared/accounts.py)
    tool_id_prefix: str = "call_"  # Anthropic's tool_use ids are toolu_...
    # The agent session the cache-miss diagnosis compares this turn with (diagnosis.py): its
    # previous turn is found under `session`; this turn is kept under `session` too, or,
    # with `chained`, under its own response id, which a Responses call continuing it names.
    session: str = ""
    chained: bool = False
    # Its prompt's text may be kept around its first cache miss (`kvfabric cache explain`):
    # never for an account whose cache is isolated from others'.
    keep_text: bool = False
    # Its `cache_control` breakpoints: (chat message index, ttl_s), in prompt order; the
    # prompt through each message stays in the store for its ttl (a `Pin` each).
    breakpoints: tuple[tuple[int, int], ...] = ()
    # Its account opted in to the prefix guard: volatile system-prompt lines are moved or
    # removed before tokenization (stability.py).
    prefix_guard: bool = False
    harness: str = "other"  # the caller's harness, from its user agent (stability.harness)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens: read from the KV store, not computed
    output_tokens: int
    cache: Diagnosis | None = None  # why the rest missed (the usage's `kvfabric_cache`)
    cache_write_tokens: int = 0  # of the missed, what a pin (cache_control) wrote

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Finished:
    # stop: the model ended its turn; stop_sequence: a stop string matched (`stop_sequence`);
    # length: max tokens or the context; tool_calls: it called tools; cancelled; error.
    reason: str
    usage: Usage
    stop_sequence: str | None = None


Event = ParseEvent | Finished


@dataclass(frozen=True)
class Turn:
    """This request as a turn of its session: the previous turn's digest and its own."""

    current: TurnDigest | None  # its digest (None: no session, so none is kept)
    probe: CacheProbe  # what the diagnosis knows before the request runs
    key: str | None  # where it is kept for the next turn (None: no session)

    def diagnosis(
        self,
        num_cached_tokens: int,
        eviction: Eviction | None = None,
        window_replayed: bool = False,
    ) -> Diagnosis:
        """With the router's tombstone of the first block missed, when it was evicted, and
        whether prefill had to recompute the window at the hit's end (known at the end)."""
        probe = self.probe
        if eviction is not None:
            probe = msgspec.structs.replace(probe, eviction=eviction)
        return Diagnosis.of(probe, num_cached_tokens, window_replayed)


@dataclass
class Prepared:
    completion: Completion
    model: ServedModel
    request: GenerateRequest
    forced_prefix: str
    parse_tools: bool
    arrival_s: float  # perf_counter when prepare() began (before tokenization), for TTFT
    turn: Turn | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return num_packed_tokens(self.request.prompt_token_ids)


class Pipeline:
    def __init__(
        self,
        bus: Bus,
        models: ModelTable,
        *,
        outbox: UsageOutbox | None = None,
        sessions: SessionTurns | None = None,
        explanations: Explanations | None = None,
        default_max_tokens: int = 1024,
        keepalive_s: float = 10.0,
        metrics: Metrics | None = None,  # the process's (a test's own when None)
        staging: StagingPolicy | None = None,  # None: nothing staged over tool calls
    ) -> None:
        self.bus = bus
        self.models = models
        self.outbox = outbox
        self.sessions = sessions
        self.explanations = explanations
        self._background: set[asyncio.Task[None]] = set()
        self.staging = staging
        self._auditor: str | None = None  # this process's audit actor, once it wrote a record
        self._audit_stream_made = False
        # A session's latest digest write, per key: a later write of the same key waits for
        # it (the turn's end must not be overwritten by its start).
        self._session_writes: dict[str, asyncio.Task[None]] = {}
        self.default_max_tokens = default_max_tokens
        self.keepalive_s = keepalive_s
        self.counts = IngressMetrics(metrics or Metrics(INGRESS, bus.instance_id))

    async def model(self, name: str) -> ServedModel:
        model = await self.models.get(name)
        if model is None and not self.models.served():
            # No worker of any model beats: the cluster is starting or recovering (NATS
            # back a moment ago), not a wrong name; a client should retry, not give up.
            raise ApiError(
                "unavailable",
                f"no worker serves model {name!r} right now (nor any other); retry shortly",
                retry_after_s=1.0,
            )
        if model is None:
            served = ", ".join(m.name for m in self.models.served())
            raise ApiError(
                "not_found",
                f"model {name!r} is not served here (served: {served})",
                param="model",
                code="model_not_found",
            )
        return model

    async def count_tokens(self, model_name: str, chat: Chat) -> int:
        model = await self.model(model_name)
        try:
            return await asyncio.to_thread(model.tokenizer.count, chat)
        except PromptError as exc:
            raise invalid(str(exc)) from exc

    async def prepare(self, completion: Completion) -> Prepared:
        arrival_s = time.perf_counter()
        model = await self.model(completion.model)
        rewrite = None
        if completion.prefix_guard:
            chat, rewrite = canonical(completion.chat)
            completion = dataclasses.replace(completion, chat=chat)
        chat = completion.chat
        with telemetry.span("ingress tokenize") as span:
            try:
                ids = await asyncio.to_thread(model.tokenizer.encode, chat)
            except PromptError as exc:
                raise invalid(str(exc)) from exc
            if span.is_recording():
                span.set_attributes(
                    {"kvfabric.model": model.name, "kvfabric.num_prompt_tokens": len(ids)}
                )
        num_prompt = len(ids)
        room = model.max_model_len - num_prompt
        if completion.max_tokens is not None and completion.max_tokens < 1:
            raise invalid(
                f"max tokens must be at least 1, got {completion.max_tokens}", param="max_tokens"
            )
        if room < 1 or (completion.max_tokens is not None and completion.max_tokens > room):
            asked = completion.max_tokens or 1
            raise ApiError(
                "invalid_request",
                f"{model.name}'s maximum context length is {model.max_model_len} tokens; "
                f"this request has {num_prompt} tokens of prompt and asks for {asked} "
                f"tokens of output ({num_prompt + asked} in all)",
                param="messages" if room < 1 else "max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = completion.max_tokens or min(self.default_max_tokens, room)
        request_id = uuid.uuid4().hex
        pins = await self._pins(chat, completion.breakpoints, model)
        # The session's turn as the client sent it: without the message of moved lines the
        # guard appended (the next turn replaces it with the answer; no edit of the client's).
        compared, num_compared = chat, num_prompt
        if rewrite is not None and rewrite.num_chars_moved:
            compared = dataclasses.replace(chat, messages=chat.messages[:-1])
            num_compared = await asyncio.to_thread(
                model.tokenizer.count, compared, add_generation_prompt=False
            )
        turn = await self._turn(completion, compared, num_compared, model, request_id, pins)
        request = build_request(
            ids,
            model=model.name,
            block_size_tokens=model.block_size_tokens,
            max_tokens=max_tokens,
            temperature=completion.temperature,
            top_p=completion.top_p,
            top_k=completion.top_k,
            seed=completion.seed,
            stop=completion.stop,
            request_id=request_id,
            api_key_id=completion.api_key_id,
            account=completion.account,
            cache_salt=completion.cache_salt,
            cache_probe=turn.probe,
            session=completion.session,
        )
        if pins:
            request = msgspec.structs.replace(request, pins=pins)
        forced = model.chat_format.forced_prefix(chat)
        parse_tools = bool(chat.tools) and chat.tool_choice.mode != "none"
        span = telemetry.current_span()  # the HTTP request's
        if span.is_recording():
            bind_request(request.request_id, None)
            span.set_attributes(
                {
                    REQUEST_ID: request.request_id,
                    "kvfabric.model": model.name,
                    "kvfabric.num_prompt_tokens": num_prompt,
                }
            )
        if rewrite is not None:
            for kind in rewrite.kinds:
                self.counts.prefix_rewrites.labels(kind).inc()
            self._in_background(self._audit_rewrite(completion, request.request_id, rewrite))
        return Prepared(completion, model, request, forced, parse_tools, arrival_s, turn)

    async def _audit_rewrite(
        self, completion: Completion, request_id: str, rewrite: Rewrite
    ) -> None:
        detail = {
            "request_id": request_id,
            "kinds": ",".join(rewrite.kinds),
            "chars_stripped": str(rewrite.num_chars_stripped),
            "chars_moved": str(rewrite.num_chars_moved),
        }
        if self._auditor is None:  # the credentials' file read once per process
            self._auditor = audit.actor()
        try:
            subject = self.bus.subjects.prefix_guard_audit
            await audit.record(
                self.bus,
                REWRITE_ACTION,
                completion.account,
                "ok",
                detail,
                subject=subject,
                who=self._auditor,
                ensure=not self._audit_stream_made,  # made once, by the first that succeeds
            )
            self._audit_stream_made = True
        except Exception:  # the request is served; the gap is logged where it can be seen
            log.error(
                "auditing a prefix-guard rewrite failed", request_id=request_id, exc_info=True
            )

    async def _pins(
        self, chat: Chat, breakpoints: tuple[tuple[int, int], ...], model: ServedModel
    ) -> tuple[Pin, ...]:
        """A `Pin` per breakpoint: the prompt's tokens through its message, and its ttl."""
        pins = []
        for index, ttl_s in breakpoints:
            through = dataclasses.replace(chat, messages=chat.messages[: index + 1])
            num_tokens = await asyncio.to_thread(
                model.tokenizer.count, through, add_generation_prompt=False
            )
            pins.append(Pin(num_tokens, ttl_s))
        return tuple(sorted(pins, key=lambda p: p.num_tokens))

    async def _turn(
        self,
        completion: Completion,
        chat: Chat,
        num_prompt: int,
        model: ServedModel,
        request_id: str,
        pins: tuple[Pin, ...] = (),
    ) -> Turn:
        previous, key = None, None
        if self.sessions is not None:
            account = completion.account
            if completion.session:
                try:
                    previous = await self.sessions.get(session_key(account, completion.session))
                except Exception:  # the diagnosis is told as if the session were new
                    log.warning("reading a session's previous turn failed", exc_info=True)
            if completion.chained:
                key = session_key(account, f"response:resp_{request_id}")
            elif completion.session:
                key = session_key(account, completion.session)
        if key is None:  # no session: nothing to compare with, no digest to keep
            return Turn(None, CacheProbe(cause=NEVER_SEEN), None)
        current = compare(previous, digest(chat, completion.cache_salt, num_prompt, pins))
        return Turn(current, probe(previous, current, model.block_size_tokens), key)

    def explain(self, prepared: Prepared, diagnosis: Diagnosis) -> None:
        """Keep the request's diagnosis for `kvfabric cache explain`, in the background."""
        if self.explanations is not None:
            self._in_background(self._explain(self.explanations, prepared, diagnosis))

    def _in_background(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def _explain(
        self, explanations: Explanations, prepared: Prepared, diagnosis: Diagnosis
    ) -> None:
        completion, request = prepared.completion, prepared.request
        before = after = ""
        if completion.keep_text:
            ids = unpack_token_ids(request.prompt_token_ids).tolist()
            first, decode = diagnosis.first_miss_token, prepared.model.tokenizer.decode
            before = decode(ids[max(first - EXCERPT_TOKENS, 0) : first])
            after = decode(ids[first : first + EXCERPT_TOKENS])
        explanation = Explanation(
            request_id=request.request_id,
            account=completion.account,
            model=request.model,
            cause=diagnosis.cause,
            part=diagnosis.part,
            first_miss_token=diagnosis.first_miss_token,
            eviction=diagnosis.eviction,
            span=diagnosis.span,
            num_prompt_tokens=prepared.num_prompt_tokens,
            has_text=completion.keep_text,
            before=before,
            after=after,
            ts_ms=now_ms(),
        )
        try:
            await explanations.put(explanation)
        except Exception:  # the answer is out; only a later `cache explain` misses it
            log.warning("keeping a request's cache explanation failed", exc_info=True)

    def remember_turn(self, prepared: Prepared) -> None:
        """Keep the request's turn for its session's next (once the router took it), in the
        background: the answer does not wait for the write."""
        turn = prepared.turn
        if self.sessions is None or turn is None or turn.key is None or turn.current is None:
            return
        self._write_turn(self.sessions, turn.key, turn.current)

    def _write_turn(self, sessions: SessionTurns, key: str, digest: TurnDigest) -> None:
        before = self._session_writes.get(key)
        task = asyncio.create_task(self._remember(sessions, key, digest, before))
        self._session_writes[key] = task
        self._background.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._background.discard(finished)
            if self._session_writes.get(key) is finished:
                del self._session_writes[key]

        task.add_done_callback(done)

    @staticmethod
    async def _remember(
        sessions: SessionTurns,
        key: str,
        current: TurnDigest,
        before: asyncio.Task[None] | None = None,
    ) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        try:
            await sessions.put(key, current)
        except Exception:  # only the next turn's diagnosis suffers
            log.warning("keeping a session's turn failed", exc_info=True)

    def stage(self, prepared: Prepared, prefill_worker_id: str, tools: tuple[str, ...]) -> None:
        """The turn ended calling `tools`: keep its session's KV on the prefill worker that
        served it until the tools are expected back, and remember when it ended (the next
        turn learns the tools' wait from it). staging.py."""
        turn = prepared.turn
        if (
            self.staging is None
            or self.sessions is None
            or turn is None
            or turn.key is None
            or turn.current is None
            or not prefill_worker_id
        ):
            return
        hold_s = self.staging.hold_s(turn.current.tool_waits, tools)
        request = prepared.request
        stage = StageRequest(
            request_id=request.request_id, block_hashes=request.block_hashes, hold_s=hold_s
        )
        subject = self.bus.subjects.instance(self.bus.subjects.prefill_stage, prefill_worker_id)
        self._in_background(self._publish(subject, stage))
        self.counts.staged_turns.inc()
        ended = msgspec.structs.replace(turn.current, tools_called=tools, ended_ms=now_ms())
        self._write_turn(self.sessions, turn.key, ended)

    async def _publish(self, subject: str, message: StageRequest) -> None:
        try:
            await self.bus.publish(subject, message)
        except Exception:  # only the next turn's speed suffers
            log.warning("staging a session failed", exc_info=True)

    def fork(self, prepared: Prepared, index: int) -> Prepared:
        """Choice `index` of an n-choice request: its own request id (and seed, if one was
        given); choice 0 is the request itself."""
        if index == 0:
            return prepared
        request = prepared.request
        sampling = request.sampling
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index)
        forked = msgspec.structs.replace(
            request, request_id=f"{request.request_id}-{index}", sampling=sampling
        )
        return dataclasses.replace(prepared, request=forked)

    def generation(self, prepared: Prepared) -> Generation:
        return Generation(self, prepared)


@dataclass
class _Output:
    """What the generation produced, for the non-streaming answer and the next turn."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)
    names: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (id, name)


class Generation:
    def __init__(self, pipeline: Pipeline, prepared: Prepared) -> None:
        self.pipeline = pipeline
        self.prepared = prepared
        self.request_id = prepared.request.request_id
        self.output = _Output()
        self._chunks: asyncio.Queue[TokenChunk | None] = asyncio.Queue()
        self._decided = asyncio.Event()
        self._events: deque[Event] = deque()
        self._task: asyncio.Task[GenerateResult] | None = None
        self._ended = False
        self._parser: ToolCallParser | None = None
        self._arguments: dict[int, str] = {}  # call index -> the JSON prefix streamed
        self._result: GenerateResult | None = None
        self._last_chunk_s: float | None = None  # when its latest tokens came (TTFT, ITL)
        self.num_cached_estimate = 0  # the router's, until decode's count comes at the end
        self.eviction: Eviction | None = None  # the router's: the first block missed, evicted
        self.pin_quota_tokens = 0  # what its pin adds to the token quota, once it ended
        self.prefill_worker_id = ""  # the router's choice, once it chose
        self._tools_called: tuple[str, ...] = ()  # the tools it called, by name, once each
        if prepared.parse_tools:
            names = [t.name for t in prepared.completion.chat.tools]
            self._parser = parser_for(
                prepared.model.chat_format.name,
                names,
                id_prefix=prepared.completion.tool_id_prefix,
            )
            if prepared.forced_prefix:
                self._parsed(self._parser.feed(prepared.forced_prefix))

    async def start(self) -> None:
        """Send the request; return once the router took it. Raises ApiError otherwise."""
        p = self.pipeline
        router_id, router_seq = p.models.router()
        self._task = asyncio.create_task(
            generate(
                p.bus,
                self.prepared.request,
                on_chunk=self._chunks.put_nowait,
                on_decision=self._on_decision,
                outbox=p.outbox,
                router_id=router_id,
                router_seq=router_seq,
            )
        )
        self._task.add_done_callback(lambda _: self._chunks.put_nowait(None))
        decided = asyncio.create_task(self._decided.wait())
        try:
            await asyncio.wait({self._task, decided}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            decided.cancel()
        if self._task.done() and not self._decided.is_set():
            self._raise_from_task()  # refused (or failed) before any worker took it

    def _on_decision(self, decision: RouteDecision) -> None:
        self.num_cached_estimate = decision.num_cached_tokens
        self.eviction = decision.eviction
        self.prefill_worker_id = decision.prefill_worker_id
        self._decided.set()

    async def next(self) -> Event | object | None:
        """The next event; KEEPALIVE after keepalive_s of silence; None after Finished.
        Raises ApiError when the generation failed mid-stream."""
        while not self._events:
            if self._ended:
                return None
            try:
                chunk = await asyncio.wait_for(self._chunks.get(), self.pipeline.keepalive_s)
            except TimeoutError:
                return KEEPALIVE
            if chunk is None:
                self._finish()
            else:
                self._take(chunk)
        event = self._events.popleft()
        self._record(event)
        return event

    def _pin_written(self, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        request = self.prepared.request
        written = cache_write_tokens(request, num_prompt_tokens, num_cached_tokens)
        ttl_s = max((p.ttl_s for p in request.pins), default=0)
        # Against the account's token quota: a pinned token counts once per hour it is kept.
        self.pin_quota_tokens = -(-written * ttl_s // 3600)
        return written

    async def run_to_end(self) -> tuple[list[Event], Finished]:
        """Every event (the non-streaming answer)."""
        events: list[Event] = []
        while (event := await self.next()) is not None:
            if event is not KEEPALIVE:
                events.append(event)  # type: ignore[arg-type]
        return events, events[-1]  # type: ignore[return-value]

    async def close(self) -> None:
        """Stop; a request still running is cancelled downstream (client.generate sends the
        CancelRequest when its task is cancelled)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- internals -----------------------------------------------------------------------
    def _take(self, chunk: TokenChunk) -> None:
        num_tokens = num_packed_tokens(chunk.token_ids)
        if num_tokens:
            now, counts = time.perf_counter(), self.pipeline.counts
            if self._last_chunk_s is None:
                counts.ttft_seconds.observe(now - self.prepared.arrival_s)
            else:
                counts.itl_seconds.observe((now - self._last_chunk_s) / num_tokens)
            self._last_chunk_s = now
        if chunk.text:
            if self._parser is not None:
                self._parsed(self._parser.feed(chunk.text))
            else:
                self._events.append(TextDelta(chunk.text))

    def _parsed(self, events: list[ParseEvent]) -> None:
        """The parser's events, with one rule for every protocol: a call's arguments are
        what its deltas carried, always a valid JSON prefix (Anthropic's SDK parses every
        fragment). Where the model's text stopped being JSON, the call ends there and the
        rest of what it wrote follows as text, so nothing it wrote is lost."""
        for event in events:
            if isinstance(event, ToolCallBegin) and event.name not in self._tools_called:
                self._tools_called += (event.name,)
            if isinstance(event, ToolCallDelta):
                self._arguments[event.index] = (
                    self._arguments.get(event.index, "") + event.arguments
                )
            elif isinstance(event, ToolCallEnd) and event.arguments != (
                sent := self._arguments.get(event.index, "")
            ):
                if sent or not _is_json(event.arguments):
                    rest = event.arguments.removeprefix(sent)
                    self._events.append(ToolCallEnd(event.index, sent))
                    self._events.append(TextDelta(rest))
                    continue
                self._arguments[event.index] = event.arguments  # whole, with no delta before
            self._events.append(event)

    @property
    def num_output_tokens(self) -> int | None:
        """What the cluster produced for it, once it has ended with its usage; else None."""
        result = getattr(self, "_result", None)
        return result.usage.num_output_tokens if result is not None and result.usage else None

    def _finish(self) -> None:
        assert self._task is not None and self._task.done()
        result = self._raise_from_task()
        if result.num_failovers:
            self.pipeline.counts.failovers.inc(result.num_failovers)
        if self._parser is not None:
            self._parsed(self._parser.finish())
        usage = result.usage
        if usage is None:  # a stream always ends with a final chunk carrying usage
            raise ApiError("api_error", "the stream ended without its usage")
        reason = result.finish_reason or "stop"
        stop_sequence = result.stop_sequence
        if reason == "stop" and stop_sequence:
            reason = "stop_sequence"
        has_calls = self._parser is not None and self._parser.num_calls > 0
        if has_calls and reason in ("stop", "stop_sequence"):
            reason = "tool_calls"
        if reason == "tool_calls" and self.prepared.request.request_id.find("-") < 0:
            # (choice 0 only: the choices of one request share one prompt)
            self.pipeline.stage(self.prepared, self.prefill_worker_id, self._tools_called)
        turn = self.prepared.turn
        cache = None
        if turn is not None:
            stats = result.stats
            replayed = stats is not None and stats.prefill.swa_restore in ("bounded", "exact")
            cache = turn.diagnosis(usage.num_cached_tokens, self.eviction, replayed)
        if cache is not None:
            counts = self.pipeline.counts
            counts.cache_diagnoses.labels(cache.cause).inc()
            if cache.cause == VOLATILE_SPAN:
                harness = self.prepared.completion.harness
                for span in (cache.span or "unknown").split(","):
                    counts.volatile_spans.labels(harness, span).inc()
            self.pipeline.explain(self.prepared, cache)
        self._events.append(
            Finished(
                reason,
                Usage(
                    usage.num_prompt_tokens,
                    usage.num_cached_tokens,
                    usage.num_output_tokens,
                    cache,
                    self._pin_written(usage.num_prompt_tokens, usage.num_cached_tokens),
                ),
                stop_sequence if reason == "stop_sequence" else None,
            )
        )
        self._ended = True
        self._result = result

    def _raise_from_task(self) -> GenerateResult:
        assert self._task is not None
        if self._task.cancelled():
            raise ApiError("api_error", "the request was cancelled")
        exc = self._task.exception()
        if isinstance(exc, ServiceError):
            raise from_service_error(exc) from exc
        if exc is not None:
            log.error("generation failed", request_id=self.request_id, error=str(exc))
            raise ApiError("api_error", "the generation failed inside the cluster") from exc
        return self._task.result()

    def _record(self, event: Event) -> None:
        out = self.output
        if isinstance(event, TextDelta):
            out.text.append(event.text)
        elif isinstance(event, ToolCallBegin):
            out.names[event.index] = (event.id, event.name)
        elif isinstance(event, ToolCallEnd):
            call_id, name = out.names[event.index]
            out.calls[event.index] = ToolCall(call_id, name, event.arguments)
        elif isinstance(event, Finished) and self._result is not None:
            self._remember(self._result)

    def _remember(self, result: GenerateResult) -> None:
        """The next turn renders this answer from its exact generated ids (cache hits through
        the model's own output); only where what we return is what the model wrote."""
        if result.finish_reason not in ("stop", "length"):
            return
        tokenizer = self.prepared.model.tokenizer
        ids = [int(i) for i in result.token_ids]
        if self.prepared.forced_prefix:  # the body starts with what the server wrote
            ids = list(tokenizer.forced_prefix_ids(self.prepared.completion.chat)) + ids
        stop_ids = set(self.prepared.model.chat_format.stop_token_ids)
        while ids and ids[-1] in stop_ids:
            ids.pop()
        message = Message(
            "assistant",
            "".join(self.output.text),
            tuple(self.output.calls[i] for i in sorted(self.output.calls)),
        )
        try:
            tokenizer.remember_output(message, ids)
        except Exception:  # a lost shortcut costs a cache miss, never the answer
            log.exception("remembering the output failed", request_id=self.request_id)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
