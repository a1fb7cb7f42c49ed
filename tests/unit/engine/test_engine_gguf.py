"""GGUF checkpoints: SmolLM2-135M-Instruct (Q4_1) against transformers 5.24 loading the same
file; tiny GGUF files written here with gguf.GGUFWriter; Checkpoint on both kinds of model.

Tolerance: logits within 2e-5 x max|ref| (engine_helpers.REL_TOL: same weights, other
summation order). Measured: SmolLM2 at most 7e-5 absolute at max|logit| ~38, 2.7e-6 relative
(7x under the bound); the tiny files 1.8e-6 relative. The dequantized weights are
bit-identical to transformers' (both use gguf.quants), which a test asserts.

The SmolLM2 tests fail when the file is not fetched (`make test` runs `kvfabric models
fetch`). transformers' model (~18 s) and tokenizer (~6-20 s) are built once
per module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, pre_tokenizers
from tokenizers.models import BPE

from shared.models import BUNDLED_MODEL_DIR, ModelError, model_path
from tests.unit.engine.engine_helpers import assert_logits_close, hf_logits, random_tokens
from worker.engine import (
    Checkpoint,
    CheckpointError,
    ModelConfig,
    ModelRunner,
    Sequence,
    UnsupportedModelError,
    config_from_gguf,
    load_model,
    read_gguf,
)
from worker.engine.gguf_tokenizer import pre_tokenizer

Q = gguf.GGMLQuantizationType
SMOL = "SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[3]

CORPUS = {
    "python": (
        "def fib(n: int) -> int:\n"
        '    """Return the n-th Fibonacci number."""\n'
        "    if n < 2:\n"
        "        return n\n"
        "    return fib(n - 1) + fib(n - 2)\n\n\n"
        "class Point:\n\tdef __init__(self, x, y):\n\t\tself.x, self.y = x, y  # 3.14\n"
    ),
    "accents": "Café naïve façade, déjà vu: Ελληνικά и русский текст.",
    "cjk": "日本語のテキスト、中文字符。한국어 문장",
    "emoji": "ship it 🎉🚀 👩‍💻 🇫🇷!",
    "whitespace": "a  b   c\t\td\n\n\ne    \n  end   \r\n\r\n",
    "numbers": "Version 3.14.159 of 2024: x = [1, 2, 3], 1,000,000 users.",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n<|endoftext|>",
}
# 2+ whitespace characters before a digit: the only place the "smollm" split (digits first)
# and transformers' GPT-2-regex fallback cut the text differently.
DIGIT_AFTER_WHITESPACE = {
    "indented-list": "x = [\n    1,\n    2,\n]",
    "two-spaces": "a  1",
    "blank-lines": "\n\n42",
    "tabs": "total:\t\t100",
}
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM, written out: every number character split off, then
# its GPT-2-style regex, each applied to the pieces the one before left.
LLAMA_CPP_SMOLLM = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(
            Regex(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
)
TWO_TURNS = [
    {"role": "system", "content": "You are a concise assistant; answer in one sentence."},
    {"role": "user", "content": "What does a paged KV cache store, and why do prefix hits help?"},
]


# ---- SmolLM2 against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path() -> Path:
    try:
        return model_path(SMOL)
    except ModelError as exc:  # `make test` fetches it: a missing file is a broken set-up
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def hf_smol_tokenizer(smol_path: Path):
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        return AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)


@pytest.fixture(scope="module")
def smol_model(smol_path: Path) -> torch.nn.Module:
    return load_model(smol_path, torch.float32)


@pytest.fixture
def smol_runner(smol_model) -> ModelRunner:
    return ModelRunner(smol_model, num_blocks=12, block_size_tokens=16)


@pytest.fixture(scope="module")
def smol_tokenizer(smol_path: Path) -> Tokenizer:
    return Checkpoint(smol_path).tokenizer()


def test_smollm2_weights_are_transformers_weights(smol_runner, transformers_smollm2) -> None:
    ours, ref = smol_runner.model.state_dict(), transformers_smollm2.state_dict()
    ref.pop("lm_head.weight")  # tied: transformers' copy of the embedding
    assert ours.keys() == ref.keys()
    differing = [name for name in ours if not torch.equal(ours[name], ref[name])]
    assert differing == []


def test_smollm2_prefill_resume_and_decode_match_transformers(
    smol_runner, transformers_smollm2, smol_path, smol_tokenizer
) -> None:
    prompt = Checkpoint(smol_path).chat_template().render(TWO_TURNS)
    tokens = smol_tokenizer.encode(prompt).ids
    assert len(tokens) >= 40
    ref = hf_logits(transformers_smollm2, tokens)
    assert_logits_close(smol_runner.forward_dense([tokens])[0], ref)
    cold = Sequence(0, tokens)
    assert_logits_close(smol_runner.prefill([cold], return_all_logits=True)[0], ref)
    # 17 then 12 more tokens (chunk edges inside blocks), then one token at a time.
    seq = Sequence(1, tokens[:17])
    smol_runner.prefill([seq])
    seq.token_ids.extend(tokens[17:29])
    assert_logits_close(smol_runner.prefill([seq], return_all_logits=True)[0], ref[17:29])
    for pos in range(29, 36):
        seq.append(tokens[pos])
        assert_logits_close(smol_runner.decode([seq])[0], ref[pos])


def test_smollm2_batched_prefill_and_decode_match_transformers(
    smol_runner, transformers_smollm2
) -> None:
    prompts = [random_tokens(n, seed=n, vocab_size=49152) for n in (30, 13, 5)]
    full = [p + random_tokens(4, seed=100 + i, vocab_size=49152) for i, p in enumerate(prompts)]
    refs = [hf_logits(transformers_smollm2, t) for t in full]
    seqs = [Sequence(10 + i, p) for i, p in enumerate(prompts)]
    for seq, logits, ref in zip(seqs, smol_runner.prefill(seqs), refs, strict=True):
        assert_logits_close(logits, ref[seq.num_tokens - 1])
    for step in range(4):
        for seq, tokens in zip(seqs, full, strict=True):
            seq.append(tokens[seq.num_tokens])
        logits = smol_runner.decode(seqs)
        for i, ref in enumerate(refs):
            assert_logits_close(logits[i], ref[len(prompts[i]) + step])


@pytest.mark.parametrize("name", list(CORPUS))
def test_tokenizer_ids_match_transformers(smol_tokenizer, hf_smol_tokenizer, name) -> None:
    text = CORPUS[name]
    ids = smol_tokenizer.encode(text).ids
    assert ids == hf_smol_tokenizer(text)["input_ids"]
    assert smol_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_vocabulary_and_special_tokens_match_transformers(
    smol_tokenizer, hf_smol_tokenizer
) -> None:
    ours, ref = smol_tokenizer, hf_smol_tokenizer.backend_tokenizer
    assert ours.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    assert ours.get_added_tokens_decoder() == ref.get_added_tokens_decoder()
    assert ours.encode("<|im_start|>assistant\n").ids == [1, 520, 9531, 198]
    assert ours.decode([1, 520, 2], skip_special_tokens=True) == "ass"


@pytest.mark.parametrize("name", list(DIGIT_AFTER_WHITESPACE))
def test_tokenizer_splits_digits_first_like_llama_cpp(
    smol_tokenizer, hf_smol_tokenizer, name
) -> None:
    text = DIGIT_AFTER_WHITESPACE[name]
    reference = Tokenizer.from_str(smol_tokenizer.to_str())
    reference.pre_tokenizer = LLAMA_CPP_SMOLLM
    ids = smol_tokenizer.encode(text).ids
    assert ids == reference.encode(text).ids
    assert smol_tokenizer.decode(ids) == text
    # The documented difference: transformers falls back to GPT-2's regex for "smollm".
    assert ids != hf_smol_tokenizer(text)["input_ids"]


def test_tokenizer_matches_llama_cpp_split_on_the_corpus(smol_tokenizer) -> None:
    reference = Tokenizer.from_str(smol_tokenizer.to_str())
    reference.pre_tokenizer = LLAMA_CPP_SMOLLM
    for text in CORPUS.values():
        assert smol_tokenizer.encode(text).ids == reference.encode(text).ids


@pytest.mark.parametrize(
    "messages", [TWO_TURNS, [{"role": "user", "content": "hi"}, TWO_TURNS[0]]], ids=["sys", "usr"]
)
def test_chat_template_matches_transformers(smol_path, hf_smol_tokenizer, messages) -> None:
    ours = Checkpoint(smol_path).chat_template().render(messages)
    ref = hf_smol_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n")


def test_checkpoint_on_smollm2(smol_path) -> None:
    checkpoint = Checkpoint(smol_path)
    config = checkpoint.config()
    assert checkpoint.is_gguf
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert (config.rope_theta, config.tie_word_embeddings) == (100000.0, True)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert checkpoint.eos_token_ids() == config.eos_token_ids == (2,)
    template = checkpoint.chat_template()
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert checkpoint.tokenizer().encode("<|im_end|>").ids == [2]


# ---- tiny GGUF files written here --------------------------------------------------------

_GGUF_LEAF = {  # an HF parameter's name inside a layer -> llama.cpp's tensor name
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _comparable(config: ModelConfig) -> dict:
    # The tiny files carry no tokenizer ids, and GGUF stores rms_norm_eps as float32.
    fields = asdict(config) | {"source": "", "bos_token_id": None, "eos_token_ids": ()}
    return fields | {"rms_norm_eps": float(np.float32(config.rms_norm_eps))}


def _gguf_name(hf_name: str) -> str:
    stem, leaf = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{leaf}"
    _, _, layer, inner = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LEAF[inner]}.{leaf}"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved pairs.
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    qtype: Q = Q.F32,
    arch: str | None = None,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    fields: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write an HF model as llama.cpp's converter would (names, q/k permute, tied output)."""
    cfg = hf_model.config
    arch = arch or cfg.model_type
    tensors = {}
    for name, value in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = value.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            array = _llama_cpp_permute(array, heads).reshape(array.shape)
        tensors[_gguf_name(name)] = array
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if fields is not None:
        fields(writer)
    for name, array in tensors.items():
        kind = qtype if array.ndim == 2 and array.dtype == np.float32 else None
        if kind is None or kind == Q.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ROUND_TRIPS = {
    "llama": ("llama", {}),
    "llama-tied-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_tiny_f32_gguf_round_trips_to_the_hf_model(make_hf, tmp_path, case) -> None:
    family, overrides = ROUND_TRIPS[case]
    hf, hf_dir = make_hf(family, **overrides)
    path = write_gguf(tmp_path / f"{case}.gguf", hf)
    from_gguf, from_hf = load_model(path), load_model(hf_dir)
    assert _comparable(from_gguf.config) == _comparable(from_hf.config)
    ours, ref = from_gguf.state_dict(), from_hf.state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[name], ref[name]) for name in ours)
    tokens = random_tokens(24, seed=3)
    runner = ModelRunner(from_gguf, num_blocks=4, block_size_tokens=16)
    assert_logits_close(runner.forward_dense([tokens])[0], hf_logits(hf, tokens))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_tiny_quantized_gguf_matches_transformers(make_hf, tmp_path, qtype) -> None:
    from transformers import AutoModelForCausalLM

    hf, _ = make_hf("llama", intermediate_size=64)  # rows must be whole 32-value blocks
    path = write_gguf(tmp_path / "tiny.gguf", hf, qtype)
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = load_model(path)
    reference = ref_model.state_dict()
    assert all(torch.equal(p, reference[name]) for name, p in ours.state_dict().items())
    # Quantization moved the weights: the file is not just the F32 model again.
    original = hf.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(ours.state_dict()["model.layers.0.mlp.up_proj.weight"], original)
    tokens = random_tokens(20, seed=5)
    runner = ModelRunner(ours, num_blocks=4, block_size_tokens=16)
    ref = hf_logits(ref_model, tokens)
    assert_logits_close(runner.forward_dense([tokens])[0], ref)
    # Decode steps multiply by the blocks themselves (quant.py) where the format has a kernel.
    has_blocks = ours.model.layers[0].mlp.up_proj.quant is not None
    assert has_blocks == (qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1))
    seq = Sequence(0, tokens[:16])
    runner.prefill([seq])
    for pos in range(16, 20):
        seq.append(tokens[pos])
        assert_logits_close(runner.decode([seq])[0], ref[pos])


