"""One process's metrics: typed Prometheus metrics in one registry, read three ways.

Every service declares what it measures here (`prometheus_client` Counters, Gauges and
Histograms) in a `Metrics` of its own: one `CollectorRegistry` per process, not the global
default, so a test can build several. `/metrics` serves the registry in Prometheus' text
format with the constant labels `service` and `instance` (the instance id) on every series;
discovery's STATS and `kvfabric status --json` show `snapshot()` of the same registry, so the
three never disagree.

Names are checked at declaration (ValueError otherwise), by Prometheus' conventions:
`kvfabric_<what>` in snake case; base units spelled out as the last word (`_seconds`,
`_bytes`; never `_ms`, `_kb`, ...); counters end in `_total`, nothing else does; histograms
name their unit (`_seconds`, `_bytes` or `_tokens`).

Labels are bounded: each label is declared with its values (a tuple or an Enum), every
combination becomes a series at declaration (at zero, so a rate exists from the start) and
`Family.labels(...)` refuses a value outside them. Never a request id, an account or any
value a caller chooses.

Two ways a metric gets its value:
- where the thing happens: `counter`, `gauge`, `histogram` return prometheus_client's objects
  (a `Family` of them when labelled). Measured on the 2-core dev machine: `Counter.inc`
  ~2 us, `Histogram.observe` ~5 us, a `Family.labels` lookup ~0.5 us against ~2 us for
  prometheus_client's own `.labels()`; bind a child once where a loop would look it up;
- when scraped: `counter_from`, `gauge_from` take a function that returns the value (or a
  mapping label values -> value; a combination it leaves out is 0). For what a pure core
  object already counts (the snapshot cache, the index, the store) and for state (queue
  depth, KV pages): nothing per request.

`snapshot()` is flat: {"kvfabric_router_decisions_total{outcome=\"routed\"}": 12, ...}, a
series' name and labels as the text format writes them (without the constant labels, which
the instance's identity carries), values as numbers (whole ones as ints). A histogram shows
its `_count` and `_sum`, not its buckets (those are for /metrics).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum
from typing import Any, Generic, TypeVar, overload

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# `<name>_created` series beside every counter and histogram double what a scrape carries
# and say nothing a restart's reset does not: off, for the whole process.
prometheus_client.disable_created_metrics()

# The text format every Prometheus (2.x and 3.x) scrapes. (prometheus_client >= 0.22 calls
# its 1.0.0 variant, UTF-8 names, the latest; ours need no escaping and read the same.)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "kvfabric_"
CONSTANT_LABELS = ("service", "instance")
HISTOGRAM_UNITS = ("seconds", "bytes", "tokens")
# Units a name must not use: what it measures goes in its base unit.
NON_BASE_UNITS = frozenset(
    {
        "ns",
        "us",
        "ms",
        "nanoseconds",
        "microseconds",
        "milliseconds",
        "millis",
        "minutes",
        "hours",
        "days",
        "kb",
        "kib",
        "mb",
        "mib",
        "gb",
        "gib",
        "tb",
        "tib",
        "percent",
    }
)
MAX_SERIES = 256  # per labelled metric: more is a label that is not bounded
_NAME = re.compile(r"kvfabric_[a-z][a-z0-9]*(_[a-z0-9]+)*")
_LABEL = re.compile(r"[a-z][a-z0-9_]*")

# The KV cache's tiers as labels (docs/design.md, 'KV tiers'); a tier named on the wire that is
# none of these is counted as "other" (`tier_label`).
CACHE_TIERS = ("device", "dram", "ssd", "other")

# Latency buckets from a millisecond to two minutes: a decode step to a 200K-token prefill.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
BYTES_BUCKETS = tuple(float(4**k) for k in range(6, 17))  # 4 KiB .. 4 GiB, x4 a step

LabelValues = Iterable[str] | type[Enum]
Labels = Mapping[str, LabelValues]
Read = Callable[[], float | Mapping[Any, float]]
M = TypeVar("M", Counter, Gauge, Histogram)


def tier_label(tier: str) -> str:
    return tier if tier in CACHE_TIERS else "other"


def check_name(name: str, kind: str) -> None:
    """ValueError unless `name` follows the conventions for a metric of `kind`."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"metric name {name!r} must be {PREFIX}<words> in lower snake case (a-z, 0-9, _)"
        )
    words = name.split("_")
    bad_units = NON_BASE_UNITS.intersection(words)
    if bad_units:
        raise ValueError(
            f"metric name {name!r} uses {', '.join(sorted(bad_units))}: name the base unit "
            "(seconds, bytes) and measure in it"
        )
    if kind == "counter" and words[-1] != "total":
        raise ValueError(f"counter name {name!r} must end in _total")
    if kind != "counter" and words[-1] == "total":
        raise ValueError(f"{kind} name {name!r} must not end in _total (counters only)")
    if kind == "histogram" and words[-1] not in HISTOGRAM_UNITS:
        raise ValueError(
            f"histogram name {name!r} must end in its unit: {', '.join(HISTOGRAM_UNITS)}"
        )


