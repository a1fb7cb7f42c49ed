"""One frozen, typed config per service: defaults < environment < command-line flags.

Each service subclasses `ServiceConfig` with its own fields and `env_prefix`
(`KVF_ROUTER_`). A field `heartbeat_s` is read from `KVF_ROUTER_HEARTBEAT_S`, then from the
shared `KVF_HEARTBEAT_S` for the fields every service has (so one `KVF_NATS_URL` serves a
whole host), and from the flag `--heartbeat-s`. Bad values fail at start with the name of
the variable or flag; `validate()` adds the cross-field checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import socket
import tomllib
import types
import typing
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from shared.load_table import HEARTBEAT_TIMEOUT_S
from shared.models import ModelError, model_path, served_name
from shared.subjects import DEFAULT_ROOT, Subjects, check_token

SHARED_ENV_PREFIX = "KVF_"
LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINES = ("model", "mock")
ENGINE_DTYPES = ("float32", "bfloat16")  # EngineWorkerConfig.dtype: torch dtypes by name


class ConfigError(ValueError):
    """A config value is malformed or inconsistent; the message names its source."""


def check_dtype(dtype: str) -> None:
    """A worker's `dtype` setting (engine and vLLM workers alike)."""
    if dtype not in ENGINE_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Fields every service has."""

    env_prefix: ClassVar[str] = SHARED_ENV_PREFIX

    nats_url: str = "nats://127.0.0.1:4222"  # a cluster's servers: comma-separated
    # This process's NATS credentials: an nkey seed file of its role (shared/nats_auth.py;
    # `kvfabric up` makes them); unset: connect without (a server without authorization).
    nats_creds: Path | None = None
    # The CA that signed the NATS servers' certificates, for tls:// URLs.
    nats_tls_ca: Path | None = None
    # Copies JetStream keeps of every stream, key-value bucket and object store this process
    # creates: 3 on a three-server NATS cluster (one server may be lost), 1 on a single one.
    js_replicas: int = 1
    # The subject root every subject, stream and bucket of this cluster is under: several
    # clusters (or tests) share one NATS server apart.
    root: str = DEFAULT_ROOT
    instance_id: str | None = None  # generated as <service>-<8 hex> when unset
    # The host it runs on, in heartbeats: routers pair a node's own swa-memcache with it.
    node_id: str = dataclasses.field(default_factory=socket.gethostname)
    # Seconds between its heartbeats (`LoadReport`s: load, state, liveness).
    heartbeat_s: float = 1.0
    # Another instance silent this long is gone: the router stops routing to it and ingress
    # stops serving a model none of whose workers beat (the same rule: shared/load_table.py).
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    # On stopping, how long requests in flight may take to finish before they are
    # cancelled (and as long again for a usage outbox to flush).
    shutdown_grace_s: float = 10.0
    # SIGTERM first drains as `kvfabric drain` does (DRAINING: routers send nothing new; its
    # running streams finish) for at most this long, then stops: what a Kubernetes rolling
    # update sends. 0: stop at once (handlers in flight still get shutdown_grace_s). A
    # second SIGTERM, or SIGINT, stops at once.
    sigterm_drain_s: float = 0.0
    # How long the first connection to NATS is retried before the process gives up (its
    # server may start after it); once connected, reconnects go on forever.
    connect_timeout_s: float = 10.0
    # debug, info, warning or error: JSON lines on stderr.
    log_level: str = "info"
    otlp_endpoint: str | None = None  # OTLP/HTTP traces endpoint; tracing export is off unless set
    # Finished spans as JSON lines in <trace_dir>/<instance>.jsonl (`kvfabric trace` reads
    # them); exporting there counts as exporting, as an OTLP endpoint does.
    trace_dir: Path | None = None
    # The share of requests traced once spans are exported: roots sampled by trace id,
    # every hop after them following the root's choice.
    trace_sample_ratio: float = 1.0
    # The process's own HTTP port: `GET /metrics` (Prometheus text format) and `GET /health`
    # (0: any free one; `metrics_url` and `health_url` in discovery metadata); off when unset.
    # `kvfabric up` gives every process one. Ingress also answers /health on its API port.
    metrics_port: int | None = None
    # The address that port binds (0.0.0.0 where probes and Prometheus come from elsewhere).
    metrics_host: str = "127.0.0.1"

    def validate(self) -> None:
        # A cluster's servers come comma-separated: a client given all of them rides out the
        # loss of any one.
        urls = self.nats_url.split(",")
        if not all(u.strip().startswith(("nats://", "tls://", "ws://", "wss://")) for u in urls):
            raise ConfigError(
                f"nats_url {self.nats_url!r} must start with nats://, tls://, ws:// or wss:// "
                "(a cluster's: each of its comma-separated URLs)"
            )
        if not 1 <= self.js_replicas <= 5:
            raise ConfigError(
                f"js_replicas must be 1-5 (JetStream's limit; at most the NATS cluster's "
                f"size), got {self.js_replicas}"
            )
        try:
            Subjects(self.root)
            if self.instance_id is not None:
                check_token(self.instance_id, "instance_id")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("heartbeat_s", "heartbeat_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.sigterm_drain_s < 0:
            raise ConfigError(f"sigterm_drain_s must be >= 0, got {self.sigterm_drain_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be in [0, 65536), got {self.metrics_port}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(
                f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}"
            )
        if self.trace_dir is not None and self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise ConfigError(f"trace_dir {str(self.trace_dir)!r} exists and is not a directory")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")

    def resolved_instance_id(self, service: str) -> str:
        return self.instance_id or f"{service}-{uuid.uuid4().hex[:8]}"

    def to_log(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


C = TypeVar("C", bound=ServiceConfig)


CONFIG_ENV = "KVF_CONFIG"  # a TOML configuration file (or --config)
SHARED_SECTION = "shared"  # the file's table of the fields every service has


def config_section(cls: type) -> str:
    """The file's table of `cls`'s own fields: its service's name (KVF_KV_INDEX_ ->
    kv-index), `shared` for the fields every service has."""
    prefix = getattr(cls, "env_prefix", SHARED_ENV_PREFIX)
    name = prefix[len(SHARED_ENV_PREFIX) :].rstrip("_").lower().replace("_", "-")
    return name or SHARED_SECTION


def load_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    **overrides: Any,
) -> C:
    """Build and validate `cls`, each source over the one before: defaults < the
    configuration file (`--config` or $KVF_CONFIG: its [shared] table, then the service's
    own) < the environment (KVF_<FIELD>, then KVF_<SERVICE>_<FIELD>) < `argv` flags <
    `overrides`."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    shared_fields = {f.name for f in dataclasses.fields(ServiceConfig)}
    flags: dict[str, Any] = {}
    config_file = environ.get(CONFIG_ENV) or None
    if argv:
        parser = argparse.ArgumentParser(prog=prog or cls.__name__, description=cls.__doc__)
        parser.add_argument(
            "--config",
            dest="_config_file",
            default=None,
            metavar="FILE",
            help=f"a TOML file: [{SHARED_SECTION}] and [{config_section(cls)}] tables of "
            f"these settings, under the environment and flags; env {CONFIG_ENV}",
        )
        # Read from the sources only for --help: not every process start.
        docs = field_docs(cls) if {"-h", "--help"} & set(argv) else {}
        for field in dataclasses.fields(cls):
            default = (
                field.default_factory()
                if field.default is dataclasses.MISSING
                and field.default_factory is not dataclasses.MISSING
                else field.default
            )
            env_name = f"{cls.env_prefix}{field.name.upper()}"
            doc = docs.get(field.name, "")
            parser.add_argument(
                f"--{field.name.replace('_', '-')}",
                dest=field.name,
                default=None,
                metavar=typing.get_type_hints(cls)[field.name].__name__
                if isinstance(typing.get_type_hints(cls)[field.name], type)
                else "VALUE",
                help=(f"{doc} " if doc else "")
                + f"(default {_jsonable(default)!r}; env {env_name})".replace("%", "%%"),
            )
        parsed = vars(parser.parse_args(list(argv)))
        config_file = parsed.pop("_config_file") or config_file
        for name, raw in parsed.items():
            if raw is not None:
                flags[name] = _convert(raw, hints[name], f"--{name.replace('_', '-')}")
    values: dict[str, Any] = _file_values(cls, Path(config_file), hints) if config_file else {}
    for field in dataclasses.fields(cls):
        names = [f"{cls.env_prefix}{field.name.upper()}"]
        if field.name in shared_fields and cls.env_prefix != SHARED_ENV_PREFIX:
            names.append(f"{SHARED_ENV_PREFIX}{field.name.upper()}")
        for env_name in names:
            if env_name in environ:
                values[field.name] = _convert(environ[env_name], hints[field.name], env_name)
                break
    values.update(flags)
    values.update(overrides)
    try:
        config = cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
    config.validate()
    return config


