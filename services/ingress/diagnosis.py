"""Why a request's prompt missed the cache, told per request: the `x-kvfabric-cache` response
header (from the router's count, known before the first byte), the usage's `kvfabric_cache`
field (from decode's count, at the end) and `kvfabric_ingress_cache_diagnoses_total{cause}`.

A session's turns are compared. Ingress keeps a digest of each session's latest turn in a
KV bucket every ingress shares (`SessionTurns`; entries expire after `ttl_s`): hashes only,
never text -- of the cache namespace, the system prompt, each tool, each message. The next
turn of the session finds the first part its prompt no longer shares with the previous one,
in the order a prompt renders them (namespace, system, tools, messages), and names a cause:

  none                 every token the previous turn sent came from the cache
  never_seen           no earlier turn of this session is known (its first, or no session)
  cache_isolation      the cache namespace differs (another `cache_salt`)
  system_changed       the system prompt differs
  tools_changed        the tools differ (added, removed, edited or reordered)
  earlier_turn_edited  a message the previous turn sent differs or is gone (`part` says which)
  volatile_span        the system prompt changed only in spans of a known volatile kind
                       (a timestamp, a nonce...: `span` names them, stability.py), or the
                       tools only in their order (`span=tool_order`), or the part that
                       changed on the previous turn changed again while the rest stayed
  window_expired       every token the previous turn sent came from the cache, but the
                       sliding window at the hit's end had to be recomputed: its snapshot
                       had expired (swa-memcache's TTL) or was on no node in reach
  evicted              the previous prompt was sent unchanged, and the first block of it
                       the cache lacked was evicted (kv-index's tombstone: from which tier,
                       why, how long ago, after how long unused)
  not_cached           the previous prompt was sent unchanged, yet its blocks were not all
                       served, and kv-index keeps no tombstone of the first one missed: not
                       yet stored (the turn before is still running, or its write failed),
                       or evicted so long ago its tombstone was overwritten

A session is `x-session-id`, Anthropic's `metadata.user_id`, or a Responses chain (each turn
is found under the id of the response it continues), always within the caller's account.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from services.ingress.stability import TOOL_ORDER, kinds_in, masked
from services.ingress.staging import learned
from shared.bus import Bus, now_ms
from shared.schema import CacheProbe, Eviction, Pin
from shared.tokenizer.chat import Chat, Message, Tool

NONE = "none"
NEVER_SEEN = "never_seen"
CACHE_ISOLATION = "cache_isolation"
SYSTEM_CHANGED = "system_changed"
TOOLS_CHANGED = "tools_changed"
EARLIER_TURN_EDITED = "earlier_turn_edited"
VOLATILE_SPAN = "volatile_span"
EVICTED = "evicted"
NOT_CACHED = "not_cached"
WINDOW_EXPIRED = "window_expired"
CAUSES = (
    NONE,
    NEVER_SEEN,
    CACHE_ISOLATION,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
    EARLIER_TURN_EDITED,
    VOLATILE_SPAN,
    EVICTED,
    NOT_CACHED,
    WINDOW_EXPIRED,
)
HEADER = "x-kvfabric-cache"
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256

# The part of a prompt that changed: "namespace", "system", "tools" or "message:<index>".
NAMESPACE, SYSTEM, TOOLS = "namespace", "system", "tools"
_CAUSE_OF_PART = {NAMESPACE: CACHE_ISOLATION, SYSTEM: SYSTEM_CHANGED, TOOLS: TOOLS_CHANGED}


class TurnDigest(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's prompt as hashes (16 hex digits each), and what it changed."""

    namespace: str
    system: str
    tools: str
    messages: tuple[str, ...]
    num_prompt_tokens: int
    changed: str = ""  # the part it changed against the turn before it ("": none, or first)
    ts_ms: int = 0
    # The system prompt with its volatile spans masked, the kinds found, and the tools in
    # name order: what tells a volatile span from an edit (stability.py).
    system_masked: str = ""
    system_kinds: str = ""  # comma-separated
    tools_in_order: str = ""
    # Its prompt's tokens a pin (cache_control) keeps in the store, and until when (epoch
    # ms): a later turn that misses inside it is flagged (`pin_missed`).
    pinned_tokens: int = 0
    pinned_until_ms: int = 0
    # Staging (staging.py): each tool name's learned wait (s), and, once the turn ended in a
    # tool call, the tools it called and when it ended (epoch ms).
    tool_waits: dict[str, float] = {}
    tools_called: tuple[str, ...] = ()
    ended_ms: int = 0


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    first_miss_token: int  # the first prompt token not served from the cache
    part: str = ""  # where the prompt changed, for the causes that name one
    eviction: Eviction | None = None  # for `evicted`: the first missed block's tombstone
    span: str = ""  # for `volatile_span`: the kinds of span that changed, where known
    pin_missed: bool = False  # the miss began inside a prefix a pin should have kept

    @classmethod
    def of(
        cls, probe: CacheProbe, num_cached_tokens: int, window_replayed: bool = False
    ) -> Diagnosis:
        cause = probe.cause_for(num_cached_tokens, window_replayed)
        eviction = probe.eviction if cause == EVICTED else None
        pin_missed = num_cached_tokens < probe.pinned_tokens
        return cls(cause, num_cached_tokens, probe.part, eviction, probe.span, pin_missed)

    def evicted(self, now: int | None = None) -> dict[str, object]:
        """The tombstone as told: tier, why, seconds ago (at `now`, epoch ms), idle before."""
        e = self.eviction
        if e is None:
            return {}
        ago_s = max((now_ms() if now is None else now) - e.evicted_ms, 0) / 1000
        return {"tier": e.tier, "reason": e.reason, "ago_s": round(ago_s, 1), "idle_s": e.idle_s}

    def header(self) -> str:
        fields = [f"cause={self.cause}", f"first_miss_token={self.first_miss_token}"]
        fields += [f"part={self.part}"] if self.part else []
        fields += [f"span={self.span}"] if self.span else []
        fields += ["pin=missed"] if self.pin_missed else []
        fields += [f"evicted_{k}={v}" for k, v in self.evicted().items()]
        return "; ".join(fields)

    def as_json(self) -> dict[str, object]:
        body: dict[str, object] = {"cause": self.cause, "first_miss_token": self.first_miss_token}
        if self.part:
            body["part"] = self.part
        if self.span:
            body["span"] = self.span
        if self.pin_missed:
            body["pin_missed"] = True
        if self.eviction is not None:
            body["evicted"] = self.evicted()
        return body


