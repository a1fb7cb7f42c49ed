"""Evaluate tiny-coder and write its model card: `python -m models.tiny_coder.evaluate`.

- held-out loss: mean next-token NLL over the held-out files, each encoded as
  `bos + file + eos` and cut into windows of at most `context` predictions that never cross
  a file boundary (so later windows of a long file start without earlier context);
- greedy continuations of fixed Python prompts (bos + prompt, transformers `generate`);
- the engine check: `worker.engine.load_model` logits against transformers (eager, float32)
  on the first held-out tokens, relative to the largest logit.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from models.tiny_coder import card, data
from models.tiny_coder.tokenizer import BOS, EOS
from worker.engine import load_model
from worker.engine.attention import DenseAttention

PROMPTS = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef list_files(path):",
    "def read_config(filename):\n    ",
    "    for i, line in enumerate(lines):\n",
)


def load_hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def held_out_loss(model, tok: Tokenizer, context: int, max_tokens: int | None = None) -> dict:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    _, files = data.split(data.list_sources())
    total_nll, num_predicted, num_bytes = 0.0, 0, 0
    for f in files:
        text = f.read()
        ids = [bos, *tok.encode(text).ids, eos]
        num_bytes += len(text.encode())
        for lo in range(0, len(ids) - 1, context):
            window = torch.tensor([ids[lo : lo + context + 1]])
            logits = model(input_ids=window[:, :-1]).logits[0]
            nll = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
            total_nll += nll.item()
            num_predicted += window.shape[1] - 1
        if max_tokens and num_predicted >= max_tokens:
            break
    mean = total_nll / num_predicted
    return {
        "held_out_files": len(files),
        "held_out_tokens": num_predicted,
        "held_out_loss": round(mean, 4),
        "held_out_ppl": round(math.exp(mean), 2),
        "held_out_bits_per_byte": round(total_nll / math.log(2) / num_bytes, 4),
    }


@torch.no_grad()
def continuations(model, tok: Tokenizer, max_new_tokens: int = 64) -> list[tuple[str, str]]:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([[bos, *tok.encode(prompt).ids]])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        out.append((prompt, tok.decode(gen[0, ids.shape[1] :].tolist())))
    return out


@torch.no_grad()
def engine_agreement(model_dir: Path, hf_model, token_ids: list[int]) -> dict:
    engine = load_model(model_dir, dtype=torch.float32)
    backend = DenseAttention(engine.config, [len(token_ids)])
    ids = torch.tensor(token_ids)
    ours = engine.compute_logits(engine(ids, torch.arange(len(ids)), backend))
    ref = hf_model(input_ids=ids[None]).logits[0].float()
    max_diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {
        "engine_tokens": len(token_ids),
        "engine_max_abs_diff": max_diff,
        "engine_rel_diff": max_diff / scale,
        "engine_top1_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-coder")
    p.add_argument("--max-held-out-tokens", type=int, default=0, help="0: all")
    p.add_argument("--no-card", action="store_true", help="print figures, leave README.md")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = Path(args.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = load_hf(model_dir)
    context = model.config.max_position_embeddings
    start = time.time()
    figures = held_out_loss(model, tok, context, args.max_held_out_tokens or None)
    # The first held-out file long enough to fill the context: past the 3 x 64 tokens the
    # sliding layers see, so a window that differed between the two would show.
    _, held_out = data.split(data.list_sources())
    encoded = (tok.encode(f.read()).ids for f in held_out)
    snippet = [tok.token_to_id(BOS), *next(ids for ids in encoded if len(ids) >= context)]
    snippet = snippet[:context]
    figures |= engine_agreement(model_dir, model, snippet)
    samples = continuations(model, tok)
    figures["eval_wall_s"] = round(time.time() - start, 1)
    print(json.dumps(figures, indent=2))
    text = card.render_samples(samples)
    print(text)
    if not args.no_card:
        summary = json.loads((model_dir / "train_summary.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
        readme = card.render(config, summary, figures, text, model_dir)
        (model_dir / "README.md").write_text(readme, encoding="utf-8")
        print(f"wrote {model_dir / 'README.md'}")


if __name__ == "__main__":
    main()
