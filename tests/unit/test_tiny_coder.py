"""The committed tiny-coder model: loads in transformers and in our engine with the same
logits, its tokenizer round-trips Python, its chat template renders DeepSeek-V3's format,
and it continues Python. Tolerance: engine vs transformers in float32 within 2e-5 x max|logit|,
the bound of tests/unit/engine/engine_helpers.py (same math, other summation order).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.tiny_coder import tokenizer as tc_tokenizer
from worker.engine import ModelConfig, ModelRunner, Sequence, load_model

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-coder"
REL_TOL = 2e-5

# Not from the stdlib (so never trained on); ~230 tokens, well past the 3 x 64 = 192 tokens
# the sliding layers can see, so a wrong window would change the logits at the end.
SNIPPET = '''import json
from pathlib import Path


class Inventory:
    """Items and their counts, persisted as JSON."""

    def __init__(self, path):
        self.path = Path(path)
        self.items = {}
        if self.path.exists():
            self.items = json.loads(self.path.read_text())

    def add(self, name, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def remove(self, name):
        try:
            del self.items[name]
        except KeyError:
            return False
        return True

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)
'''


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Forwards of <= 250 tokens gain nothing from a second thread, and on a busy 2-core box
    # its barrier waits cost: one 40-token forward took 1.29 s with 2 threads, 37 ms with 1.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def snippet_ids(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id(tc_tokenizer.BOS), *tok.encode(SNIPPET).ids]


def test_config_has_explicit_sliding_then_full_layers() -> None:
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw["use_sliding_window"] is True
    assert raw["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] * 3
    cfg = ModelConfig.from_hf(MODEL_DIR)
    assert cfg.sliding_window == raw["sliding_window"] == 64
    assert cfg.sliding_layer_ids == (0, 1, 2)
    assert cfg.tie_word_embeddings and cfg.qk_norm


def test_engine_logits_match_transformers(hf_model, snippet_ids: list[int]) -> None:
    assert len(snippet_ids) > 3 * 64
    with torch.no_grad():
        ref = hf_model(torch.tensor([snippet_ids]), use_cache=False).logits[0].float()
    runner = ModelRunner(load_model(MODEL_DIR), num_blocks=32, block_size_tokens=16)
    dense = runner.forward_dense([snippet_ids])[0]
    bound = REL_TOL * float(ref.abs().max())
    assert float((dense - ref).abs().max()) <= bound
    # The serving path: prefill a prefix, then decode token by token through the window.
    seq = Sequence(0, snippet_ids[:180])
    runner.prefill([seq])
    for pos in range(180, len(snippet_ids)):
        seq.token_ids.append(snippet_ids[pos])
        logits = runner.decode([seq])[0]
        assert float((logits - ref[pos]).abs().max()) <= bound, f"position {pos}"


@pytest.mark.parametrize(
    "source",
    [
        SNIPPET,
        Path(tc_tokenizer.__file__).read_text(encoding="utf-8"),
        "def f(a,\tb):\r\n    return a  # naïve — ünïcode ✓ 中文\n\n\n   \n",
        "x = '<｜User｜>' if y else \"</think>\"\n",
    ],
)
def test_tokenizer_round_trips_python_source(tok: Tokenizer, source: str) -> None:
    ids = tok.encode(source).ids
    assert tok.decode(ids, skip_special_tokens=False) == source
    assert len(ids) < len(source)  # BPE merged something: not a byte-per-token fallback


def test_special_tokens_are_single_ids_in_deepseek_order(tok: Tokenizer) -> None:
    for expected_id, text in enumerate(tc_tokenizer.SPECIAL_TOKENS):
        assert tok.token_to_id(text) == expected_id
        assert tok.encode(f"x = 1{text}y").ids.count(expected_id) == 1
    assert tok.token_to_id("<｜tool▁calls▁begin｜>") is not None  # the U+2581 spelling
    hf_tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (0, 1, 2)


def test_chat_template_renders_deepseek_v3_format() -> None:
    hf_tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    call = {"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": "<think>one file</think>There is a.py."},
        {"role": "user", "content": "Thanks"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>You write Python.<｜User｜>List files."
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ls\n"
        '```json\n{"path": "."}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>a.py<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>There is a.py.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks<｜Assistant｜>"
    )
    ids = hf_tok.encode(text, add_special_tokens=False)
    # Every marker the template wrote is one id: bos 0, eos 1, User 3, Assistant 4, ...
    assert ids[0] == 0 and ids[-1] == 4
    assert [ids.count(i) for i in (1, 3, 4, 5, 7, 9, 13)] == [2, 2, 2, 1, 1, 1, 1]


# Prompts end inside a def header, not after "def ": BPE attaches a space to the word after it,
# so a prompt ending in a bare space token is one the model almost never saw.
@pytest.mark.parametrize(
    "prompt",
    [
        "def parse(self",
        "    def __init__(self",
        "    def close(self):",
        "class Parser:\n    def __init__(",
    ],
)
def test_greedy_continuation_of_def_is_python(hf_model, tok: Tokenizer, prompt: str) -> None:
    ids = [tok.token_to_id(tc_tokenizer.BOS), *tok.encode(prompt).ids]
    num_prompt = len(ids)
    # Greedy by full forwards, no cache: 32 passes of <= 45 tokens, ~1 s in all.
    with torch.no_grad():
        for _ in range(32):
            logits = hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    text = prompt + tok.decode(ids[num_prompt:])
    # The header closes (parameters, colon, newline) and the body starts one level deeper
    # with a docstring or a statement keyword.
    header = re.search(r"^( *)def \w+\([^)]*\):\n", text, re.M)
    assert header, text
    body = text[header.end() :]
    indent = len(header.group(1))
    first = re.match(r'( +)("""|return\b|if\b|for\b|self\.|raise\b|with\b|try\b)', body)
    assert first and len(first.group(1)) > indent, text
