"""The embedded one-machine cluster behind `kvfabric up`: a nats-server (unless an existing one
is given), then one process per service instance, started in dependency order and stopped in
the reverse order. Each process serves `/metrics` and `/health` on a port of its own
(`--metrics-port`: consecutive from `metrics_port`, or any free one), named in discovery.
Children, the nats-server among them, die with the launcher even if it is killed
(PR_SET_PDEATHSIG), so no orphan outlives it.

Supervision (`supervise`, supervisor.py): a process that exits on its own is started again
under the same id and flags after a backoff, the embedded nats-server on the same port and
store; an instance whose restart budget is spent is marked failed and the rest serve on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from services.admin.supervisor import (
    FAILED,
    NATS_SERVER,
    RUNNING,
    RestartPolicy,
    Supervisor,
    exit_reason,
)
from shared import models
from shared.bus import Bus
from shared.bus.connection import CREDS_ENV, TLS_CA_ENV
from shared.config import CONFIG_ENV, ServiceConfig, load_config
from shared.discovery import Instance, discover
from shared.metrics import Metrics
from shared.nats_auth import ADMIN, ROLES, authorization_conf, ensure_credentials, seed_path
from shared.natsd import (
    DEFAULT_MAX_FILE_STORE_BYTES,
    NatsCluster,
    NatsServer,
    NatsServerError,
    die_with_parent,
)
from shared.subjects import (
    BILLING,
    DECODE,
    DEFAULT_ROOT,
    INGRESS,
    KV_INDEX,
    PREFILL,
    ROUTER,
    SERVICES,
    SWA_MEMCACHE,
    VLLM_WORKER,
    Subjects,
    check_token,
)
from shared.tls_certs import ensure_server_tls

# Start order: what others call comes up first. Stop order is the reverse: ingress stops
# taking HTTP requests before the workers behind it drain.
START_ORDER: tuple[str, ...] = (
    KV_INDEX,
    SWA_MEMCACHE,
    BILLING,
    DECODE,
    PREFILL,
    VLLM_WORKER,
    ROUTER,
    INGRESS,
)
MODEL_WORKERS = (PREFILL, DECODE, VLLM_WORKER)  # the services that run a model
# Instances a service gets unless `replicas` says: one each, but no vLLM workers (they take
# vLLM's own venv; `kvfabric up --engine vllm` runs them instead of prefill and decode).
DEFAULT_REPLICAS = {VLLM_WORKER: 0}
GIB = 1 << 30
assert set(START_ORDER) == set(SERVICES)


def instance_host(placement: Placement) -> str:
    """The node id of a placed instance: the host's name when its environment names one (a
    namespace has the machine's hostname), else its address."""
    return dict(placement.env).get("KVF_NODE_ID", placement.address)


def module_of(service: str) -> str:
    return "services." + service.replace("-", "_")


def _short(model: str) -> str:
    """A model's name in instance ids: its first alias (`smollm2`), else its name."""
    try:
        known = models.source(model)
    except models.ModelError:  # a path: the file's or directory's name
        return check_token(models.served_name(model).lower().replace(".", "-"), "model name")
    return (known.aliases or (known.name,))[0].lower()


def parse_replicas(text: str) -> dict[str, int]:
    """`prefill=2,decode=2` -> {"prefill": 2, "decode": 2}; unknown names are an error."""
    replicas: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, count = part.partition("=")
        name = name.strip().replace("_", "-")
        if not sep or name not in SERVICES or not count.strip().isdigit():
            raise ValueError(
                f"bad replica spec {part!r}: expected <service>=<count> with a service "
                f"among {', '.join(SERVICES)}"
            )
        replicas[name] = int(count)
    return replicas


