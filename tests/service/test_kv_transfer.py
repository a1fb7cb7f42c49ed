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
from shared.transfer import ByteRange, KvTransferAgent, TransferError, TransferTimeout

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
