"""The cache-miss diagnosis's comparison of a session's turns (services/ingress/diagnosis.py):
each cause provoked by the change an agent harness makes, and named."""

from __future__ import annotations

import msgspec

from services.ingress.diagnosis import (
    CACHE_ISOLATION,
    EARLIER_TURN_EDITED,
    NEVER_SEEN,
    NONE,
    NOT_CACHED,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
    VOLATILE_SPAN,
    Diagnosis,
    TurnDigest,
    compare,
    diagnose,
    digest,
    probe,
    request_id_of,
    session_key,
)
from shared.schema import Pin
from shared.tokenizer.chat import Chat, Message, Tool, ToolCall

BLOCK = 16
READ = Tool("read_file", "Read a file.", {"type": "object", "properties": {"path": {}}})
EDIT = Tool("edit_file", "Edit a file.", {"type": "object", "properties": {"diff": {}}})
SYSTEM = "You are a coding agent. Today is 2026-12-07."


def chat(system: str = SYSTEM, tools: tuple[Tool, ...] = (READ, EDIT), turns: int = 1) -> Chat:
    messages = [Message("system", system), Message("user", "Fix the failing test.")]
    for i in range(1, turns):
        call = ToolCall(f"call_{i}", "read_file", f'{{"path": "src/{i}.py"}}')
        messages += [
            Message("assistant", "", (call,)),
            Message("tool", f"contents of src/{i}.py", tool_call_id=f"call_{i}"),
        ]
    return Chat(tuple(messages), tools)


def turn(c: Chat, previous: TurnDigest | None, tokens: int, namespace: str = "") -> TurnDigest:
    return compare(previous, digest(c, namespace, tokens))


def test_a_first_turn_was_never_seen() -> None:
    first = turn(chat(), None, 200)
    assert diagnose(None, first, 0, BLOCK).cause == NEVER_SEEN
    assert first.changed == ""


def test_a_turn_that_extends_the_last_misses_only_what_is_new_or_says_it_was_not_cached() -> None:
    first = turn(chat(turns=1), None, 200)
    second = turn(chat(turns=2), first, 260)
    assert second.changed == ""
    assert diagnose(first, second, 192, BLOCK).cause == NONE  # 200 // 16 * 16: all it could
    missed = diagnose(first, second, 64, BLOCK)
    assert (missed.cause, missed.first_miss_token) == (NOT_CACHED, 64)
    # A prompt shorter than what came before can reuse only its own whole blocks, bar the last.
    short = msgspec.structs.replace(second, num_prompt_tokens=100)
    assert diagnose(first, short, 96, BLOCK).cause == NONE


def test_each_part_that_changed_is_named_first_in_rendering_order() -> None:
    first = turn(chat(turns=3), None, 400)
    system = turn(chat("You are a coding agent. Today is 2026-12-08.", turns=4), first, 500)
    got = diagnose(first, system, 0, BLOCK)
    assert (got.cause, got.part) == (SYSTEM_CHANGED, "system")
    tools = turn(chat(tools=(READ,), turns=4), first, 500)  # one removed
    assert diagnose(first, tools, 48, BLOCK).cause == TOOLS_CHANGED
    reordered = diagnose(first, turn(chat(tools=(EDIT, READ), turns=4), first, 500), 48, BLOCK)
    assert (reordered.cause, reordered.part, reordered.span) == (
        VOLATILE_SPAN,
        "tools",
        "tool_order",
    )
    edited = chat(turns=4)
    messages = list(edited.messages)
    messages[3] = Message("tool", "contents of src/1.py, edited", tool_call_id="call_1")
    edited = Chat(tuple(messages), edited.tools)
    got = diagnose(first, turn(edited, first, 500), 96, BLOCK)
    assert (got.cause, got.part, got.first_miss_token) == (EARLIER_TURN_EDITED, "message:2", 96)
    compacted = Chat(chat().messages[:1] + (Message("user", "Summary so far."),), chat().tools)
    got = diagnose(first, turn(compacted, first, 100), 32, BLOCK)
    assert (got.cause, got.part) == (EARLIER_TURN_EDITED, "message:0")
    both = turn(chat("Another system prompt.", tools=(READ,), turns=4), first, 500)
    assert diagnose(first, both, 0, BLOCK).part == "system"


def test_a_part_that_changes_on_every_turn_is_a_volatile_span() -> None:
    stamps = [f"You are a coding agent. Request nonce {n}." for n in ("a1", "b2", "c3")]
    first = turn(chat(stamps[0], turns=1), None, 200)
    second = turn(chat(stamps[1], turns=2), first, 260)
    assert diagnose(first, second, 0, BLOCK).cause == SYSTEM_CHANGED
    third = turn(chat(stamps[2], turns=3), second, 320)
    got = diagnose(second, third, 0, BLOCK)
    assert (got.cause, got.part) == (VOLATILE_SPAN, "system")
    # A turn where it held still breaks the run: a later change is a change again.
    fourth = turn(chat(stamps[2], turns=4), third, 380)
    fifth = turn(chat(stamps[0], turns=5), fourth, 440)
    assert diagnose(fourth, fifth, 0, BLOCK).cause == SYSTEM_CHANGED


