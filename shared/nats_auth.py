"""Who may do what on NATS: one nkey per role and the subject permissions of each role,
written into the nats-server's own configuration (no operator/JWT mode).

A role is a service kind (ingress, router, prefill, ...), `admin` (the operator's CLI: key
and account management, drains, cache operations) or `client` (a user's tooling that sends
requests to the router directly: `kvfabric generate`). Every service instance of a kind
shares its role's nkey; the permissions are templated on the subject root, so one server
can host several clusters apart.

A credential is an nkey seed in a file of its own (`<dir>/<role>.nk`, mode 0600): the
server's configuration holds only public keys, so it can be read by anyone who runs it.

Permissions are allow lists, one small table per role (`ROLE_GRANTS`) of what its code
publishes and subscribes to, built from `Subjects`; every service adds what the runtime does
(`service_grants`). JetStream is granted per stream, for what nats-py's calls send: a request
the server drops for want of a grant gets no answer, so a missing grant is a 5 s stall, not an
error. `admin_only` is denied to every other role whatever its table says. What permissions
cannot stop: any role may publish and subscribe to any `_INBOX.>` subject (the replies to
its requests and the token streams a request names come there), so a compromised service or
client can read other requests' replies and streams; decode and vLLM workers stream to
whatever subject a request's `stream_inbox` names, within their own grants; and a role that
keeps a stream up to date (`stream_own`) can change its config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import nkeys

from shared.subjects import (
    BILLING,
    DECODE,
    DISCOVERY_PREFIX,
    INBOX_PREFIX,
    INGRESS,
    JS_PREFIX,
    KV_INDEX,
    KV_PREFIX,
    OBJ_PREFIX,
    PREFILL,
    ROUTER,
    SERVICES,
    SWA_MEMCACHE,
    VLLM_WORKER,
    Subjects,
    discovery,
    js_pull_next,
)

ADMIN = "admin"
CLIENT = "client"
ROLES: tuple[str, ...] = (*SERVICES, ADMIN, CLIENT)
SEED_SUFFIX = ".nk"


@dataclass(frozen=True)
class Permissions:
    """One role's subject permissions, as nats-server's `permissions` block reads them
    (a deny wins over an allow)."""

    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()

    def to_config(self) -> dict[str, object]:
        publish: dict[str, object] = {"allow": list(self.publish_allow)}
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        subscribe: dict[str, object] = {"allow": list(self.subscribe_allow)}
        if self.subscribe_deny:
            subscribe["deny"] = list(self.subscribe_deny)
        return {"publish": publish, "subscribe": subscribe}


# -- subjects outside the root, fixed by the NATS protocol ------------------------------------
INBOX_ALL = (
    f"{INBOX_PREFIX}.>"  # request replies, and the token streams a request names (stream_inbox)
)
JS = JS_PREFIX  # JetStream: its API (`$JS.API.*`), acknowledgements and flow control
JS_API = f"{JS}.API"
# KV_PREFIX: a key-value bucket B is the stream KV_B, its keys `$KV.B.<key>`
# OBJ_PREFIX: an object store B is the stream OBJ_B, its chunks and metadata `$O.B.>`
ANY = "any"  # an instance, writer or shard id in a subject built to be made wild (`each`)


def each(subject: str) -> str:
    """`subject` with its last token (an instance, writer or shard id) wild: every one."""
    return subject.rsplit(".", 1)[0] + ".*"


def instances(endpoint: str) -> str:
    """An endpoint's per-instance subjects (`Subjects.instance(endpoint, <any id>)`)."""
    return f"{endpoint}.*"


def endpoint_subjects(endpoint: str) -> tuple[str, str]:
    """An endpoint's pooled subject and every instance's own: what serving it subscribes to
    (shared/bus/endpoints.py), and what a caller that may send to either publishes."""
    return endpoint, instances(endpoint)


