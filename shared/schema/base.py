"""The base of every cross-service message, and the MessagePack codec."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

# Bumped only for an incompatible change; additive changes (new fields with defaults) keep it.
SCHEMA_VERSION = 2


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """A message on the wire. Subclasses set an explicit, never reused `tag`.

    Evolution rules: add fields only with defaults, never rename or reuse a tag. Decoders
    ignore unknown fields, so an older consumer keeps working with a newer producer.
    """


T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


# Messages that failed to decode, by the type expected: every service exports it
# (`kvfabric_malformed_messages_total`), so garbage on any subject shows, not only in logs.
malformed: dict[str, int] = {}


def decode(data: bytes | memoryview, message_type: type[T]) -> T:
    """Decode `data` as `message_type`; raises `msgspec.DecodeError` (incl. validation),
    counted in `malformed`."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError:
        name = getattr(message_type, "__name__", "other")
        malformed[name] = malformed.get(name, 0) + 1
        raise


def message_types() -> tuple[type[Message], ...]:
    """Every concrete message type (the subclasses of `Message`, at any depth)."""
    found: list[type[Message]] = []
    pending = list(Message.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return tuple(sorted(found, key=lambda c: c.__name__))


def schema_header(message_type: type) -> str:
    """Value of the schema header: `<tag>/<version>`."""
    tag = message_type.__struct_config__.tag or message_type.__name__
    return f"{tag}/{SCHEMA_VERSION}"
