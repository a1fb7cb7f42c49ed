"""Every NATS subject, queue group and stream name of kvfabric, and nothing else.

Subjects are ``<root>.<service>.<verb>[.<instance_id>]``. The root (``kvf.v1``) is
configurable so that tests isolate themselves on one shared server (``t1a2b3c4.kvf.v1``).
A request endpoint is served twice: on its pooled subject in a queue group named after the
service (any instance may answer) and on ``<subject>.<instance_id>`` without a queue group
(the router addresses one worker). No other module spells a subject; a contract test greps
for literals elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_ROOT = "kvf.v1"

# Service names as they appear in subjects, queue groups, discovery and metrics.
INGRESS = "ingress"
ROUTER = "router"
PREFILL = "prefill"
DECODE = "decode"
KV_INDEX = "kv-index"
SWA_MEMCACHE = "swa-memcache"
BILLING = "billing"
# A vLLM engine behind the same messages: prefill and decode in one instance (aggregated).
VLLM_WORKER = "vllm-worker"
SERVICES: tuple[str, ...] = (
    INGRESS,
    ROUTER,
    PREFILL,
    DECODE,
    KV_INDEX,
    SWA_MEMCACHE,
    BILLING,
    VLLM_WORKER,
)

# The NATS micro discovery API: `$SRV.<VERB>[.<name>[.<id>]]`, fixed by the protocol and
# therefore outside our root; instances carry the root in their metadata instead.
DISCOVERY_PREFIX = "$SRV"
DISCOVERY_VERBS: tuple[str, ...] = ("PING", "INFO", "STATS")

# Fixed by NATS itself: request reply inboxes (nats-py's default prefix), JetStream's API,
# acknowledgements and flow control, and the subjects of key-value and object-store buckets.
INBOX_PREFIX = "_INBOX"
JS_PREFIX = "$JS"
KV_PREFIX = "$KV"
OBJ_PREFIX = "$O"

# JetStream: usage records must not be lost (billing consumes them at least once).
USAGE_STREAM = "KVF_USAGE"


def js_pull_next(stream: str, durable: str) -> str:
    """JetStream's API subject for the next batch of a pull consumer."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"


_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_ROOT = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def is_inbox(subject: str) -> bool:
    """A reply inbox (`_INBOX.<token>...`): where a worker may stream a request's chunks."""
    prefix, _, rest = subject.partition(".")
    return (
        prefix == INBOX_PREFIX
        and bool(rest)
        and all(t and "*" not in t and ">" not in t for t in rest.split("."))
    )


def queue_group(service: str) -> str:
    """The queue group of a service's pooled endpoints is the service's own name."""
    return service


def discovery(verb: str, service: str | None = None, instance_id: str | None = None) -> str:
    if verb not in DISCOVERY_VERBS:
        raise ValueError(f"unknown discovery verb {verb!r}")
    parts = [DISCOVERY_PREFIX, verb]
    if service is not None:
        parts.append(service)
        if instance_id is not None:
            parts.append(instance_id)
    return ".".join(parts)


