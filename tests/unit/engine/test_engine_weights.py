"""Checkpoint loading: sharded files, and typed errors naming the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.engine.engine_helpers import assert_logits_close, hf_logits, random_tokens
from worker.engine import CheckpointError, ModelRunner, UnsupportedModelError, load_model

TENSOR = "model.layers.1.self_attn.k_proj.weight"


def rewrite(path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_and_matches(make_hf, tmp_path) -> None:
    hf, path = make_hf("qwen3")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    tokens = random_tokens(12, seed=0)
    runner = ModelRunner(load_model(sharded), num_blocks=2, block_size_tokens=16)
    assert_logits_close(runner.forward_dense([tokens])[0], hf_logits(hf, tokens))


def test_missing_tensor_names_file_and_tensor(make_hf) -> None:
    _, path = make_hf("llama")
    rewrite(path / "model.safetensors", lambda t: t.pop(TENSOR))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: missing tensor '{TENSOR}'"):
        load_model(path)


def test_misshaped_tensor_names_file_tensor_and_shapes(make_hf) -> None:
    _, path = make_hf("llama")
    rewrite(path / "model.safetensors", lambda t: t.update({TENSOR: torch.zeros(8, 31)}))
    with pytest.raises(
        CheckpointError, match=rf"model\.safetensors: tensor '{TENSOR}' has shape \[8, 31\]"
    ):
        load_model(path)


def test_unexpected_tensor_names_file_and_tensor(make_hf) -> None:
    _, path = make_hf("qwen2")
    extra = "model.layers.1.self_attn.q_norm.weight"  # a qwen3 tensor in a qwen2 checkpoint
    rewrite(path / "model.safetensors", lambda t: t.update({extra: torch.ones(8)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: unexpected tensor '{extra}'"):
        load_model(path)


def test_missing_shard_file_names_it(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{victim.name}: file listed in"):
        load_model(sharded)


def test_unsupported_architecture(make_hf) -> None:
    _, path = make_hf("llama")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gemma3"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: field 'model_type' = 'gemma3'"):
        load_model(path)