def _label_values(labels: Labels | None) -> dict[str, tuple[str, ...]]:
    values: dict[str, tuple[str, ...]] = {}
    for label, allowed in (labels or {}).items():
        if not _LABEL.fullmatch(label) or label in (*CONSTANT_LABELS, "le", "quantile"):
            raise ValueError(f"label name {label!r} is not allowed")
        if isinstance(allowed, type) and issubclass(allowed, Enum):
            allowed = [str(member.value) for member in allowed]
        elif isinstance(allowed, str):
            raise ValueError(f"label {label!r}: give its values as a tuple, not one string")
        values[label] = tuple(dict.fromkeys(str(v) for v in allowed))
        if not values[label]:
            raise ValueError(f"label {label!r} has no values")
    num_series = math.prod(len(v) for v in values.values())
    if num_series > MAX_SERIES:
        raise ValueError(f"{num_series} label combinations: more than {MAX_SERIES}")
    return values


class Family(Generic[M]):
    """A labelled metric's children, one per combination of its declared values, made at
    declaration and found by a dict lookup."""

    def __init__(self, name: str, metric: M, values: dict[str, tuple[str, ...]]) -> None:
        self.name = name
        self.label_names = tuple(values)
        self._children: dict[tuple[str, ...], M] = {
            combo: metric.labels(*combo) for combo in itertools.product(*values.values())
        }

    def labels(self, *values: str) -> M:
        """The child for these label values (an Enum member counts as its value); ValueError
        for a combination not declared."""
        try:
            return self._children[values]
        except KeyError:
            given = dict(zip(self.label_names, values, strict=False))
            raise ValueError(f"{self.name}: labels {given} outside the declared values") from None