def _hash(*texts: str) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")  # ("ab", "c") and ("a", "bc") differ
    return digest.hexdigest()


def _message_hash(message: Message) -> str:
    calls = [f"{c.id}\x01{c.name}\x01{c.arguments}" for c in message.tool_calls]
    return _hash(message.role, message.content, message.tool_call_id, message.name, *calls)


def _tools_hash(tools: Iterable[Tool]) -> str:
    return _hash(
        *(
            f"{t.name}\x01{t.description}\x01{json.dumps(t.parameters, sort_keys=True)}"
            for t in tools
        )
    )


def digest(
    chat: Chat, namespace: str, num_prompt_tokens: int, pins: Sequence[Pin] = ()
) -> TurnDigest:
    """The turn's digest; `changed` is filled in by `compare` once the previous is known.
    `pins`: the request's (cache_control), the longest of which the digest keeps."""
    messages = chat.messages
    has_system = bool(messages) and messages[0].role == "system"
    system = messages[0].content if has_system else ""
    rest = messages[1:] if has_system else messages
    return TurnDigest(
        namespace=_hash(namespace),
        system=_hash(system),
        tools=_tools_hash(chat.tools),
        messages=tuple(_message_hash(m) for m in rest),
        num_prompt_tokens=num_prompt_tokens,
        ts_ms=now_ms(),
        system_masked=_hash(masked(system)),
        system_kinds=",".join(kinds_in(system)),
        tools_in_order=_tools_hash(sorted(chat.tools, key=lambda t: t.name)),
        pinned_tokens=max((p.num_tokens for p in pins), default=0),
        pinned_until_ms=max((now_ms() + p.ttl_s * 1000 for p in pins), default=0),
    )


def changed_part(previous: TurnDigest, current: TurnDigest) -> str:
    """The first part, in rendering order, where `current` stops extending `previous`."""
    if current.namespace != previous.namespace:
        return NAMESPACE
    if current.system != previous.system:
        return SYSTEM
    if current.tools != previous.tools:
        return TOOLS
    for index, before in enumerate(previous.messages):
        if index >= len(current.messages) or current.messages[index] != before:
            return f"message:{index}"
    return ""


def compare(previous: TurnDigest | None, current: TurnDigest) -> TurnDigest:
    """`current` with the part it changed against `previous` (what the next turn reads)."""
    if previous is None:
        return current
    waits = previous.tool_waits
    if previous.tools_called and previous.ended_ms:  # the tools ran until this turn came
        waited_s = max(current.ts_ms - previous.ended_ms, 0) / 1000
        waits = learned(waits, previous.tools_called, waited_s)
    current = msgspec.structs.replace(current, tool_waits=waits)
    changed = changed_part(previous, current)
    if not changed and previous.pinned_until_ms > max(now_ms(), current.pinned_until_ms):
        # An earlier pin of this prefix outlives this turn's own (or its lack of one).
        return msgspec.structs.replace(
            current,
            pinned_tokens=max(previous.pinned_tokens, current.pinned_tokens),
            pinned_until_ms=previous.pinned_until_ms,
        )
    return msgspec.structs.replace(current, changed=changed)


