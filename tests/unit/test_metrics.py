"""shared/metrics.py: naming rules enforced at declaration, bounded labels, the snapshot
discovery shows and the text /metrics serves, both from one registry."""

from __future__ import annotations

from enum import StrEnum

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import MAX_SERIES, Metrics, check_name


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


@pytest.mark.parametrize(
    ("name", "kind", "problem"),
    [
        ("router_decisions_total", "counter", "kvfabric_"),
        ("kvfabric_RouterDecisions_total", "counter", "snake case"),
        ("kvfabric_router__decisions_total", "counter", "snake case"),
        ("kvfabric_router_decisions", "counter", "must end in _total"),
        ("kvfabric_queue_depth_total", "gauge", "must not end in _total"),
        ("kvfabric_ttft_ms", "histogram", "ms"),
        ("kvfabric_store_read_kib_total", "counter", "kib"),
        ("kvfabric_step_milliseconds_total", "counter", "milliseconds"),
        ("kvfabric_ttft", "histogram", "must end in its unit"),
        ("kvfabric_ttft_total", "histogram", "must not end in _total"),
    ],
)
def test_a_bad_name_or_unit_is_refused(name: str, kind: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_name(name, kind)
    metrics = Metrics("svc", "svc-0")
    declare = {"counter": metrics.counter, "gauge": metrics.gauge}.get(kind, metrics.histogram)
    with pytest.raises(ValueError, match=problem):
        declare(name, "doc")


def test_good_names_are_taken_and_a_name_declared_twice_is_refused() -> None:
    metrics = Metrics("svc", "svc-0")
    metrics.counter("kvfabric_router_decisions_total", "doc")
    metrics.gauge("kvfabric_worker_kv_pages_used", "doc")
    metrics.histogram("kvfabric_decode_time_to_first_token_seconds", "doc")
    metrics.histogram("kvfabric_transfer_bytes", "doc")
    metrics.counter_from("kvfabric_store_read_bytes_total", "doc", lambda: 0)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.counter("kvfabric_router_decisions_total", "again")
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.gauge_from("kvfabric_worker_kv_pages_used", "again", lambda: 0)
    with pytest.raises(ValueError, match="buckets"):
        metrics.histogram("kvfabric_prompt_tokens", "tokens have no default buckets")
    # Another process's registry (a test's) is its own: the same names again are fine.
    Metrics("svc", "svc-1").counter("kvfabric_router_decisions_total", "doc")


def test_labels_are_bounded_to_their_declared_values() -> None:
    metrics = Metrics("svc", "svc-0")
    family = metrics.counter(
        "kvfabric_paint_total", "doc", labels={"color": Color, "coat": ("first", "second")}
    )
    family.labels("red", "first").inc()
    family.labels(Color.BLUE, "second").inc(2)  # an enum member is its value
    with pytest.raises(ValueError, match="outside the declared values"):
        family.labels("green", "first")
    with pytest.raises(ValueError, match="outside the declared values"):
        family.labels("red")  # a label missing
    snapshot = metrics.snapshot()
    # Every combination exists from the start, at zero.
    assert snapshot == {
        'kvfabric_paint_total{color="red",coat="first"}': 1,
        'kvfabric_paint_total{color="red",coat="second"}': 0,
        'kvfabric_paint_total{color="blue",coat="first"}': 0,
        'kvfabric_paint_total{color="blue",coat="second"}': 2,
    }


@pytest.mark.parametrize(
    ("labels", "problem"),
    [
        ({"request_id": tuple(str(i) for i in range(MAX_SERIES + 1))}, "combinations"),
        ({"a": tuple("abcdefghijklmnopq"), "b": tuple("abcdefghijklmnopq")}, "combinations"),
        ({"color": "red"}, "not one string"),
        ({"color": ()}, "no values"),
        ({"instance": ("a",)}, "not allowed"),
        ({"le": ("a",)}, "not allowed"),
        ({"Color": ("a",)}, "not allowed"),
    ],
)
def test_unbounded_or_reserved_labels_are_refused(labels: dict, problem: str) -> None:
    metrics = Metrics("svc", "svc-0")
    with pytest.raises(ValueError, match=problem):
        metrics.counter("kvfabric_paint_total", "doc", labels=labels)
    with pytest.raises(ValueError, match=problem):
        metrics.gauge_from("kvfabric_paint_cans", "doc", dict, labels=labels)


def test_snapshot_is_flat_numbers_with_histogram_count_and_sum() -> None:
    metrics = Metrics("router", "router-0")
    metrics.counter("kvfabric_routed_total", "doc").inc(3)
    metrics.gauge("kvfabric_queue_depth", "doc").set(2.5)
    latency = metrics.histogram("kvfabric_step_seconds", "doc", buckets=(0.1, 1.0))
    latency.observe(0.05)
    latency.observe(0.5)
    pages = {"used": 7}
    metrics.gauge_from("kvfabric_kv_pages_used", "doc", lambda: pages["used"])
    metrics.counter_from(
        "kvfabric_misses_total", "doc", lambda: {"torn": 4}, labels={"reason": ("torn", "gone")}
    )
    first = metrics.snapshot()
    assert first == {
        "kvfabric_routed_total": 3,
        "kvfabric_queue_depth": 2.5,
        "kvfabric_step_seconds_count": 2,
        "kvfabric_step_seconds_sum": 0.55,
        "kvfabric_kv_pages_used": 7,
        'kvfabric_misses_total{reason="torn"}': 4,
        'kvfabric_misses_total{reason="gone"}': 0,  # left out by the read: 0, as declared
    }
    assert isinstance(first["kvfabric_routed_total"], int)  # whole numbers as ints
    pages["used"] = 9  # read when collected: the snapshot follows
    assert metrics.snapshot()["kvfabric_kv_pages_used"] == 9


def test_a_value_read_outside_the_declared_labels_fails_the_collection() -> None:
    metrics = Metrics("svc", "svc-0")
    metrics.counter_from(
        "kvfabric_misses_total", "doc", lambda: {"other": 1}, labels={"reason": ("torn",)}
    )
    with pytest.raises(ValueError, match="outside the declared values"):
        metrics.snapshot()


def test_exposition_is_the_same_registry_with_the_constant_labels() -> None:
    metrics = Metrics("decode", "decode-0")
    metrics.counter("kvfabric_requests_total", "doc", labels={"outcome": ("stop", "error")})
    metrics.histogram("kvfabric_ttft_seconds", "doc").observe(0.3)
    metrics.gauge_from("kvfabric_pages", "doc", lambda: 5)
    text = metrics.exposition().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert (s.labels["service"], s.labels["instance"]) == ("decode", "decode-0")
            labels = {k: v for k, v in s.labels.items() if k not in ("service", "instance")}
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    assert "_created" not in text  # off: they double a scrape and say nothing
    assert samples[("kvfabric_pages", ())] == 5
    assert samples[("kvfabric_ttft_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("kvfabric_ttft_seconds_bucket", (("le", "0.25"),))] == 0
    # Every series the snapshot shows is in the text, with the same value.
    for key, value in metrics.snapshot().items():
        name, _, rest = key.partition("{")
        labels = tuple(sorted(p.split("=") for p in rest.rstrip("}").split(",") if p))
        labels = tuple((k, v.strip('"')) for k, v in labels)
        assert samples[(name, labels)] == value
