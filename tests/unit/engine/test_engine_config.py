"""ModelConfig.from_hf against what transformers derives from the same config.json."""

from __future__ import annotations

import json

import pytest

from worker.engine import CheckpointError, ModelConfig, UnsupportedModelError

FULL, SLIDING = "full_attention", "sliding_attention"
BASE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("family", "overrides", "expected_types", "window"),
    [
        ("llama", {}, (FULL,) * 4, None),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            (FULL, SLIDING, SLIDING, SLIDING),
            8,
        ),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8}, (FULL,) * 4, None),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
            },
            (SLIDING, SLIDING, SLIDING, FULL),
            8,
        ),
        ("mistral", {"sliding_window": 8}, (SLIDING,) * 4, 8),
        ("mistral", {"sliding_window": None}, (FULL,) * 4, None),
    ],
)
def test_layer_types_follow_transformers(make_hf, family, overrides, expected_types, window):
    hf, path = make_hf(family, **overrides)
    config = ModelConfig.from_hf(path)
    assert config.layer_types == expected_types
    assert config.sliding_window == window
    hf_types = getattr(hf.config, "layer_types", None)
    if hf_types is not None:  # llama and mistral have none: every layer is alike
        assert tuple(hf_types) == expected_types
    assert config.num_full_layers + config.num_sliding_layers == 4
    assert config.source.endswith("config.json")


def test_family_specific_fields(make_hf) -> None:
    _, qwen2 = make_hf("qwen2")
    _, qwen3 = make_hf("qwen3", attention_bias=True)
    _, llama3 = make_hf(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 5e5,
        },
    )
    q2, q3, l3 = (ModelConfig.from_hf(p) for p in (qwen2, qwen3, llama3))
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm) == (True, False, False)
    assert (q3.attention_bias, q3.o_proj_bias, q3.qk_norm) == (True, True, True)
    assert q2.head_dim == 8 and q3.head_dim == 8
    assert l3.rope_theta == 5e5 and l3.rope_scaling["rope_type"] == "llama3"
    assert l3.rope_scaling["original_max_position_embeddings"] == 16


def test_legacy_rope_fields_and_defaults() -> None:
    raw = dict(
        BASE,
        model_type="qwen3",
        rope_theta=5e5,
        eos_token_id=[1, 2],
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    config = ModelConfig.from_hf(raw)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 128  # qwen3's default when head_dim is absent
    assert config.eos_token_ids == (1, 2)
    assert ModelConfig.from_hf(dict(BASE, model_type="llama")).head_dim == 8


def test_errors_name_file_and_field(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, model_type="gpt2")))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: field 'model_type' = 'gpt2'"):
        ModelConfig.from_hf(tmp_path)
    path.write_text(
        json.dumps({k: v for k, v in BASE.items() if k != "hidden_size"} | {"model_type": "llama"})
    )
    with pytest.raises(CheckpointError, match=r"config\.json: required field 'hidden_size'"):
        ModelConfig.from_hf(path)
    path.write_text(
        json.dumps(
            dict(BASE, model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
        )
    )
    with pytest.raises(UnsupportedModelError, match=r"config\.json: field 'rope_parameters"):
        ModelConfig.from_hf(path)
    # transformers fails at the first forward here; we refuse at load time.
    path.write_text(
        json.dumps(
            dict(
                BASE,
                model_type="qwen3",
                use_sliding_window=False,
                layer_types=[SLIDING, FULL, FULL, FULL],
            )
        )
    )
    with pytest.raises(CheckpointError, match=r"config\.json: field 'layer_types'.*sliding"):
        ModelConfig.from_hf(path)
    with pytest.raises(CheckpointError, match="not found"):
        ModelConfig.from_hf(tmp_path / "absent")
