"""What billing measures: the usage consumer's tally (`Counts`, read when scraped): records
ledgered by source, duplicates, dead letters, ledger failures, commit time, and revenue by
kind in pico-CNY (the ledger's own unit: 1 CNY = 10^12), of the request ids new to the
ledger. A decode row that replaces the caller's estimate (a stream whose decode worker died)
changes the ledger's amount by the difference, which this counter does not follow: the
ledger (`kvfabric billing report`) is the account, this is its rate.
"""

from __future__ import annotations

from services.billing.consumer import REVENUE_KINDS, Counts
from services.billing.ledger import SOURCES
from shared.metrics import Metrics


def observe(metrics: Metrics, counts: Counts) -> None:
    m = metrics
    m.counter_from(
        "kvfabric_billing_records_ledgered_total",
        "Usage records the ledger took (new, or decode's replacing the caller's), by source.",
        lambda: counts.num_ledgered_by_source,
        labels={"source": SOURCES},
    )
    m.counter_from(
        "kvfabric_billing_duplicate_records_total",
        "Usage records the ledger had already (redeliveries, repeats): left as they were.",
        lambda: counts.num_duplicates,
    )
    m.counter_from(
        "kvfabric_billing_dead_letters_total",
        "Messages that were no usable usage record, dead-lettered with their reason.",
        lambda: counts.num_dead_letters,
    )
    m.counter_from(
        "kvfabric_billing_ledger_failures_total",
        "Batches the ledger failed to write (delivered again).",
        lambda: counts.num_ledger_failures,
    )
    m.counter_from(
        "kvfabric_billing_batches_total",
        "Batches committed and acknowledged.",
        lambda: counts.num_batches,
    )
    m.counter_from(
        "kvfabric_billing_commit_seconds_total",
        "Time committing batches to the ledger and acknowledging them.",
        lambda: counts.commit_time_ns / 1e9,
    )
    m.counter_from(
        "kvfabric_billing_revenue_pico_cny_total",
        "Money of the request ids new to the ledger, pico-CNY, by kind (cache hit, miss, "
        "output tokens).",
        lambda: counts.revenue_pico_cny,
        labels={"kind": REVENUE_KINDS},
    )