def discovery_answers(service: str) -> tuple[str, ...]:
    """What a `DiscoveryResponder` subscribes to: `$SRV.<verb>`, `$SRV.<verb>.<service>`,
    `$SRV.<verb>.<service>.<id>`."""
    return (
        f"{DISCOVERY_PREFIX}.*",
        f"{DISCOVERY_PREFIX}.*.{service}",
        f"{DISCOVERY_PREFIX}.*.{service}.*",
    )


# -- JetStream, granted per stream --------------------------------------------------------
def js_api(*tokens: str) -> str:
    return ".".join((JS_API, *tokens))


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def obj_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def js_basics() -> tuple[str, ...]:
    """Every JetStream user's: account info, and which stream stores a subject (nats-py asks
    after a publish no stream answered, and for a push consumer or object read named without
    its stream)."""
    return js_api("INFO"), js_api("STREAM", "NAMES")


def stream_read(stream: str) -> tuple[str, ...]:
    """Its info (bounds, a bucket opened) and single messages (a key's value, an object's
    metadata), plain or direct."""
    return (
        js_api("STREAM", "INFO", stream),
        js_api("STREAM", "MSG", "GET", stream),
        js_api("DIRECT", "GET", stream),
        js_api("DIRECT", "GET", stream, ">"),
    )


def stream_create(stream: str) -> tuple[str, ...]:
    """Create it where it is missing (`ensure_stream`, `ensure_kv`): an existing stream
    refuses a create with another config, so this changes nothing already there."""
    return js_api("STREAM", "INFO", stream), js_api("STREAM", "CREATE", stream)


def stream_own(stream: str) -> tuple[str, ...]:
    """Create it, and bring an existing one to this role's config or replicas
    (`ensure_stream`, `_raise_replicas`)."""
    return (*stream_create(stream), js_api("STREAM", "UPDATE", stream))


def stream_consume(stream: str) -> tuple[str, ...]:
    """Consumers of it: ordered push ones (`consume`, an object read, a key watch) and
    durable pull ones (`pull`): created, looked up, pulled from, acknowledged, and the
    flow-control replies of ordered ones. (No consumer is deleted by any role's code.)"""
    return (
        js_api("CONSUMER", "CREATE", stream),
        js_api("CONSUMER", "CREATE", stream, ">"),
        js_api("CONSUMER", "DURABLE", "CREATE", stream, ">"),
        js_api("CONSUMER", "INFO", stream, ">"),
        js_pull_next(stream, ">"),
        f"{JS}.ACK.{stream}.>",
        f"{JS}.FC.{stream}.>",
    )


def kv_read(bucket: str) -> tuple[str, ...]:
    """Open a bucket and get keys (`kv_get`), never put."""
    return stream_read(kv_stream(bucket))


def kv_own(bucket: str) -> tuple[str, ...]:
    """A bucket the role creates (`ensure_kv`), reads and puts to (`kv_put`, `kv_add`)."""
    stream = kv_stream(bucket)
    return (*stream_own(stream), *stream_read(stream), f"{KV_PREFIX}.{bucket}.>")


def obj_own(bucket: str) -> tuple[str, ...]:
    """An object store the role creates, reads (an ordered consumer of its chunks) and puts
    to; nats-py's `put` of an existing name purges that name's old chunks."""
    stream = obj_stream(bucket)
    return (
        *stream_own(stream),
        *stream_read(stream),
        *stream_consume(stream),
        f"{OBJ_PREFIX}.{bucket}.>",
        js_api("STREAM", "PURGE", stream),
    )


def kv_index_snapshots(subjects: Subjects) -> str:
    """kv-index's snapshot object store (`KvIndexService.snapshot_bucket`)."""
    return f"{subjects.kv_events_stream}_SNAPSHOTS"


def any_shard(subject_of: Callable[[int], str]) -> str:
    """A kv-index endpoint of every shard (`kv_index_match_shard` ...)."""
    return each(subject_of(0))


# -- what each role does ------------------------------------------------------------------
Grants = tuple[tuple[str, ...], tuple[str, ...]]  # (publish, subscribe)