def read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    """The file's tables: [up], [shared] and one per service."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"configuration file {path}: {exc}") from exc
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name} = ... outside a table ([shared], [router] ...)")
    return data


def read_table(path: Path, section: str) -> dict[str, Any]:
    return read_config_file(path).get(section, {})


_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:\s*[^=]+(?:=\s*(.*))?$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description: the comment lines just above it in its class's source
    (or the comment after it on its line), as `--help` shows them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines:
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("#").strip())
                continue
            match = _FIELD_LINE.match(line)
            if match and not stripped.startswith(("def ", "@", "return")):
                trailing = line.split("#", 1)[1].strip() if "  # " in line else ""
                text = " ".join(above) or trailing
                if text:
                    docs[match.group(1)] = text
            above = []
    return docs


def _file_values(cls: type, path: Path, hints: Mapping[str, Any]) -> dict[str, Any]:
    """`cls`'s settings from the file: [shared], then [<service>] over it. A key that is not
    a setting of its table is an error, as a misspelled flag would be."""
    data = read_config_file(path)
    shared_fields = {f.name for f in dataclasses.fields(ServiceConfig)}
    own = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for section, allowed in ((SHARED_SECTION, shared_fields), (config_section(cls), own)):
        for key, raw in data.get(section, {}).items():
            if key not in allowed:
                raise ConfigError(f"{path}: [{section}] {key} is not one of its settings")
            values[key] = _from_file(raw, hints[key], f"{path} [{section}] {key}")
    return values


def _from_file(raw: Any, hint: Any, source: str) -> Any:
    """A TOML value as the field's type: strings convert as the environment's do; numbers
    and booleans must fit the type; an array is a tuple's items."""
    if isinstance(raw, list):
        raw = ",".join(str(item) for item in raw)
    elif isinstance(raw, bool):
        raw = "true" if raw else "false"
    elif isinstance(raw, int | float):
        raw = repr(raw)
    elif not isinstance(raw, str):
        raise ConfigError(f"{source}: unsupported value {raw!r}")
    return _convert(raw, hint, source)


