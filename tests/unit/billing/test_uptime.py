"""Device spans from heartbeats: per worker and UTC hour, merged order-free."""

from __future__ import annotations

import random

from services.billing.uptime import HOUR_MS, DeviceSpans
from shared.schema import LoadReport

T0 = 1_790_000_000_000 - 1_790_000_000_000 % HOUR_MS  # an hour's start


def beat(ts_ms: int, instance: str = "decode-0", devices: int = 1) -> LoadReport:
    return LoadReport(
        service="decode", instance_id=instance, seq=0, ts_ms=ts_ms, model="m", num_devices=devices
    )


def test_spans_cover_first_to_last_beat_of_each_hour() -> None:
    spans = DeviceSpans()
    for ts in range(T0 + 10_000, T0 + HOUR_MS + 30_000, 1000):  # crosses into the next hour
        spans.observe(beat(ts, devices=8))
    spans.observe(beat(T0 + 5_000, "router-0", devices=0))  # holds no device: not counted
    by_hour = {s.hour_ms: s for s in spans.drain()}
    assert set(by_hour) == {T0, T0 + HOUR_MS}
    first, second = by_hour[T0], by_hour[T0 + HOUR_MS]
    assert (first.first_ms, first.last_ms) == (T0 + 10_000, T0 + HOUR_MS - 1000)
    assert first.device_ms == (HOUR_MS - 11_000) * 8
    assert second.device_ms == 29_000 * 8
    assert spans.drain() == []


def test_any_order_and_put_back_give_the_same_spans() -> None:
    beats = [beat(T0 + i * 1000, f"prefill-{i % 3}") for i in range(300)]
    ordered = DeviceSpans()
    for b in beats:
        ordered.observe(b)
    shuffled = DeviceSpans()
    random.Random(5).shuffle(beats)
    for b in beats[:150]:
        shuffled.observe(b)
    failed_write = shuffled.drain()
    for b in beats[150:]:
        shuffled.observe(b)
    shuffled.put_back(failed_write)
    key = lambda s: s.instance_id  # noqa: E731
    assert sorted(shuffled.drain(), key=key) == sorted(ordered.drain(), key=key)
