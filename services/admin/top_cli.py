"""`kvfabric top`: the cluster live in the terminal. Each refresh finds the instances through
discovery (their state and load, as `kvfabric status` shows them) and scrapes each one's
/metrics; rates are the change between two scrapes over the time between them, so the first
frame comes one interval after the start (`--once` prints that frame and exits).

Cluster figures: HTTP requests per second at ingress, the hit share (prompt tokens decode
took from the cache over all prompt tokens, as billed), output tokens per second, TTFT p50
(ingress' histogram, the observations of the interval; of all so far when the interval has
none) and revenue per GPU-hour (billing's revenue rate over the devices the prefill and
decode workers report in their heartbeats, `num_devices`)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import aiohttp
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shared.bus import Bus
from shared.discovery import Instance, discover
from shared.schema import ServiceError
from shared.subjects import BILLING, DECODE, DEFAULT_ROOT, INGRESS, PREFILL

PICO = 1e12  # billing counts pico-CNY
TTFT = "kvfabric_ingress_time_to_first_token_seconds_bucket"
# What each service's "requests" are: ingress' HTTP answers, billing's records, the
# others' endpoint requests. Its "tokens": decode's output, prefill's computed prompt.
REQUESTS = {
    INGRESS: "kvfabric_ingress_requests_total",
    BILLING: "kvfabric_billing_records_ledgered_total",
}
TOKENS = {
    DECODE: ("kvfabric_decode_output_tokens_total", {}),
    PREFILL: ("kvfabric_prefill_tokens_total", {"source": "computed"}),
}

Samples = dict[tuple[str, frozenset], float]  # (sample name, its labels) -> value


@dataclass(frozen=True)
class Reading:
    """One refresh: who is there, and each one's scrape (None when it failed)."""

    at_s: float
    instances: list[Instance]
    scrapes: dict[str, Samples | None]

    def total(self, name: str, service: str | None = None, **labels: str) -> float:
        """The sum of `name`'s series with these labels, over the instances (of `service`)."""
        wanted = set(labels.items())
        return sum(
            value
            for i in self.instances
            if service in (None, i.service)
            for (sample, sample_labels), value in (self.scrapes.get(i.instance_id) or {}).items()
            if sample == name and wanted <= sample_labels
        )

    def buckets(self, name: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound, summed over the instances."""
        counts: dict[float, float] = {}
        for samples in self.scrapes.values():
            for (sample, labels), value in (samples or {}).items():
                if sample == name:
                    le = float(dict(labels)["le"])
                    counts[le] = counts.get(le, 0.0) + value
        return counts


def parse(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset(
                (k, v) for k, v in s.labels.items() if k not in ("service", "instance")
            )
            found[(s.name, labels)] = s.value
    return found


async def read(bus: Bus, session: aiohttp.ClientSession) -> Reading:
    instances = await discover(bus, timeout_s=0.3)

    async def scrape(instance: Instance) -> Samples | None:
        url = instance.metadata.get("metrics_url")
        if not url:
            return None
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                return parse(await response.text()) if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None  # a process going away between discovery and its scrape

    scrapes = await asyncio.gather(*(scrape(i) for i in instances))
    ids = [i.instance_id for i in instances]
    return Reading(time.monotonic(), instances, dict(zip(ids, scrapes, strict=True)))


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts; None without counts."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for upper in bounds:
        if buckets[upper] >= rank:
            if math.isinf(upper):
                return lower  # above the highest finite bound: that bound, as Prometheus does
            return lower + (upper - lower) * (rank - below) / max(buckets[upper] - below, 1e-12)
        lower, below = upper, buckets[upper]
    return None


def figures(now: Reading, before: Reading) -> dict[str, float | None]:
    """The cluster's headline figures between two readings."""
    seconds = max(now.at_s - before.at_s, 1e-9)

    def delta(name: str, **labels: str) -> float:
        return max(now.total(name, **labels) - before.total(name, **labels), 0.0)

    prompt = delta("kvfabric_decode_prompt_tokens_total")
    hits = delta("kvfabric_decode_cache_hit_tokens_total")
    if prompt == 0:  # nothing ended in the interval: the share so far
        prompt = now.total("kvfabric_decode_prompt_tokens_total")
        hits = now.total("kvfabric_decode_cache_hit_tokens_total")
    window = {
        le: count - before.buckets(TTFT).get(le, 0.0) for le, count in now.buckets(TTFT).items()
    }
    ttft = quantile(0.5, window)
    devices = sum(int(i.load.get("num_devices", 0)) for i in now.instances)
    revenue_per_s = delta("kvfabric_billing_revenue_pico_cny_total") / PICO / seconds
    return {
        "requests": now.total("kvfabric_ingress_requests_total"),
        "requests_per_s": delta("kvfabric_ingress_requests_total") / seconds,
        "hit_share": hits / prompt if prompt else None,
        "tokens_per_s": delta("kvfabric_decode_output_tokens_total") / seconds,
        "ttft_p50_s": ttft if ttft is not None else quantile(0.5, now.buckets(TTFT)),
        "revenue_per_gpu_hour": revenue_per_s * 3600 / devices if devices else None,
    }


def instance_rates(now: Reading, before: Reading, instance: Instance) -> tuple[str, str]:
    """(requests/s, tokens/s) of one instance, "-" where it has none or was not scraped."""
    after, earlier = now.scrapes.get(instance.instance_id), before.scrapes.get(instance.instance_id)
    if after is None or earlier is None:
        return "-", "-"
    seconds = max(now.at_s - before.at_s, 1e-9)

    def rate(name: str, labels: Mapping[str, str]) -> float:
        def total(samples: Samples) -> float:
            wanted = set(labels.items())
            return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)

        return max(total(after) - total(earlier), 0.0) / seconds

    requests = rate(REQUESTS.get(instance.service, "kvfabric_endpoint_requests_total"), {})
    tokens = TOKENS.get(instance.service)
    return f"{requests:.1f}", f"{rate(*tokens):.0f}" if tokens else "-"


