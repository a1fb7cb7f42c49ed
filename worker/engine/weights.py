"""Load a model into CausalLM: an HF directory (config.json + *.safetensors, sharded or not)
or a GGUF file (`*.gguf`, read by gguf.py).

Every tensor is checked before any is copied: a missing, unexpected or mis-shaped tensor
raises CheckpointError naming the file and the tensor, so a half-loaded model never exists.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from shared.kernels import cpu as cpu_kernels
from worker.engine.config import ModelConfig
from worker.engine.errors import CheckpointError
from worker.engine.gguf import (
    GGUFFile,
    Q,
    config_from_gguf,
    engine_name,
    read_blocks,
    read_gguf,
    read_tensor,
)
from worker.engine.layers import Linear, pack_linears, uninitialized_weights
from worker.engine.model import CausalLM
from worker.engine.quant import KERNEL_INPUT_DTYPES, QuantWeight

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def _ignored(name: str, config: ModelConfig) -> bool:
    # Old llama exports saved the rotary inv_freq buffer; we recompute it. Tied checkpoints
    # sometimes still carry lm_head.weight, a copy of the embedding that transformers ignores.
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: no valid 'weight_map' ({exc})") from exc
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files and no {INDEX_FILE}")
    located: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in located:
                    raise CheckpointError(f"{path}: tensor '{name}' also in {located[name]}")
                located[name] = path
    return located


def _describe_source(model_dir: Path) -> str:
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return str(index_path)
    return ", ".join(str(p) for p in sorted(model_dir.glob("*.safetensors")))


def is_gguf_path(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Load and check every tensor of an HF directory or a `.gguf` file into `model`."""
    if is_gguf_path(model_dir):
        load_gguf_weights(model, read_gguf(model_dir))
        return
    model_dir = Path(model_dir)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    located = {n: p for n, p in tensor_files(model_dir).items() if not _ignored(n, model.config)}
    unexpected = sorted(located.keys() - expected.keys())
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(
            f"{located[name]}: unexpected tensor '{name}' (not part of a "
            f"{model.config.model_type} model with this config.json; "
            f"{len(unexpected)} unexpected in all)"
        )
    missing = sorted(expected.keys() - located.keys())
    if missing:
        raise CheckpointError(
            f"{_describe_source(model_dir)}: missing tensor '{missing[0]}' "
            f"({len(missing)} missing in all)"
        )
    by_file: dict[Path, list[str]] = {}
    for name, path in located.items():
        by_file.setdefault(path, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        if not path.exists():
            raise CheckpointError(f"{path}: file listed in {INDEX_FILE} does not exist")
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{path}: tensor '{name}' has shape {list(shape)}, "
                        f"config.json implies {list(expected[name])}"
                    )
                loaded[name] = handle.get_tensor(name)
    model.load_state_dict(loaded, strict=True)


def load_gguf_weights(model: CausalLM, gguf: GGUFFile) -> None:
    """Check every tensor of a GGUF file against `model`, then dequantize them into it."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    # A tensor we have no name for keeps its GGUF name, so it is reported as unexpected.
    located = {engine_name(name) or name: tensor for name, tensor in gguf.tensors.items()}
    unexpected = sorted(located.keys() - expected.keys())
    if unexpected:
        raise CheckpointError(
            f"{gguf.path}: unexpected tensor '{located[unexpected[0]].name}' (not part of a "
            f"{model.config.model_type} model with this metadata; "
            f"{len(unexpected)} unexpected in all)"
        )
    missing = sorted(expected.keys() - located.keys())
    if missing:
        raise CheckpointError(
            f"{gguf.path}: missing tensor '{missing[0]}' ({len(missing)} missing in all)"
        )
    for name, tensor in located.items():
        if tensor.shape != expected[name]:
            raise CheckpointError(
                f"{gguf.path}: tensor '{tensor.name}' ({name}) has shape {list(tensor.shape)}, "
                f"the metadata implies {list(expected[name])}"
            )
    params = model.state_dict()
    with torch.no_grad():
        for name, tensor in located.items():
            params[name].copy_(torch.from_numpy(read_tensor(gguf, tensor, model.config)))


# GGUF block formats the block kernel multiplies by directly (quant.py).
KERNEL_FORMATS = {Q.Q4_0: "Q4_0", Q.Q4_1: "Q4_1", Q.Q8_0: "Q8_0"}


def attach_quant_weights(model: CausalLM, gguf: GGUFFile) -> int:
    """Give every linear layer whose GGUF tensor is Q4_0/Q4_1/Q8_0 its blocks (and the logits
    those of the output projection, or of the embedding when tied); returns how many.
    KernelUnavailable when the kernels cannot be built here."""
    cpu_kernels.library()
    count = 0
    for gguf_name, tensor in gguf.tensors.items():
        fmt = KERNEL_FORMATS.get(tensor.ggml_type)
        name = engine_name(gguf_name)
        if fmt is None or name is None or len(tensor.shape) != 2:
            continue
        blocks = QuantWeight.from_blocks(fmt, read_blocks(gguf, tensor, model.config))
        module_name = name.removesuffix(".weight")
        if module_name == "model.embed_tokens":
            if model.lm_head is None:
                model.logits_quant = blocks
                count += 1
            continue
        module = model.get_submodule(module_name)
        if isinstance(module, Linear):
            module.quant = blocks
            if module_name == "lm_head":
                model.logits_quant = blocks
            count += 1
    return count


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    block_kernel: bool = True,
    onednn: bool = True,
) -> CausalLM:
    """Read the config (config.json, or a GGUF file's metadata), build the model, load and
    check every tensor.

    SmolLM2-135M-Instruct Q4_1 (98 MB GGUF) in float32 on a 2-core AVX2 VM: 2.8 s (0.65 s
    metadata, 1.0 s reading and dequantizing its 272 tensors, 0.6 s the block kernel's
    blocks, 0.4 s oneDNN packing). It was 7.7 s while gguf's own code dequantized (4.5 s)
    and the layers were randomly initialized before being loaded (2.4 s). 1.0 GB peak RSS
    (0.22 GB of it torch itself, 0.53 GB the model, the rest the mapped file and one tensor's
    temporaries); transformers takes 18.5 s and 1.13 GB for the same file (on a faster VM,
    where ours took 2.3 s before these changes).

    With `block_kernel` (float32 and bfloat16), a GGUF model's Q4_0/Q4_1/Q8_0 linear layers
    also keep their blocks for decode-sized batches (quant.py; +0.11 GB for SmolLM2); without
    a C compiler that is logged and skipped.

    With `onednn` (where `can_pack`), every linear layer also keeps its weight in oneDNN's
    blocked layout for the inputs the block kernel does not take (`pack_linears`).
    """
    if is_gguf_path(path):
        gguf = read_gguf(path)
        with uninitialized_weights():  # every parameter is loaded next
            model = CausalLM(config_from_gguf(gguf)).to(dtype)
        load_gguf_weights(model, gguf)
        if block_kernel and dtype in KERNEL_INPUT_DTYPES:
            try:
                attach_quant_weights(model, gguf)
            except cpu_kernels.KernelUnavailable as exc:
                log.warning("block kernel unavailable, decoding from float32 weights: %s", exc)
    else:
        with uninitialized_weights():
            model = CausalLM(ModelConfig.from_hf(path))
        load_weights(model, path)
        model = model.to(dtype)
    if onednn:
        pack_linears(model)
    return model.eval()
