"""GGUF checkpoints (llama.cpp's one-file format): metadata -> ModelConfig, tensors -> the
engine's parameter names, dequantized here (Q4_0, Q4_1, Q8_0: `dequantize_blocks`, whole
tensors at once, bit for bit gguf's result) or with `gguf.quants` (the other formats).
Torch-free (numpy only), so that checkpoint.py reads a config without importing torch;
weights.py makes parameters of the arrays.

What transformers 5.24 does (modeling_gguf_pytorch_utils.py, integrations/ggml.py), copied here
because it is the reference our logits are checked against:
- names: `blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`, ... (the tables below);
- llama only: llama.cpp's converter reordered the rows of q_proj and k_proj (weight and bias)
  of each head from HF's rotate-half layout to interleaved pairs; `_unpermute` undoes it, per
  KV head for k_proj;
- tie_word_embeddings is "no output.weight tensor"; vocab_size falls back to the token count;
  head_dim is llama's rope.dimension_count.
Where we differ, on purpose: attention.key_length wins where present (transformers ignores it
for qwen3 and takes the config default, 128); a linear rope.scaling is honoured (transformers
drops it); a `rope_freqs.weight` tensor (Llama 3.1's rope factors, which transformers ignores),
mistral and other architectures are refused instead of loaded with a guessed layout; arch
"llama" is always llama (transformers makes it mistral when general.name says "mistral").

The file is parsed here, not with gguf.GGUFReader: that builds a numpy view per array element,
3.4 s for SmolLM2's 49,152 tokens + 48,900 merges on a 2-core box; this reader takes 0.1 s.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from worker.engine.config import ModelConfig, _from_dict
from worker.engine.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
Q = GGMLQuantizationType
DEQUANTIZABLE = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
_MAGIC, _VERSIONS, _DEFAULT_ALIGNMENT, _MAX_DIMS = b"GGUF", (2, 3), 32, 4
# GGUF value type -> struct format: u8 i8 u16 i16 u32 i32 f32 bool, then u64 i64 f64.
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the GGUF name (`blk.3.attn_q.weight`)
    shape: tuple[int, ...]  # torch order: GGUF lists dimensions innermost first
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor data is read only by `read_tensor`."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: required field '{key}' is missing")
        return self.metadata[key]

    def positive_int(self, key: str) -> int:
        value = self.require(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(
                f"{self.path}: field '{key}' must be a positive integer, got {value!r}"
            )
        return value


class _Cursor:
    """Reads little-endian GGUF values; running off the end is a truncated file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise CheckpointError(f"{self.path}: truncated at byte {self.pos} (metadata)") from exc
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated at byte {self.pos} (a string)")
        try:
            text = self.buf[self.pos : end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: string at byte {self.pos} is not UTF-8") from exc
        self.pos = end
        return text

    def value(self, value_type: int, key: str) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALARS:
                if count * struct.calcsize(_SCALARS[item_type]) > len(self.buf) - self.pos:
                    raise CheckpointError(f"{self.path}: field '{key}' runs past the end")
                return list(self.unpack(f"{count}{_SCALARS[item_type]}"))
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
        raise CheckpointError(f"{self.path}: field '{key}' has unknown value type {value_type}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header, the metadata and the tensor table (no tensor data is read)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            if path.stat().st_size < 24:
                raise CheckpointError(f"{path}: {path.stat().st_size} bytes, too short for GGUF")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path), len(buf))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _parse(cur: _Cursor, file_size: int) -> GGUFFile:
    path = cur.path
    if cur.buf[:4] != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {cur.buf[:4]!r})")
    cur.pos = 4
    version, num_tensors, num_fields = cur.unpack("IQQ")
    if version not in _VERSIONS:
        raise UnsupportedModelError(f"{path}: GGUF version {version} (supported: 2, 3)")
    metadata: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I")[0], key)
    table = []
    for _ in range(num_tensors):
        name = cur.string()
        (num_dims,) = cur.unpack("I")
        if not 0 < num_dims <= _MAX_DIMS:
            raise CheckpointError(f"{path}: tensor '{name}' has {num_dims} dimensions")
        dims = cur.unpack(f"{num_dims}Q")
        type_id, offset = cur.unpack("IQ")
        table.append((name, tuple(reversed(dims)), type_id, offset))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise CheckpointError(f"{path}: field 'general.alignment' = {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in table:
        tensor = _tensor(path, name, shape, type_id, data_start + offset)
        if tensor.offset + tensor.nbytes > file_size:
            raise CheckpointError(
                f"{path}: tensor '{name}' ends at byte {tensor.offset + tensor.nbytes}, past the "
                f"end of the file ({file_size} bytes): truncated"
            )
        tensors[name] = tensor
    return GGUFFile(path, metadata, tensors)


def _tensor(path: Path, name: str, shape: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(f"{path}: tensor '{name}' has unknown type {type_id}") from None
    if ggml_type not in DEQUANTIZABLE:
        raise UnsupportedModelError(
            f"{path}: tensor '{name}' is {ggml_type.name} (supported: "
            f"{', '.join(sorted(t.name for t in DEQUANTIZABLE))})"
        )
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if shape[-1] % block_size:
        raise CheckpointError(
            f"{path}: tensor '{name}' has rows of {shape[-1]} values, not whole "
            f"{ggml_type.name} blocks of {block_size}"
        )
    nbytes = prod(shape[:-1]) * (shape[-1] // block_size) * block_bytes
    return GGUFTensor(name, shape, ggml_type, offset, nbytes)


def config_from_gguf(source: GGUFFile | str | Path) -> ModelConfig:
    """The engine config a GGUF file's metadata describes (llama, qwen2, qwen3)."""
    gguf = source if isinstance(source, GGUFFile) else read_gguf(source)
    arch, src = gguf.architecture, str(gguf.path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{src}: field 'general.architecture' = {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedModelError(f"{src}: tensor 'rope_freqs.weight' (llama3 rope factors)")
    meta = gguf.metadata
    hidden = gguf.positive_int(f"{arch}.embedding_length")
    num_heads = gguf.positive_int(f"{arch}.attention.head_count")
    # transformers reads llama's head_dim from rope.dimension_count, qwen2's from hidden/heads.
    keys = [f"{arch}.attention.key_length"]
    if arch == "llama":
        keys.append(f"{arch}.rope.dimension_count")
    head_dim = next((gguf.positive_int(k) for k in keys if k in meta), hidden // num_heads)
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(
            f"{src}: field '{arch}.rope.dimension_count' = {rotary} != head_dim {head_dim} "
            "(partial rotary)"
        )
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        raise CheckpointError(f"{src}: no field '{arch}.vocab_size' and no tokenizer.ggml.tokens")
    kv_key = f"{arch}.attention.head_count_kv"
    raw = {
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": gguf.positive_int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": gguf.positive_int(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": gguf.positive_int(kv_key) if kv_key in meta else num_heads,
        "head_dim": head_dim,
        "rope_parameters": _rope(gguf, arch),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos_token_ids(gguf)),
    }
    # The same family rules (qwen2 biases, qwen3 q/k norms, defaults) as a config.json gets,
    # with the GGUF file named in its errors.
    return _from_dict(raw, src)


def eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """tokenizer.ggml.eos_token_id (all transformers' generation config uses), then the
    end-of-turn / end-of-message ids llama.cpp also stops on, where the file names them."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    found = (gguf.metadata.get(f"tokenizer.ggml.{key}") for key in keys)
    return tuple(dict.fromkeys(i for i in found if isinstance(i, int)))


def _rope(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    meta = gguf.metadata
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    legacy_factor = meta.get(f"{arch}.rope.scale_linear")
    if kind == "none" and legacy_factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    if kind in ("none", "linear"):
        factor = meta.get(f"{arch}.rope.scaling.factor", legacy_factor)
        if factor is None:
            raise CheckpointError(f"{gguf.path}: field '{arch}.rope.scaling.factor' is missing")
        return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    raise UnsupportedModelError(
        f"{gguf.path}: field '{arch}.rope.scaling.type' = {kind!r} is not supported (linear only)"
    )


def engine_name(gguf_name: str) -> str | None:
    """The CausalLM parameter a GGUF tensor loads into; None for a tensor we do not know."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and leaf in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{leaf}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def dequantize(rows: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Rows of blocks (uint8 [..., row bytes]) as float32 [..., values]."""
    if ggml_type in _BLOCK_FORMATS:
        return dequantize_blocks(rows, ggml_type)
    return quants.dequantize(rows, ggml_type)


# (bytes before the quants, quants are nibbles) of the block formats dequantized here
_BLOCK_FORMATS = {Q.Q8_0: (2, False), Q.Q4_0: (2, True), Q.Q4_1: (4, True)}


def dequantize_blocks(rows: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Q8_0, Q4_0 and Q4_1 blocks of 32 values, every block of the tensor in one numpy pass:
    a float16 scale d (Q4_1: then a float16 minimum m), then the quants -- 32 int8 (Q8_0), or
    16 bytes whose low nibbles are values 0-15 and high nibbles 16-31 (value = d * (q - 8),
    Q4_0; d * q + m, Q4_1). The same float32 arithmetic as `gguf.quants`, so the same bits:
    there each tensor went in small groups of rows (SmolLM2's 272 tensors: 4.5 s on a 2-core
    AVX2 VM against 0.5 s here)."""
    head, nibbles = _BLOCK_FORMATS[ggml_type]
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    quants_ = blocks[:, head:]
    if not nibbles:
        values = quants_.view(np.int8).astype(np.float32) * d
    else:
        q = np.concatenate([quants_ & 0x0F, quants_ >> 4], axis=1)  # [n, 32], 0-15
        if ggml_type == Q.Q4_0:
            values = (q.view(np.int8) - np.int8(8)).astype(np.float32) * d
        else:
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            values = q.astype(np.float32) * d + m
    return values.reshape(*rows.shape[:-1], rows.shape[-1] // block_bytes * block_size)


def read_tensor(gguf: GGUFFile, tensor: GGUFTensor, config: ModelConfig) -> np.ndarray:
    """One tensor as float32 in the engine's layout (dequantized, q/k rows un-permuted)."""
    block_size, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=tensor.nbytes)
    row_bytes = tensor.shape[-1] // block_size * block_bytes
    values = dequantize(raw.reshape(*tensor.shape[:-1], row_bytes), tensor.ggml_type)
    values = values.astype(np.float32, copy=False).reshape(tensor.shape)
    if gguf.architecture == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
        values = _unpermute(values, heads)
    # A float32 tensor comes back as a read-only view of the mapped file; torch wants to own it.
    return values.copy() if np.may_share_memory(values, raw) else values


def read_blocks(gguf: GGUFFile, tensor: GGUFTensor, config: ModelConfig) -> np.ndarray:
    """A 2-D block-quantized tensor's rows as stored (uint8 [rows, row bytes]), q/k rows
    un-permuted like read_tensor's: what quant.QuantWeight keeps for the block kernel."""
    block_size, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=tensor.nbytes)
    rows = raw.reshape(prod(tensor.shape[:-1]), tensor.shape[-1] // block_size * block_bytes)
    if gguf.architecture == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
        rows = _unpermute(rows, heads)
    return np.array(rows)  # a copy: the mapping is not kept


def _unpermute(values: np.ndarray, num_heads: int) -> np.ndarray:
    # HF orders each head's rows [first half | second half] (rotate-half RoPE); llama.cpp
    # interleaved them (row i of the first half, row i of the second, ...) for its pairwise
    # RoPE. View the rows as [half, 2] and swap back to [2, half].
    half = values.shape[0] // num_heads // 2
    grouped = values.reshape(num_heads, half, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)
