"""UsageOutbox: ordered, retried, durable across crashes, compacted, exclusive."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs

from shared.schema import Unavailable, UsageRecord
from shared.usage_outbox import OutboxClosed, OutboxLocked, UsageOutbox

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_record(request_id: str) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        api_key_id="key-1",
        model="tiny",
        num_cache_hit_tokens=16,
        num_cache_miss_tokens=4,
        num_output_tokens=8,
    )


class FakePublish:
    """Records what it stored; fails the first `num_failures` calls, or every call while
    `failing` is set, and blocks once `num_allowed` records are stored until `allow` lifts it."""

    def __init__(self, *, num_failures: int = 0, failing: bool = False) -> None:
        self.records: list[UsageRecord] = []
        self.num_calls = 0
        self.num_failures = num_failures
        self.failing = failing
        self.num_allowed: int | None = None
        self.blocked = asyncio.Event()  # set while a call waits on num_allowed
        self._changed = asyncio.Event()

    def allow(self, num_allowed: int | None) -> None:
        self.num_allowed = num_allowed
        self.blocked.clear()  # so a test waits for the next block, not a past one
        self._changed.set()

    async def __call__(self, record: UsageRecord) -> None:
        self.num_calls += 1
        if self.failing or self.num_calls <= self.num_failures:
            raise Unavailable("jetstream unavailable")
        while self.num_allowed is not None and len(self.records) >= self.num_allowed:
            self.blocked.set()
            self._changed.clear()
            await self._changed.wait()
        self.blocked.clear()
        self.records.append(record)

    @property
    def stored(self) -> list[str]:
        return [record.request_id for record in self.records]


def new_outbox(path: Path, publish: FakePublish, **kwargs: int) -> UsageOutbox:
    return UsageOutbox(path, publish, retry_initial_s=0.01, retry_max_s=0.02, **kwargs)


async def test_records_are_published_in_order_and_file_truncated(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    publish = FakePublish()
    outbox = new_outbox(path, publish)
    assert await outbox.open() == 0
    ids = [f"req-{i}" for i in range(10)]
    for request_id in ids:
        await outbox.add(make_record(request_id))
    assert await outbox.flush(timeout_s=2.0) is True
    assert publish.stored == ids
    assert outbox.num_pending == 0
    assert path.stat().st_size == 0
    counters = outbox.counters()
    assert counters["num_added"] == 10
    assert counters["num_published"] == 10
    assert counters["num_publish_failures"] == 0
    await outbox.close()


async def test_failed_publishes_are_retried_and_each_record_stored_once(tmp_path: Path) -> None:
    publish = FakePublish(num_failures=3)
    outbox = new_outbox(tmp_path / "usage.log", publish)
    await outbox.open()
    ids = ["a", "b", "c"]
    for request_id in ids:
        await outbox.add(make_record(request_id))
    assert await outbox.flush(timeout_s=2.0) is True
    assert publish.stored == ids
    assert publish.num_calls == 3 + len(ids)
    assert outbox.counters()["num_publish_failures"] == 3
    assert outbox.counters()["num_published"] == 3
    await outbox.close()


async def test_unexpected_publish_error_is_retried_with_one_traceback(tmp_path: Path) -> None:
    calls: list[str] = []

    async def publish(record: UsageRecord) -> None:
        calls.append(record.request_id)
        if len(calls) <= 3:
            raise KeyError("bug in the publisher")

    outbox = UsageOutbox(tmp_path / "usage.log", publish, retry_initial_s=0.01)
    await outbox.open()
    with capture_logs() as logs:
        await outbox.add(make_record("a"))
        assert await outbox.flush(timeout_s=2.0) is True
    assert calls == ["a"] * 4
    tracebacks = [entry for entry in logs if entry.get("exc_info")]
    assert len(tracebacks) == 1
    assert tracebacks[0]["request_id"] == "a"
    await outbox.close()


CRASHING_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from shared.logging import configure_logging
    from shared.schema import Unavailable, UsageRecord
    from shared.usage_outbox import UsageOutbox

    async def publish(record):
        raise Unavailable("jetstream unavailable")

    async def main():
        configure_logging(service="test", instance_id="child")  # logs to stderr, not stdout
        outbox = UsageOutbox(Path(sys.argv[1]), publish, retry_initial_s=0.01)
        await outbox.open()
        for i in range(3):
            await outbox.add(UsageRecord(request_id=f"req-{i}", api_key_id="k", model="m",
                num_cache_hit_tokens=0, num_cache_miss_tokens=1, num_output_tokens=2))
        print("added", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_records_survive_a_killed_process_and_are_replayed(tmp_path: Path) -> None:
    path = tmp_path / "outbox" / "usage.log"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CRASHING_CHILD,
        str(path),
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=20.0)
        assert line == b"added\n"
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    assert child.returncode == -signal.SIGKILL

    publish = FakePublish()
    outbox = new_outbox(path, publish)
    assert await outbox.open() == 3
    assert await outbox.flush(timeout_s=2.0) is True
    assert publish.stored == ["req-0", "req-1", "req-2"]
    assert outbox.counters()["num_replayed"] == 3
    await outbox.close()


async def kept_while_failing(path: Path, ids: list[str]) -> None:
    """Leave `ids` pending in the file at `path`."""
    outbox = new_outbox(path, FakePublish(failing=True))
    await outbox.open()
    for request_id in ids:
        await outbox.add(make_record(request_id))
    await outbox.close(timeout_s=0.01)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(b"\x07\x00", id="partial-header"),
        pytest.param(b"\x64\x00\x00\x00\x00\x00\x00\x00\x01short", id="partial-payload"),
        pytest.param(b"\x03\x00\x00\x00\xde\xad\xbe\xef\x01abc", id="bad-checksum"),
    ],
)
async def test_torn_tail_is_truncated_and_valid_records_replayed(
    tmp_path: Path, tail: bytes
) -> None:
    path = tmp_path / "usage.log"
    await kept_while_failing(path, ["a", "b"])
    valid_nbytes = path.stat().st_size
    with path.open("ab") as file:
        file.write(tail)

    publish = FakePublish()
    publish.allow(0)
    outbox = new_outbox(path, publish)
    with capture_logs() as logs:
        assert await outbox.open() == 2
    assert path.stat().st_size == valid_nbytes
    dropped = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["num_bytes"] for entry in dropped] == [len(tail)]
    publish.allow(None)
    assert await outbox.flush(timeout_s=2.0) is True
    assert publish.stored == ["a", "b"]
    await outbox.close()


async def test_acked_records_are_not_replayed(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    publish = FakePublish()
    publish.allow(2)
    outbox = new_outbox(path, publish)
    await outbox.open()
    for request_id in ["a", "b", "c"]:
        await outbox.add(make_record(request_id))
    await asyncio.wait_for(publish.blocked.wait(), timeout=2.0)
    await outbox.close(timeout_s=0.01)
    assert path.stat().st_size > 0  # "c" is pending, so the acks of "a" and "b" are in the file

    replay = FakePublish()
    reopened = new_outbox(path, replay)
    assert await reopened.open() == 1
    assert await reopened.flush(timeout_s=2.0) is True
    assert replay.stored == ["c"]
    await reopened.close()


async def test_nothing_is_replayed_after_everything_was_stored(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    outbox = new_outbox(path, FakePublish())
    await outbox.open()
    for request_id in ["a", "b"]:
        await outbox.add(make_record(request_id))
    assert await outbox.flush(timeout_s=2.0) is True
    await outbox.close()

    reopened = new_outbox(path, FakePublish(failing=True))
    assert await reopened.open() == 0
    assert reopened.num_pending == 0
    await reopened.close(timeout_s=0.01)


async def test_ack_of_a_repeated_request_id_acks_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    publish = FakePublish()
    publish.allow(1)
    outbox = new_outbox(path, publish)
    await outbox.open()
    first = make_record("same")
    second = msgspec.structs.replace(first, num_output_tokens=99)
    await outbox.add(first)
    await outbox.add(second)
    await asyncio.wait_for(publish.blocked.wait(), timeout=2.0)
    await outbox.close(timeout_s=0.01)
    assert publish.records == [first]

    replay = FakePublish()
    reopened = new_outbox(path, replay)
    assert await reopened.open() == 1
    assert await reopened.flush(timeout_s=2.0) is True
    assert replay.records == [second]
    await reopened.close()


async def test_compaction_bounds_the_file_and_keeps_the_pending_set(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    compact_nbytes = 2048
    publish = FakePublish()
    publish.allow(0)
    outbox = new_outbox(path, publish, compact_nbytes=compact_nbytes)
    await outbox.open()
    ids = [f"request-{i:03d}" for i in range(60)]
    for request_id in ids:
        await outbox.add(make_record(request_id))
    peak_nbytes = path.stat().st_size
    assert peak_nbytes > 3 * compact_nbytes

    publish.allow(55)
    await asyncio.wait_for(publish.blocked.wait(), timeout=2.0)
    assert publish.stored == ids[:55]
    assert outbox.counters()["num_compactions"] >= 1
    # A file past compact_nbytes is rewritten once at least half of it is dead, so it ends
    # within twice its five pending records (frames of one size: the peak held 60); without
    # compaction it would be the peak and the acks.
    pending_nbytes = 5 * peak_nbytes // 60
    assert path.stat().st_size <= max(compact_nbytes, 2 * pending_nbytes) < peak_nbytes // 3
    await outbox.close(timeout_s=0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage.log", "usage.log.lock"]

    replay = FakePublish()
    reopened = new_outbox(path, replay)
    assert await reopened.open() == 5
    assert await reopened.flush(timeout_s=2.0) is True
    assert replay.stored == ids[55:]
    await reopened.close()


async def test_second_outbox_on_the_same_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    first = new_outbox(path, FakePublish())
    await first.open()
    second = new_outbox(path, FakePublish())
    with pytest.raises(OutboxLocked, match="usage.log"):
        await second.open()
    await first.close()
    assert await second.open() == 0  # the lock went with close
    await second.close()


async def test_close_with_failing_publisher_keeps_pending_records(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    outbox = new_outbox(path, FakePublish(failing=True))
    await outbox.open()
    for request_id in ["a", "b", "c"]:
        await outbox.add(make_record(request_id))
    assert await outbox.flush(timeout_s=0.01) is False
    await asyncio.wait_for(outbox.close(timeout_s=0.05), timeout=2.0)
    await outbox.close()  # a second close is a no-op
    assert outbox.num_pending == 3
    with pytest.raises(OutboxClosed):
        await outbox.add(make_record("d"))

    replay = FakePublish()
    reopened = new_outbox(path, replay)
    assert await reopened.open() == 3
    assert await reopened.flush(timeout_s=2.0) is True
    assert replay.stored == ["a", "b", "c"]
    await reopened.close()


async def test_refused_open_leaks_no_file_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "usage.log"
    first = new_outbox(path, FakePublish())
    await first.open()
    num_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OutboxLocked):
        await new_outbox(path, FakePublish()).open()
    assert len(os.listdir("/proc/self/fd")) == num_fds
    await first.close()
