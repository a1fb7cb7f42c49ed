"""API keys: `kvf-` + 43 random characters, stored only as their SHA-256, each mapped to the
account billing charges. Shared by every ingress replica and `kvfabric keys` through a
JetStream key-value bucket (`Subjects.api_keys_bucket`), keyed by the hash: a stolen bucket
holds no usable key, and a key is never logged.

A key's public name is its `key_id` (`key_` + the first 12 hex digits of its hash): what
`keys list` shows, usage records carry and `keys revoke` takes.

A key may expire (`expires_s`), and may carry limits of its own besides its account's.
Rotating a key issues a new one with the same account, label and limits and lets the old
one work on for a grace period. Ingress caches lookups for `cache_s` (2 s): the bound on
how long a revoked or expired key still works on any replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass

from shared.accounts import Limits, check_name
from shared.bus import Bus

KEY_PREFIX = "kvf-"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    account: str
    name: str = ""
    created_s: int = 0
    revoked: bool = False
    expires_s: int = 0  # unix time it stops working; 0: never
    limits: Limits = Limits()

    @classmethod
    def of(cls, fields: dict) -> ApiKey:
        return cls(**{**fields, "limits": Limits.of(fields.get("limits"))})

    def is_live(self, now_s: float) -> bool:
        return not self.revoked and not (self.expires_s and now_s >= self.expires_s)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str:
    return "key_" + key_hash(key)[:12]


class KeyStore:
    def __init__(self, bus: Bus, *, cache_s: float = 2.0) -> None:
        self.bus = bus
        self.bucket = bus.subjects.api_keys_bucket
        self.cache_s = cache_s  # a revoked key stops working within this
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket)

    async def create(
        self,
        account: str,
        name: str = "",
        *,
        limits: Limits | None = None,
        expires_s: int = 0,
    ) -> tuple[str, ApiKey]:
        """A new key (returned once, never stored) and its record."""
        check_name(account)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(
            key_id_of(key), account, name, int(time.time()), False, expires_s, limits or Limits()
        )
        await self._put(key_hash(key), record)
        return key, record

    async def list(self) -> list[ApiKey]:
        records = []
        for digest in await self.bus.js.kv_keys(self.bucket):
            raw = await self.bus.js.kv_get(self.bucket, digest)
            if raw is not None:
                records.append(ApiKey.of(json.loads(raw)))
        return sorted(records, key=lambda r: (r.account, r.created_s))

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked (kept, so usage still names it); False if there is none."""
        found = await self._find(key_id)
        if found is None:
            return False
        await self._change(found, revoked=True)
        return True

    async def set_limits(self, key_id: str, **limits: int | str | None) -> ApiKey | None:
        """Change the key's own limits (a limit of 0 is removed); None if there is no key."""
        found = await self._find(key_id)
        if found is None:
            return None
        return await self._change(found, limits=found[1].limits.merged(**limits))

    async def rotate(self, key_id: str, grace_s: int) -> tuple[str, ApiKey, ApiKey] | None:
        """A new key for the same account, label and limits; the old one expires after
        `grace_s` (or when it would have, if sooner). None if there is no live key."""
        found = await self._find(key_id)
        if found is None or not found[1].is_live(time.time()):
            return None
        old = found[1]
        key, new = await self.create(old.account, old.name, limits=old.limits)
        ends = int(time.time()) + grace_s
        expired = await self._change(
            found, expires_s=min(ends, old.expires_s) if old.expires_s else ends
        )
        return key, new, expired

    async def _find(self, key_id: str) -> tuple[str, ApiKey] | None:
        for digest in await self.bus.js.kv_keys(self.bucket):
            if "key_" + digest[:12] == key_id:
                raw = await self.bus.js.kv_get(self.bucket, digest)
                return (digest, ApiKey.of(json.loads(raw))) if raw is not None else None
        return None

    async def _change(self, found: tuple[str, ApiKey], **changes: object) -> ApiKey:
        """Write `found` (a `_find` result) back with `changes`, and forget its cached copy."""
        digest, record = found
        record = dataclasses.replace(record, **changes)  # type: ignore[arg-type]
        await self._put(digest, record)
        self._cache.pop(digest, None)
        return record

    async def _put(self, digest: str, record: ApiKey) -> None:
        await self.bus.js.kv_put(self.bucket, digest, json.dumps(asdict(record)).encode())

    async def lookup(self, key: str) -> ApiKey | None:
        """The live (not revoked, not expired) record of a presented key, cached for `cache_s`."""
        digest = key_hash(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1] if hit[1] is not None and hit[1].is_live(time.time()) else None
        raw = await self.bus.js.kv_get(self.bucket, digest)
        record = ApiKey.of(json.loads(raw)) if raw is not None else None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (now, record)
        return record if record is not None and record.is_live(time.time()) else None
