"""What `kvfabric up` does when one of its processes exits on its own: start it again, after a
backoff that doubles with each restart inside a window, until a restart budget is spent; then
the instance is marked failed and the rest of the cluster keeps serving.

A process that exits with code 0 was drained (`kvfabric drain`) or stopped by someone on
purpose: it is started again at once and not charged against the budget. Any other exit (a
crash, `kill -9`, a service that could not start and said why in its log) is charged.

The launcher writes every instance's record to `<state dir>/supervisor.json` whenever one
changes; `kvfabric status` reads it beside discovery, so restarts, crash loops and failed
instances show even when the instance itself cannot answer.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "supervisor.json"
NATS_SERVER = "nats-server"  # the embedded server's record, beside the services'

RUNNING = "running"
BACKOFF = "backoff"  # exited; restarts at `restart_at`
FAILED = "failed"  # the restart budget is spent: not restarted again


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # At most `budget` charged restarts within `window_s`; one more exit marks it failed.
    budget: int = 5
    window_s: float = 60.0

    def backoff_s(self, num_recent: int) -> float:
        return min(self.initial_backoff_s * 2**num_recent, self.max_backoff_s)


@dataclass
class Record:
    """One supervised instance (or the embedded nats-server)."""

    instance_id: str
    service: str
    pid: int | None = None
    state: str = RUNNING
    restarts: int = 0  # every restart since `kvfabric up` started
    charged: list[float] = field(default_factory=list)  # wall times of charged exits in window
    last_exit_code: int | None = None
    last_exit_reason: str = ""  # the last line its log had when it exited
    last_exit_at: float | None = None  # wall clock
    restart_at: float | None = None  # monotonic, while in BACKOFF

    @property
    def is_crash_looping(self) -> bool:
        """Restarted more than once inside the window and still exiting: what an operator
        must look at even though the instance is up right now."""
        return self.state == FAILED or len(self.charged) >= 2


@dataclass
class Supervisor:
    """The records and the decisions; the launcher owns the processes."""

    state_dir: Path
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    records: dict[str, Record] = field(default_factory=dict)
    metrics_url: str = ""  # the launcher's /metrics, once served

    def started(self, instance_id: str, service: str, pid: int | None) -> None:
        record = self.records.setdefault(instance_id, Record(instance_id, service))
        record.pid, record.state, record.restart_at = pid, RUNNING, None

    def exited(self, instance_id: str, code: int, reason: str) -> Record:
        """An unplanned exit: schedule the restart, or mark the instance failed."""
        record = self.records[instance_id]
        now = time.time()
        record.last_exit_code, record.last_exit_reason, record.last_exit_at = code, reason, now
        record.pid = None
        if code == 0:  # drained or stopped on purpose: back at once, uncharged
            record.state, record.restart_at = BACKOFF, time.monotonic()
            return record
        record.charged = [t for t in record.charged if now - t < self.policy.window_s]
        if len(record.charged) >= self.policy.budget:
            record.state, record.restart_at = FAILED, None
            return record
        delay_s = self.policy.backoff_s(len(record.charged))
        record.charged.append(now)
        record.state, record.restart_at = BACKOFF, time.monotonic() + delay_s
        return record

    def due(self) -> list[Record]:
        """Records whose backoff is over: the launcher starts them now."""
        now = time.monotonic()
        return [
            r
            for r in self.records.values()
            if r.state == BACKOFF and r.restart_at is not None and r.restart_at <= now
        ]

    def restarted(self, instance_id: str, pid: int | None) -> None:
        record = self.records[instance_id]
        record.restarts += 1
        self.started(instance_id, record.service, pid)

    def failed(self) -> list[Record]:
        return [r for r in self.records.values() if r.state == FAILED]

    def save(self) -> None:
        """Write the records for `kvfabric status` (atomically: it may read at any time)."""
        path = self.state_dir / STATE_FILE
        now = time.monotonic()
        body = {
            "launcher_pid": os.getpid(),
            "written_at": time.time(),
            "metrics_url": self.metrics_url,
            "policy": asdict(self.policy),
            "instances": [
                asdict(r)
                | {
                    "crash_looping": r.is_crash_looping,
                    "restart_in_s": None if r.restart_at is None else max(r.restart_at - now, 0),
                }
                for r in self.records.values()
            ],
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(path)


def load_state(state_dir: Path) -> dict[str, Any] | None:
    """What the running (or last) `kvfabric up` of `state_dir` wrote; None when it wrote
    nothing. `live` says whether that launcher still runs."""
    path = state_dir / STATE_FILE
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = body.get("launcher_pid")
    try:
        os.kill(int(pid), 0)
        body["live"] = True
    except (TypeError, ValueError, ProcessLookupError, PermissionError):
        body["live"] = False
    return body


def exit_reason(code: int, log_path: Path | None) -> str:
    """Why a process exited: the signal that killed it (its log predates the signal and says
    nothing), else the last line of its log (a service that must exit says why there)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return last_log_line(log_path) if log_path is not None else ""


def last_log_line(path: Path, max_bytes: int = 4096) -> str:
    """The last non-empty line of a log: why a process exited, when it said so."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - max_bytes, 0))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line), "")[:500]
