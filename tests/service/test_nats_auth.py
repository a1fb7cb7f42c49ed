"""The roles' permissions (shared/nats_auth.py) on a real nats-server configured with them:
nkey users in the global account, JetStream on. Who may not connect, what a role may not
publish (the server says so through the client's error callback), and that each role's own
work -- its heartbeats, its JetStream streams, buckets and consumers -- goes through with the
project's own code. A JetStream request the server drops for want of a grant gets no answer,
so every call here is bounded well below nats-py's 5 s: a missing grant fails fast."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.billing.consumer import DURABLE
from services.ingress.limits import Limiter
from services.ingress.openai_responses import ResponseStore
from shared.accounts import AccountStore
from shared.api_keys import KeyStore, key_hash
from shared.bus import Bus
from shared.nats_auth import (
    ADMIN,
    CLIENT,
    authorization_conf,
    ensure_credentials,
    seed_path,
)
from shared.natsd import die_with_parent, find_nats_server, free_port
from shared.schema import KvEventBatch, UsageRecord, UsageStatus
from shared.subjects import BILLING, DECODE, INGRESS, KV_INDEX, PREFILL, Subjects
from shared.testing import unique_root
from shared.testing.waits import eventually
from shared.usage import ensure_usage_stream, usage_publisher

pytestmark = pytest.mark.nats

STEP_S = 5.0  # bounds one step that should take milliseconds
DENIED_TIMEOUT_S = 1.0  # how long a request the server dropped is waited for


@dataclass
class SecuredServer:
    url: str
    subjects: Subjects
    creds: Path


@dataclass
class Connection:
    nc: Client
    errors: list[str] = field(default_factory=list)

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e]


def _start(conf: Path, log: Path, timeout_s: float = 15.0) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
    deadline = time.monotonic() + timeout_s
    while "Server is ready" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise AssertionError(f"nats-server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.02)
    return process


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredServer]:
    """One server for the module, its authorization for a fresh root."""
    directory = tmp_path_factory.mktemp("nats-auth")
    subjects = Subjects(unique_root())
    creds = directory / "creds"
    keys = ensure_credentials(creds)
    port = free_port()
    conf = directory / "nats-server.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{directory / "jetstream"}" }}\n'
        + authorization_conf(keys, subjects)
    )
    process = _start(conf, directory / "nats-server.log")
    try:
        yield SecuredServer(f"nats://127.0.0.1:{port}", subjects, creds)
    finally:
        _stop(process)


Connect = Callable[[str], Awaitable[Connection]]


@pytest_asyncio.fixture
async def connect(server: SecuredServer) -> AsyncIterator[Connect]:
    """`await connect(role)`: a nats-py connection with `role`'s seed, errors collected."""
    opened: list[Connection] = []

    async def open_as(role: str) -> Connection:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())  # nats-py lowercases the server's -ERR text

        nc = await nats.connect(
            server.url,
            nkeys_seed=str(seed_path(server.creds, role)),
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )
        opened.append(Connection(nc, errors))
        return opened[-1]

    yield open_as
    for connection in opened:
        if not connection.nc.is_closed:
            await connection.nc.close()


def bus_of(connection: Connection, server: SecuredServer, role: str) -> Bus:
    return Bus(connection.nc, subjects=server.subjects, service=role, instance_id=f"{role}-0")


