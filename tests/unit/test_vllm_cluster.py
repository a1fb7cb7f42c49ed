"""vLLM workers in the one-machine cluster without running vLLM: `kvfabric up --engine vllm`
puts vllm-workers in place of prefill and decode, each launched with its model, the shared
store and the usage outbox; without it no vllm-worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from services.admin.cli import apply_engine
from services.admin.launcher import START_ORDER, ClusterSpec
from services.vllm_worker.vllm_env import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    SOURCE_ROOT,
    connector_config,
)
from shared.models import DEFAULT_MODELS
from shared.subjects import DECODE, PREFILL, VLLM_WORKER

SMOL = "SmolLM2-135M-Instruct"


def test_no_vllm_worker_unless_asked(tmp_path: Path) -> None:
    spec = ClusterSpec(state_dir=tmp_path)
    apply_engine(spec, "model", ",".join(DEFAULT_MODELS))
    assert spec.instances(VLLM_WORKER) == []
    assert spec.instances(PREFILL) and spec.instances(DECODE)
    assert VLLM_WORKER in START_ORDER


def test_engine_vllm_runs_vllm_workers_in_place_of_prefill_and_decode(tmp_path: Path) -> None:
    spec = ClusterSpec(state_dir=tmp_path)
    apply_engine(spec, "vllm", ",".join(DEFAULT_MODELS))  # the default list: SmolLM2 only
    assert spec.instances(PREFILL) == spec.instances(DECODE) == []
    assert spec.instances(VLLM_WORKER) == [("vllm-worker-0", SMOL)]
    two = ClusterSpec(state_dir=tmp_path, replicas={VLLM_WORKER: 2})
    apply_engine(two, "vllm", SMOL)
    assert [i for i, _ in two.instances(VLLM_WORKER)] == ["vllm-worker-0", "vllm-worker-1"]
    with pytest.raises(typer.BadParameter, match="must be one of"):
        apply_engine(ClusterSpec(state_dir=tmp_path), "sglang", SMOL)


def test_the_connector_config_names_our_module_and_the_checkout_is_importable() -> None:
    config = connector_config({"nats_url": "nats://x:4222", "model": SMOL})
    assert config["kv_connector"] == CONNECTOR_CLASS == "KvfabricConnector"
    module_file = SOURCE_ROOT / (CONNECTOR_MODULE.replace(".", "/") + ".py")
    assert module_file.is_file() and f"class {CONNECTOR_CLASS}(" in module_file.read_text()
    assert config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"]["model"] == SMOL