@dataclass(frozen=True)
class Placement:
    """Where one process runs when the cluster is split over hosts (the fault suite's network
    namespaces): the command prefix that runs it there (`ip netns exec NAME`), what its
    environment adds, and the host's address, which it binds and advertises instead of
    127.0.0.1."""

    prefix: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    address: str = "127.0.0.1"
    # For what the launcher starts itself (the embedded nats-servers): puts the calling
    # thread on the host while it starts them (their children inherit its network).
    enter: Callable[[], AbstractContextManager[None]] | None = None

    def entered(self) -> AbstractContextManager[None]:
        return self.enter() if self.enter is not None else contextlib.nullcontext()


@dataclass
class ClusterSpec:
    state_dir: Path
    nats_url: str | None = None  # None: start an embedded nats-server
    nats_port: int = 4222  # 0: any free port
    root: str = DEFAULT_ROOT
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # replicas take the following ports; 0: any free port
    # Every process's /metrics and /health: this port and the following ones, one per
    # process in start order; 0: any free port (discovery names each: `metrics_url`).
    metrics_port: int = 0
    replicas: dict[str, int] = field(default_factory=dict)
    # None: the children's own (their environment, the configuration file, the default);
    # set, `up` passes it to every child as a flag, over those.
    log_level: str | None = None
    shutdown_grace_s: float | None = None
    # A TOML file every child reads ($KVF_CONFIG): [shared] and one table per service.
    config_file: Path | None = None
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # per service flags
    # Per instance flags, after its service's: {"prefill-1": ["--node-id", "node-b"]}.
    instance_args: dict[str, list[str]] = field(default_factory=dict)
    # What the prefill and decode workers serve: `replicas` of each service per model.
    # Names (shared.models) or paths; the workers' `--model`, unless extra_args give one.
    models: tuple[str, ...] = ("tiny-coder",)
    dev_api_key: str | None = None  # ingress accepts it besides `kvfabric keys` (account dev)
    # Tracing, for every service: spans as JSON lines under `trace_dir` (`kvfabric trace`)
    # and/or over OTLP/HTTP, the share of requests traced.
    trace_dir: Path | None = None
    otlp_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Hosts apart: where each instance runs (absent: this machine, 127.0.0.1), and the
    # embedded nats-server (a single one; its address is then what clients are given).
    placement: dict[str, Placement] = field(default_factory=dict)
    nats_placement: Placement | None = None
    # Embedded NATS servers: 1, or a JetStream cluster of this many (`up --nats-cluster 3`).
    nats_cluster: int = 1
    # Replicas of every stream, bucket and object store; None: min(servers, 3).
    js_replicas: int | None = None
    # Embedded servers' JetStream store ceiling (shared/natsd.py says why it is stated);
    # 0: the server's default, 75% of the disk's free space when it starts.
    nats_max_store_bytes: int = DEFAULT_MAX_FILE_STORE_BYTES
    # NATS credentials, one nkey per role (shared/nats_auth.py): embedded servers get them
    # unless `nats_auth` is off (made under <state_dir>/nats-creds, the servers configured
    # with each role's permissions); an external server's come from `nats_creds_dir`.
    nats_auth: bool = True
    nats_creds_dir: Path | None = None
    # Embedded servers take TLS only (a private CA under <state_dir>/nats-tls; clients trust
    # its ca.pem). An external server's CA: $KVF_NATS_TLS_CA.
    nats_tls: bool = False

    def grace_s(self) -> float:
        """How long a child may take to drain once stopped: the one given to `up`, else what
        the children read themselves (their environment and the configuration file)."""
        if self.shutdown_grace_s is not None:
            return self.shutdown_grace_s
        environ = dict(os.environ)
        if self.config_file is not None:
            environ[CONFIG_ENV] = str(self.config_file)
        return load_config(ServiceConfig, environ=environ).shutdown_grace_s

    def creds_dir(self) -> Path | None:
        """Where each role's seed lies, or None: connect without credentials."""
        if self.nats_url is not None:
            return self.nats_creds_dir
        if not self.nats_auth:
            return None
        return self.nats_creds_dir or self.state_dir / "nats-creds"

    def stream_replicas(self) -> int:
        if self.js_replicas is not None:
            return self.js_replicas
        return min(self.nats_cluster, 3) if self.nats_url is None else 1

    def num_replicas(self, service: str) -> int:
        return self.replicas.get(service, DEFAULT_REPLICAS.get(service, 1))

    def instances(self, service: str) -> list[tuple[str, str | None]]:
        """(instance id, model) of each instance of `service` (model None: not a worker).
        With one model ids are `prefill-0`, ...; with several `prefill-<model>-0`, ...,
        the model's short name (`smollm2`) in the id."""
        count = self.num_replicas(service)
        if service not in MODEL_WORKERS:
            return [(f"{service}-{i}", None) for i in range(count)]
        if len(self.models) == 1:
            return [(f"{service}-{i}", self.models[0]) for i in range(count)]
        return [
            (f"{service}-{_short(model)}-{i}", model) for model in self.models for i in range(count)
        ]


