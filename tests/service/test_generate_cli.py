"""`kvfabric generate` against no server, no router, and a fake router and decode worker."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from click.testing import Result
from typer.testing import CliRunner

from services.admin.cli import app
from shared.bus import Context
from shared.natsd import NatsServer
from shared.schema import CancelRequest, GenerateRequest, Overloaded, RouteDecision
from shared.testing.fixtures import BusFactory
from tests.service.fake_cluster import DECODE_ID, FakeDecode, cluster, collect

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the command configures logging for its own process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_one_clean_error_line(result: Result, *expected: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0]


@pytest.fixture(autouse=True)
def _in_a_fresh_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command keeps its usage outbox under ./.kvfabric: not in the repository."""
    monkeypatch.chdir(tmp_path)


def test_no_nats_server_is_a_clean_error() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["generate", "hello", "--nats-url", url])
    assert_one_clean_error_line(result, "generate: UNAVAILABLE: cannot connect to NATS", url)
    assert result.stdout == ""


@pytest.mark.nats
def test_no_router_is_a_clean_error(nats_server: NatsServer, subject_root: str) -> None:
    args = ["generate", "hello", "--nats-url", nats_server.url, "--root", subject_root]
    result = runner.invoke(app, args)
    assert_one_clean_error_line(result, "generate: UNAVAILABLE: no instance serves")


async def invoke(nats_server: NatsServer, subject_root: str, *args: str) -> Result:
    # In a thread: the command runs its own event loop while this one serves the fakes.
    cli_args = [
        "generate",
        *args,
        "--nats-url",
        nats_server.url,
        "--root",
        subject_root,
        "--model",
        "tiny-coder",
    ]
    return await asyncio.to_thread(runner.invoke, app, cli_args)


@pytest.mark.nats
async def test_the_text_streams_to_stdout_and_the_summary_to_stderr(
    bus_factory: BusFactory, nats_server: NatsServer, subject_root: str
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0, 1], [2], [3]])
    async with cluster(bus_factory, decode):
        result = await invoke(nats_server, subject_root, "def f():", "--stop", "\n\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "abcd"
    assert "prompt 200 tokens, cached 128 (64.0%), output 4 (length)" in result.stderr
    assert "TTFT" in result.stderr and "prefill: load" in result.stderr


@pytest.mark.nats
async def test_json_prints_one_object(
    bus_factory: BusFactory, nats_server: NatsServer, subject_root: str
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0, 1], [2], [3]])
    async with cluster(bus_factory, decode):
        result = await invoke(nats_server, subject_root, "--chat", "hi", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["text"] == "abcd" and data["token_ids"] == [0, 1, 2, 3]
    assert data["finish_reason"] == "length" and data["num_cached_tokens"] == 128
    assert data["decision"]["decode_worker_id"] == DECODE_ID
    assert data["num_prompt_tokens"] == 4  # bos, <｜User｜>, hi, <｜Assistant｜>


@pytest.mark.nats
async def test_overloaded_prints_the_retry_after(
    bus_factory: BusFactory, nats_server: NatsServer, subject_root: str
) -> None:
    async def refuse(request: GenerateRequest, ctx: Context) -> RouteDecision:
        raise Overloaded("every decode worker is full", retry_after_s=2.5)

    async with cluster(bus_factory, route=refuse):
        result = await invoke(nats_server, subject_root, "hello", "--overload-wait-s", "0")
    assert_one_clean_error_line(
        result, "generate: OVERLOADED: every decode worker is full (retry after 2.5 s)"
    )


@pytest.mark.nats
@pytest.mark.slow
async def test_ctrl_c_sends_cancel_request_and_exits_130(
    bus_factory: BusFactory, nats_server: NatsServer, subject_root: str
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0]], end="hang")
    watcher = await bus_factory("watcher")
    cancels = await collect(watcher, watcher.subjects.cancel, CancelRequest)
    async with cluster(bus_factory, decode):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.admin.cli",
            "generate",
            "hello",
            "--nats-url",
            nats_server.url,
            "--root",
            subject_root,
            "--model",
            "tiny-coder",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # As from an interactive shell: a test run in the background (`cmd &` without job
            # control) inherits SIGINT ignored, and a process that ignores it never sees Ctrl-C.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            assert process.stdout is not None
            first = await asyncio.wait_for(process.stdout.read(1), 60)  # the first chunk's text
            assert first == b"a"
            process.send_signal(signal.SIGINT)
            _, stderr = await asyncio.wait_for(process.communicate(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        cancel = await asyncio.wait_for(cancels.get(), 5)
    assert process.returncode == 130
    assert stderr.decode().strip().endswith("generate: interrupted")
    assert b"Traceback" not in stderr
    assert cancel.reason == "cancelled"