def test_load_model_in_bfloat16(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")
    model = load_model(write_gguf(tmp_path / "tiny.gguf", hf), torch.bfloat16)
    expected = hf.state_dict()["model.layers.2.self_attn.v_proj.weight"].to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.state_dict()["model.layers.2.self_attn.v_proj.weight"], expected)


@pytest.fixture
def tiny_gguf(make_hf, tmp_path) -> Path:
    hf, _ = make_hf("llama")
    return write_gguf(tmp_path / "tiny.gguf", hf)


def test_truncated_tensor_data_is_a_checkpoint_error(tiny_gguf) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: tensor '.*' ends at byte .*truncated"):
        load_model(tiny_gguf)


def test_truncated_metadata_is_a_checkpoint_error(tiny_gguf) -> None:
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: truncated at byte \d+"):
        Checkpoint(tiny_gguf).config()


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file"):
        load_model(path)
    with pytest.raises(CheckpointError, match=r"missing\.gguf: cannot read"):
        Checkpoint(tmp_path / "missing.gguf").config()


def test_unknown_architecture_names_it(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")
    path = write_gguf(tmp_path / "falcon.gguf", hf, arch="falcon")
    with pytest.raises(
        UnsupportedModelError, match=r"falcon\.gguf: field 'general.architecture' = 'falcon'"
    ):
        load_model(path)


def test_missing_field_names_it(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")
    complete = read_gguf(write_gguf(tmp_path / "x.gguf", hf))
    assert config_from_gguf(complete).num_layers == 4
    metadata = {k: v for k, v in complete.metadata.items() if k != "llama.block_count"}
    with pytest.raises(CheckpointError, match=r"x\.gguf: required field 'llama.block_count'"):
        config_from_gguf(replace(complete, metadata=metadata))


TENSOR = "blk.1.attn_k.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(TENSOR), r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"),
        (
            lambda t: t.update({TENSOR: np.zeros((8, 31), np.float32)}),
            rf"tensor '{TENSOR}' \(model\.layers\.1\.self_attn\.k_proj\.weight\) has shape "
            r"\[8, 31\], the metadata implies \[16, 32\]",
        ),
        (
            lambda t: t.update({"blk.0.attn_gate.weight": np.ones((4, 32), np.float32)}),
            r"unexpected tensor 'blk\.0\.attn_gate\.weight'",
        ),
    ],
    ids=["missing", "misshaped", "unexpected"],
)
def test_bad_tensor_names_file_and_tensor(make_hf, tmp_path, edit, message) -> None:
    hf, _ = make_hf("llama")
    path = write_gguf(tmp_path / "bad.gguf", hf, edit=edit)
    with pytest.raises(CheckpointError, match=rf"bad\.gguf: {message}"):
        load_model(path)