async def refused(url: str, **options: object) -> str:
    """What the server said to a connection it would not take."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    try:
        nc = await nats.connect(
            url,
            error_cb=on_error,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
            **options,
        )
    except Exception as exc:
        return " ".join([str(exc), *errors]).lower()
    await nc.close()
    raise AssertionError("the server took the connection")


def usage(request_id: str) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        api_key_id="key-1",
        model="m",
        num_cache_hit_tokens=64,
        num_cache_miss_tokens=10,
        num_output_tokens=3,
        status=UsageStatus.COMPLETED,
        finish_reason="length",
        started_ms=1,
        finished_ms=2,
    )


async def test_a_connection_without_known_credentials_is_refused(
    server: SecuredServer, tmp_path: Path
) -> None:
    assert "authorization violation" in await refused(server.url)
    ensure_credentials(tmp_path / "other", roles=[ADMIN])  # a seed the server does not know
    said = await refused(server.url, nkeys_seed=str(seed_path(tmp_path / "other", ADMIN)))
    assert "authorization violation" in said


async def test_decode_may_not_publish_billing_usage_nor_drains(
    server: SecuredServer, connect: Connect
) -> None:
    s = server.subjects
    decode, billing = await connect(DECODE), await connect(BILLING)
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def on_heartbeat(msg: Msg) -> None:
        heard.put_nowait(msg.subject)

    await billing.nc.subscribe(s.load_all, cb=on_heartbeat)
    await billing.nc.flush()

    await decode.nc.publish(s.load(DECODE, "decode-0"), b"beat")  # its own: allowed
    await decode.nc.publish(s.usage(BILLING), b"forged")
    await decode.nc.publish(s.drain("router-0"), b"{}")
    await decode.nc.flush()
    await eventually(lambda: len(decode.violations()) >= 2, timeout_s=STEP_S)

    violations = " ".join(decode.violations())
    assert f'publish to "{s.usage(BILLING)}"'.lower() in violations
    assert f'publish to "{s.drain("router-0")}"'.lower() in violations
    assert s.load(DECODE, "decode-0").lower() not in violations
    assert await asyncio.wait_for(heard.get(), STEP_S) == s.load(DECODE, "decode-0")
    # Another kind's heartbeats are refused, and billing may not forge any.
    await decode.nc.publish(s.load(PREFILL, "prefill-0"), b"beat")
    await billing.nc.publish(s.usage(DECODE), b"forged")
    await eventually(lambda: len(decode.violations()) >= 3, timeout_s=STEP_S)
    await eventually(lambda: billing.violations(), timeout_s=STEP_S)
    assert heard.empty()


async def test_only_admin_writes_api_keys_which_ingress_reads(
    server: SecuredServer, connect: Connect
) -> None:
    s = server.subjects
    admin = await connect(ADMIN)
    store = KeyStore(bus_of(admin, server, ADMIN))  # `kvfabric keys create`
    async with asyncio.timeout(STEP_S):
        await store.start()  # the bucket
        key, record = await store.create("acme")  # a key's record put

    ingress = await connect(INGRESS)
    js = ingress.nc.jetstream(timeout=DENIED_TIMEOUT_S)
    kv = await js.key_value(s.api_keys_bucket)
    entry = await kv.get(key_hash(key))
    assert record.key_id.encode() in (entry.value or b"")
    with pytest.raises(nats.errors.TimeoutError):  # the server dropped the put: no answer
        await kv.put(key_hash("sk-forged"), b'{"account": "acme"}')
    await eventually(lambda: ingress.violations(), timeout_s=STEP_S)
    assert f"$kv.{s.api_keys_bucket}.".lower() in " ".join(ingress.violations())
    # The project's own read path (ensure_kv on the existing bucket, then a lookup).
    keys = KeyStore(bus_of(ingress, server, INGRESS))
    await asyncio.wait_for(keys.start(), STEP_S)
    found = await asyncio.wait_for(keys.lookup(key), STEP_S)
    assert found is not None and found.account == "acme"

    client = await connect(CLIENT)
    with pytest.raises(nats.errors.TimeoutError):  # not even a look at the bucket
        await client.nc.jetstream(timeout=DENIED_TIMEOUT_S).key_value(s.api_keys_bucket)


async def test_ingress_sets_up_its_buckets_and_streams(
    server: SecuredServer, connect: Connect
) -> None:
    """What ingress does at start and per request with JetStream, each step bounded: a
    missing grant would stall it for nats-py's timeout (and `until_answered`'s retries)."""
    ingress = await connect(INGRESS)
    bus = bus_of(ingress, server, INGRESS)
    responses = ResponseStore(bus, ttl_s=3600.0)
    limiter = Limiter(bus, window_s=60.0)
    async with asyncio.timeout(3 * STEP_S):
        await AccountStore(bus).start()  # creates the accounts bucket if admin has not
        await responses.start()
        await limiter.start()
        await responses.put({"id": "resp_1", "output": []}, [], "acme")
        assert await responses.get("resp_1", "acme") is not None
        assert await bus.js.kv_add(server.subjects.quota_bucket, "key_1.day", 5) == 5
        assert await bus.js.kv_add(server.subjects.quota_bucket, "key_1.day", 2) == 7
        await limiter.stop()
    assert not ingress.violations()


async def test_billing_consumes_the_usage_decode_publishes(
    server: SecuredServer, connect: Connect
) -> None:
    s = server.subjects
    billing, decode, client = await connect(BILLING), await connect(DECODE), await connect(CLIENT)
    billing_bus, decode_bus = bus_of(billing, server, BILLING), bus_of(decode, server, DECODE)
    client_bus = bus_of(client, server, CLIENT)
    async with asyncio.timeout(3 * STEP_S):
        # billing/main.py and consumer.py at start: the usage log, the dead letters' stream,
        # the durable pull consumer.
        await ensure_usage_stream(billing_bus)
        await billing_bus.js.ensure_stream(s.usage_dead_stream, [s.usage_dead])
        consumer = await billing_bus.js.pull(s.usage_stream, s.usage_all, DURABLE)
        try:
            await ensure_usage_stream(decode_bus)  # decode/main.py: the same, at its start
            await usage_publisher(decode_bus, DECODE)(usage("r-1"))
            # `kvfabric generate` bills a lost stream's tokens as ingress does.
            await usage_publisher(client_bus, INGRESS)(usage("r-2"))
            batch = await consumer.fetch(2, timeout_s=1.0)
            assert [m.subject for m in batch] == [s.usage(DECODE), s.usage(INGRESS)]
            await batch[0].ack()
            await billing_bus.js.publish(s.usage_dead, b"dead letter", msg_id="dead-2")
            await batch[1].term()
            # Acknowledgements are publishes nobody answers: settled once the consumer
            # holds nothing unacknowledged.
            while await billing_bus.js.consumer_backlog(s.usage_stream, DURABLE):
                await asyncio.sleep(0.01)
        finally:
            await consumer.close()
    assert not billing.errors and not decode.errors and not client.errors
    # Nor may billing delete the log.
    with pytest.raises(nats.errors.TimeoutError):
        await billing.nc.jetstream(timeout=DENIED_TIMEOUT_S).delete_stream(s.usage_stream)
    assert billing.violations()


async def test_kv_index_keeps_its_log_and_snapshots(
    server: SecuredServer, connect: Connect
) -> None:
    """A writer's batches through the event log to kv-index's ordered consumer, and the
    snapshot object store written twice (nats-py purges the first one's chunks) and read."""
    s = server.subjects
    index, writer = await connect(KV_INDEX), await connect(PREFILL)
    index_bus, writer_bus = bus_of(index, server, KV_INDEX), bus_of(writer, server, PREFILL)
    bucket = f"{s.kv_events_stream}_SNAPSHOTS"  # KvIndexService.snapshot_bucket
    got: asyncio.Queue[KvEventBatch] = asyncio.Queue()

    async def on_batch(batch: KvEventBatch, stream_seq: int) -> None:
        got.put_nowait(batch)

    async with asyncio.timeout(3 * STEP_S):
        await index_bus.js.ensure_stream(s.kv_events_stream, [s.kv_events_all])
        await index_bus.js.stream_bounds(s.kv_events_stream)
        await index_bus.js.consume(s.kv_events_stream, s.kv_events_all, KvEventBatch, on_batch)
        batch = KvEventBatch(writer_id="w-1", seq=1, ts_ms=0, events=())
        await writer_bus.js.publish(s.kv_events("w-1"), batch, msg_id="w-1:1")
        assert await got.get() == batch
        await index_bus.js.put_object(bucket, "shard0-of-1", b"a" * 300_000)
        await index_bus.js.put_object(bucket, "shard0-of-1", b"b" * 300_000, "adopted")
        assert await index_bus.js.get_object(bucket, "shard0-of-1") == b"b" * 300_000
        assert await index_bus.js.object_description(bucket, "shard0-of-1") == "adopted"
    assert not index.errors and not writer.errors
