"""compose/ stays in step with the code (statically; tests/deploy/test_compose_up.py runs it):
every kvfabric container runs `kvfabric serve <service>` with the role's own NATS seed and a
configuration file every service loads; prefill nodes pair with their swa-memcache, kv-index
shards have replicas the router's shard count matches, the workers share one store and the
outbox one volume; the NATS servers route to each other; Prometheus scrapes every kvfabric
container; Grafana, the collector and Jaeger (the observability profile) name each other."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.admin.launcher import DEFAULT_REPLICAS, START_ORDER, module_of
from shared.config import load_config
from shared.subjects import (
    BILLING,
    DECODE,
    INGRESS,
    KV_INDEX,
    PREFILL,
    SERVICES,
    SWA_MEMCACHE,
    VLLM_WORKER,
)

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "compose.yaml"
CONFIG = COMPOSE.parent / "kvfabric.toml"
OBSERVABILITY = {"grafana", "otel-collector", "jaeger"}


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def kvfabric_containers() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose_services().items() if s.get("command", [""])[0] == "serve"}


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in kvfabric_containers().items() if s["command"][1] == kind}


def settings() -> dict[str, Any]:
    return tomllib.loads(CONFIG.read_text())


def mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts of files under compose/: container path -> host path."""
    found = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("./"):
            found[container] = (COMPOSE.parent / host).resolve()
    return found


def named_volumes(service: dict) -> dict[str, str]:
    """container path -> named volume."""
    return {
        v.split(":")[1]: v.split(":")[0]
        for v in service.get("volumes", [])
        if not v.startswith(("./", "/"))
    }


def mounted_file(service: dict, container_path: str) -> Path:
    """The host file a container reads at `container_path` (under one of its mounts)."""
    for container, host in mounts(service).items():
        if container_path == container or container_path.startswith(container + "/"):
            path = host / container_path.removeprefix(container).lstrip("/")
            assert path.exists(), f"{container_path} -> {path}: no such file"
            return path
    raise AssertionError(f"nothing mounted at {container_path}")


def test_every_service_kind_runs_through_kvfabric_serve_with_its_own_seed() -> None:
    containers = kvfabric_containers()
    # The services `kvfabric up` starts (its registry), each at least twice where a second
    # instance can take over (billing and kv-index shards aside).
    started = {s for s in START_ORDER if DEFAULT_REPLICAS.get(s, 1) > 0}
    assert {s["command"][1] for s in containers.values()} == started
    counts = Counter(s["command"][1] for s in containers.values())
    assert all(counts[k] >= 2 for k in started - {BILLING}), counts
    ids = [s["environment"]["KVF_INSTANCE_ID"] for s in containers.values()]
    assert len(set(ids)) == len(ids)
    for name, service in containers.items():
        kind = service["command"][1]
        assert service["image"].startswith("localhost/kvfabric:")
        assert service["init"] is True  # Python as PID 1 would ignore SIGTERM
        environment = service["environment"]
        # Mounted where the variable says, and the seed of its own role: the servers give
        # each role only its own subjects.
        seed = mounts(service)[environment["KVF_NATS_CREDS"]]
        assert seed.parent.name == "nats" and seed.name == f"{kind}.nk", (name, seed)
        assert mounts(service)[environment["KVF_CONFIG"]] == CONFIG.resolve()
        assert set(service["depends_on"]) >= {"nats-1", "nats-2", "nats-3"}


@pytest.mark.parametrize("kind", sorted(set(SERVICES) - {VLLM_WORKER}))
def test_each_service_loads_the_configuration_file(kind: str) -> None:
    """The file holds only settings of each table's service, with values they accept; with a
    container's environment over it, each gets the cluster's NATS and its own identity."""
    module = importlib.import_module(module_of(kind) + ".config")
    suffix = kind.upper().replace("-", "_") + "_"
    [config_class] = [
        v for v in vars(module).values()
        if isinstance(v, type) and getattr(v, "env_prefix", "").endswith(suffix)
    ]  # fmt: skip
    for name, service in of_kind(kind).items():
        environ = {k: str(v) for k, v in service["environment"].items()}
        environ |= {"KVF_CONFIG": str(CONFIG), "KVF_NATS_CREDS": str(CONFIG)}  # any file
        config = load_config(config_class, environ=environ)
        hosts = sorted(urlsplit(u).hostname for u in config.nats_url.split(","))
        assert hosts == ["nats-1", "nats-2", "nats-3"]
        assert config.js_replicas == 3
        assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9100)
        assert config.instance_id == environ["KVF_INSTANCE_ID"], name


def test_each_prefill_node_has_its_own_swa_memcache() -> None:
    nodes = Counter(s["environment"]["KVF_NODE_ID"] for s in of_kind(SWA_MEMCACHE).values())
    prefill_nodes = [s["environment"]["KVF_NODE_ID"] for s in of_kind(PREFILL).values()]
    assert len(prefill_nodes) == 2 and len(set(prefill_nodes)) == 2
    assert {n: nodes[n] for n in prefill_nodes} == dict.fromkeys(prefill_nodes, 1)


