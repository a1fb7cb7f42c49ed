"""compose/ starts the same services with the same command as `kvfabric up`."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.admin.cli import app
from shared.subjects import SERVICES

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"


def test_compose_runs_every_service_through_kvfabric_serve() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == set(SERVICES) | {"nats"}
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
