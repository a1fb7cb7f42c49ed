"""NIXL (UCX) KV transfer between separate processes, agent metadata over a real nats-server:
the bytes arrive where they were sent, the notification arrives after them, and a dead or
absent peer is a typed error within the timeout, never a hang."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from shared.bus import Context, Endpoint
from shared.natsd import NatsServer
from shared.schema import ServiceError
from shared.schema.transfer import NixlAgentInfo, NixlMetadataRequest
from shared.testing.fixtures import BusFactory
from tests.service.kv_transfer_peer import pattern
from worker import transfer
from worker.transfer import ByteRange, KvTransferAgent, TransferError, TransferTimeout

pytestmark = [pytest.mark.nats, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BLOCK_NBYTES = 98_304  # one 64-token block of the tiny model
NUM_BLOCKS = 100


def start_peer(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.service.kv_transfer_peer", *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def read_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    """The peer's next stdout line; fails the test rather than hang on a silent peer."""
    assert proc.stdout is not None
    done: list[str] = []

    def target() -> None:
        done.append(proc.stdout.readline())  # type: ignore[union-attr]

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert done, f"peer printed nothing within {timeout_s}s (exit code {proc.poll()})"
    return done[0].strip()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_cross_process_write_with_notification(nats_server: NatsServer, subject_root: str):
    common = [nats_server.url, subject_root]
    blocks = (str(NUM_BLOCKS), str(BLOCK_NBYTES), "kv:req-42")
    # Both start at once (each takes seconds to import); the sender waits for "go".
    receiver = start_peer("receive", *common, "decode-1", *blocks)
    sender = start_peer("send", *common, "decode-1", *blocks)
    try:
        assert read_line(receiver) == "ready"
        assert read_line(sender) == "ready"
        sender.stdin.write("go\n")  # type: ignore[union-attr]
        sender.stdin.flush()  # type: ignore[union-attr]
        sent = json.loads(read_line(sender))
        assert sent["sent"] == NUM_BLOCKS * BLOCK_NBYTES
        assert sender.wait(timeout=20) == 0
        verdict = json.loads(read_line(receiver))
        assert verdict == {"sender": sent["agent"], "message": "kv:req-42", "ok": True}
        assert receiver.wait(timeout=20) == 0
    finally:
        stop(sender)
        stop(receiver)


async def test_dead_peer_is_a_typed_error_within_timeout(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
):
    peer = start_peer("serve", nats_server.url, subject_root, "decode-9", "4", str(BLOCK_NBYTES))
    bus = await bus_factory("prefill")
    agent = KvTransferAgent(bus, np.ones(4 * BLOCK_NBYTES, np.uint8), service="prefill")
    ranges = [ByteRange(0, 0, BLOCK_NBYTES)]
    try:
        line = await asyncio.to_thread(read_line, peer)
        assert line == "ready"
        await agent.write("decode", "decode-9", ranges, notification=b"warm", timeout_s=10.0)
        stop(peer)  # its metadata stays cached here: the next write finds a dead UCX peer
        # wait_for only guards against a hang: the error must be ours, raised by the agent.
        with pytest.raises(TransferError) as caught:
            await asyncio.wait_for(
                agent.write("decode", "decode-9", ranges, notification=b"x", timeout_s=2.0),
                timeout=10.0,
            )
        assert isinstance(caught.value, ServiceError)
        # The failed peer was forgotten: asking again finds nobody serving its metadata.
        with pytest.raises(TransferError):
            await agent.write("decode", "decode-9", ranges, notification=b"y", timeout_s=1.0)
    finally:
        stop(peer)
        agent.close()


async def test_absent_silent_peer_and_missing_notification(bus_factory: BusFactory):
    bus = await bus_factory("prefill")
    agent = KvTransferAgent(bus, np.ones(BLOCK_NBYTES, np.uint8), service="prefill")
    silent = await bus_factory("decode", instance_id="decode-silent")

    async def never_answers(request: NixlMetadataRequest, ctx: Context) -> NixlAgentInfo:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    subject = silent.subjects.nixl_metadata("decode")
    await silent.serve(Endpoint("nixl-metadata", subject, NixlMetadataRequest, never_answers))
    await silent.flush()
    ranges = [ByteRange(0, 0, 16)]
    try:
        with pytest.raises(TransferError) as absent:
            await agent.write("decode", "nobody", ranges, notification=b"n", timeout_s=1.0)
        assert not isinstance(absent.value, TransferTimeout)  # no responders: known at once
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(
                agent.write("decode", "decode-silent", ranges, notification=b"n", timeout_s=0.5),
                timeout=10.0,
            )
        with pytest.raises(TransferTimeout):
            await agent.wait_notification(b"never", timeout_s=0.2)
    finally:
        agent.close()