def test_unsupported_tensor_type_names_it(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")
    path = write_gguf(
        tmp_path / "i32.gguf", hf, edit=lambda t: t.update({TENSOR: np.zeros((16, 32), np.int32)})
    )
    with pytest.raises(UnsupportedModelError, match=rf"i32\.gguf: tensor '{TENSOR}' is I32"):
        load_model(path)


# ---- tokenizers of other GGUF files, Checkpoint on an HF directory -----------------------


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_pre_tokenizer_matches_transformers_converter(pre) -> None:
    from transformers import GPT2Tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import set_split_regex

    if pre == "gpt2":
        ref = GPT2Tokenizer(vocab={"a": 0}, merges=[]).backend_tokenizer.pre_tokenizer
    else:
        holder = SimpleNamespace(backend_tokenizer=Tokenizer(BPE()))
        ref = set_split_regex(holder, {"pre_tokenizer_type": pre}).backend_tokenizer.pre_tokenizer
    ours = pre_tokenizer(pre, "<test>")
    for text in [*CORPUS.values(), *DIGIT_AFTER_WHITESPACE.values()]:
        assert ours.pre_tokenize_str(text) == ref.pre_tokenize_str(text)


def test_unsupported_tokenizer_is_named(make_hf, tmp_path) -> None:
    hf, _ = make_hf("llama")

    def vocab(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("jais")
        writer.add_token_list([chr(ord("!") + i) for i in range(97)])
        writer.add_token_merges(["! !"])

    path = write_gguf(tmp_path / "jais.gguf", hf, fields=vocab)
    with pytest.raises(UnsupportedModelError, match=r"jais\.gguf: field 'tokenizer.ggml.pre'"):
        Checkpoint(path).tokenizer()


def test_checkpoint_on_tiny_coder() -> None:
    from transformers import AutoTokenizer

    checkpoint = Checkpoint(BUNDLED_MODEL_DIR)
    assert not checkpoint.is_gguf
    assert checkpoint.config().model_type == "qwen3"
    assert checkpoint.eos_token_ids() == (1,)
    ref = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    text = CORPUS["python"]
    assert checkpoint.tokenizer().encode(text).ids == ref(text)["input_ids"]
    rendered = checkpoint.chat_template().render(TWO_TURNS)
    assert rendered == ref.apply_chat_template(
        TWO_TURNS, tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<｜begin▁of▁sentence｜>You are a concise assistant;")


def test_checkpoint_eos_ids_fall_back_to_config_json(tmp_path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, model_dir)
    (model_dir / "generation_config.json").unlink()
    config = (
        (model_dir / "config.json")
        .read_text()
        .replace('"eos_token_id": 1', '"eos_token_id": [1, 5]')
    )
    (model_dir / "config.json").write_text(config)
    assert Checkpoint(model_dir).eos_token_ids() == (1, 5)
    (model_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: no chat_template"):
        Checkpoint(model_dir).chat_template()


def test_checkpoint_module_does_not_import_torch() -> None:
    code = "import sys, worker.engine.checkpoint; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
