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


def decode(data: bytes | memoryview, message_type: type[T]) -> T:
    """Decode `data` as `message_type`; raises `msgspec.DecodeError` (incl. validation)."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decoder.decode(data)


def schema_header(message_type: type) -> str:
    """Value of the schema header: `<tag>/<version>`."""
    tag = message_type.__struct_config__.tag or message_type.__name__
    return f"{tag}/{SCHEMA_VERSION}"