def service_grants(service: str, s: Subjects) -> Grants:
    """What every service process does (shared/runtime.py, shared/discovery.py): replies
    to requests (its endpoints', drain's, ping's, discovery's) and its own kind's
    heartbeats; it is drained, pinged and discovered."""
    return (
        (INBOX_ALL, each(s.load(service, ANY))),
        (
            INBOX_ALL,
            each(s.drain(ANY)),
            each(s.ping(ANY)),
            *discovery_answers(service),
        ),
    )


def swa_client(s: Subjects) -> tuple[str, ...]:
    """worker/swa_client.py: window snapshots to and from swa-memcache (the node's instance,
    or any), a lease released to the instance that gave it, and that instance's NIXL
    metadata to pull a leased one; its node's instance found through discovery."""
    return (
        *endpoint_subjects(s.swa_put),
        *endpoint_subjects(s.swa_get),
        instances(s.swa_release),
        *endpoint_subjects(s.swa_hold),
        instances(s.nixl_metadata(SWA_MEMCACHE)),
        discovery("STATS", SWA_MEMCACHE),
    )


def kv_writer(s: Subjects) -> Grants:
    """worker/kvstore/writer.py: `KvEventBatch`es to the event log (JetStream), kv-index's
    resync requests and evictions heard; worker/serving/holdings.py: its own memory's
    holdings out, kv-index's syncs heard."""
    return (
        (each(s.kv_events(ANY)), each(s.kv_holdings(ANY)), *js_basics()),
        (each(s.kv_resync(ANY)), each(s.kv_evict(ANY)), each(s.kv_holdings_sync(ANY))),
    )


def _ingress(s: Subjects) -> Grants:
    return (
        (
            # shared/client.py, run for each HTTP request: to any router or the one heard
            # beating; cancels; a stalled decode worker probed.
            *endpoint_subjects(s.router_generate),
            s.cancel,
            each(s.ping(ANY)),
            # The usage of a stream whose decode worker died; the log is created if missing.
            s.usage(INGRESS),
            *stream_create(s.usage_stream),
            # limits.py: admissions (a stream kept a window), open streams, quota counters.
            s.limits_use,
            s.limits_open,
            *stream_own(s.limits_stream),
            *stream_consume(s.limits_stream),
            *kv_own(s.quota_bucket),
            # openai_responses.py: stored responses; diagnosis.py: sessions' latest turns.
            *kv_own(s.responses_bucket),
            *kv_own(s.sessions_bucket),
            *kv_own(s.cache_explain_bucket),
            # staging.py: a session's KV kept on the worker that served it, over a tool call.
            instances(s.prefill_stage),
            # stability.py: the prefix guard's rewrites, into the audit log.
            s.prefix_guard_audit,
            *stream_create(s.audit_stream),
            # API keys and accounts: read, and the bucket created if missing (ensure_kv);
            # never put to nor reconfigured (admin's: see `admin_only`), so an ingress with
            # more js_replicas than admin made them with fails its start (`_raise_replicas`).
            *kv_read(s.api_keys_bucket),
            *stream_create(kv_stream(s.api_keys_bucket)),
            *kv_read(s.accounts_bucket),
            *stream_create(kv_stream(s.accounts_bucket)),
            # models.py: the served models, from discovery.
            discovery("STATS"),
            *js_basics(),
        ),
        (s.load_all, s.limits_open),
    )


def _router(s: Subjects) -> Grants:
    return (
        (
            instances(s.decode_run),
            instances(s.vllm_run),
            instances(s.prefill_run),
            each(s.ping(ANY)),  # a decode worker that did not accept in time
            s.cancel,
            s.router_inflight,
            s.swa_resync,
            any_shard(s.kv_index_match_shard),
        ),
        (
            *endpoint_subjects(s.router_generate),
            s.load_all,
            s.router_inflight,
            s.cancel,
            s.swa_events_all,
        ),
    )


def _prefill(s: Subjects) -> Grants:
    writer_publish, writer_subscribe = kv_writer(s)
    return (
        (
            instances(s.decode_suffix),  # the handoff: decode pulls the staged suffix
            *swa_client(s),
            *writer_publish,
        ),
        (
            *endpoint_subjects(s.prefill_run),
            *endpoint_subjects(s.prefill_stage),  # ingress: a session's KV kept over a tool call
            *endpoint_subjects(s.nixl_metadata(PREFILL)),  # decode and swa-memcache pull from us
            s.cancel,
            *writer_subscribe,
        ),
    )


