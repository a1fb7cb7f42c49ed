"""`kvfabric top` in a pseudo-terminal against a mock-engine cluster under load: its frames
show every instance and live figures that move between frames (the request count grows,
a request rate and tokens/s appear), Ctrl-C typed at the terminal ends it cleanly; `--once`
prints one frame and exits."""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from services.admin.launcher import Cluster
from tests.e2e.test_dashboards import send_load

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KVFABRIC = str(Path(sys.executable).parent / "kvfabric")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")
FRAME = re.compile(
    r"frame (\d+) .*?\nrequests (\d+)\s+req/s ([\d.]+)\s+hit share (\S+)\s+"
    r"tokens/s (\d+)",
    re.S,
)


@pytest.fixture(scope="module")
def cluster(observed_cluster: Cluster) -> Cluster:
    return observed_cluster


def top_args(cluster: Cluster) -> list[str]:
    return [KVFABRIC, "top", "--nats-url", cluster.nats_url, "--root", cluster.spec.root]


def start_in_terminal(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """`args` with a pseudo-terminal (200 x 50) as its controlling terminal: its stdin, stdout
    and stderr, so Ctrl-C written to `master` reaches it as SIGINT."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))

    def take_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # As from an interactive shell: a test run in the background (`cmd &` without job
        # control) inherits SIGINT ignored, and a process that ignores it never sees Ctrl-C.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    process = subprocess.Popen(
        args,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=take_terminal,
        close_fds=True,
        env={**env, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"},
    )
    os.close(slave)
    return process, master


def read_until(master: int, seen: list[str], done, timeout_s: float) -> str:  # noqa: ANN001
    """Read the terminal into `seen` until `done(text)` (text without escape codes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = ANSI.sub("", "".join(seen))
        if done(text):
            return text
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the terminal showed, in {timeout_s}s:\n{text[-3000:]}"
        ready, _, _ = select.select([master], [], [], min(remaining, 0.5))
        if ready:
            try:
                seen.append(os.read(master, 65536).decode(errors="replace"))
            except OSError:  # EIO: the other side closed
                return text


def wait_reading(
    process: subprocess.Popen[bytes], master: int, seen: list[str], timeout_s: float
) -> int:
    """The process's exit status, reading the terminal meanwhile, as a terminal does: a
    pty's buffer holds a few KB, and a process whose last frame does not fit blocks in write
    until someone reads."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        assert time.monotonic() < deadline, f"still running {timeout_s}s after Ctrl-C"
        if select.select([master], [], [], 0.1)[0]:
            try:
                seen.append(os.read(master, 65536).decode(errors="replace"))
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                break  # EIO: every writer closed the terminal
    return process.wait(timeout=max(deadline - time.monotonic(), 0.1))


def drain(master: int, seen: list[str]) -> None:
    """What the process wrote before it exited."""
    while select.select([master], [], [], 0.5)[0]:
        try:
            seen.append(os.read(master, 65536).decode(errors="replace"))
        except OSError:  # EIO: every writer closed
            return


def test_frames_show_live_numbers_and_ctrl_c_stops_it(cluster: Cluster) -> None:
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            send_load(cluster.http_urls[0], 4, concurrency=2)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    process, master = start_in_terminal(top_args(cluster), cluster.admin_env())
    seen: list[str] = []
    try:
        text = read_until(master, seen, lambda t: len(FRAME.findall(t)) >= 3, timeout_s=60)
        frames = FRAME.findall(text)
        first, last = frames[0], frames[-1]
        assert int(last[0]) > int(first[0])
        assert int(last[1]) > int(first[1]), "the request count did not grow between frames"
        assert any(float(f[2]) > 0 for f in frames), "no request rate under load"
        assert any(int(f[4]) > 0 for f in frames), "no tokens/s under load"
        for instance_id in cluster.metrics_urls:
            assert instance_id in text
        os.write(master, b"\x03")  # Ctrl-C, as typed
        assert wait_reading(process, master, seen, timeout_s=15) == 0
        drain(master, seen)
        assert "Traceback" not in ANSI.sub("", "".join(seen))
    finally:
        stop_load.set()
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
        loader.join(timeout=30)


def test_once_prints_one_frame_and_exits(cluster: Cluster) -> None:
    send_load(cluster.http_urls[0], 4, concurrency=2)
    done = subprocess.run(
        [*top_args(cluster), "--once"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**cluster.admin_env(), "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    frames = FRAME.findall(done.stdout)
    assert len(frames) == 1 and frames[0][0] == "1"
    assert int(frames[0][1]) >= 4
    assert frames[0][3] != "-"  # a hit share, from the requests so far
    assert re.search(r"TTFT p50 \d+\.\d+ s", done.stdout), done.stdout
    for instance_id in cluster.metrics_urls:
        assert instance_id in done.stdout


def test_an_unreachable_nats_is_a_clear_error() -> None:
    done = subprocess.run(
        [KVFABRIC, "top", "--nats-url", "nats://127.0.0.1:1", "--once"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    # its own line last (log lines of the retried connection may come before it, on stderr)
    assert done.stderr.splitlines()[-1].startswith("top: cannot connect")
    assert "Traceback" not in done.stderr and not done.stdout
