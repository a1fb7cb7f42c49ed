"""swa-memcache: sliding-window snapshots by the boundary block's hash.

A snapshot up to the memcache's `inline_max_bytes` rides inline in these messages. A larger
one (megabytes: ~20 layers x 128 tokens x K/V x heads x dim) moves over NIXL: the message
carries a `SwaNixlRef` naming the NIXL agent whose registered region holds the bytes, and
the receiving side pulls them (`KvTransferAgent.read`) and checks their XXH3-64.
"""

from __future__ import annotations

import msgspec

from shared.schema.base import Message


class SwaNixlRef(msgspec.Struct, frozen=True, array_like=True):
    """`nbytes` at `offset` in the registered region of the NIXL agent of (`service`,
    `instance_id`), whose metadata is served on `Subjects.nixl_metadata(service)`."""

    service: str
    instance_id: str
    offset: int
    nbytes: int
    checksum: int  # XXH3-64 of the bytes (xxhash.xxh3_64_intdigest)


class SwaGet(Message, tag="swa_get"):
    block_hash: int
    # The caller has a NIXL agent and pulls a large snapshot itself (`SwaGetReply.location`).
    can_read_nixl: bool = False


class SwaGetReply(Message, tag="swa_get_reply"):
    found: bool
    snapshot: bytes = b""
    # Set instead of `snapshot` for a large one: the bytes in the memcache's region, kept in
    # place for `lease_s` after the reply was sent. Pull, check, then send `SwaRelease`.
    location: SwaNixlRef | None = None
    lease_id: int = 0
    lease_s: float = 0.0


class SwaPut(Message, tag="swa_put"):
    block_hash: int
    snapshot: bytes
    # Set (with an empty `snapshot`) for a large one: the memcache pulls the bytes from the
    # caller's region before it replies; the caller keeps them in place until then.
    source: SwaNixlRef | None = None


class SwaPutReply(Message, tag="swa_put_reply"):
    stored: bool
    reason: str = ""  # why not stored: no room, pull failed, checksum mismatch


class SwaRelease(Message, tag="swa_release"):
    """A reader -> the memcache that leased it a snapshot: done pulling (no reply needed)."""

    lease_id: int


class SwaHold(Message, tag="swa_hold"):
    """A prefill worker -> its node's memcache (no reply): keep these snapshots until
    `until_ms` (epoch) at least, past their TTL: a session's window, staged while its agent
    runs a tool (services/ingress/staging.py)."""

    block_hashes: bytes  # packed u64
    until_ms: int


class SwaContains(Message, tag="swa_contains"):
    """An operator or a test -> a node's memcache: which of these boundaries does it hold?
    (Routers do not ask: they keep a map from `SwaHeld` events.)"""

    block_hashes: bytes  # packed u64


class SwaContainsReply(Message, tag="swa_contains_reply"):
    found: bytes  # one byte per asked hash: 1 held, 0 not


class SwaHeld(Message, tag="swa_held"):
    """A memcache -> every router (`Subjects.swa_events`): what it now holds.

    `seq` counts per instance and starts from the clock in microseconds, so a restarted
    instance shows a jump; a receiver that sees a gap asks for a `SwaResync`. `is_full`: the
    batch starts a full state (`added` replaces what the receiver knew of this instance; a
    large state continues in the following non-full batches)."""

    instance_id: str
    node_id: str
    seq: int
    is_full: bool = False
    added: bytes = b""  # packed u64 block hashes now held
    removed: bytes = b""  # packed u64 block hashes no longer held: expired, evicted


class SwaResync(Message, tag="swa_resync"):
    """A router -> the memcaches (`Subjects.swa_resync`): publish your full state again."""

    instance_id: str = ""  # "": every memcache (a router that just started)
    reason: str = ""
