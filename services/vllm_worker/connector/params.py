"""What a vllm-worker hands its connector with each request it was routed, in vLLM's
`kv_transfer_params` (the request body's field, which reaches the scheduler side as
`request.kv_transfer_params`): the prompt's chain as the caller hashed it, and where the
router's kv-index match found its stored prefix. With them the connector neither hashes the
prompt nor asks kv-index again (no vLLM import here: the worker and the tests read it too).

One base64 string of MessagePack under one key: the chain and the locations stay packed,
8 and 34 bytes a block (~55 KB as base64 for 1,200 blocks). The chain alone as a JSON list
of ints would be ~26 KB against ~13 KB, and vLLM's server would parse it into 1,200 Python
ints on its event loop.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec

from shared.schema import unpack_block_hashes
from shared.schema.inference import BlockLocations

PARAMS_KEY = "kvfabric"


class RoutedPrefix(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: bytes  # packed u64: `GenerateRequest.block_hashes`, every complete prompt block
    cached_blocks: BlockLocations = BlockLocations()  # `DecodeJob.cached_blocks`

    def hashes(self) -> list[int]:
        return unpack_block_hashes(self.block_hashes).tolist()


class RoutedPrefixError(ValueError):
    """`kv_transfer_params` carried our key, but not a `RoutedPrefix`."""


_decoder = msgspec.msgpack.Decoder(RoutedPrefix)


def to_kv_transfer_params(prefix: RoutedPrefix) -> dict[str, str]:
    return {PARAMS_KEY: base64.b64encode(msgspec.msgpack.encode(prefix)).decode("ascii")}


def from_kv_transfer_params(params: dict[str, Any] | None) -> RoutedPrefix | None:
    """The request's routed prefix; None for a request without one (sent to vLLM directly)."""
    if not params or PARAMS_KEY not in params:
        return None
    try:
        prefix = _decoder.decode(base64.b64decode(params[PARAMS_KEY], validate=True))
        unpack_block_hashes(prefix.block_hashes)  # a whole number of u64s
    except (binascii.Error, TypeError, ValueError, msgspec.DecodeError) as exc:
        raise RoutedPrefixError(f"kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from exc
    return prefix