def test_kv_index_shards_have_replicas_and_the_router_asks_them_all() -> None:
    num_shards = settings()["kv-index"]["num_shards"]
    assert settings()["router"]["kv_index_shards"] == num_shards
    shards = Counter(
        int(s["environment"]["KVF_KV_INDEX_SHARD_ID"]) for s in of_kind(KV_INDEX).values()
    )
    assert set(shards) == set(range(num_shards)) and min(shards.values()) >= 2


def test_workers_share_the_store_and_the_outbox_outlives_containers() -> None:
    store_dir, outbox_dir = (
        settings()["decode"]["store_dir"],
        settings()["decode"]["usage_outbox_dir"],
    )
    assert settings()["prefill"]["store_dir"] == store_dir
    assert settings()["ingress"]["usage_outbox_dir"] == outbox_dir
    for kind in (PREFILL, DECODE):
        for service in of_kind(kind).values():
            assert named_volumes(service)[store_dir] == "kvstore"
    for kind in (DECODE, INGRESS):
        for service in of_kind(kind).values():
            assert named_volumes(service)[outbox_dir] == "outbox"
    assert named_volumes(compose_services()["postgres"])["/var/lib/postgresql/data"]


def test_the_nats_servers_route_to_each_other_and_take_the_generated_authorization() -> None:
    services = compose_services()
    servers = sorted(n for n in services if n.startswith("nats-"))
    assert servers == ["nats-1", "nats-2", "nats-3"]
    names = set()
    for name in servers:
        conf = mounted_file(services[name], "/etc/nats/nats.conf").read_text()
        routes = {urlsplit(r).hostname for r in conf.split() if r.startswith("nats-route://")}
        assert routes == set(servers)
        assert "include ./authorization.conf" in conf
        assert mounts(services[name])["/etc/nats/authorization.conf"].name == "authorization.conf"
        assert "/data" in named_volumes(services[name])
        names.add(services[name]["environment"]["NATS_SERVER_NAME"])
    assert names == set(servers)  # JetStream clustering needs each its own name


def test_the_observability_profile_holds_what_cannot_be_built_here() -> None:
    services = compose_services()
    assert {n for n, s in services.items() if "observability" in s.get("profiles", [])} == (
        OBSERVABILITY
    )
    for name, service in services.items():
        if name not in OBSERVABILITY:
            assert service["image"].startswith("localhost/kvfabric"), name


def test_the_collector_sends_traces_to_jaeger_over_otlp() -> None:
    services = compose_services()
    config_path = services["otel-collector"]["command"][0].removeprefix("--config=")
    collector = yaml.safe_load(mounted_file(services["otel-collector"], config_path).read_text())
    pipeline = collector["service"]["pipelines"]["traces"]
    assert set(pipeline["receivers"]) <= set(collector["receivers"])
    assert set(pipeline["processors"]) <= set(collector["processors"])
    assert set(pipeline["exporters"]) <= set(collector["exporters"])
    [exporter] = [collector["exporters"][e] for e in pipeline["exporters"]]
    host, port = exporter["endpoint"].split(":")
    assert host == "jaeger" and port == "4317"  # Jaeger's OTLP/gRPC receiver
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def prometheus_config() -> tuple[Path, dict]:
    prometheus = compose_services()["prometheus"]
    [flag] = [a for a in prometheus["command"] if a.startswith("--config.file=")]
    path = mounted_file(prometheus, flag.removeprefix("--config.file="))
    return path, yaml.safe_load(path.read_text())


def test_prometheus_scrapes_every_kvfabric_container_on_its_metrics_port() -> None:
    _, config = prometheus_config()
    [job] = config["scrape_configs"]
    assert job["honor_labels"] is True  # the series keep their own instance ids
    [static] = job["static_configs"]
    port = settings()["shared"]["metrics_port"]
    assert sorted(static["targets"]) == sorted(f"{n}:{port}" for n in kvfabric_containers())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_prometheus_config() -> None:
    path, _ = prometheus_config()
    checked = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboards() -> None:
    services = compose_services()
    grafana = services["grafana"]
    provisioning = mounted_file(grafana, "/etc/grafana/provisioning")
    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus"
    [published] = services["prometheus"]["ports"]
    assert published.endswith(f":{url.port}")
    [provider] = yaml.safe_load((provisioning / "dashboards" / "kvfabric.yml").read_text())[
        "providers"
    ]
    dashboards = mounted_file(grafana, provider["options"]["path"])
    assert sorted(p.name for p in dashboards.glob("*.json")) == sorted(
        p.name for p in (COMPOSE.parent / "grafana" / "dashboards").glob("*.json")
    )
    assert len(list(dashboards.glob("*.json"))) >= 9
    mounted_file(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
