"""Billing through real processes: the ledger holds exactly one row per request served, none
lost and none doubled, through kill -9 of the billing process, a NATS server restart and
duplicate publishes; decode's account wins over the caller's; a malformed record is
dead-lettered with its reason; and through `kvfabric up`'s processes, the ledger's hit / miss
/ output tokens are what the HTTP clients were told.

The mock engine serves (real router, store, KV events and usage records; simulated timing).
Every test runs twice: over the embedded SQLite ledger and over a real PostgreSQL server.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from services.admin.launcher import Cluster, Placement
from services.billing.consumer import DURABLE as BILLING_DURABLE
from services.billing.ledger import open_ledger
from shared.bus import Bus
from shared.natsd import die_with_parent
from shared.schema import DeadLetter, UsageRecord, decode
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL
from shared.testing.hosts import HostNetwork, unavailable_reason
from shared.testing.postgres import (  # noqa: F401 (postgres_url: a fixture)
    PostgresServer,
    PostgresUnavailable,
    postgres_url,
    schema_url,
)
from shared.usage import usage_publisher
from tests.e2e.cluster_helpers import CLIENT_HOST, apart, connect, run_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "kvf-billing-test-key"
MOCK = ["--engine", "mock", "--mock-speedup", "50"]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The same cluster over either ledger: the embedded SQLite file `kvfabric up` keeps, or
    a real PostgreSQL server started from the machine's binaries (a schema of its own), on
    the control-plane host of a cluster split over hosts."""
    state_dir = tmp_path_factory.mktemp(f"billing-{request.param}")
    with contextlib.ExitStack() as stack:
        hosts = ["ctl", "node-a", "node-b", CLIENT_HOST]
        net = stack.enter_context(HostNetwork(hosts)) if unavailable_reason() is None else None
        if request.param == "sqlite":
            url = f"sqlite:///{(state_dir / 'billing' / 'ledger.db').resolve()}"
        else:
            url = postgres_schema(request, stack, net)
        for cluster in run_cluster(
            state_dir,
            replicas={BILLING: 1},
            extra_args={
                PREFILL: MOCK,
                DECODE: MOCK,
                INGRESS: ["--dev-api-key", KEY],
                # What the killed replica held comes back after 3 s, not JetStream's default 30.
                BILLING: ["--batch-size", "200", "--ack-wait-s", "3", "--ledger-url", url],
            },
            ready_timeout_s=120,
            hosts=apart,
            network=net,
        ):
            cluster.ledger_url = url  # type: ignore[attr-defined]
            yield cluster


def postgres_schema(
    request: pytest.FixtureRequest, stack: contextlib.ExitStack, net: HostNetwork | None
) -> str:
    """A fresh schema's URL on a PostgreSQL server: one of its own on ctl where the cluster
    is split over hosts (stopped before the hosts go), else the session's on 127.0.0.1."""
    import psycopg

    if net is None:
        server_url = request.getfixturevalue("postgres_url")
    else:
        try:
            server = PostgresServer(host=net["ctl"])
            stack.callback(server.stop)
            server.start()
        except PostgresUnavailable as exc:
            pytest.skip(f"no PostgreSQL server: {exc}")
        server_url = server.url
    schema = f"billing_{uuid.uuid4().hex[:10]}"
    with (
        net[CLIENT_HOST].inside() if net is not None else contextlib.nullcontext(),
        psycopg.connect(server_url, autocommit=True) as conn,
    ):
        conn.execute(f"CREATE SCHEMA {schema}")
    return schema_url(server_url, schema)


def ledger_url(cluster: Cluster) -> str:
    return cluster.ledger_url  # type: ignore[attr-defined]


def billing_child(cluster: Cluster):  # noqa: ANN201
    return next(c for c in cluster.children if c.service == BILLING and c.process.poll() is None)


def ledger_rows(cluster: Cluster, request_ids: list[str], timeout_s: float = 60.0) -> dict:
    """The ledger's rows of `request_ids` (None where missing), once all are there or
    `timeout_s` passed."""
    ledger = open_ledger(ledger_url(cluster))
    try:
        deadline = time.monotonic() + timeout_s
        found: dict = {}
        while True:
            for rid in request_ids:
                if found.get(rid) is None:
                    found[rid] = ledger.get(rid)
            if all(found.values()) or time.monotonic() > deadline:
                return found
            time.sleep(0.3)
    finally:
        ledger.close()