def _convert(raw: str, hint: Any, source: str) -> Any:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if optional and raw.strip().lower() in ("", "none", "null"):
        return None
    try:
        if hint is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if hint in (int, float, str, Path):
            return hint(raw)
        if typing.get_origin(hint) is tuple:
            item = typing.get_args(hint)[0]
            return tuple(item(part.strip()) for part in raw.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from exc
    raise ConfigError(f"{source}: unsupported config type {hint!r}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineWorkerConfig(ServiceConfig):
    """Fields of the services that run the model (prefill, decode)."""

    # What this worker serves: a model's name (`kvfabric models list`: tiny-coder,
    # SmolLM2-135M-Instruct) or a path, an HF directory or a .gguf file.
    model: str = "tiny-coder"
    # Tokens per KV block: the unit of hashing, caching, the store and transfers (every
    # worker of a model must agree).
    kv_block_size_tokens: int = 64
    # The KV pool: `num_kv_blocks` pages, or (0) as many as fit in `kv_pool_bytes`. A page is
    # every full-attention layer's K and V for one block: 96 KiB for tiny-coder, 2.8 MiB
    # for SmolLM2 in fp32 (30 layers x K/V x 64 tokens x 3 heads x 64 dims x 4 bytes), so
    # 1 GiB is 10,922 pages of tiny-coder and 364 of SmolLM2 (23K tokens). Pages are touched
    # as they are used (the pool is zero-filled lazily).
    num_kv_blocks: int = 0
    # The KV pool's size in bytes when `num_kv_blocks` is 0 (see above).
    kv_pool_bytes: int = 1 << 30
    # The host-memory tier behind the pool: the bytes of blocks the pool hands out again,
    # kept (least recently used out first) up to this size and read back before the store
    # (0: none).
    host_tier_bytes: int = 256 << 20
    # Torch threads; 0: every core this process may run on (its CPU affinity). Workers on
    # one host then share the cores through the OS: a prefill with decode idle gets them
    # all, and both get about half while both compute (measured, docs/benchmarks.md).
    num_threads: int = 0
    # The model's arithmetic and its KV pages: float32, or bfloat16 (a CPU with AVX-512 BF16
    # or AMX runs its matmuls and attention in it: SmolLM2's 256-token prefill after 1,792
    # cached tokens took 145 ms against 353 ms in float32 here, docs/engine-benchmarks.md).
    # A page's bytes depend on it, so the workers of one model must agree: a block stored by
    # a worker of the other dtype reads as a miss (its slot's payload size differs).
    dtype: str = "float32"
    # Dummy tokens the worker runs through its model before it joins discovery (0: none):
    # a fresh process's first long forward pays for its thread's allocator arena and
    # OpenMP team (~100 ms on SmolLM2, worker/engine/worker.py), the warm-up instead of the
    # first request routed to it.
    warmup_tokens: int = 512
    # Longest sequence served; 0: the model's max_position_embeddings (its training context).
    # Larger values run RoPE past what the model was trained on: right for timing (the
    # 8K-context benchmarks on the 512-token tiny-coder), not for quality.
    max_model_len: int = 0
    # The SSD tier: one directory shared by every worker (a 3FS mount in a cluster); each
    # worker writes its own subdirectory and reads everyone's.
    store_dir: Path = Path("/tmp/kvfabric/kvstore")
    store_capacity_bytes: int = 8 << 30  # this worker's share
    # Bytes per file of the store: blocks go into fixed-size slots of files this large.
    store_file_nbytes: int = 256 << 20
    store_backend: str = "nixl:POSIX"  # nixl:GDS, nixl:GDS_MT, nixl:HF3FS, aiofiles
    # NIXL-registered host memory for the prefill -> decode KV handoff; 0: room for one
    # prompt of the longest length served (its pages and window), whatever the model.
    handoff_staging_bytes: int = 0
    # `mock`: the same worker and engine over a simulated model (worker/mock_engine/): the
    # checkpoint's geometry without its weights, deterministic tokens, each pass sleeping the
    # CostModel's time; its KV pages, windows, handoffs, store writes and usage are real.
    engine: str = "model"
    mock_speedup: float = 1.0  # simulated seconds per wall-clock second

    def validate(self) -> None:
        super().validate()
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.mock_speedup <= 0:
            raise ConfigError(f"mock_speedup must be > 0, got {self.mock_speedup}")
        try:
            model_path(self.model)
        except ModelError as exc:
            raise ConfigError(str(exc)) from exc
        if self.max_model_len < 0:
            raise ConfigError("max_model_len must be >= 0")
        for name in (
            "kv_block_size_tokens",
            "store_capacity_bytes",
            "store_file_nbytes",
            "kv_pool_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        for name in ("num_kv_blocks", "handoff_staging_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: sized for the model)")
        if self.host_tier_bytes < 0:
            raise ConfigError(f"host_tier_bytes must be >= 0 (0: none), got {self.host_tier_bytes}")
        if self.num_threads < 0:
            raise ConfigError("num_threads must be >= 0 (0: every core this process may use)")
        if self.warmup_tokens < 0:
            raise ConfigError(f"warmup_tokens must be >= 0 (0: none), got {self.warmup_tokens}")
        check_dtype(self.dtype)

    @property
    def model_path(self) -> Path:
        """The model's files (ModelError when a known model is not fetched)."""
        return model_path(self.model)

    @property
    def model_name(self) -> str:
        """What requests ask for and discovery says: a known model's name, else the file's."""
        return served_name(self.model)

    @property
    def torch_threads(self) -> int:
        """`num_threads`, or (0) the cores this process may run on."""
        return self.num_threads or len(os.sched_getaffinity(0))

    def pool_pages(self, block_nbytes: int) -> int:
        """KV pool pages for blocks of `block_nbytes` (`num_kv_blocks`, else what fits)."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        return max(self.kv_pool_bytes // max(block_nbytes, 1), 1)
