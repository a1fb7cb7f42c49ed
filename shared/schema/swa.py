"""swa-memcache: sliding-window snapshots by the boundary block's hash."""

from __future__ import annotations

from shared.schema.base import Message


class SwaGet(Message, tag="swa_get"):
    block_hash: int


class SwaGetReply(Message, tag="swa_get_reply"):
    found: bool
    snapshot: bytes = b""


class SwaPut(Message, tag="swa_put"):
    block_hash: int
    snapshot: bytes


class SwaPutReply(Message, tag="swa_put_reply"):
    stored: bool


class SwaContains(Message, tag="swa_contains"):
    """router -> a node's memcache: which of these boundaries does it hold?"""

    block_hashes: bytes  # packed u64


class SwaContainsReply(Message, tag="swa_contains_reply"):
    found: bytes  # one byte per asked hash: 1 held, 0 not