def _decode(s: Subjects) -> Grants:
    writer_publish, writer_subscribe = kv_writer(s)
    return (
        (
            # Token streams go to the caller's inbox (service_grants' INBOX_ALL).
            instances(s.nixl_metadata(PREFILL)),  # the suffix pulled from prefill
            *swa_client(s),
            *writer_publish,
            s.usage(DECODE),  # a record per request (shared/usage.py), the log created
            *stream_own(s.usage_stream),
        ),
        (
            *endpoint_subjects(s.decode_run),
            *endpoint_subjects(s.decode_suffix),
            *endpoint_subjects(s.nixl_metadata(DECODE)),  # swa-memcache pulls our snapshots
            s.cancel,
            *writer_subscribe,
        ),
    )


def _vllm_worker(s: Subjects) -> Grants:
    writer_publish, writer_subscribe = kv_writer(s)  # its KV connector's store
    return (
        (
            *writer_publish,
            any_shard(s.kv_index_match_shard),  # the connector asks kv-index
            # Its usage is published as decode's (services/vllm_worker/main.py): the
            # engine's own count, which billing prefers.
            s.usage(DECODE),
            *stream_own(s.usage_stream),
        ),
        (*endpoint_subjects(s.vllm_run), s.cancel, *writer_subscribe),
    )


def _kv_index(s: Subjects) -> Grants:
    return (
        (
            each(s.kv_resync(ANY)),
            each(s.kv_evict(ANY)),
            each(s.kv_holdings_sync(ANY)),
            *stream_own(s.kv_events_stream),  # created with its bounds; its info read
            *stream_consume(s.kv_events_stream),  # every replica replays it in order
            *obj_own(kv_index_snapshots(s)),
            *js_basics(),
        ),
        (
            *endpoint_subjects(any_shard(s.kv_index_match_shard)),
            # Served here, asked only by admin (`kvfabric cache`): see `admin_only`.
            *endpoint_subjects(any_shard(s.kv_index_admin)),
            *endpoint_subjects(any_shard(s.kv_index_rebuild)),
            s.kv_holdings_all,
        ),
    )


def _swa_memcache(s: Subjects) -> Grants:
    return (
        (
            each(s.swa_events(ANY)),
            # A large put is pulled from the putter's region (prefill's or decode's agent).
            instances(s.nixl_metadata(PREFILL)),
            instances(s.nixl_metadata(DECODE)),
        ),
        (
            *endpoint_subjects(s.swa_get),
            *endpoint_subjects(s.swa_put),
            *endpoint_subjects(s.swa_release),
            *endpoint_subjects(s.swa_hold),
            *endpoint_subjects(s.swa_contains),
            *endpoint_subjects(s.nixl_metadata(SWA_MEMCACHE)),
            s.swa_resync,
        ),
    )


def _billing(s: Subjects) -> Grants:
    return (
        (
            # The usage log (created as the producers do) and its durable pull consumer,
            # messages acknowledged, refused (nak) or dead-lettered (term).
            *stream_own(s.usage_stream),
            *stream_consume(s.usage_stream),
            s.usage_dead,
            *stream_own(s.usage_dead_stream),
            *js_basics(),
        ),
        (s.load_all,),  # device-hours from the workers' heartbeats
    )


def _client(s: Subjects) -> Grants:
    """`kvfabric generate` (services/admin/generate_cli.py -> shared/client.py): no
    service of its own, so no heartbeats, drain or discovery."""
    return (
        (
            INBOX_ALL,  # JetStream's replies come to our inbox; nothing else is answered
            *endpoint_subjects(s.router_generate),
            s.cancel,
            each(s.ping(ANY)),
            # Its outbox bills a lost stream as ingress does (generate_cli.py).
            s.usage(INGRESS),
            *stream_create(s.usage_stream),
            *js_basics(),
        ),
        (
            INBOX_ALL,  # request replies, and the token stream
            # The router until it answers, then the decode (or vLLM) worker streaming.
            each(s.load(ROUTER, ANY)),
            each(s.load(DECODE, ANY)),
            each(s.load(VLLM_WORKER, ANY)),
        ),
    )