def _show(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def render(now: Reading, before: Reading, root: str, frame: int) -> Group:
    f = figures(now, before)
    clock = datetime.now().strftime("%H:%M:%S")
    header = Text.assemble(
        ("kvfabric top", "bold"),
        f"  root {root}  frame {frame}  {clock}\n",
        f"requests {f['requests']:.0f}  ",
        f"req/s {f['requests_per_s']:.1f}  ",
        f"hit share {_show(f['hit_share'], '{:.1%}')}  ",
        f"tokens/s {f['tokens_per_s']:.0f}  ",
        f"TTFT p50 {_show(f['ttft_p50_s'], '{:.3f} s')}  ",
        f"revenue/GPU-h {_show(f['revenue_per_gpu_hour'], 'CNY {:.4f}')}",
    )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in (
        "SERVICE",
        "INSTANCE",
        "MODEL",
        "STATE",
        "INFLIGHT",
        "QUEUED",
        "RUNNING",
        "KV USED/TOTAL",
        "REQ/S",
        "TOKENS/S",
    ):
        table.add_column(column, no_wrap=True)
    for i in now.instances:
        load = i.load
        total = load.get("num_kv_pages_total", 0)
        kv = f"{total - load.get('num_kv_pages_free', 0)}/{total}" if total else "-"
        requests, tokens = instance_rates(now, before, i)
        table.add_row(
            i.service,
            i.instance_id,
            i.metadata.get("model", ""),
            str(load.get("state", "?")),
            str(load.get("num_inflight", 0)),
            str(load.get("num_queued", 0)),
            str(load.get("num_running", 0)),
            kv,
            requests,
            tokens,
        )
    if not now.instances:
        return Group(header, Text(f"no kvfabric instances under root {root!r}"))
    return Group(header, table)


async def run(nats_url: str, root: str, interval_s: float, once: bool, console: Console) -> None:
    bus = await Bus.connect(nats_url, service="admin", root=root, connect_timeout_s=3.0)
    try:
        async with aiohttp.ClientSession() as session:
            before = await read(bus, session)
            await asyncio.sleep(interval_s)
            if once:
                console.print(render(await read(bus, session), before, root, 1))
                return
            with Live(console=console, auto_refresh=False, transient=False) as live:
                frame = 0
                while True:
                    now = await read(bus, session)
                    frame += 1
                    live.update(render(now, before, root, frame), refresh=True)
                    before = now
                    await asyncio.sleep(max(interval_s - (time.monotonic() - now.at_s), 0.0))
    finally:
        await bus.close()


def top_command(
    nats_url: str = typer.Option(
        "nats://127.0.0.1:4222", help="NATS server of the cluster", envvar="KVF_NATS_URL"
    ),
    root: str = typer.Option(DEFAULT_ROOT, help="subject root of the cluster", envvar="KVF_ROOT"),
    interval_s: float = typer.Option(1.0, help="seconds between refreshes"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit (for scripts)"),
) -> None:
    """The cluster live: every instance's state and load, and from their /metrics the request
    rate, hit share, tokens/s, TTFT p50 and revenue per GPU-hour; Ctrl-C stops it."""
    if not interval_s > 0:
        raise typer.BadParameter(f"must be > 0, got {interval_s}", param_hint="--interval-s")
    try:
        asyncio.run(run(nats_url, root, interval_s, once, Console()))
    except ServiceError as exc:
        typer.echo(f"top: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