async def test_a_restarted_peer_is_reached_by_the_first_transfer_after_its_restart(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
):
    """The same instance id, a new process: the metadata cached for the old one fails when
    the transfer is posted, and the agent asks again and retries once."""
    bus = await bus_factory("prefill")
    agent = KvTransferAgent(bus, pattern(NUM_BLOCKS, BLOCK_NBYTES), service="prefill")
    ranges = [
        ByteRange(i * BLOCK_NBYTES, (NUM_BLOCKS - 1 - i) * BLOCK_NBYTES, BLOCK_NBYTES)
        for i in range(NUM_BLOCKS)
    ]
    peer_args = (nats_server.url, subject_root, "decode-5", str(NUM_BLOCKS), str(BLOCK_NBYTES))
    names = []
    try:
        for tag in ("kv:before", "kv:after"):
            receiver = start_peer("receive", *peer_args, tag)
            try:
                assert await asyncio.to_thread(read_line, receiver) == "ready"
                await agent.write(
                    "decode", "decode-5", ranges, notification=tag.encode(), timeout_s=10.0
                )
                verdict = json.loads(await asyncio.to_thread(read_line, receiver))
                assert verdict == {"sender": agent.agent_name, "message": tag, "ok": True}
                assert await asyncio.to_thread(receiver.wait, 20) == 0
                names.append(agent._peers[("decode", "decode-5")].agent_name)
            finally:
                stop(receiver)
        assert names[0] != names[1]  # two agents under one instance id
    finally:
        agent.close()


async def test_connect_soon_asks_once_and_the_transfers_use_it(bus_factory: BusFactory):
    """`connect_soon` fetches the peer's metadata ahead of the first transfer; the transfers
    after it, two at once, ask nothing more, and their bytes land."""
    bus = await bus_factory("decode")
    target_bus = await bus_factory("prefill", instance_id="prefill-7")
    agent = KvTransferAgent(bus, np.zeros(2 * BLOCK_NBYTES, np.uint8), service="decode")
    target = KvTransferAgent(target_bus, pattern(2, BLOCK_NBYTES), service="prefill")
    asked: list[str] = []

    async def counted(request: NixlMetadataRequest, ctx: Context) -> NixlAgentInfo:
        asked.append(request.requester_agent)
        return target.info

    subject = target_bus.subjects.nixl_metadata("prefill")
    await target_bus.serve(Endpoint("nixl-metadata", subject, NixlMetadataRequest, counted))
    await target_bus.flush()
    try:
        agent.connect_soon("prefill", "prefill-7")
        agent.connect_soon("prefill", "prefill-7")  # already under way: nothing more
        deadline = asyncio.get_running_loop().time() + 10
        while ("prefill", "prefill-7") not in agent._peers:
            assert asyncio.get_running_loop().time() < deadline, "never connected"
            await asyncio.sleep(0.01)
        assert asked == [agent.agent_name]

        async def progress_target() -> None:  # the target's pump, as `serve()` runs it
            for _ in range(2000):
                target._collect_notifications()
                await asyncio.sleep(0.001)

        pump = asyncio.create_task(progress_target())
        await asyncio.gather(
            *(
                agent.read(
                    "prefill",
                    "prefill-7",
                    [ByteRange(i * BLOCK_NBYTES, i * BLOCK_NBYTES, BLOCK_NBYTES)],
                    timeout_s=10.0,
                )
                for i in range(2)
            )
        )
        pump.cancel()
        assert asked == [agent.agent_name]
        assert np.array_equal(agent.buffer, pattern(2, BLOCK_NBYTES))
    finally:
        agent.close()
        target.close()


async def test_a_busy_window_wakes_the_idle_pump_at_once(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
):
    """`busy()` and `expect_traffic()` make the pump progress the agent now, not at the end
    of its idle wait (a peer's first transfer over a new connection waits for it). The idle
    wait is made a minute long here: only the wake-up can account for progress."""
    monkeypatch.setattr(transfer, "_PUMP_IDLE_S", 60.0)
    bus = await bus_factory("prefill")
    agent = KvTransferAgent(bus, np.ones(BLOCK_NBYTES, np.uint8), service="prefill")
    progressed = asyncio.Event()
    collect = agent._collect_notifications

    def counted() -> None:
        progressed.set()
        collect()

    try:
        await agent.serve()
        await asyncio.sleep(0.05)  # the pump's first round is done: it waits, idle
        agent._collect_notifications = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.05)
        assert not progressed.is_set()
        async with agent.busy():
            await asyncio.wait_for(progressed.wait(), 10.0)
        await asyncio.sleep(0.05)  # back to idle
        progressed.clear()
        await asyncio.sleep(0.05)
        assert not progressed.is_set()
        agent.expect_traffic(1.0)
        await asyncio.wait_for(progressed.wait(), 10.0)
    finally:
        agent.close()
