"""The embedded one-machine cluster behind `kvfabric up`: a nats-server (unless an existing one
is given), then one process per service instance, started in dependency order and stopped in
the reverse order. Each process serves `/metrics` and `/health` on a port of its own
(`--metrics-port`: consecutive from `metrics_port`, or any free one), named in discovery.
Children, the nats-server among them, die with the launcher even if it is killed
(PR_SET_PDEATHSIG), so no orphan outlives it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared import models
from shared.bus import Bus
from shared.discovery import Instance, discover
from shared.natsd import NatsServer, die_with_parent
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
    check_token,
)

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
assert set(START_ORDER) == set(SERVICES)


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
    log_level: str = "info"
    shutdown_grace_s: float = 10.0
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


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsServer | None = None
        self.children: list[Child] = []
        self.nats_url = spec.nats_url or ""
        self.http_urls: list[str] = []
        self.metrics_urls: dict[str, str] = {}  # instance id -> its /metrics, once ready

    def start(self) -> None:
        self.spec.state_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.state_dir / "logs").mkdir(exist_ok=True)
        record_trace_dir(self.spec.state_dir, self.spec.trace_dir)
        if self.spec.nats_url is None:
            self.nats = NatsServer(self.spec.state_dir / "nats", port=self.spec.nats_port)
            self.nats.start()
            self.nats_url = self.nats.url
        for service in START_ORDER:
            for index, (instance_id, model) in enumerate(self.spec.instances(service)):
                self._spawn(service, index, instance_id, model)

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
            "--log-level",
            self.spec.log_level,
            "--shutdown-grace-s",
            str(self.spec.shutdown_grace_s),
        ]
        if self.spec.trace_dir is not None:
            args += ["--trace-dir", str(self.spec.trace_dir.resolve())]
        if self.spec.otlp_endpoint:
            args += ["--otlp-endpoint", self.spec.otlp_endpoint]
        if self.spec.trace_dir is not None or self.spec.otlp_endpoint:
            args += ["--trace-sample-ratio", str(self.spec.trace_sample_ratio)]
        base = self.spec.metrics_port
        args += ["--metrics-port", str(base + len(self.children) if base else 0)]
        if service == INGRESS:
            port = self.spec.http_port + index if self.spec.http_port else 0
            args += ["--http-host", self.spec.http_host, "--http-port", str(port)]
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
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops us in order
                preexec_fn=die_with_parent,
            )
        self.children.append(Child(service, instance_id, process, log_path, index, model))

    def child(self, instance_id: str) -> Child:
        """The latest process of `instance_id`."""
        for child in reversed(self.children):
            if child.instance_id == instance_id:
                return child
        raise KeyError(f"no instance {instance_id!r} in this cluster")

    def stop_instance(self, instance_id: str) -> int:
        """SIGTERM one instance and wait for its drain (SIGKILL past the grace period); its
        exit code. The rest of the cluster runs on."""
        process = self.child(instance_id).process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.spec.shutdown_grace_s + 5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def restart_instance(self, instance_id: str) -> None:
        """Stop one instance (if it runs) and start it again under the same id and flags: a
        worker restarted with its files (store, outbox) where it left them."""
        old = self.child(instance_id)
        self.stop_instance(instance_id)
        self.children.remove(old)
        self._spawn(old.service, old.index, old.instance_id, old.model)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.process.poll() is not None]

    async def wait_ready(self, bus: Bus, timeout_s: float = 60.0) -> list[Instance]:
        """Until every started instance answers discovery; raises if one exits first."""
        expected = {c.instance_id for c in self.children}
        deadline = time.monotonic() + timeout_s
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
                return instances
            if time.monotonic() > deadline:
                missing = sorted(expected - {i.instance_id for i in instances})
                raise TimeoutError(f"not up within {timeout_s}s: {', '.join(missing)}")
            await asyncio.sleep(0.2)

    def stop(self, on_progress: Callable[[str], None] | None = None) -> None:
        """SIGTERM each service tier in reverse start order, wait for its drain, then stop the
        nats-server. SIGKILL only what outlives its grace period. Safe to call twice."""
        grace_s = self.spec.shutdown_grace_s + 5.0
        for service in reversed(START_ORDER):
            tier = [c for c in self.children if c.service == service and c.process.poll() is None]
            for child in tier:
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
        if self.nats is not None:
            self.nats.stop()
            if on_progress:
                on_progress("stopped nats-server")