def check_token(value: str, what: str) -> str:
    """A subject token: letters, digits, `_` and `-` (no dots, spaces or wildcards)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+")
    return value


@dataclass(frozen=True)
class Subjects:
    """All subjects under one root."""

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        if not _ROOT.match(self.root):
            raise ValueError(
                f"subject root {self.root!r} must be dot-separated [A-Za-z0-9_-] tokens"
            )

    # -- request endpoints -------------------------------------------------------------
    def endpoint(self, service: str, verb: str) -> str:
        return f"{self.root}.{check_token(service, 'service')}.{check_token(verb, 'verb')}"

    def instance(self, endpoint_subject: str, instance_id: str) -> str:
        return f"{endpoint_subject}.{check_token(instance_id, 'instance id')}"

    @property
    def router_generate(self) -> str:
        return self.endpoint(ROUTER, "generate")

    @property
    def prefill_run(self) -> str:
        return self.endpoint(PREFILL, "run")

    @property
    def decode_run(self) -> str:
        return self.endpoint(DECODE, "run")

    @property
    def vllm_run(self) -> str:
        """router -> an aggregated vLLM worker (per instance): `DecodeJob`, the whole request."""
        return self.endpoint(VLLM_WORKER, "run")

    @property
    def decode_suffix(self) -> str:
        """prefill -> the job's decode worker (per instance): `SuffixReady`, pull the KV."""
        return self.endpoint(DECODE, "suffix")

    @property
    def router_inflight(self) -> str:
        """`InflightNotice`s among router replicas (each ignores its own)."""
        return f"{self.root}.router.inflight"

    @property
    def cancel(self) -> str:
        """`CancelRequest` broadcast: every prefill and decode worker listens."""
        return f"{self.root}.request.cancel"

    @property
    def kv_index_match(self) -> str:
        return self.endpoint(KV_INDEX, "match")

    def kv_index_match_shard(self, shard_id: int) -> str:
        """One shard's match endpoint; its replicas answer it as one queue group."""
        return f"{self.kv_index_match}.shard{shard_id}"

    def kv_index_admin(self, shard_id: int) -> str:
        return f"{self.endpoint(KV_INDEX, 'admin')}.shard{shard_id}"

    def kv_index_rebuild(self, shard_id: int) -> str:
        return f"{self.endpoint(KV_INDEX, 'rebuild')}.shard{shard_id}"

    def kv_resync(self, writer_id: str) -> str:
        """kv-index -> a writer: `ResyncRequest`, answered by a full-state `KvEventBatch`."""
        return f"{self.root}.kv.resync.{check_token(writer_id, 'writer id')}"

    def kv_evict(self, writer_id: str) -> str:
        """kv-index -> a writer: `BlocksRemoved` it evicted; the writer frees those slots."""
        return f"{self.root}.kv.evict.{check_token(writer_id, 'writer id')}"

    @property
    def kv_events_stream(self) -> str:
        return f"KVF_KV_EVENTS_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def responses_bucket(self) -> str:
        """KV bucket: stored OpenAI Responses (`previous_response_id`), shared by ingresses."""
        return f"KVF_RESPONSES_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def sessions_bucket(self) -> str:
        """KV bucket: each agent session's latest turn as hashes, for the cache-miss
        diagnosis (services/ingress/diagnosis.py), shared by ingresses."""
        return f"KVF_SESSIONS_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def cache_explain_bucket(self) -> str:
        """KV bucket: each request's cache-miss diagnosis with the prompt's text around its
        first miss (`kvfabric cache explain`), written by ingresses, read by admin."""
        return f"KVF_CACHE_EXPLAIN_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def accounts_bucket(self) -> str:
        """KV bucket: account settings by name (`kvfabric accounts`), read by every ingress."""
        return f"KVF_ACCOUNTS_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def limits_use(self) -> str:
        """ingress -> every ingress: `LimitUse`, what each admitted (kept by `limits_stream`
        for one window, so a replica that starts late sees the window it joins)."""
        return f"{self.root}.ingress.limits.use"

    @property
    def limits_stream(self) -> str:
        return f"KVF_LIMITS_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def limits_open(self) -> str:
        """ingress -> every ingress, each second: `OpenStreams`, its streams open per scope."""
        return f"{self.root}.ingress.limits.open"

    @property
    def quota_bucket(self) -> str:
        """KV bucket: tokens used per scope and quota period, added to by every ingress."""
        return f"KVF_QUOTA_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def api_keys_bucket(self) -> str:
        """KV bucket: API keys by hash -> account (`kvfabric keys`), read by every ingress."""
        return f"KVF_API_KEYS_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def swa_get(self) -> str:
        return self.endpoint(SWA_MEMCACHE, "get")

    @property
    def swa_put(self) -> str:
        return self.endpoint(SWA_MEMCACHE, "put")

    @property
    def swa_contains(self) -> str:
        return self.endpoint(SWA_MEMCACHE, "contains")

    @property
    def swa_hold(self) -> str:
        """A prefill worker -> its node's memcache: keep snapshots past their TTL (`SwaHold`)."""
        return self.endpoint(SWA_MEMCACHE, "hold")

    @property
    def prefill_stage(self) -> str:
        """ingress -> a prefill worker: keep a session's KV while its tool runs (`StageRequest`)."""
        return self.endpoint(PREFILL, "stage")

    @property
    def swa_release(self) -> str:
        """A reader -> the memcache instance that leased it a snapshot (`SwaRelease`)."""
        return self.endpoint(SWA_MEMCACHE, "release")

    def nixl_metadata(self, service: str) -> str:
        """A worker's NIXL agent metadata (`NixlMetadataRequest` -> `NixlAgentInfo`); a
        peer addresses one worker with `instance(nixl_metadata(service), instance_id)`."""
        return self.endpoint(service, "nixl-metadata")

    def audit(self, action: str) -> str:
        """`AuditRecord`s of admin actions (kept by `audit_stream`): only admin publishes."""
        return f"{self.root}.audit.{check_token(action.replace('.', '_'), 'action')}"

    @property
    def audit_all(self) -> str:
        return f"{self.root}.audit.>"

    @property
    def prefix_guard_audit(self) -> str:
        """`AuditRecord`s of ingress's prefix-guard rewrites (services/ingress/stability.py),
        kept by `audit_stream` too: ingress publishes here, outside admin's `audit.>`."""
        return f"{self.root}.audit_guard.rewrite"

    @property
    def audit_stream(self) -> str:
        return f"KVF_AUDIT_{self.root.replace('.', '_').replace('-', '_')}"

    def drain(self, instance_id: str) -> str:
        """`DrainRequest` to one instance (any service): `kvfabric drain`."""
        return f"{self.root}.control.drain.{check_token(instance_id, 'instance id')}"

    def ping(self, instance_id: str) -> str:
        """An empty request to one instance (any service), answered empty: a caller that
        waits on it learns it is gone at once, from NATS's no-responders reply (its
        subscriptions die with its connection), not a heartbeat timeout later."""
        return f"{self.root}.control.ping.{check_token(instance_id, 'instance id')}"

    # -- events --------------------------------------------------------------------------
    def load(self, service: str, instance_id: str) -> str:
        """`LoadReport` heartbeats of one instance."""
        service, instance_id = check_token(service, "service"), check_token(instance_id, "id")
        return f"{self.root}.load.{service}.{instance_id}"

    @property
    def load_all(self) -> str:
        return f"{self.root}.load.>"

    def kv_events(self, writer_id: str) -> str:
        """`KvEventBatch`es of one writer (prefill or decode worker)."""
        return f"{self.root}.kv.events.{check_token(writer_id, 'writer id')}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.root}.kv.events.*"

    def kv_holdings(self, holder: str) -> str:
        """`HoldingsUpdate`s of one worker's own memory (core NATS: a lost update shows as
        a sequence gap and costs a sync)."""
        return f"{self.root}.kv.holdings.{check_token(holder, 'holder id')}"

    @property
    def kv_holdings_all(self) -> str:
        return f"{self.root}.kv.holdings.*"

    def kv_holdings_sync(self, holder: str) -> str:
        """kv-index -> a worker: `HoldingsSync`, answered by a full `HoldingsUpdate`."""
        return f"{self.root}.kv.holdings_sync.{check_token(holder, 'holder id')}"

    def swa_events(self, instance_id: str) -> str:
        """`SwaHeld` batches of one swa-memcache instance (core NATS: a lost batch shows as
        a sequence gap and costs a resync)."""
        return f"{self.root}.{SWA_MEMCACHE}.events.{check_token(instance_id, 'instance id')}"

    @property
    def swa_events_all(self) -> str:
        return f"{self.root}.{SWA_MEMCACHE}.events.*"

    @property
    def swa_resync(self) -> str:
        """`SwaResync` broadcast: the memcache it names (every one for "") publishes its full
        state on its `swa_events` subject."""
        return f"{self.root}.{SWA_MEMCACHE}.resync"

    def usage(self, service: str) -> str:
        """`UsageRecord`s, captured by the JetStream stream `usage_stream`."""
        return f"{self.root}.usage.{check_token(service, 'service')}"

    @property
    def usage_all(self) -> str:
        return f"{self.root}.usage.>"

    @property
    def usage_dead(self) -> str:
        """billing -> `DeadLetter`s: usage messages it could not ledger, with the reason
        (kept by the stream `usage_dead_stream`; outside `usage.>` so billing never reads
        its own dead letters)."""
        return f"{self.root}.billing.dead"

    @property
    def usage_dead_stream(self) -> str:
        return f"KVF_USAGE_DEAD_{self.root.replace('.', '_').replace('-', '_')}"

    @property
    def usage_stream(self) -> str:
        # Stream names may not contain dots; one stream per root keeps tests isolated.
        return f"{USAGE_STREAM}_{self.root.replace('.', '_').replace('-', '_')}"
