"""What the connector and the vllm-worker read from vLLM, without vLLM: the connector's
extra config (required fields, unknown ones refused by name), the completion request the
worker sends, the chunks and usage it reads back, and vLLM's load from its /metrics text."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.vllm_worker.connector.config import ConnectorConfig, ConnectorConfigError
from services.vllm_worker.vllm_client import Delta, VllmError, _delta, completion_body, parse_load
from shared.schema import SamplingParams

REQUIRED = {
    "nats_url": "nats://127.0.0.1:4222",
    "model": "SmolLM2-135M-Instruct",
    "store_dir": "/tmp/s",
    "writer_id": "vllm-worker-0",
}


def test_connector_config_needs_its_fields_and_names_unknown_ones() -> None:
    config = ConnectorConfig.from_extra(REQUIRED | {"block_size_tokens": 32})
    assert config.store_dir == Path("/tmp/s") and config.block_size_tokens == 32
    assert config.root == "kvf.v1" and config.load and config.save
    with pytest.raises(ConnectorConfigError, match="needs model, writer_id"):
        ConnectorConfig.from_extra({"nats_url": "nats://x", "store_dir": "/s"})
    with pytest.raises(ConnectorConfigError, match="unknown shared_storage_path"):
        ConnectorConfig.from_extra(REQUIRED | {"shared_storage_path": "/x"})
    with pytest.raises(ConnectorConfigError, match="positive"):
        ConnectorConfig.from_extra(REQUIRED | {"kv_index_shards": 0})
    assert config.idle_spin_s == 0.05  # vLLM's own 1 s only when asked for (None)
    assert ConnectorConfig.from_extra(REQUIRED | {"idle_spin_s": None}).idle_spin_s is None
    with pytest.raises(ConnectorConfigError, match="idle_spin_s must be 0-10 s, got -1"):
        ConnectorConfig.from_extra(REQUIRED | {"idle_spin_s": -1})


def test_completion_body_carries_ids_sampling_and_salt_but_no_stop_strings() -> None:
    sampling = SamplingParams(
        max_tokens=7, temperature=0.0, top_k=5, seed=3, stop=("\n\n",), stop_token_ids=(2,)
    )
    body = completion_body("m", [1, 2, 3], sampling, request_id="r-1", cache_salt="t")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7 and body["top_k"] == 5
    assert body["stream"] and body["return_token_ids"] and body["cache_salt"] == "t"
    assert body["stop_token_ids"] == [2] and "stop" not in body  # stop strings are ours
    assert "cache_salt" not in completion_body("m", [1], SamplingParams(), request_id="r")


def test_chunks_and_the_final_usage() -> None:
    assert _delta({"choices": [{"token_ids": [5, 6], "finish_reason": None}]}) == Delta((5, 6))
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    last = _delta({"choices": [], "usage": usage})
    assert (last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens) == (100, 64, 4)
    with pytest.raises(VllmError, match="too long"):
        _delta({"error": {"message": "prompt too long"}})


def test_load_from_vllm_metrics_text() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:cache_config_info{block_size="64",engine="0",num_gpu_blocks="1200"} 1.0',
        ]
    )
    load = parse_load(text)
    assert (load.num_running, load.num_waiting, load.num_kv_blocks_total) == (3, 1, 1200)
    assert load.kv_cache_usage == 0.25
