"""The roles' permission table (shared/nats_auth.py), checked as nats-server reads it: a
subject is allowed when some allow pattern matches it and no deny pattern does (`*` one
token, `>` the rest). The real server's view is tests/service/test_nats_auth.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from shared.nats_auth import (
    ADMIN,
    CLIENT,
    ROLES,
    authorization,
    authorization_conf,
    ensure_credentials,
    permissions,
    seed_path,
)
from shared.subjects import (
    BILLING,
    DECODE,
    INGRESS,
    KV_INDEX,
    PREFILL,
    ROUTER,
    SERVICES,
    SWA_MEMCACHE,
    VLLM_WORKER,
    Subjects,
    discovery,
    js_pull_next,
)

S = Subjects("t1a2b3c4.kvf.v1")
NOT_ADMIN = tuple(r for r in ROLES if r != ADMIN)
KV_WRITERS = {PREFILL, DECODE, VLLM_WORKER}
# Who publishes usage records, and as what: vLLM workers as decode (their engine's own
# count), `kvfabric generate` as ingress (a lost stream's usage, billed by the caller).
USAGE_AS = {DECODE: DECODE, VLLM_WORKER: DECODE, INGRESS: INGRESS, CLIENT: INGRESS}


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    pattern_tokens, tokens = pattern.split("."), subject.split(".")
    for i, token in enumerate(pattern_tokens):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or token not in ("*", tokens[i]):
            return False
    return len(pattern_tokens) == len(tokens)


def may_publish(role: str, subject: str, subjects: Subjects = S) -> bool:
    p = permissions(role, subjects)
    return any(matches(a, subject) for a in p.publish_allow) and not any(
        matches(d, subject) for d in p.publish_deny
    )


def may_subscribe(role: str, subject: str, subjects: Subjects = S) -> bool:
    p = permissions(role, subjects)
    return any(matches(a, subject) for a in p.subscribe_allow) and not any(
        matches(d, subject) for d in p.subscribe_deny
    )


def js(*tokens: str) -> str:
    return ".".join(("$JS", "API", *tokens))


def every_subject(s: Subjects) -> list[str]:
    """A subject of each kind under `s.root`, and JetStream's subjects of its streams."""
    core = [
        s.router_generate,
        s.instance(s.router_generate, "router-0"),
        s.instance(s.prefill_run, "prefill-0"),
        s.instance(s.decode_run, "decode-0"),
        s.instance(s.decode_suffix, "decode-0"),
        s.instance(s.vllm_run, "vllm-0"),
        s.router_inflight,
        s.cancel,
        s.kv_index_match_shard(0),
        s.kv_index_admin(0),
        s.kv_index_rebuild(1),
        s.kv_resync("w-1"),
        s.kv_evict("w-1"),
        s.kv_events("w-1"),
        s.limits_use,
        s.limits_open,
        s.swa_get,
        s.swa_put,
        s.instance(s.swa_release, "swa-0"),
        s.swa_contains,
        s.swa_events("swa-0"),
        s.swa_resync,
        s.instance(s.nixl_metadata(PREFILL), "prefill-0"),
        s.drain("x"),
        s.ping("x"),
        s.load(DECODE, "decode-0"),
        s.usage(DECODE),
        s.usage(INGRESS),
        s.usage_dead,
        s.audit("keys.create"),
    ]
    streams = [
        s.usage_stream,
        s.usage_dead_stream,
        s.kv_events_stream,
        s.limits_stream,
        s.audit_stream,
        f"KV_{s.api_keys_bucket}",
        f"KV_{s.accounts_bucket}",
        f"KV_{s.responses_bucket}",
        f"KV_{s.sessions_bucket}",
        f"KV_{s.cache_explain_bucket}",
        f"KV_{s.quota_bucket}",
        f"OBJ_{s.kv_events_stream}_SNAPSHOTS",
    ]
    api = [
        js(*verb.split("."), stream)
        for stream in streams
        for verb in ("STREAM.INFO", "STREAM.CREATE", "STREAM.UPDATE", "STREAM.MSG.GET")
    ]
    api += [js("CONSUMER", "CREATE", stream) for stream in streams]
    api += [f"$JS.ACK.{stream}.c.1.1.1.1.0" for stream in streams]
    buckets = [
        s.api_keys_bucket,
        s.accounts_bucket,
        s.responses_bucket,
        s.sessions_bucket,
        s.cache_explain_bucket,
        s.quota_bucket,
    ]
    return core + api + [f"$KV.{b}.k" for b in buckets]


def test_the_matcher_reads_wildcards_as_nats_does() -> None:
    assert matches("a.*.c", "a.b.c") and not matches("a.*.c", "a.b.b.c")
    assert matches("a.>", "a.b") and matches("a.>", "a.b.c") and not matches("a.>", "a")
    assert matches("a.b", "a.b") and not matches("a.b", "a.b.c") and not matches("a.b.c", "a.b")


