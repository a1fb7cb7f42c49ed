"""ModelConfig: the engine's view of an HF config.json (llama, qwen2, qwen3, mistral).

The per-family rules below copy what transformers 5.x does in
`models/<family>/configuration_<family>.py` and `modeling_<family>.py`, because transformers is
the reference our logits are checked against:

- llama: every layer is full attention (the modeling code never builds a sliding mask).
  `attention_bias` puts a bias on q/k/v AND o_proj; `mlp_bias` on gate/up/down.
- qwen2: q/k/v always carry a bias, o_proj never. `sliding_window` counts only when
  `use_sliding_window` is true. Without explicit `layer_types`, layer i is sliding iff
  sliding is on and i >= max_window_layers (the LAST layers slide, not the first).
- qwen3: like qwen2, but the bias follows `attention_bias` (q/k/v and o_proj), each head
  gets an RMSNorm on q and k, and a missing `head_dim` means 128, not hidden/heads.
- mistral: one `sliding_window` for all layers (a missing key means 4096, None disables it);
  `layer_types` is ignored, as transformers' MistralConfig warns and ignores it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.engine.errors import CheckpointError, UnsupportedModelError

SLIDING = "sliding_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Defaults transformers' config classes use when config.json omits the key.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "head_dim": None},
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None, or the HF rope dict ({"rope_type": "linear" | "llama3" | "yarn", "factor": ...}).
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = "<dict>"  # where the config came from, for error messages

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        _validate(self)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layer_ids)

    @property
    def num_sliding_layers(self) -> int:
        return len(self.sliding_layer_ids)

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> ModelConfig:
        """Read a model directory, a config.json path, or an already parsed dict."""
        if isinstance(source, Mapping):
            return _from_dict(dict(source), "<dict>")
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path}: file not found") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc.msg})") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: top level is not a JSON object")
        return _from_dict(raw, str(path))


def _require(raw: Mapping[str, Any], key: str, src: str, kind: type = int) -> Any:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{src}: required field '{key}' is missing")
    value = raw[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise CheckpointError(f"{src}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _rope(raw: Mapping[str, Any], src: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files use top-level
    # `rope_theta` plus `rope_scaling` with either "rope_type" or the legacy "type" key.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{src}: field 'rope_parameters.rope_type' = {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModelError(f"{src}: field 'partial_rotary_factor' != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in needed.get(rope_type, ()):
        if params.get(key) is None:
            raise CheckpointError(
                f"{src}: field 'rope_parameters.{key}' is required for {rope_type}"
            )
    return theta, {"rope_type": rope_type, **params}


def _layer_types(raw: Mapping[str, Any], model_type: str, num_layers: int, src: str):
    if model_type == "llama":
        return None, (FULL,) * num_layers
    if model_type == "mistral":
        window = raw.get("sliding_window", 4096)
        return window, ((SLIDING if window is not None else FULL),) * num_layers
    # qwen2 / qwen3
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    explicit = raw.get("layer_types")
    if explicit is not None:
        return window, tuple(explicit)
    first_sliding = raw.get("max_window_layers", 28)
    types = tuple(
        SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)
    )
    return window, types


def _from_dict(raw: dict[str, Any], src: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{src}: field 'model_type' = {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"{src}: field 'hidden_act' = {raw['hidden_act']!r}, need 'silu'"
        )
    defaults = _FAMILY_DEFAULTS[model_type]
    hidden = _require(raw, "hidden_size", src)
    num_heads = _require(raw, "num_attention_heads", src)
    num_layers = _require(raw, "num_hidden_layers", src)
    num_kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"]) or num_heads
    head_dim = raw.get("head_dim", defaults["head_dim"]) or hidden // num_heads
    theta, scaling = _rope(raw, src)
    window, layer_types = _layer_types(raw, model_type, num_layers, src)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=_require(raw, "vocab_size", src),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", src),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bias and model_type != "mistral",
        o_proj_bias=bias and model_type in ("llama", "qwen3"),
        mlp_bias=bool(raw.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        layer_types=layer_types,
        max_position_embeddings=int(
            raw.get("max_position_embeddings") or defaults["max_position_embeddings"]
        ),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        source=src,
    )


def _validate(cfg: ModelConfig) -> None:
    src = cfg.source
    if cfg.num_heads % cfg.num_kv_heads != 0:
        raise CheckpointError(
            f"{src}: field 'num_key_value_heads' = {cfg.num_kv_heads} does not divide "
            f"'num_attention_heads' = {cfg.num_heads}"
        )
    if len(cfg.layer_types) != cfg.num_layers:
        raise CheckpointError(
            f"{src}: field 'layer_types' has {len(cfg.layer_types)} entries, "
            f"'num_hidden_layers' is {cfg.num_layers}"
        )
    bad = sorted(set(cfg.layer_types) - {SLIDING, FULL})
    if bad:
        raise UnsupportedModelError(f"{src}: field 'layer_types' has unsupported entries {bad}")
    if SLIDING in cfg.layer_types and (cfg.sliding_window is None or cfg.sliding_window <= 0):
        # transformers raises at the first forward in this case; we refuse at load time.
        raise CheckpointError(
            f"{src}: field 'layer_types' has sliding layers but 'sliding_window' is "
            f"{cfg.sliding_window!r} (qwen2/qwen3 also need 'use_sliding_window': true)"
        )
