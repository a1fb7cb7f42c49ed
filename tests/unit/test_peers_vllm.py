"""The vLLM peer without vLLM: the HF directory exported from SmolLM2's GGUF holds the same
config, weights (bit for bit), tokenizer ids and chat template as our loader reads from the
file; transformers (what vLLM's tokenizer and config come from) reads it the same way; the
export is cached; a server that cannot start says why, with its log.

Tolerance for transformers' logits from the export against our engine from the GGUF:
engine_helpers.REL_TOL (same float32 weights, other summation order).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from loadtest.peers.vllm import leading_agreement
from services.vllm_worker.vllm_env import EXPORT_STAMP, VllmServer, export_checkpoint
from shared.models import BUNDLED_MODEL_DIR, model_path
from shared.venvs import VenvUnavailable
from tests.unit.engine.engine_helpers import assert_logits_close, hf_logits
from worker.engine import Checkpoint, ModelConfig, ModelRunner, load_model
from worker.engine.gguf import config_from_gguf, engine_name, read_gguf, read_tensor

SMOL = "SmolLM2-135M-Instruct"
TEXTS = (
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # 3.14\n",
    "Café naïve façade 2024, déjà vu: Ελληνικά и русский.",
    "<|im_start|>user\nhi<|im_end|>\n\t\t  123 456",
)
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort [3, 1, 2]."},
    {"role": "assistant", "content": "sorted([3, 1, 2])"},
    {"role": "user", "content": "Now in reverse."},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return model_path(SMOL)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_checkpoint(SMOL, tmp_path_factory.mktemp("export") / "smollm2")


def test_config_is_the_gguf_config(exported: Path, gguf_path: Path) -> None:
    ours = ModelConfig.from_hf(exported)
    expected = config_from_gguf(gguf_path)
    assert ours == replace(expected, source=ours.source)
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 == Checkpoint(exported).eos_token_ids()[0]


def test_weights_are_the_dequantized_gguf_tensors_bit_for_bit(
    exported: Path, gguf_path: Path
) -> None:
    gguf = read_gguf(gguf_path)
    config = config_from_gguf(gguf)
    tensors = load_file(str(exported / "model.safetensors"))
    assert set(tensors) == {engine_name(n) for n in gguf.tensors}
    assert "lm_head.weight" not in tensors  # tied to the embedding, as in the file
    for name, tensor in gguf.tensors.items():
        saved = tensors[engine_name(name)]
        assert saved.dtype == np.float32
        assert np.array_equal(saved, read_tensor(gguf, tensor, config)), name


def test_tokenizer_and_chat_template_are_the_files(exported: Path, gguf_path: Path) -> None:
    theirs, ours = Checkpoint(exported), Checkpoint(gguf_path)
    for text in TEXTS:
        expected = ours.tokenizer().encode(text, add_special_tokens=False).ids
        assert theirs.tokenizer().encode(text, add_special_tokens=False).ids == expected
    assert theirs.chat_template() == replace(
        ours.chat_template(), source=theirs.chat_template().source
    )
    assert theirs.chat_template().render(CHAT) == ours.chat_template().render(CHAT)


def test_transformers_reads_the_export_as_we_read_the_gguf(exported: Path, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    ours = Checkpoint(gguf_path)
    for text in TEXTS:  # "\n    1": llama.cpp's split, which transformers' GGUF path misses
        expected = ours.tokenizer().encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_special_tokens=False) == expected
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.chat_template().render(CHAT)
    assert tokenizer.eos_token_id == 2 and tokenizer.decode([2]) == "<|im_end|>"


@pytest.mark.slow
def test_logits_from_the_export_match_our_engine_on_the_gguf(
    exported: Path, gguf_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    tokens = Checkpoint(gguf_path).tokenizer().encode(TEXTS[0]).ids
    runner = ModelRunner(
        load_model(gguf_path, block_kernel=False), num_blocks=8, block_size_tokens=64
    )
    reference = runner.forward_dense([tokens])[0]
    # Our own loader reads the directory into the same float32 model: identical logits.
    same = ModelRunner(load_model(exported), num_blocks=8, block_size_tokens=64)
    assert torch.equal(same.forward_dense([tokens])[0], reference)
    hf = AutoModelForCausalLM.from_pretrained(
        str(exported), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert_logits_close(reference, hf_logits(hf, tokens))


def test_export_is_reused_until_its_stamp_changes(exported: Path) -> None:
    weights = exported / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert export_checkpoint(SMOL, exported) == exported
    assert weights.stat().st_mtime_ns == written
    (exported / EXPORT_STAMP).write_text("{}")  # as if the GGUF file had changed
    assert export_checkpoint(SMOL, exported) == exported
    assert weights.stat().st_mtime_ns != written
    assert json.loads((exported / EXPORT_STAMP).read_text())["gguf"] == str(
        model_path(SMOL).resolve()
    )
    assert not list(exported.parent.glob("*.partial-*"))


def test_an_hf_directory_model_is_given_as_it_is() -> None:
    assert export_checkpoint("tiny-coder") == BUNDLED_MODEL_DIR


def test_a_server_that_exits_at_start_reports_its_code_and_log(
    exported: Path, tmp_path: Path
) -> None:
    # Our venv has no vllm: the module is not found, which the error must show.
    server = VllmServer(
        exported,
        SMOL,
        python=Path(sys.executable),
        log_path=tmp_path / "vllm.log",
        startup_timeout_s=60,
    )
    with pytest.raises(VenvUnavailable, match="exited with code 1") as raised:
        server.start()
    assert "No module named 'vllm'" in str(raised.value)
    assert server.process is None
    assert "--enable-prefix-caching" in (tmp_path / "vllm.log").read_text()


def test_leading_agreement_counts_the_shared_start() -> None:
    assert leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert leading_agreement([1, 2], [1, 2, 3]) == 2
    assert leading_agreement([], [1]) == 0