class _Observed:
    """A metric whose value a function returns when the registry is collected."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: str,
        read: Read,
        values: dict[str, tuple[str, ...]],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.kind = kind
        self.read = read
        self.label_names = tuple(values)
        self._combos = tuple(itertools.product(*values.values()))

    def _family(self) -> Metric:
        family = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        return family(self.name, self.documentation, labels=self.label_names)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        value = self.read()
        if not self.label_names:
            family.add_metric([], float(value))  # type: ignore[arg-type]
        else:
            assert isinstance(value, Mapping)
            numbers = dict.fromkeys(self._combos, 0.0)  # every combination, as declared ones
            for key, number in value.items():
                combo = tuple(str(part) for part in (key if isinstance(key, tuple) else (key,)))
                if combo not in numbers:
                    raise ValueError(f"{self.name}: labels {combo} outside the declared values")
                numbers[combo] = float(number)
            for combo, number in numbers.items():
                family.add_metric(list(combo), number)
        yield family


class _WithConstantLabels:
    """The inner registry's series, each with the process's constant labels added."""

    def __init__(self, inner: CollectorRegistry, constant: dict[str, str]) -> None:
        self.inner = inner
        self.constant = constant

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labelled.add_sample(s.name, {**self.constant, **s.labels}, s.value, s.timestamp)
            yield labelled


class Metrics:
    """The registry of one process (`service`, `instance_id`): declare, then read."""

    def __init__(self, service: str, instance_id: str) -> None:
        self.service = service
        self.instance_id = instance_id
        self._inner = CollectorRegistry()  # raises on a name declared twice
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            _WithConstantLabels(self._inner, {"service": service, "instance": instance_id})
        )

    # -- declared, updated where it happens -----------------------------------------------
    @overload
    def counter(self, name: str, documentation: str) -> Counter: ...
    @overload
    def counter(self, name: str, documentation: str, *, labels: Labels) -> Family[Counter]: ...
    def counter(
        self, name: str, documentation: str, *, labels: Labels | None = None
    ) -> Counter | Family[Counter]:
        check_name(name, "counter")
        values = _label_values(labels)
        metric = Counter(name, documentation, tuple(values), registry=self._inner)
        return Family(name, metric, values) if values else metric

    @overload
    def gauge(self, name: str, documentation: str) -> Gauge: ...
    @overload
    def gauge(self, name: str, documentation: str, *, labels: Labels) -> Family[Gauge]: ...
    def gauge(
        self, name: str, documentation: str, *, labels: Labels | None = None
    ) -> Gauge | Family[Gauge]:
        check_name(name, "gauge")
        values = _label_values(labels)
        metric = Gauge(name, documentation, tuple(values), registry=self._inner)
        return Family(name, metric, values) if values else metric

    @overload
    def histogram(
        self, name: str, documentation: str, *, buckets: Iterable[float] | None = None
    ) -> Histogram: ...
    @overload
    def histogram(
        self,
        name: str,
        documentation: str,
        *,
        labels: Labels,
        buckets: Iterable[float] | None = None,
    ) -> Family[Histogram]: ...
    def histogram(
        self,
        name: str,
        documentation: str,
        *,
        labels: Labels | None = None,
        buckets: Iterable[float] | None = None,
    ) -> Histogram | Family[Histogram]:
        """Buckets default by unit: LATENCY_BUCKETS_S for seconds, BYTES_BUCKETS for bytes
        (tokens have no default: give them)."""
        check_name(name, "histogram")
        values = _label_values(labels)
        if buckets is None:
            unit = name.rsplit("_", 1)[-1]
            if unit == "tokens":
                raise ValueError(f"histogram {name!r}: give the buckets of a count of tokens")
            buckets = LATENCY_BUCKETS_S if unit == "seconds" else BYTES_BUCKETS
        metric = Histogram(
            name, documentation, tuple(values), registry=self._inner, buckets=tuple(buckets)
        )
        return Family(name, metric, values) if values else metric

    # -- declared, read when scraped ------------------------------------------------------
    def counter_from(
        self, name: str, documentation: str, read: Read, *, labels: Labels | None = None
    ) -> None:
        """A counter whose value `read()` returns (with labels: {label values: value}, the
        values a tuple, or a string for one label). It must never go down."""
        check_name(name, "counter")
        self._inner.register(_Observed(name, documentation, "counter", read, _label_values(labels)))

    def gauge_from(
        self, name: str, documentation: str, read: Read, *, labels: Labels | None = None
    ) -> None:
        """A gauge whose value `read()` returns, as `counter_from`."""
        check_name(name, "gauge")
        self._inner.register(_Observed(name, documentation, "gauge", read, _label_values(labels)))

    # -- reading --------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format (`CONTENT_TYPE`), constant labels included."""
        return prometheus_client.generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Every series as {name{labels}: value}; a histogram's count and sum only."""
        flat: dict[str, float] = {}
        for family in self._inner.collect():
            for s in family.samples:
                if s.name.endswith(("_bucket", "_created")):
                    continue
                value: float = s.value
                if math.isfinite(value) and value.is_integer():
                    value = int(value)
                flat[series_name(s.name, s.labels)] = value
        return flat


def series_name(name: str, labels: Mapping[str, str]) -> str:
    """`name{a="x",b="y"}` as the text format writes a series (the snapshot's keys)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
