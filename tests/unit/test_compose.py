"""compose/ starts the same services with the same command as `kvfabric up`, and beside them
Prometheus, Grafana, an OpenTelemetry collector and Jaeger whose config files exist, parse and
name each other (host, port, mounted path) as the compose file wires them. Static checks:
no Docker engine here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from services.admin.cli import app
from shared.subjects import SERVICES

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"
OBSERVABILITY = {"prometheus", "grafana", "otel-collector", "jaeger"}


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts of files under compose/: container path -> host path."""
    found = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("./"):
            found[container] = (COMPOSE.parent / host).resolve()
    return found


def mounted_file(service: dict, container_path: str) -> Path:
    """The host file a container reads at `container_path` (under one of its mounts)."""
    for container, host in mounts(service).items():
        if container_path == container or container_path.startswith(container + "/"):
            path = host / container_path.removeprefix(container).lstrip("/")
            assert path.exists(), f"{container_path} -> {path}: no such file"
            return path
    raise AssertionError(f"nothing mounted at {container_path}")


def test_compose_runs_every_service_through_kvfabric_serve() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == set(SERVICES) | {"nats"} | OBSERVABILITY
    for name in SERVICES:
        assert services[name]["command"][:2] == ["serve", name]
        assert services[name]["environment"]["KVF_NATS_URL"] == "nats://nats:4222"
    assert "--jetstream" in services["nats"]["command"]
    assert {c.callback.__name__ for c in app.registered_commands} >= {"serve", "up", "status"}


def test_prefill_and_decode_share_one_store_volume() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("prefill", "decode"):
        command = services[name]["command"]
        store_dir = command[command.index("--store-dir") + 1]
        assert f"kvstore:{store_dir}" in services[name]["volumes"]


def test_decode_keeps_its_usage_outbox_on_a_volume() -> None:
    command = yaml.safe_load(COMPOSE.read_text())["services"]["decode"]["command"]
    outbox_dir = command[command.index("--usage-outbox-dir") + 1]
    volumes = yaml.safe_load(COMPOSE.read_text())["services"]["decode"]["volumes"]
    assert f"outbox:{outbox_dir}" in volumes


def test_every_service_serves_metrics_and_exports_spans_to_the_collector() -> None:
    services = compose_services()
    collector = yaml.safe_load(
        mounted_file(services["otel-collector"], "/etc/otelcol/collector.yml").read_text()
    )
    receiver = urlsplit("http://" + collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    for name in SERVICES:
        environment = services[name]["environment"]
        assert environment["KVF_METRICS_PORT"] == "9100"
        assert environment["KVF_METRICS_HOST"] == "0.0.0.0"
        endpoint = urlsplit(environment["KVF_OTLP_ENDPOINT"])
        assert endpoint.hostname == "otel-collector" and endpoint.path == "/v1/traces"
        assert endpoint.port == receiver.port
        assert "otel-collector" in services[name]["depends_on"]


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


def test_prometheus_scrapes_every_service_container_on_its_metrics_port() -> None:
    _, config = prometheus_config()
    [job] = config["scrape_configs"]
    assert job["honor_labels"] is True  # the series keep their own instance ids
    [discovery] = job["dns_sd_configs"]
    assert set(discovery["names"]) == set(SERVICES)
    assert discovery["port"] == int(compose_services()["router"]["environment"]["KVF_METRICS_PORT"])


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
    assert f"{url.port}:{url.port}" in services["prometheus"]["ports"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "kvfabric.yml").read_text())[
        "providers"
    ]
    dashboards = mounted_file(grafana, provider["options"]["path"])
    assert sorted(p.name for p in dashboards.glob("*.json")) == sorted(
        p.name for p in (COMPOSE.parent / "grafana" / "dashboards").glob("*.json")
    )
    assert len(list(dashboards.glob("*.json"))) >= 9
    mounted_file(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
