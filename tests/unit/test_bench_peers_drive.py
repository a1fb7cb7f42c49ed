"""`kvfabric bench peers`'s driver (`loadtest.bench_peers.drive`) against fake sides: which
session's step lands in which list, and in what order around the restart and the move. The
control sessions take the step that follows the restart before any restart; only the other
sessions take it after the restart and on another worker. Interleaved, every side but the
one whose turn it is stays stopped; the process tree it stops is read from /proc (real
processes)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from loadtest.bench_peers import (
    PROBE,
    VLLM_STEP_DEADLINE_S,
    Side,
    _vllm_step_deadline,
    drive,
    process_state,
    process_tree,
    signal_tree,
)
from loadtest.results import BenchResult


class FakeClient:
    """What `send` uses of `openai.AsyncOpenAI`: a streamed completion, then usage."""

    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, *, messages: list[dict], **_: object):  # noqa: ANN202
        if messages != PROBE:
            self.log.append((self.name, messages[1]["content"], len(messages)))
        text = f"answer {len(messages)}"

        async def chunks():  # noqa: ANN202
            delta = SimpleNamespace(content=text)
            yield SimpleNamespace(choices=[SimpleNamespace(delta=delta)], usage=None)
            details = SimpleNamespace(cached_tokens=len(messages))
            usage = SimpleNamespace(
                prompt_tokens=10 * len(messages), completion_tokens=3, prompt_tokens_details=details
            )
            yield SimpleNamespace(choices=[], usage=usage)

        return chunks()


def test_controls_take_the_step_before_the_restart_and_the_others_after_it() -> None:
    log: list[tuple] = []
    args = argparse.Namespace(
        sessions=2,
        steps=3,
        context=64,
        growth=16,
        max_tokens=4,
        concurrency=1,
        concurrent_steps=2,
        think_s=0.0,
        gap_s=0.0,
        mode="interleaved",
    )

    async def restart() -> None:
        log.append(("restart",))

    async def move() -> FakeClient:
        log.append(("move",))
        return FakeClient(log, "moved")

    side = Side("a", FakeClient(log, "a"), restart, move)  # type: ignore[arg-type]
    asyncio.run(drive([side], args))
    r = side.result
    # 4 sessions (2 restarted + 2 controls) of 2 steps before the restart: a cold and a warm each
    assert (len(r.cold), len(r.warm)) == (4, 4)
    assert len(r.same_step_warm) == len(r.after_restart) == len(r.moved) == 2
    # The step each session takes after the restart is the one the controls took before it.
    last = 2 + 2 * (args.steps - 1)  # system, task, then an answer and a tool result a step
    restart_at, move_at = log.index(("restart",)), log.index(("move",))
    before, after = log[:restart_at], log[restart_at + 1 : move_at]
    assert [n for *_, n in after] == [last, last]
    restarted = [task for _, task, _ in after]
    controls = [task for _, task, n in before if n == last]
    assert len(set(controls)) == 2 and not set(controls) & set(restarted)
    # The restarted sessions' earlier steps all came before the restart.
    assert sorted(n for _, task, n in before if task in restarted) == [2, 2, 4, 4]
    # Then the same sessions, one step further, on the worker they were moved to.
    assert log[move_at + 1 : move_at + 3] == [("moved", task, last + 2) for task in restarted]


class FailingOnce(FakeClient):
    """Fails the first request that is some session's second step (4 messages), as a
    server's error mid-stream reaches the SDK; answers every other."""

    failed = False

    async def create(self, *, messages: list[dict], **kw: object):  # noqa: ANN202
        if len(messages) == 4 and not self.failed:
            self.failed = True
            raise openai.APIError("vLLM failed", httpx.Request("POST", "http://x"), body=None)
        return await super().create(messages=messages, **kw)


def test_a_request_failing_at_concurrency_is_counted_and_the_run_goes_on() -> None:
    # The concurrent phase goes to the client the move returned: it fails one request.
    log: list[tuple] = []
    moved = FailingOnce(log, "moved")

    async def restart() -> None:
        pass

    async def move() -> FakeClient:
        return moved

    side = Side("a", FakeClient(log, "a"), restart, move)  # type: ignore[arg-type]
    asyncio.run(drive([side], _args(concurrency=3, concurrent_steps=3)))
    assert side.result.errors == ["APIError: vLLM failed"]
    # 3 sessions of 3 steps: the failed one's first step answered, its last not asked.
    answered = [n for name, _, n in log if name == "moved" and n <= 6]
    assert sorted(answered) == [2, 2, 2, 4, 4, 6, 6]
    assert side.result.requests_per_s > 0


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(
        **(
            {
                "sessions": 1,
                "steps": 3,
                "context": 64,
                "growth": 16,
                "max_tokens": 4,
                "concurrency": 1,
                "concurrent_steps": 2,
                "think_s": 0.0,
                "gap_s": 0.0,
                "mode": "interleaved",
            }
            | kw
        )
    )