ROLE_GRANTS: dict[str, Callable[[Subjects], Grants]] = {
    INGRESS: _ingress,
    ROUTER: _router,
    PREFILL: _prefill,
    DECODE: _decode,
    KV_INDEX: _kv_index,
    SWA_MEMCACHE: _swa_memcache,
    BILLING: _billing,
    VLLM_WORKER: _vllm_worker,
    CLIENT: _client,
}


def admin_only(s: Subjects) -> tuple[str, ...]:
    """Denied to every role but admin, whatever its allow list says (a deny wins): drains,
    kv-index's cache operations, the audit log, writing the API-key and account buckets,
    and deleting or purging the streams that keep money and keys."""
    protected = (
        kv_stream(s.api_keys_bucket),
        kv_stream(s.accounts_bucket),
        s.usage_stream,
        s.usage_dead_stream,
        s.audit_stream,
        s.kv_events_stream,
    )
    return (
        each(s.drain(ANY)),
        *endpoint_subjects(any_shard(s.kv_index_admin)),
        *endpoint_subjects(any_shard(s.kv_index_rebuild)),
        s.audit_all,
        f"{KV_PREFIX}.{s.api_keys_bucket}.>",
        f"{KV_PREFIX}.{s.accounts_bucket}.>",
        js_api("STREAM", "UPDATE", kv_stream(s.api_keys_bucket)),
        js_api("STREAM", "UPDATE", kv_stream(s.accounts_bucket)),
        js_api("STREAM", "DELETE", ">"),
        js_api("STREAM", "MSG", "DELETE", ">"),
        *(js_api("STREAM", "PURGE", stream) for stream in protected),
    )


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def permissions(role: str, subjects: Subjects) -> Permissions:
    """The subjects `role` may publish and subscribe to under `subjects.root`."""
    if role == ADMIN:
        return Permissions(publish_allow=(">",), subscribe_allow=(">",))
    if role not in ROLE_GRANTS:
        raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(ROLES)}")
    publish, subscribe = ROLE_GRANTS[role](subjects)
    if role in SERVICES:
        base_publish, base_subscribe = service_grants(role, subjects)
        publish, subscribe = (*base_publish, *publish), (*base_subscribe, *subscribe)
    return Permissions(
        publish_allow=_unique(publish),
        subscribe_allow=_unique(subscribe),
        publish_deny=_unique(admin_only(subjects)),
    )


def new_seed() -> bytes:
    """A fresh user nkey seed (`SU...`)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def public_key(seed: bytes) -> str:
    """The public key (`U...`) the server's configuration names for `seed`."""
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def seed_path(directory: Path, role: str) -> Path:
    return directory / f"{role}{SEED_SUFFIX}"


def ensure_credentials(directory: Path, roles: Iterable[str] = ROLES) -> dict[str, str]:
    """A seed file per role in `directory` (an existing one is kept: restarts keep their
    credentials); returns role -> public key."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    keys: dict[str, str] = {}
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(ROLES)}")
        path = seed_path(directory, role)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(new_seed())
        keys[role] = public_key(path.read_bytes().strip())
    return keys


def authorization(users: Mapping[str, str], subjects: Subjects) -> dict[str, object]:
    """nats-server's `authorization` block: each role's public key with its permissions.
    (JSON is valid nats-server configuration.)"""
    return {
        "users": [
            {"nkey": key, "permissions": permissions(role, subjects).to_config()}
            for role, key in sorted(users.items())
        ]
    }


def authorization_conf(users: Mapping[str, str], subjects: Subjects) -> str:
    """The `authorization` block as configuration text to include in a server's file."""
    return "authorization: " + json.dumps(authorization(users, subjects), indent=2) + "\n"