def test_another_cache_namespace_is_isolation_however_often() -> None:
    first = turn(chat(), None, 200, namespace="acct-a")
    second = turn(chat(turns=2), first, 260, namespace="acct-a/salt-1")
    third = turn(chat(turns=3), second, 320, namespace="acct-a/salt-2")
    assert diagnose(first, second, 0, BLOCK).cause == CACHE_ISOLATION
    assert diagnose(second, third, 0, BLOCK).cause == CACHE_ISOLATION


def test_the_header_and_usage_field_and_the_session_key() -> None:
    first = turn(chat(), None, 200)
    edited = turn(chat("Other."), first, 200)
    got = diagnose(first, edited, 32, BLOCK)
    assert got.header() == "cause=system_changed; first_miss_token=32; part=system"
    assert got.as_json() == {"cause": "system_changed", "first_miss_token": 32, "part": "system"}
    assert diagnose(None, first, 0, BLOCK).header() == "cause=never_seen; first_miss_token=0"
    # Sessions are per account: the same id in two accounts are two sessions.
    assert session_key("a", "s") != session_key("b", "s")
    assert len(session_key("a", "ü" * 300)) == 32


def test_an_explanation_is_found_by_any_protocols_name_for_the_request() -> None:
    rid = "0123456789abcdef0123456789abcdef"
    for name in (rid, f"chatcmpl-{rid}", f"resp_{rid}", f"msg_{rid}"):
        assert request_id_of(name) == rid
    assert request_id_of(f"chatcmpl-{rid}-1") == f"{rid}-1"  # choice 1 of n
    for bad in ("", "nope", "ü" * 32, rid.upper(), f"{rid}/../x", f"{rid}.k"):
        assert request_id_of(bad) is None


def test_a_system_prompt_that_changed_only_in_known_volatile_spans_says_which() -> None:
    """A billing header's nonce and a timestamp changed, nothing else: volatile at once,
    naming the kinds; the same change plus an edit elsewhere in the system prompt is an edit."""

    def system(nonce: str, at: str, rule: str = "Be brief.") -> str:
        return (
            f"x-anthropic-billing-header: cc_version=2.0.14; cch={nonce};\n"
            f"You are a coding agent. {rule}\nCurrent time: {at}"
        )

    first = turn(chat(system("1a2b3c4d5e6f7a8b", "2026-12-07T10:00:01Z")), None, 200)
    second = turn(chat(system("9f8e7d6c5b4a3f2e", "2026-12-07T10:00:09Z"), turns=2), first, 260)
    got = diagnose(first, second, 0, BLOCK)
    assert (got.cause, got.part, got.span) == (VOLATILE_SPAN, "system", "billing_header,timestamp")
    assert "span=billing_header,timestamp" in got.header()
    assert got.as_json()["span"] == "billing_header,timestamp"
    # (a turn in between that changed nothing: two changes running are volatile anyway)
    still = turn(chat(system("9f8e7d6c5b4a3f2e", "2026-12-07T10:00:09Z"), turns=3), second, 300)
    edited = system("0f8e7d6c5b4a3f2e", "2026-12-07T10:00:19Z", "Be verbose.")
    assert (
        diagnose(still, turn(chat(edited, turns=4), still, 340), 0, BLOCK).cause == SYSTEM_CHANGED
    )


def test_a_miss_inside_a_prefix_still_pinned_is_flagged() -> None:
    first = compare(None, digest(chat(turns=1), "", 200, (Pin(100, 3600), Pin(170, 300))))
    assert (first.pinned_tokens, first.pinned_until_ms > 0) == (170, True)
    second = turn(chat(turns=2), first, 260)  # no pin of its own: the first's still holds
    assert second.pinned_tokens == 170
    missed = diagnose(first, second, 32, BLOCK)
    assert missed.pin_missed and "pin=missed" in missed.header() and missed.as_json()["pin_missed"]
    assert not diagnose(first, second, 160, BLOCK).pin_missed  # 170 // 16 * 16: all it stored
    ended = msgspec.structs.replace(first, pinned_until_ms=1)  # a pin that ended long ago
    assert not diagnose(ended, turn(chat(turns=2), ended, 260), 32, BLOCK).pin_missed


def test_every_token_hit_but_the_window_recomputed_is_window_expired() -> None:
    first = turn(chat(turns=1), None, 200)
    second = turn(chat(turns=2), first, 260)
    assert diagnose(first, second, 192, BLOCK).cause == NONE
    probe_ = probe(first, second, BLOCK)
    assert Diagnosis.of(probe_, 192, window_replayed=True).cause == "window_expired"
    assert Diagnosis.of(probe_, 64, window_replayed=True).cause == NOT_CACHED  # a miss first
