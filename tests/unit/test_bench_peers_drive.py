"""`kvfabric bench peers`'s driver (`loadtest.bench_peers.drive`) against fake sides: which
session's step lands in which list, and in what order around the restart and the move. The
control sessions take the step that follows the restart before any restart; only the other
sessions take it after the restart and on another worker."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

from loadtest.bench_peers import PROBE, Side, drive


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
            usage = SimpleNamespace(prompt_tokens=10 * len(messages), completion_tokens=3,
                                    prompt_tokens_details=details)  # fmt: skip
            yield SimpleNamespace(choices=[], usage=usage)

        return chunks()


def test_controls_take_the_step_before_the_restart_and_the_others_after_it() -> None:
    log: list[tuple] = []
    args = argparse.Namespace(sessions=2, steps=3, context=64, growth=16, max_tokens=4,
                              concurrency=1, concurrent_steps=2, think_s=0.0,
                              gap_s=0.0)  # fmt: skip

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