class PausedSide(Side):
    """A fake side whose pause and resume are logged instead of signalled."""

    def __init__(self, name: str, log: list[tuple], running: set[str], seen: list) -> None:
        async def restart() -> None:
            seen.append(set(running))

        super().__init__(name, FakeClient(log, name), restart)  # type: ignore[arg-type]
        self.log, self.running = log, running

    def pause(self) -> None:
        self.running.discard(self.name)

    def resume(self) -> None:
        self.running.add(self.name)


@pytest.mark.parametrize(("mode", "alone_when_sent"), [("interleaved", True), ("together", False)])
def test_interleaved_sides_are_each_sent_to_with_every_other_side_stopped(
    mode: str, alone_when_sent: bool
) -> None:
    log: list[tuple] = []
    running: set[str] = set()
    seen: list[set[str]] = []  # what ran at each request and restart
    sides = [PausedSide(name, log, running, seen) for name in ("a", "b", "c")]
    for side in sides:
        create = side.client.create

        async def logged(*, _create=create, **kw: object):  # noqa: ANN202
            seen.append(set(running))
            return await _create(**kw)

        side.client.chat.completions.create = logged
    running.update(side.name for side in sides)  # all started, as _run_sides leaves them
    asyncio.run(drive(sides, _args(mode=mode)))
    assert len(seen) > 3 * 5  # probes, steps, restarts, their probes, the concurrent sessions
    if alone_when_sent:
        assert all(len(s) == 1 for s in seen), seen
    else:
        assert all(s == {"a", "b", "c"} for s in seen), seen
    # Each side's steps rotate: no side always goes first.
    firsts = [log[i][0] for i in range(0, 3 * 4, 3)]
    assert len(set(firsts)) > 1, firsts
    assert running == {"a", "b", "c"}  # resumed at the end: a stopped process misses SIGTERM


def test_a_side_s_process_tree_is_stopped_and_continued_with_its_descendants() -> None:
    # A shell whose child is a sleep: the tree holds both, and both stop and continue.
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    side = Side("s", None, None, processes=lambda: [shell.pid])  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 10
        while len(tree := process_tree([shell.pid])) < 2:
            assert time.monotonic() < deadline, "the shell's child never appeared"
            time.sleep(0.02)
        assert tree[0] == shell.pid and len(tree) == 2
        assert process_tree([shell.pid + 10**7]) == [shell.pid + 10**7]  # no such process
        assert process_state(shell.pid + 10**7) == "X"
        side.pause()  # returns once both are stopped
        assert [process_state(pid) for pid in tree] == ["T", "T"]
        side.resume()
        deadline = time.monotonic() + 10
        while any(process_state(pid) == "T" for pid in tree):
            assert time.monotonic() < deadline, "still stopped 10 s after SIGCONT"
            time.sleep(0.01)
    finally:
        signal_tree([shell.pid], signal.SIGKILL)
        shell.wait()


@pytest.mark.parametrize("mode", ["interleaved", "alone"])
def test_interleaved_vllm_gets_a_step_deadline_that_outlasts_its_pauses(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's 300 s step deadline counts the time a side is stopped: an interleaved run puts
    a day in the environment every vLLM inherits, for the run only, and says so; a value set
    by the user stays; a run whose sides are never stopped leaves it alone."""
    name = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
    monkeypatch.delenv(name, raising=False)
    result = BenchResult("peers", quick=True)
    with _vllm_step_deadline(mode, result):
        inside = os.environ.get(name)
    assert name not in os.environ
    if mode == "interleaved":
        assert inside == str(VLLM_STEP_DEADLINE_S) and VLLM_STEP_DEADLINE_S >= 3600
        assert any(name in note for note in result.notes)
    else:
        assert inside is None and not result.notes
    monkeypatch.setenv(name, "900")
    with _vllm_step_deadline(mode, result):
        assert os.environ[name] == "900"
    assert os.environ[name] == "900"