TRACE_DIR_RECORD = "trace-dir"  # in the state dir: where its cluster's spans go


def record_trace_dir(state_dir: Path, trace_dir: Path | None) -> None:
    """Note in the state dir where this cluster writes its spans (`kvfabric trace` reads them
    from there by default); a cluster started without a trace dir removes the note."""
    record = state_dir / TRACE_DIR_RECORD
    if trace_dir is None:
        record.unlink(missing_ok=True)
    else:
        record.write_text(f"{trace_dir.resolve()}\n")


def recorded_trace_dir(state_dir: Path) -> Path | None:
    """The trace dir the last `kvfabric up` with this state dir wrote to, if it had one."""
    record = state_dir / TRACE_DIR_RECORD
    if not record.is_file():
        return None
    text = record.read_text().strip()
    return Path(text) if text else None


@dataclass
class Child:
    service: str
    instance_id: str
    process: subprocess.Popen[bytes]
    log_path: Path
    index: int = 0  # among its service's instances (its HTTP port's offset)
    model: str | None = None
    env: dict[str, str] | None = None  # what it was started with (its role's credentials)
    is_stopped_on_purpose: bool = False  # by the launcher: not an exit to supervise
    is_exit_handled: bool = False
    started_at: float = field(default_factory=time.monotonic)


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsServer | None = None  # the embedded server, or the cluster's first
        self.nats_cluster: NatsCluster | None = None
        self.children: list[Child] = []
        self.nats_url = spec.nats_url or ""
        # The operator's (admin) credentials: what `kvfabric` commands against this cluster
        # need in $KVF_NATS_CREDS; None: the servers take anyone.
        self.nats_creds: Path | None = None
        self.nats_tls_ca: Path | None = None  # the embedded servers' CA, with `nats_tls`
        self.grace_s = 10.0  # how long a child may drain once stopped: set by `start`
        self.http_urls: list[str] = []
        self.metrics_urls: dict[str, str] = {}  # instance id -> its /metrics, once ready
        self.supervisor = Supervisor(spec.state_dir, spec.restart_policy)
        # instance id -> {"http": port, "metrics": port}, once discovery named them
        self.pinned_ports: dict[str, dict[str, int]] = {}
        # Supervision runs on its own thread beside whoever drives the cluster (the CLI's
        # event loop, a test); the lock keeps `children` whole between the two.
        self._lock = threading.RLock()
        self._is_stopping = False
        self._is_closed = False
        self._supervising: threading.Thread | None = None

    def start(self) -> None:
        # Read once: the children's own grace comes from their environment and config file.
        self.grace_s = self.spec.grace_s()
        self.spec.state_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.state_dir / "logs").mkdir(exist_ok=True)
        record_trace_dir(self.spec.state_dir, self.spec.trace_dir)
        placed = self.spec.nats_placement or Placement()
        authorization = self._credentials()
        tls = None
        if self.spec.nats_tls and self.spec.nats_url is None:
            tls = ensure_server_tls(self.spec.state_dir / "nats-tls", [placed.address])
            self.nats_tls_ca = tls.ca
        if self.spec.nats_url is None and self.spec.nats_cluster > 1:
            size, base = self.spec.nats_cluster, self.spec.nats_port
            with placed.entered():
                self.nats_cluster = NatsCluster(
                    self.spec.state_dir / "nats-cluster",
                    size,
                    host=placed.address,
                    ports=[base + i if base else 0 for i in range(size)],
                    max_file_store_bytes=self.spec.nats_max_store_bytes or None,
                    authorization=authorization,
                    tls=tls,
                )
                self.nats_cluster.start()
            self.nats = self.nats_cluster.servers[0]
            self.nats_url = self.nats_cluster.url
            for i, server in enumerate(self.nats_cluster.servers):
                self.supervisor.started(f"{NATS_SERVER}-{i}", NATS_SERVER, server.pid)
        elif self.spec.nats_url is None:
            self.nats = NatsServer(
                self.spec.state_dir / "nats",
                host=placed.address,
                port=self.spec.nats_port,
                max_file_store_bytes=self.spec.nats_max_store_bytes or None,
                authorization=authorization,
                tls=tls,
            )
            with placed.entered():
                self.nats.start()
            self.nats_url = self.nats.url
            self.supervisor.started(NATS_SERVER, NATS_SERVER, self.nats.pid)
        for service in START_ORDER:
            for index, (instance_id, model) in enumerate(self.spec.instances(service)):
                self._spawn(service, index, instance_id, model)
        self.supervisor.save()

    def nats_violations(self) -> list[str]:
        """What the embedded servers refused: publishes and subscriptions outside a role's
        permissions, and connections without valid credentials (their log lines)."""
        servers = self.nats_cluster.servers if self.nats_cluster else [self.nats]
        return [line for s in servers if s is not None for line in s.violations()]

    def admin_env(self) -> dict[str, str]:
        """This environment with the admin credentials: for `kvfabric` commands run against
        this cluster."""
        return os.environ | self._nats_env(self.nats_creds)

    def _nats_env(self, creds: Path | None) -> dict[str, str]:
        """The variables that take a process to these servers: its credentials, the CA."""
        env = {}
        if creds is not None:
            env[CREDS_ENV] = str(creds.resolve())
        if self.nats_tls_ca is not None:
            env[TLS_CA_ENV] = str(self.nats_tls_ca.resolve())
        return env

    def _credentials(self) -> str | None:
        """Each role's seed (kept across restarts of the cluster) and, for embedded
        servers, their `authorization` block."""
        directory = self.spec.creds_dir()
        if directory is None:
            return None
        if self.spec.nats_url is not None:
            missing = [r for r in ROLES if not seed_path(directory, r).is_file()]
            if missing:
                raise NatsServerError(
                    f"{directory} lacks the NATS credentials of {', '.join(missing)} "
                    "(`kvfabric nats-creds` makes them)"
                )
            self.nats_creds = seed_path(directory, ADMIN)
            return None
        keys = ensure_credentials(directory)
        self.nats_creds = seed_path(directory, ADMIN)
        return authorization_conf(keys, Subjects(self.spec.root))

    def _spawn(self, service: str, index: int, instance_id: str, model: str | None) -> None:
        args = [
            sys.executable,
            "-m",
            module_of(service),
            "--nats-url",
            self.nats_url,
            "--root",
            self.spec.root,
            "--instance-id",
            instance_id,
            "--js-replicas",
            str(self.spec.stream_replicas()),
        ]
        if self.spec.log_level is not None:
            args += ["--log-level", self.spec.log_level]
        if self.spec.shutdown_grace_s is not None:
            args += ["--shutdown-grace-s", str(self.spec.shutdown_grace_s)]
        if self.spec.trace_dir is not None:
            args += ["--trace-dir", str(self.spec.trace_dir.resolve())]
        if self.spec.otlp_endpoint:
            args += ["--otlp-endpoint", self.spec.otlp_endpoint]
        if self.spec.trace_dir is not None or self.spec.otlp_endpoint:
            args += ["--trace-sample-ratio", str(self.spec.trace_sample_ratio)]
        # A restarted process keeps the ports its first one bound (picked free when 0):
        # clients, load balancers and Prometheus find it where it was.
        pinned = self.pinned_ports.get(instance_id, {})
        base = self.spec.metrics_port
        metrics_port = pinned.get("metrics") or (base + len(self.children) if base else 0)
        args += ["--metrics-port", str(metrics_port)]
        placement = self.spec.placement.get(instance_id)
        if placement is not None:
            args += ["--metrics-host", placement.address, "--node-id", instance_host(placement)]
        if service == INGRESS:
            port = pinned.get("http") or (self.spec.http_port + index if self.spec.http_port else 0)
            host = placement.address if placement is not None else self.spec.http_host
            args += ["--http-host", host, "--http-port", str(port)]
            if self.spec.dev_api_key:
                args += ["--dev-api-key", self.spec.dev_api_key]
        extra = self.spec.extra_args.get(service, []) + self.spec.instance_args.get(instance_id, [])
        if model is not None and "--model" not in extra:
            args += ["--model", model]
        if service in MODEL_WORKERS and "--store-dir" not in extra:
            # One SSD tier for the whole one-machine cluster: every worker reads every slot.
            args += ["--store-dir", str(self.spec.state_dir / "kvstore")]
        if service == BILLING and "--ledger-url" not in extra:
            # The embedded ledger, under the state dir: a restarted cluster keeps its books.
            ledger = (self.spec.state_dir / "billing" / "ledger.db").resolve()
            ledger.parent.mkdir(parents=True, exist_ok=True)
            args += ["--ledger-url", f"sqlite:///{ledger}"]
        if service in (DECODE, INGRESS, VLLM_WORKER) and "--usage-outbox-dir" not in extra:
            # Under the state dir: a restarted cluster replays what its workers left pending.
            args += ["--usage-outbox-dir", str(self.spec.state_dir / "outbox")]
        args += extra
        log_path = self.spec.state_dir / "logs" / f"{instance_id}.log"
        env = os.environ | dict(placement.env if placement is not None else ())
        if placement is not None:
            args = [*placement.prefix, *args]
        if self.spec.config_file is not None:
            env[CONFIG_ENV] = str(self.spec.config_file.resolve())
        # By environment: vLLM's engine processes (its connector) inherit them too.
        creds = self.spec.creds_dir()
        env |= self._nats_env(seed_path(creds, service) if creds is not None else None)
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                args,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops us in order
                preexec_fn=die_with_parent,
            )
        with self._lock:
            self.children.append(
                Child(service, instance_id, process, log_path, index, model, env=env)
            )
            self.supervisor.started(instance_id, service, process.pid)

    def child(self, instance_id: str) -> Child:
        """The latest process of `instance_id`."""
        with self._lock:
            for child in reversed(self.children):
                if child.instance_id == instance_id:
                    return child
        raise KeyError(f"no instance {instance_id!r} in this cluster")

    def stop_instance(self, instance_id: str) -> int:
        """SIGTERM one instance and wait for its drain (SIGKILL past the grace period); its
        exit code. The rest of the cluster runs on, and supervision leaves it stopped."""
        child = self.child(instance_id)
        child.is_stopped_on_purpose = True
        process = child.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.grace_s + 5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def restart_instance(self, instance_id: str) -> None:
        """Stop one instance (if it runs) and start it again under the same id and flags: a
        worker restarted with its files (store, outbox) where it left them."""
        old = self.child(instance_id)
        self.stop_instance(instance_id)
        with self._lock:
            self.children.remove(old)
            self._spawn(old.service, old.index, old.instance_id, old.model)

    def exited(self) -> list[Child]:
        with self._lock:
            return [c for c in self.children if c.process.poll() is not None]

    # -- supervision ---------------------------------------------------------------------
    def supervise(self) -> list[str]:
        """One round: note the processes that exited on their own, start again those whose
        backoff is over. What happened, one line each (for the launcher's output)."""
        events: list[str] = []
        with self._lock:
            if self._is_stopping:
                return events
            for nats_id, server in self._nats_servers().items():
                code = server.returncode
                if code is not None and self.supervisor.records[nats_id].state == RUNNING:
                    events.append(self._note_exit(nats_id, code, exit_reason(code, None)))
            for child in self.children:
                if child.is_stopped_on_purpose or child.is_exit_handled:
                    continue
                if (code := child.process.poll()) is not None:
                    child.is_exit_handled = True
                    reason = exit_reason(code, child.log_path)
                    events.append(self._note_exit(child.instance_id, code, reason))
            for record in self.supervisor.due():
                events.append(self._restart(record.instance_id))
            if events:
                self.supervisor.save()
        return events

    def _note_exit(self, instance_id: str, code: int, reason: str) -> str:
        record = self.supervisor.exited(instance_id, code, reason)
        how = f"exited with code {code}" + (f" ({reason})" if reason else "")
        if record.state == FAILED:
            policy = self.supervisor.policy
            return (
                f"{instance_id} {how}; FAILED: {policy.budget} restarts within "
                f"{policy.window_s:.0f}s, not restarted (the rest of the cluster serves on)"
            )
        delay_s = max((record.restart_at or 0) - time.monotonic(), 0.0)
        return f"{instance_id} {how}; restarting in {delay_s:.1f}s"

    def _nats_servers(self) -> dict[str, NatsServer]:
        """The embedded servers by their supervision id."""
        if self.nats_cluster is not None:
            return {f"{NATS_SERVER}-{i}": s for i, s in enumerate(self.nats_cluster.servers)}
        return {NATS_SERVER: self.nats} if self.nats is not None else {}

    def _restart(self, instance_id: str) -> str:
        if (server := self._nats_servers().get(instance_id)) is not None:
            log = server.log_path
            if log.exists():  # keep the dead server's last words
                shutil.copyfile(log, log.with_suffix(".log.prev"))
            try:
                with (self.spec.nats_placement or Placement()).entered():
                    server.start()  # the same ports and store: clients and peers come back
            except NatsServerError as exc:
                self.supervisor.exited(instance_id, 1, str(exc))
                return f"{instance_id} failed to restart: {exc}"
            self.supervisor.restarted(instance_id, server.pid)
            return f"{instance_id} restarted on {server.url} (pid {server.pid})"
        old = self.child(instance_id)
        self.children.remove(old)
        self._spawn(old.service, old.index, old.instance_id, old.model)
        self.supervisor.restarted(instance_id, self.child(instance_id).process.pid)
        return f"{instance_id} restarted (pid {self.child(instance_id).process.pid})"

    def supervise_in_background(
        self, on_event: Callable[[str], None] | None = None, interval_s: float = 0.2
    ) -> None:
        """`supervise` every `interval_s` on a thread of its own until `stop`."""

        # The thread outlives supervision until `stop` has stopped every process: a process
        # it restarted gets PR_SET_PDEATHSIG from it (the kernel ties that signal to the
        # thread that started the child), and must stop in order, not when the thread ends.
        def loop() -> None:
            while not self._is_closed:
                for event in self.supervise():
                    if on_event:
                        on_event(event)
                time.sleep(interval_s)

        self._supervising = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervising.start()

    def supervisor_metrics(self) -> Metrics:
        """The launcher's own /metrics: restarts and state of every supervised process."""
        metrics = Metrics("launcher", "launcher")
        ids = tuple(self.supervisor.records)
        labels = {"instance_id": ids}
        records = self.supervisor.records
        metrics.counter_from(
            "kvfabric_supervisor_restarts_total",
            "Times the launcher started a process again after it exited.",
            lambda: {i: r.restarts for i, r in records.items()},
            labels=labels,
        )
        metrics.gauge_from(
            "kvfabric_supervisor_up",
            "1 while the process runs, 0 while it waits for its restart or has failed.",
            lambda: {i: int(r.state == RUNNING) for i, r in records.items()},
            labels=labels,
        )
        metrics.gauge_from(
            "kvfabric_supervisor_failed",
            "1 once the restart budget is spent: the launcher no longer restarts it.",
            lambda: {i: int(r.state == FAILED) for i, r in records.items()},
            labels=labels,
        )
        metrics.gauge_from(
            "kvfabric_supervisor_crash_looping",
            "1 while the process exited more than once within the restart window.",
            lambda: {i: int(r.is_crash_looping) for i, r in records.items()},
            labels=labels,
        )
        return metrics

    async def wait_ready(
        self,
        bus: Bus,
        timeout_s: float = 60.0,
        on_progress: Callable[[str], None] | None = None,
        progress_every_s: float = 5.0,
    ) -> list[Instance]:
        """Until every started instance answers discovery; raises if one exits first.
        `on_progress` hears, every `progress_every_s`, how many are ready and who is not."""
        expected = {c.instance_id for c in self.children}
        started = time.monotonic()
        deadline = started + timeout_s
        next_progress = started + progress_every_s
        while True:
            dead = self.exited()
            if dead:
                child = dead[0]
                tail = child.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"{child.instance_id} exited with code {child.process.returncode} during "
                    f"start-up; end of {child.log_path}:\n{tail}"
                )
            instances = await discover(bus, timeout_s=0.3)
            if expected <= {i.instance_id for i in instances}:
                self.http_urls = [
                    i.metadata["http_url"]
                    for i in instances
                    if i.service == INGRESS and "http_url" in i.metadata
                ]
                self.metrics_urls = {
                    i.instance_id: i.metadata["metrics_url"]
                    for i in instances
                    if i.instance_id in expected and "metrics_url" in i.metadata
                }
                for i in instances:
                    for name in ("http", "metrics"):
                        url = i.metadata.get(f"{name}_url", "")
                        if i.instance_id in expected and url:
                            port = int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                            self.pinned_ports.setdefault(i.instance_id, {})[name] = port
                return instances
            missing = sorted(expected - {i.instance_id for i in instances})
            if time.monotonic() > deadline:
                raise TimeoutError(f"not up within {timeout_s}s: {', '.join(missing)}")
            if on_progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                on_progress(
                    f"{len(expected) - len(missing)}/{len(expected)} ready after "
                    f"{time.monotonic() - started:.0f}s; waiting for {', '.join(missing)}"
                )
            await asyncio.sleep(0.2)

    def stop(self, on_progress: Callable[[str], None] | None = None) -> None:
        """SIGTERM each service tier in reverse start order, wait for its drain, then stop the
        nats-server. SIGKILL only what outlives its grace period. Safe to call twice."""
        grace_s = self.grace_s + 5.0
        with self._lock:
            self._is_stopping = True
        for service in reversed(START_ORDER):
            tier = [c for c in self.children if c.service == service and c.process.poll() is None]
            for child in tier:
                child.is_stopped_on_purpose = True
                child.process.send_signal(signal.SIGTERM)
            for child in tier:
                try:
                    child.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                if on_progress:
                    on_progress(f"stopped {child.instance_id} (exit {child.process.returncode})")
        for child in self.children:  # reap anything already dead
            child.process.poll()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
            if on_progress:
                on_progress(f"stopped {len(self.nats_cluster.servers)} nats-servers")
        elif self.nats is not None:
            self.nats.stop()
            if on_progress:
                on_progress("stopped nats-server")
        self._is_closed = True
        if self._supervising is not None and self._supervising is not threading.current_thread():
            self._supervising.join()