def test_admin_may_do_anything_and_an_unknown_role_nothing() -> None:
    for subject in every_subject(S):
        assert may_publish(ADMIN, subject) and may_subscribe(ADMIN, subject)
    with pytest.raises(ValueError, match="unknown NATS role"):
        permissions("operator", S)


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_usage_is_published_only_as_its_producer(role: str) -> None:
    for service in SERVICES:
        assert may_publish(role, S.usage(service)) == (USAGE_AS.get(role) == service), service
    assert not may_publish(role, S.usage_all)


def test_billing_may_not_forge_usage_and_decode_not_as_ingress() -> None:
    assert not may_publish(BILLING, S.usage(DECODE))
    assert may_publish(DECODE, S.usage(DECODE))  # shared/usage.py: a record per request
    assert not may_publish(DECODE, S.usage(INGRESS))


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_kv_events_come_only_from_kv_writers(role: str) -> None:
    assert may_publish(role, S.kv_events("w-1")) == (role in KV_WRITERS)
    assert may_subscribe(role, S.kv_resync("w-1")) == (role in KV_WRITERS)
    assert may_publish(role, S.kv_resync("w-1")) == (role == KV_INDEX)
    assert may_publish(role, S.kv_evict("w-1")) == (role == KV_INDEX)


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_heartbeats_only_of_its_own_kind(role: str) -> None:
    for service in SERVICES:
        assert may_publish(role, S.load(service, "i-0")) == (role == service), service


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_admin_only_operations(role: str) -> None:
    for subject in (
        S.drain("x"),
        S.kv_index_admin(0),
        S.instance(S.kv_index_admin(2), "kv-index-0"),
        S.kv_index_rebuild(0),
        S.audit("keys.create"),
        f"$KV.{S.api_keys_bucket}.k",
        f"$KV.{S.accounts_bucket}.k",
        js("STREAM", "UPDATE", f"KV_{S.api_keys_bucket}"),
        js("STREAM", "UPDATE", f"KV_{S.accounts_bucket}"),
        js("STREAM", "DELETE", S.usage_stream),
        js("STREAM", "DELETE", f"KV_{S.api_keys_bucket}"),
        js("STREAM", "PURGE", S.usage_stream),
        js("STREAM", "PURGE", f"KV_{S.api_keys_bucket}"),
        js("STREAM", "MSG", "DELETE", S.usage_stream),
    ):
        assert not may_publish(role, subject), subject
        assert may_publish(ADMIN, subject), subject
    assert not may_subscribe(role, f"$KV.{S.api_keys_bucket}.k")
    assert not may_subscribe(role, S.usage(DECODE))


@pytest.mark.parametrize("role", NOT_ADMIN)
@pytest.mark.parametrize("root", ["kvf.v1", "kvf.v2", "t9z8y7x6.kvf.v1", "other"])
def test_another_roots_subjects_are_never_allowed(role: str, root: str) -> None:
    for subject in every_subject(Subjects(root)):
        assert not may_publish(role, subject), subject
        assert not may_subscribe(role, subject), subject


@pytest.mark.parametrize("role", ROLES)
def test_every_role_replies_and_reads_its_inbox(role: str) -> None:
    assert may_publish(role, "_INBOX.x")
    assert may_subscribe(role, "_INBOX.abc.def")


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_nothing_is_granted_wholesale(role: str) -> None:
    p = permissions(role, S)
    for pattern in (*p.publish_allow, *p.subscribe_allow):
        assert pattern not in (">", "$JS.>", "$JS.API.>", "$KV.>", "$O.>", f"{S.root}.>")
        first = pattern.split(".", 1)[0]
        assert pattern.startswith(f"{S.root}.") or first in ("_INBOX", "$SRV", "$JS", "$KV", "$O")
    # Nothing of the default root leaks into another root's table (never hard-coded).
    assert not any(x.startswith("kvf.v1.") for x in (*p.publish_allow, *p.subscribe_allow))


def test_ingress_reads_api_keys_and_accounts_but_never_writes_them() -> None:
    for bucket in (S.api_keys_bucket, S.accounts_bucket):
        stream = f"KV_{bucket}"
        assert may_publish(INGRESS, js("STREAM", "INFO", stream))  # key_value()
        assert may_publish(INGRESS, js("STREAM", "MSG", "GET", stream))  # get
        assert may_publish(INGRESS, js("DIRECT", "GET", stream, f"$KV.{bucket}.k"))
        assert may_publish(INGRESS, js("STREAM", "CREATE", stream))  # ensure_kv on a miss
        assert not may_publish(INGRESS, f"$KV.{bucket}.k")
        assert not may_publish(INGRESS, js("STREAM", "UPDATE", stream))
        for role in (ROUTER, PREFILL, DECODE, BILLING, CLIENT):
            assert not may_publish(role, js("STREAM", "INFO", stream)), role
    own = (S.responses_bucket, S.sessions_bucket, S.cache_explain_bucket, S.quota_bucket)
    for bucket in own:  # read and written
        assert may_publish(INGRESS, f"$KV.{bucket}.k")
        assert may_publish(INGRESS, js("STREAM", "UPDATE", f"KV_{bucket}"))