async def until_billed(bus: Bus, timeout_s: float = 60.0) -> None:
    """Once billing's consumer has committed and acknowledged every usage record stored so
    far (it acknowledges only after the ledger's commit)."""
    deadline = time.monotonic() + timeout_s
    while await bus.js.consumer_backlog(bus.subjects.usage_stream, BILLING_DURABLE):
        assert time.monotonic() < deadline, "billing did not work through the usage log"
        await asyncio.sleep(0.05)


def record(request_id: str, i: int, **fields) -> UsageRecord:  # noqa: ANN003
    base = {
        "request_id": request_id,
        "api_key_id": "key_test",
        "account": "acme",
        "model": "tiny-coder",
        "num_cache_hit_tokens": 64 * i,
        "num_cache_miss_tokens": 10 + i,
        "num_output_tokens": 1 + i % 7,
        "finished_ms": 1_790_000_000_000 + i,
    }
    return UsageRecord(**{**base, **fields})


async def publish(
    bus: Bus, records: list[UsageRecord], service: str = DECODE, msg_prefix: str = ""
) -> None:
    subject = bus.subjects.usage(service)
    for r in records:
        await bus.js.publish(subject, r, msg_id=msg_prefix + r.request_id)


def test_decode_account_wins_over_the_callers_estimate(cluster: Cluster) -> None:
    estimate = record("both-1", 3, num_output_tokens=2, status="failed")
    real = record("both-1", 3, num_output_tokens=9)
    late = record("both-2", 4, num_output_tokens=1)
    first = record("both-2", 4, num_output_tokens=8)

    async def run() -> None:
        bus = await connect(cluster)
        try:
            # As the producers publish: JetStream keeps both records of a request
            caller, decode = usage_publisher(bus, INGRESS), usage_publisher(bus, DECODE)
            await caller(estimate)  # the caller lost the stream, and is stored first
            await decode(real)
            await decode(first)
            await until_billed(bus)  # decode's row of both-2 is in the ledger
            await caller(late)  # a late estimate loses too
            await until_billed(bus)
        finally:
            await bus.close()

    asyncio.run(run())
    rows = ledger_rows(cluster, ["both-1", "both-2"])
    assert (rows["both-1"].num_output_tokens, rows["both-1"].source) == (9, "decode")
    assert (rows["both-2"].num_output_tokens, rows["both-2"].source) == (8, "decode")


def test_a_malformed_record_is_dead_lettered_with_its_reason(cluster: Cluster) -> None:
    async def run() -> list[DeadLetter]:
        bus = await connect(cluster)
        letters: list[DeadLetter] = []
        try:
            await bus.js.publish(bus.subjects.usage(DECODE), b"\x93not a record", msg_id="junk-1")
            await publish(bus, [record("neg-1", 1, num_output_tokens=-5)])
            subjects = bus.subjects

            async def on_letter(letter: DeadLetter, seq: int) -> None:
                letters.append(letter)

            sub = await bus.js.consume(
                subjects.usage_dead_stream, subjects.usage_dead, DeadLetter, on_letter
            )
            deadline = time.monotonic() + 30
            while len(letters) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await bus.unsubscribe(sub)
            return letters
        finally:
            await bus.close()

    letters = asyncio.run(run())
    reasons = {decode_id(letter): letter.reason for letter in letters}
    assert any("not a UsageRecord" in r for r in reasons.values()), reasons
    assert any("num_output_tokens is negative" in r for r in reasons.values()), reasons
    assert ledger_rows(cluster, ["neg-1"], timeout_s=1)["neg-1"] is None


def decode_id(letter: DeadLetter) -> str:
    try:
        return decode(letter.data, UsageRecord).request_id
    except ValueError:  # msgspec's DecodeError: the junk that was dead-lettered
        return f"seq-{letter.stream_seq}"


def test_the_ledger_matches_what_clients_were_told(cluster: Cluster) -> None:
    url = cluster.http_urls[0]
    told = {}
    run = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as c:
        for i in range(12):
            messages = [
                {"role": "system", "content": "You write Python. " * 30},
                {"role": "user", "content": f"Task {i % 3}: sort a list."},
            ]
            r = c.post(
                "/v1/chat/completions",
                json={"model": "tiny-coder", "messages": messages, "max_tokens": 8},
                headers={"x-session-id": f"{run}-{i % 3}"},  # three sessions of four turns
            )
            assert r.status_code == 200, r.text
            body = r.json()
            told[body["id"].removeprefix("chatcmpl-")] = body["usage"]
    rows = ledger_rows(cluster, list(told), timeout_s=30)
    assert all(rows.values()), [rid for rid, row in rows.items() if row is None]
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in told.values()) > 0
    for rid, usage in told.items():
        row = rows[rid]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert (row.num_cache_hit_tokens, row.num_cache_miss_tokens, row.num_output_tokens) == (
            cached,
            usage["prompt_tokens"] - cached,
            usage["completion_tokens"],
        )
        assert row.account == "dev" and row.source == "decode" and row.total_pico_cny > 0
        assert row.cache_miss_cause == usage["kvfabric_cache"]["cause"]
    causes = [u["kvfabric_cache"]["cause"] for u in told.values()]
    assert causes[:3] == ["never_seen"] * 3  # each session's first turn
    assert set(causes[3:]) <= {"none", "not_cached"}  # the same prompt again