def probe(previous: TurnDigest | None, current: TurnDigest, block_size_tokens: int) -> CacheProbe:
    """What is known before the request runs; `current` as `compare` returned it."""
    if previous is None:
        return CacheProbe(cause=NEVER_SEEN)
    part = current.changed
    if part:
        span = _volatile_kinds(previous, current, part)
        if span:
            return CacheProbe(cause=VOLATILE_SPAN, part=part, span=span)
        if part == previous.changed and part != NAMESPACE:
            return CacheProbe(cause=VOLATILE_SPAN, part=part)
        return CacheProbe(cause=_CAUSE_OF_PART.get(part, EARLIER_TURN_EDITED), part=part)
    # The prompt extends the previous one: every whole block of it could come from the
    # cache, but never the block holding the prompt's last token (it is recomputed).
    sent_before = previous.num_prompt_tokens // block_size_tokens * block_size_tokens
    reusable = (current.num_prompt_tokens - 1) // block_size_tokens * block_size_tokens
    expected = min(sent_before, reusable)
    pinned = 0
    if previous.pinned_until_ms > now_ms():  # what prefill stored of it: whole blocks
        pinned = min(previous.pinned_tokens // block_size_tokens * block_size_tokens, expected)
    return CacheProbe(expected_cached_tokens=expected, pinned_tokens=pinned)


def _volatile_kinds(previous: TurnDigest, current: TurnDigest, part: str) -> str:
    """The kinds of volatile span that alone made `part` change, or "" (an edit, or not
    known: a digest kept before these fields were)."""
    if part == SYSTEM and previous.system_masked and current.system_kinds:
        return current.system_kinds if current.system_masked == previous.system_masked else ""
    if part == TOOLS and previous.tools_in_order == current.tools_in_order != "":
        return TOOL_ORDER
    return ""


def diagnose(
    previous: TurnDigest | None,
    current: TurnDigest,
    num_cached_tokens: int,
    block_size_tokens: int,
) -> Diagnosis:
    """Why the prompt's tokens from `num_cached_tokens` on were not served from the cache.
    `current` as `compare` returned it."""
    return Diagnosis.of(probe(previous, current, block_size_tokens), num_cached_tokens)


def session_key(account: str, session: str) -> str:
    """A bucket key: the session within its account, hashed (any text is a valid key)."""
    return hashlib.sha256(f"{account}\x00{session}".encode()).hexdigest()[:32]


class SessionTurns:
    """Each session's latest `TurnDigest`, in a KV bucket every ingress shares; an entry
    lives `ttl_s` after its turn (bounded retention)."""

    def __init__(self, bus: Bus, ttl_s: float) -> None:
        self.bus, self.ttl_s = bus, ttl_s
        self.bucket = bus.subjects.sessions_bucket

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket, ttl_s=self.ttl_s)

    async def get(self, key: str) -> TurnDigest | None:
        raw = await self.bus.js.kv_get(self.bucket, key)
        if raw is None:
            return None
        try:
            return msgspec.msgpack.decode(raw, type=TurnDigest)
        except msgspec.DecodeError:  # an older layout: as if the session were new
            return None

    async def put(self, key: str, turn: TurnDigest) -> None:
        await self.bus.js.kv_put(self.bucket, key, msgspec.msgpack.encode(turn))


EXCERPT_TOKENS = 48  # of the prompt on each side of the first miss, in an explanation
REQUEST_ID = re.compile(r"[0-9a-f]{32}(-[0-9]{1,3})?")
ID_PREFIXES = ("chatcmpl-", "resp_", "msg_")  # how each protocol names a request


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    """One request's diagnosis, kept for `kvfabric cache explain` and
    GET /v1/kvfabric/cache/explain/{id}: where its prompt first missed, and the prompt's text
    around that token unless its account's cache is isolated from others' (then no text)."""

    request_id: str
    account: str
    model: str
    cause: str
    part: str
    first_miss_token: int
    num_prompt_tokens: int
    has_text: bool
    eviction: Eviction | None = None  # for `evicted`: the first missed block's tombstone
    span: str = ""  # for `volatile_span`: the kinds of span that changed, where known
    before: str = ""  # the prompt's text just before the first missed token
    after: str = ""  # from that token on
    ts_ms: int = 0

    def as_json(self) -> dict[str, object]:
        return msgspec.to_builtins(self)


def request_id_of(name: str) -> str | None:
    """The request id in an id a protocol returned (chatcmpl-..., resp_..., msg_...)."""
    for prefix in ID_PREFIXES:
        name = name.removeprefix(prefix)
    return name if REQUEST_ID.fullmatch(name) else None


class Explanations:
    """Every request's `Explanation`, in a KV bucket every ingress writes; an entry lives
    `ttl_s` (bounded retention). Readable by ingress (for the owning account) and admin."""

    def __init__(self, bus: Bus, ttl_s: float) -> None:
        self.bus, self.ttl_s = bus, ttl_s
        self.bucket = bus.subjects.cache_explain_bucket

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket, ttl_s=self.ttl_s)

    async def put(self, explanation: Explanation) -> None:
        data = msgspec.msgpack.encode(explanation)
        await self.bus.js.kv_put(self.bucket, explanation.request_id, data)

    async def get(self, name: str, account: str | None = None) -> Explanation | None:
        """The request's, if kept (and, with `account`, that account's: another's is as
        absent as one never kept)."""
        request_id = request_id_of(name)
        if request_id is None:
            return None
        raw = await self.bus.js.kv_get(self.bucket, request_id)
        if raw is None:
            return None
        try:
            found = msgspec.msgpack.decode(raw, type=Explanation)
        except msgspec.DecodeError:
            return None
        return found if account is None or found.account == account else None
