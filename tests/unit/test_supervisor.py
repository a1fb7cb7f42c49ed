"""The launcher's restart decisions: backoff doubling to its ceiling, the budget within its
window, a clean exit (a drain) restarted at once and uncharged, the state file status reads."""

from __future__ import annotations

import os
from pathlib import Path

from services.admin.status import render_supervision
from services.admin.supervisor import (
    BACKOFF,
    FAILED,
    RUNNING,
    RestartPolicy,
    Supervisor,
    exit_reason,
    load_state,
)


def test_backoff_doubles_to_its_ceiling() -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_the_budget_is_spent_within_the_window_then_failed(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, RestartPolicy(budget=2, window_s=60.0))
    supervisor.started("router-0", "router", 100)
    first = supervisor.exited("router-0", -9, "killed by SIGKILL")
    assert first.state == BACKOFF and not first.is_crash_looping
    supervisor.restarted("router-0", 101)
    second = supervisor.exited("router-0", 1, "bad config")
    assert second.state == BACKOFF and second.is_crash_looping
    supervisor.restarted("router-0", 102)
    third = supervisor.exited("router-0", 1, "bad config")
    assert third.state == FAILED and supervisor.failed() == [third]
    assert third.restarts == 2 and third.last_exit_reason == "bad config"
    assert supervisor.due() == []  # a failed instance is never started again


def test_exits_outside_the_window_are_forgiven(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, RestartPolicy(budget=1, window_s=60.0))
    supervisor.started("billing-0", "billing", 1)
    record = supervisor.exited("billing-0", -9, "")
    record.charged = [t - 61.0 for t in record.charged]  # that exit was long ago
    supervisor.restarted("billing-0", 2)
    assert supervisor.exited("billing-0", -9, "").state == BACKOFF


def test_a_clean_exit_restarts_at_once_uncharged(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, RestartPolicy(budget=0))
    supervisor.started("decode-0", "decode", 1)
    record = supervisor.exited("decode-0", 0, "stopped")
    assert record.state == BACKOFF and record.charged == []
    assert supervisor.due() == [record]
    supervisor.restarted("decode-0", 2)
    assert record.state == RUNNING and record.restarts == 1 and record.pid == 2


def test_status_reads_the_state_file(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, RestartPolicy(budget=0))
    supervisor.started("router-0", "router", 1)
    supervisor.started("router-1", "router", 2)
    supervisor.exited("router-1", -9, exit_reason(-9, None))
    supervisor.save()
    state = load_state(tmp_path)
    assert state is not None and state["live"] and state["launcher_pid"] == os.getpid()
    text = render_supervision(state, [])
    assert "FAILED: restart budget spent; killed by SIGKILL" in text
    assert "degraded: router (router-0, router-1)" in text  # neither answers discovery


def test_exit_reason_names_the_signal_or_the_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("starting\nbad config: --model nope not found\n\n")
    assert exit_reason(2, log) == "bad config: --model nope not found"
    assert exit_reason(-15, log) == "killed by SIGTERM"
