"""Accounts: what the keys of one account share besides its bill. Today that is where its
prompts' KV is cached, its cache scope, which keeps tenants apart: a prefix cached for one
account is never a hit for another, so no tenant can time another's prompts.

Its limits (`Limits`, enforced by ingress: services/ingress/limits.py) apply to all its keys
together; a key may carry limits of its own as well (shared/api_keys.py), and both hold.

Every block hash is namespaced by the request's `cache_salt` (shared/blocks.py); ingress
sets it from the caller's account, never from the request alone:

    scope "account" (the default)  the account's own namespace, "account:NAME"
    scope "group:NAME"             one namespace for every account naming that group (an
                                   organisation's shared system prompt, opted into)
    scope "shared"                 the cluster's unsalted namespace (what `kvfabric generate`
                                   and the dev key use)

A request may narrow its account's namespace further with its own `cache_salt` (one user of
a multi-user application): "<account's>/request:<salt>". It can never widen it.

Settings live in a JetStream key-value bucket (`Subjects.accounts_bucket`), keyed by the
account's name; an account without a record has the defaults. Ingress caches a lookup for
`cache_s`, the bound on how long a change takes to reach every replica.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass

from shared.bus import Bus

SCOPE_ACCOUNT = "account"
SCOPE_SHARED = "shared"
GROUP_PREFIX = "group:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
REQUEST_SALT = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def check_name(name: str, what: str = "account") -> str:
    if not NAME.fullmatch(name):
        raise ValueError(
            f"{what} {name!r}: 1-64 letters, digits, '-' and '_', starting with a letter or digit"
        )
    return name


def check_scope(scope: str) -> str:
    """'account', 'shared' or 'group:NAME'; ValueError saying so otherwise."""
    if scope in (SCOPE_ACCOUNT, SCOPE_SHARED):
        return scope
    if scope.startswith(GROUP_PREFIX):
        check_name(scope.removeprefix(GROUP_PREFIX), "group")
        return scope
    raise ValueError(f"cache scope {scope!r}: use 'account', 'shared' or 'group:NAME'")


def check_request_salt(salt: str) -> str:
    if not REQUEST_SALT.fullmatch(salt):
        raise ValueError("cache_salt: 1-128 printable ASCII characters without spaces")
    return salt


PERIODS = ("day", "month")


@dataclass(frozen=True)
class Limits:
    """What a key or an account may use; None: no limit. Per minute: a sliding 60 s window
    shared by every ingress replica. The token quota counts input and output tokens per UTC
    day or month."""

    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_period: int | None = None
    period: str = "day"
    max_body_bytes: int | None = None
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "period" and value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or unset, got {value!r}")
        if self.period not in PERIODS:
            raise ValueError(f"period must be one of {', '.join(PERIODS)}, got {self.period!r}")

    @classmethod
    def of(cls, fields: dict | None) -> Limits:
        return cls(**fields) if fields else cls()

    def merged(self, **changes: int | str | None) -> Limits:
        """These limits with `changes` (a value of 0 removes that limit)."""
        current = asdict(self)
        for name, value in changes.items():
            if value is not None:
                current[name] = None if value == 0 else value
        return Limits(**current)

    def describe(self) -> str:
        set_ = {k: v for k, v in asdict(self).items() if v is not None and k != "period"}
        if "tokens_per_period" in set_:
            set_["tokens_per_period"] = f"{set_['tokens_per_period']}/{self.period}"
        return ", ".join(f"{k}={v}" for k, v in set_.items()) or "none"


@dataclass(frozen=True)
class Account:
    name: str
    cache_scope: str = SCOPE_ACCOUNT
    updated_s: int = 0
    limits: Limits = Limits()
    # Rewrite known volatile lines of its system prompts before tokenization, so the cached
    # prefix survives them (services/ingress/stability.py); off unless the account opts in.
    prefix_guard: bool = False

    @classmethod
    def of(cls, fields: dict) -> Account:
        return cls(**{**fields, "limits": Limits.of(fields.get("limits"))})

    def cache_salt(self, request_salt: str = "") -> str:
        """The `cache_salt` of this account's request (`request_salt`: the request's own)."""
        if self.cache_scope == SCOPE_SHARED:
            base = ""
        elif self.cache_scope.startswith(GROUP_PREFIX):
            base = self.cache_scope
        else:
            base = f"{SCOPE_ACCOUNT}:{self.name}"
        return f"{base}/request:{request_salt}" if request_salt else base


class AccountStore:
    def __init__(self, bus: Bus, *, cache_s: float = 5.0) -> None:
        self.bus = bus
        self.bucket = bus.subjects.accounts_bucket
        self.cache_s = cache_s  # a changed setting reaches every ingress within this
        self._cache: dict[str, tuple[float, Account]] = {}

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket)

    async def set(
        self,
        name: str,
        *,
        cache_scope: str | None = None,
        prefix_guard: bool | None = None,
        **limits: int | str | None,
    ) -> Account:
        """Change an account's settings (what is not given stays; a limit of 0 is removed)."""
        current = await self._read(check_name(name))
        account = Account(
            name,
            check_scope(cache_scope) if cache_scope is not None else current.cache_scope,
            int(time.time()),
            current.limits.merged(**limits),
            current.prefix_guard if prefix_guard is None else prefix_guard,
        )
        await self.bus.js.kv_put(self.bucket, name, json.dumps(asdict(account)).encode())
        self._cache.pop(name, None)
        return account

    async def _read(self, name: str) -> Account:
        raw = await self.bus.js.kv_get(self.bucket, name) if NAME.fullmatch(name) else None
        return Account.of(json.loads(raw)) if raw is not None else Account(name)

    async def list(self) -> list[Account]:
        accounts = []
        for name in await self.bus.js.kv_keys(self.bucket):
            raw = await self.bus.js.kv_get(self.bucket, name)
            if raw is not None:
                accounts.append(Account.of(json.loads(raw)))
        return sorted(accounts, key=lambda a: a.name)

    async def get(self, name: str) -> Account:
        """The account's settings (the defaults where it has no record), cached."""
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        account = await self._read(name)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[name] = (now, account)
        return account