def test_each_endpoint_is_served_only_by_its_service() -> None:
    served = {
        S.router_generate: ROUTER,
        S.prefill_run: PREFILL,
        S.decode_run: DECODE,
        S.decode_suffix: DECODE,
        S.vllm_run: VLLM_WORKER,
        S.kv_index_match_shard(3): KV_INDEX,
        S.kv_index_admin(0): KV_INDEX,
        S.swa_get: SWA_MEMCACHE,
        S.swa_put: SWA_MEMCACHE,
        S.swa_release: SWA_MEMCACHE,
        S.swa_contains: SWA_MEMCACHE,
        S.nixl_metadata(PREFILL): PREFILL,
        S.nixl_metadata(DECODE): DECODE,
        S.nixl_metadata(SWA_MEMCACHE): SWA_MEMCACHE,
    }
    for endpoint, server in served.items():
        for subject in (endpoint, S.instance(endpoint, "i-0")):
            for role in NOT_ADMIN:
                assert may_subscribe(role, subject) == (role == server), (role, subject)


@pytest.mark.parametrize("role", NOT_ADMIN)
def test_services_are_drained_pinged_and_discovered(role: str) -> None:
    is_service = role in SERVICES
    assert may_subscribe(role, S.drain("i-0")) == is_service
    assert may_subscribe(role, S.ping("i-0")) == is_service
    assert may_subscribe(role, discovery("PING")) == is_service
    assert may_subscribe(role, discovery("STATS", role, "i-0")) == is_service
    other = BILLING if role != BILLING else ROUTER
    assert not may_subscribe(role, discovery("INFO", other))


def test_the_callers_of_the_request_path() -> None:
    for role in (INGRESS, CLIENT):  # shared/client.py
        assert may_publish(role, S.router_generate)
        assert may_publish(role, S.instance(S.router_generate, "router-0"))
        assert may_publish(role, S.cancel)
        assert may_publish(role, S.ping("decode-0"))
        assert not may_publish(role, S.instance(S.decode_run, "decode-0"))
    assert may_subscribe(CLIENT, S.load(DECODE, "decode-0"))  # the streaming worker's beats
    assert not may_subscribe(CLIENT, S.load(BILLING, "billing-0"))
    assert not may_publish(CLIENT, discovery("STATS"))
    assert may_publish(ROUTER, S.instance(S.decode_run, "decode-0"))
    assert not may_publish(ROUTER, S.decode_run)  # the router names a worker
    assert may_publish(PREFILL, S.instance(S.decode_suffix, "decode-0"))
    assert not may_publish(DECODE, S.instance(S.prefill_run, "prefill-0"))


def test_billing_consumes_the_usage_log_and_nothing_else_does() -> None:
    pull = js_pull_next(S.usage_stream, "billing")
    ack = f"$JS.ACK.{S.usage_stream}.billing.1.7.7.1700000000000000000.0"
    for role in NOT_ADMIN:
        assert may_publish(role, pull) == (role == BILLING), role
        assert may_publish(role, ack) == (role == BILLING), role
    assert may_publish(BILLING, S.usage_dead)
    assert may_publish(KV_INDEX, js("STREAM", "PURGE", f"OBJ_{S.kv_events_stream}_SNAPSHOTS"))
    assert not may_publish(KV_INDEX, js("STREAM", "PURGE", S.kv_events_stream))


def test_credentials_are_private_and_kept(tmp_path: Path) -> None:
    directory = tmp_path / "creds"
    keys = ensure_credentials(directory)
    assert set(keys) == set(ROLES)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    seeds = {}
    for role, key in keys.items():
        path = seed_path(directory, role)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert key.startswith("U") and path.read_bytes().startswith(b"SU")
        seeds[role] = path.read_bytes()
    assert ensure_credentials(directory) == keys  # a restart keeps its credentials
    assert {role: seed_path(directory, role).read_bytes() for role in ROLES} == seeds
    with pytest.raises(ValueError, match="unknown NATS role"):
        ensure_credentials(directory, roles=["root"])


def test_the_server_configuration_names_each_roles_key(tmp_path: Path) -> None:
    keys = ensure_credentials(tmp_path / "creds")
    text = authorization_conf(keys, S)
    prefix = "authorization: "
    assert text.startswith(prefix)
    block = json.loads(text[len(prefix) :])
    assert block == authorization(keys, S)
    users = {user["nkey"]: user["permissions"] for user in block["users"]}
    assert set(users) == set(keys.values())
    for role, key in keys.items():
        assert users[key] == permissions(role, S).to_config(), role
    for role in keys:  # public keys only: the file may be read by whoever runs the server
        assert seed_path(tmp_path / "creds", role).read_text().strip() not in text