# Last: it restarts the NATS server under the cluster.
def test_through_kill_restarts_and_duplicates_each_request_is_one_row(cluster: Cluster) -> None:
    records = [record(f"once-{i:05d}", i) for i in range(3000)]

    async def run() -> None:
        bus = await connect(cluster)
        try:
            await publish(bus, records[:1500])
            # kill -9 while it works through them; a new process takes over the consumer
            child = billing_child(cluster)
            await asyncio.sleep(0.3)
            child.process.kill()
            child.process.wait(10)
            await publish(bus, records[1500:2200])
            with child.log_path.open("ab") as log:
                replacement = subprocess.Popen(
                    child.process.args,
                    env=child.env,  # its role's NATS credentials
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            child.process = replacement
            # duplicates under new message ids (so JetStream keeps them): the ledger must
            await publish(bus, records[:500], msg_prefix="dup-")
            await publish(bus, records[2200:])
        finally:
            await bus.close()

    asyncio.run(run())
    # the NATS server restarts under it (JetStream keeps the log and the consumer)
    assert cluster.nats is not None
    cluster.nats.stop()
    with (cluster.spec.nats_placement or Placement()).entered():  # on its own host
        cluster.nats.start()  # the same port and store
    rows = ledger_rows(cluster, [r.request_id for r in records], timeout_s=90)
    missing = [rid for rid, row in rows.items() if row is None]
    assert not missing, f"{len(missing)} requests missing, e.g. {missing[:3]}"
    # One row each is the table's primary key: the duplicates and redeliveries were no-ops,
    # as the service's own counters say.
    for r in records[::97]:
        row = rows[r.request_id]
        assert (row.num_cache_hit_tokens, row.num_cache_miss_tokens, row.num_output_tokens) == (
            r.num_cache_hit_tokens,
            r.num_cache_miss_tokens,
            r.num_output_tokens,
        )
        assert row.account == "acme" and row.source == "decode"


def _device_ms(url: str) -> int:
    ledger = open_ledger(url)
    try:
        return ledger.device_ms()
    finally:
        ledger.close()


def test_reports_from_the_cli(cluster: Cluster) -> None:
    """`kvfabric billing report|usage` over the same ledger: JSON sums equal the rows'."""
    import json
    import sys
    from pathlib import Path

    kvfabric = str(Path(sys.executable).parent / "kvfabric")
    url = ledger_url(cluster)
    # Billing writes the workers' heartbeat spans every few seconds: until a flush spans two
    # heartbeats of one worker, the ledger holds no device time.
    deadline = time.monotonic() + 30
    while not _device_ms(url):
        assert time.monotonic() < deadline, "no device time reached the ledger"
        time.sleep(0.5)
    out = subprocess.run(
        [kvfabric, "billing", "report", "--by", "account", "--ledger-url", url, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    report = json.loads(out)
    by_account = {r["key"]: r for r in report["rows"]}
    # the workers' heartbeats gave device-hours, so revenue per GPU-hour is known
    assert float(report["device_hours"]) > 0 and report["revenue_per_device_hour_cny"]
    ledger = open_ledger(url)
    try:
        (dev,) = ledger.usage("dev")
    finally:
        ledger.close()
    assert by_account["dev"]["num_requests"] == dev.num_requests > 0
    assert by_account["dev"]["total_pico_cny"] == str(dev.total_pico_cny)
    table = subprocess.run(
        [
            kvfabric,
            "billing",
            "usage",
            "--account",
            "dev",
            "--ledger-url",
            url,
            "--usd-rate",
            "0.145",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "tiny-coder" in table and "revenue mix (hit / miss / output)" in table
    assert "USD total" in table
    text = subprocess.run(
        [kvfabric, "billing", "report", "--ledger-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "revenue per GPU-hour: CNY" in text
