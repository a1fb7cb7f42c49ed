from __future__ import annotations

import msgspec
import pytest

from shared.schema import (
    GenerateRequest,
    Message,
    decode,
    encode,
    num_packed_tokens,
    pack_token_ids,
)
from tests.contract.examples import EXAMPLES, GOLDEN_DIR


def _all_message_types() -> set[type]:
    found, todo = set(), [Message]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("shared.schema"):  # not the tests' own messages
                found.add(sub)
            todo.append(sub)
    return found


def test_every_message_type_has_an_example() -> None:
    top_level = {type(m) for m in EXAMPLES.values()}
    nested = {"BlocksStored", "BlocksRemoved", "AllBlocksCleared", "BlocksPinned"}  # in batches
    missing = {t.__name__ for t in _all_message_types()} - {t.__name__ for t in top_level} - nested
    assert not missing, f"add examples (and golden bytes) for {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip(name: str) -> None:
    message = EXAMPLES[name]
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_golden_bytes(name: str) -> None:
    golden = (GOLDEN_DIR / f"{name}.msgpack").read_bytes()
    message = EXAMPLES[name]
    assert encode(message) == golden, "wire format changed: see tests/contract/examples.py"
    assert decode(golden, type(message)) == message


def test_tags_are_unique() -> None:
    tags = [t.__struct_config__.tag for t in _all_message_types()]
    assert len(tags) == len(set(tags))


def test_unknown_fields_are_ignored_by_older_consumers() -> None:
    newer = msgspec.msgpack.encode(
        {
            "type": "generate_request",
            "request_id": "r",
            "model": "m",
            "prompt_token_ids": b"",
            "added_later": 1,
        }
    )
    assert decode(newer, GenerateRequest).request_id == "r"


def test_wrong_tag_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(encode(EXAMPLES["TokenChunk"]), GenerateRequest)


def test_200k_token_prompt_fits_the_max_payload() -> None:
    request = GenerateRequest(
        request_id="r", model="m", prompt_token_ids=pack_token_ids(range(200_000))
    )
    data = encode(request)
    assert num_packed_tokens(request.prompt_token_ids) == 200_000
    # 4 bytes per token plus a little framing: a tenth of the 8 MB the server allows.
    assert len(data) < 200_000 * 4 + 1024
    assert len(data) < 8 * 1024 * 1024 // 8
