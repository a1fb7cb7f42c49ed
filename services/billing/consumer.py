"""The usage log into the ledger, exactly once in effect.

A durable pull consumer (`billing`, shared by every billing replica: each message goes to one
of them) fetches `UsageRecord`s in batches. Each batch is priced and written to the ledger in
one transaction, and only then acknowledged: a process killed before the commit leaves its
messages unacknowledged and JetStream delivers them again; one killed after the commit but
before the acks delivers rows the ledger already has, which the database's one-row-per-request
key turns into no-ops. A record the caller published for a stream whose decode worker died
loses to decode's own, whenever both arrive.

A message that is not a usage record (or names a negative count) is dead-lettered: published
with its reason to `usage_dead` (a JetStream stream of its own) and then terminated, so it
is neither lost nor retried forever. A ledger that fails (a database down) naks the batch
with a delay and the loop tries again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry.trace import StatusCode

from services.billing.ledger import SOURCES, Ledger, LedgerRow, RecordResult
from services.billing.pricing import PriceBook, price
from shared import telemetry
from shared.bus import Bus, PulledMessage
from shared.logging import get_logger
from shared.schema import DeadLetter, UsageRecord, decode
from shared.telemetry import REQUEST_ID, TRACEPARENT

log = get_logger(__name__)

DURABLE = "billing"
# The ledger commits in a worker thread, which needs the GIL back after each SQLite step and
# each fsync; at CPython's default 5 ms switch interval it waits that long behind the event
# loop parsing messages. The billing process sets 0.5 ms (measured into SQLite: ~21K ->
# ~24K records/s).
GIL_SWITCH_INTERVAL_S = 0.0005
DEAD_LETTER_MAX_AGE_S = 30 * 86400.0


REVENUE_KINDS = ("hit", "miss", "output")


@dataclass
class Counts:
    """The consumer's own tally: plain integers, a few adds per batch (billing's metrics,
    metrics.py, read them when scraped; a caller waiting for records reads them too)."""

    num_batches: int = 0
    num_ledgered: int = 0  # rows the ledger took (new, or decode replacing the caller's)
    num_duplicates: int = 0  # redeliveries and repeats, already there
    num_dead_letters: int = 0
    num_ledger_failures: int = 0
    commit_time_ns: int = 0  # committing and acknowledging batches, summed
    num_ledgered_by_source: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SOURCES, 0)
    )
    # The money of request ids new to the ledger, pico-CNY by kind.
    revenue_pico_cny: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(REVENUE_KINDS, 0)
    )


class UsageConsumer:
    def __init__(
        self,
        bus: Bus,
        ledger: Ledger,
        prices: PriceBook,
        *,
        batch_size: int = 500,
        fetch_timeout_s: float = 1.0,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 2.0,
    ) -> None:
        self.bus = bus
        self.ledger = ledger
        self.prices = prices
        self.batch_size = batch_size
        self.fetch_timeout_s = fetch_timeout_s
        self.ack_wait_s = ack_wait_s
        self.retry_delay_s = retry_delay_s
        self.counts = Counts()
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        s = self.bus.subjects
        await self.bus.js.ensure_stream(
            s.usage_dead_stream, [s.usage_dead], max_age_s=DEAD_LETTER_MAX_AGE_S
        )
        self._consumer = await self.bus.js.pull(
            s.usage_stream, s.usage_all, DURABLE, ack_wait_s=self.ack_wait_s
        )

    async def run(self) -> None:
        """Until stop(): fetch, price, commit, acknowledge. The next batch is fetched and
        priced while the previous one commits (in a worker thread), one commit at a time.
        Measured here (bench_ledger, batches of 500): ~26K records/s into SQLite, ~12K into
        PostgreSQL; the rest of a record's ~38 us is nats-py's (receiving and acking a
        message with no work at all tops out near 52K/s on this machine)."""
        committing: asyncio.Task[None] | None = None
        try:
            while not self._stopping.is_set():
                try:
                    batch = await self._consumer.fetch(self.batch_size, self.fetch_timeout_s)
                except Exception as exc:  # a NATS outage: the client reconnects; try again
                    log.warning("fetching usage failed", error=str(exc))
                    await asyncio.sleep(self.retry_delay_s)
                    continue
                if not batch:
                    continue
                rows, taken = await self._rows(batch)
                if committing is not None:
                    await committing
                committing = asyncio.create_task(self._commit(rows, taken))
        finally:
            if committing is not None:
                await committing
            await self._consumer.close()  # the durable consumer stays for the next process

    async def stop(self) -> None:
        self._stopping.set()

    async def _rows(
        self, batch: list[PulledMessage]
    ) -> tuple[list[LedgerRow], list[PulledMessage]]:
        rows, taken = [], []
        for msg in batch:
            row = self._row(msg)
            if isinstance(row, str):
                await self._dead_letter(msg, row)
            else:
                rows.append(row)
                taken.append(msg)
        return rows, taken

    async def _commit(self, rows: list[LedgerRow], taken: list[PulledMessage]) -> None:
        started = time.perf_counter_ns()
        started_ns = time.time_ns()
        if rows:
            try:
                result = await asyncio.to_thread(self.ledger.record, rows)
            except Exception as exc:
                self.counts.num_ledger_failures += 1
                log.error(
                    "ledger write failed: the batch is delivered again",
                    error=str(exc),
                    num_records=len(rows),
                )
                _trace_records(rows, taken, started_ns, f"ledger write failed: {exc}")
                for msg in taken:
                    await msg.nak(self.retry_delay_s)
                return
            _trace_records(rows, taken, started_ns, None)
            self._tally(result)
        for msg in taken:  # only now: the rows are committed
            await msg.ack()
        self.counts.num_batches += 1
        self.counts.commit_time_ns += time.perf_counter_ns() - started

    def _tally(self, result: RecordResult) -> None:
        counts = self.counts
        counts.num_ledgered += result.num_inserted + result.num_replaced
        counts.num_duplicates += result.num_duplicates
        for source, num_rows in zip(SOURCES, result.num_ledgered_by_source, strict=True):
            counts.num_ledgered_by_source[source] += num_rows
        for kind, pico_cny in zip(REVENUE_KINDS, result.inserted_pico_cny, strict=True):
            counts.revenue_pico_cny[kind] += pico_cny

    def _row(self, msg: PulledMessage) -> LedgerRow | str:
        """The priced row, or why the message cannot be one (it is dead-lettered)."""
        source = msg.subject.rsplit(".", 1)[-1]  # usage.<service>: decode, or the caller's
        try:
            record = decode(msg.data, UsageRecord)
        except Exception as exc:  # not a UsageRecord at all
            return f"not a UsageRecord: {exc}"
        problem = _problem(record)
        if problem is not None:
            return problem
        at_ms = record.finished_ms or int(time.time() * 1000)
        try:
            charge = price(
                self.prices,
                record.model,
                at_ms,
                record.num_cache_hit_tokens,
                record.num_cache_miss_tokens,
                record.num_output_tokens,
                cache_write_tokens=record.num_cache_write_tokens,
                pin_ttl_s=record.pin_ttl_s,
            )
            return LedgerRow.of(record, source=source, charge=charge)
        except ValueError as exc:  # a source no producer should use, a price that cannot be
            return str(exc)

    async def _dead_letter(self, msg: PulledMessage, reason: str) -> None:
        letter = DeadLetter(
            subject=msg.subject,
            stream_seq=msg.stream_seq,
            reason=reason,
            data=msg.data,
            dead_ms=int(time.time() * 1000),
        )
        try:
            await self.bus.js.publish(
                self.bus.subjects.usage_dead, letter, msg_id=f"dead-{msg.stream_seq}"
            )
        except Exception as exc:  # kept in the usage log: delivered again later
            log.error("dead letter not stored", stream_seq=msg.stream_seq, error=str(exc))
            await msg.nak(self.retry_delay_s)
            return
        log.warning("usage record dead-lettered", stream_seq=msg.stream_seq, reason=reason)
        self.counts.num_dead_letters += 1
        await msg.term()


def _trace_records(
    rows: list[LedgerRow], taken: list[PulledMessage], started_ns: int, error: str | None
) -> None:
    """A `billing record` span for each record that came with its request's trace context
    (the producer's headers): the batch's ledger write, as a step of that request's trace.
    One span per traced record rather than one per batch, so each request's trace ends at
    its own ledger row; a record without a sampled context costs a header lookup."""
    ended_ns = time.time_ns()
    for row, msg in zip(rows, taken, strict=True):  # one row per message taken
        headers = msg.headers
        if TRACEPARENT not in headers:
            continue
        span = telemetry.child_span(
            telemetry.remote_parent(headers), "billing record", start_ns=started_ns
        )
        if span.is_recording():
            span.set_attributes(
                {
                    REQUEST_ID: row.request_id,
                    "kvfabric.source": row.source,
                    "kvfabric.model": row.model,
                    "kvfabric.total_pico_cny": row.total_pico_cny,
                    "kvfabric.batch_size": len(rows),
                }
            )
            if error is not None:
                span.set_status(StatusCode.ERROR, error)
        span.end(end_time=ended_ns)


def _problem(record: UsageRecord) -> str | None:
    if (
        record.request_id
        and record.model
        and record.num_cache_hit_tokens >= 0
        and record.num_cache_miss_tokens >= 0
        and record.num_output_tokens >= 0
    ):
        return None  # (the common case, in one expression: this runs for every record)
    if not record.request_id:
        return "no request_id"
    if not record.model:
        return "no model"
    for name in ("num_cache_hit_tokens", "num_cache_miss_tokens", "num_output_tokens"):
        if getattr(record, name) < 0:
            return f"{name} is negative ({getattr(record, name)})"
    return None
