"""API keys: `kvf-` + 43 random characters, stored only as their SHA-256, each mapped to the
account billing charges. Shared by every ingress replica and `kvfabric keys` through a
JetStream key-value bucket (`Subjects.api_keys_bucket`), keyed by the hash: a stolen bucket
holds no usable key, and a key is never logged.

A key's public name is its `key_id` (`key_` + the first 12 hex digits of its hash): what
`keys list` shows, usage records carry and `keys revoke` takes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass

from shared.bus import Bus

KEY_PREFIX = "kvf-"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    account: str
    name: str = ""
    created_s: int = 0
    revoked: bool = False


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str:
    return "key_" + key_hash(key)[:12]


class KeyStore:
    def __init__(self, bus: Bus, *, cache_s: float = 5.0) -> None:
        self.bus = bus
        self.bucket = bus.subjects.api_keys_bucket
        self.cache_s = cache_s  # a revoked key stops working within this
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket)

    async def create(self, account: str, name: str = "") -> tuple[str, ApiKey]:
        """A new key (returned once, never stored) and its record."""
        if not account or not account.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"account {account!r}: use letters, digits, '-' and '_'")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(key_id_of(key), account, name, int(time.time()))
        await self.bus.js.kv_put(self.bucket, key_hash(key), json.dumps(asdict(record)).encode())
        return key, record

    async def list(self) -> list[ApiKey]:
        records = []
        for digest in await self.bus.js.kv_keys(self.bucket):
            raw = await self.bus.js.kv_get(self.bucket, digest)
            if raw is not None:
                records.append(ApiKey(**json.loads(raw)))
        return sorted(records, key=lambda r: (r.account, r.created_s))

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked (kept, so usage still names it); False if there is none."""
        for digest in await self.bus.js.kv_keys(self.bucket):
            if "key_" + digest[:12] == key_id:
                raw = await self.bus.js.kv_get(self.bucket, digest)
                if raw is None:
                    return False
                record = ApiKey(**{**json.loads(raw), "revoked": True})
                await self.bus.js.kv_put(self.bucket, digest, json.dumps(asdict(record)).encode())
                self._cache.pop(digest, None)
                return True
        return False

    async def lookup(self, key: str) -> ApiKey | None:
        """The live (unrevoked) record of a presented key, cached for `cache_s`."""
        digest = key_hash(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        raw = await self.bus.js.kv_get(self.bucket, digest)
        record = ApiKey(**json.loads(raw)) if raw is not None else None
        if record is not None and record.revoked:
            record = None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (now, record)
        return record
