"""What bounded replay costs in quality (docs/design.md, 'Sliding-window state'), measured,
not assumed.

Over held-out code, at many block-aligned boundaries P, the sliding-window state at P is
rebuilt by bounded replay of R tokens (R in {0, W/2, W, 2W, k x W}); the following tokens are
then prefilled from P over the exact cached prefix pages, and their next-token distributions
are compared with exact recomputation (a cold prefill of the whole sequence):
KL(exact || replayed) in nats and top-1 agreement, over the first W tokens after P and over
all `--num-following` tokens.

    python -m loadtest.swa_quality --model models/tiny-coder [--num-sequences 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from worker.engine import ModelRunner, Sequence, load_model
from worker.engine.swa_restore import exact_replay_tokens, replay_window

BLOCK = 64


@dataclass
class Tally:
    kl_near: list[float] = field(default_factory=list)  # first W tokens after the boundary
    kl_all: list[float] = field(default_factory=list)
    top1_near: list[bool] = field(default_factory=list)
    top1_all: list[bool] = field(default_factory=list)


def kl_and_top1(exact: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_p, log_q = F.log_softmax(exact.double(), -1), F.log_softmax(approx.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl, exact.argmax(-1) == approx.argmax(-1)


def measure(
    model_dir: Path, sequences: list[list[int]], boundaries: list[int], num_following: int
) -> tuple[dict[int, Tally], int, int]:
    model = load_model(model_dir)
    config = model.config
    window, exact_r = config.sliding_window or 0, exact_replay_tokens(config)
    replay_lengths = sorted({0, window // 2, window, 2 * window, exact_r})
    tallies = {r: Tally() for r in replay_lengths}
    num_blocks = 2 * (max(len(s) for s in sequences) // BLOCK + 2)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size_tokens=BLOCK)
    started = time.monotonic()
    for index, tokens in enumerate(sequences):
        cold = Sequence(0, tokens)
        exact_logits = runner.prefill([cold], return_all_logits=True)[0]
        for boundary in boundaries:
            if boundary + num_following > len(tokens):
                continue
            prefix_blocks = cold.block_table[: boundary // BLOCK]
            for r in replay_lengths:
                state = replay_window(model, runner.pool, prefix_blocks, tokens, boundary, r)
                warm = Sequence(1, tokens[: boundary + num_following])
                runner.block_manager.attach_prefix(warm, prefix_blocks, state)
                approx = runner.prefill([warm], return_all_logits=True)[0]
                runner.release(warm)
                # Row i predicts token boundary + i + 1: compare the same rows.
                kl, top1 = kl_and_top1(exact_logits[boundary : boundary + num_following], approx)
                tally = tallies[r]
                tally.kl_near += kl[:window].tolist()
                tally.kl_all += kl.tolist()
                tally.top1_near += top1[:window].tolist()
                tally.top1_all += top1.tolist()
        runner.release(cold)
        print(
            f"  sequence {index + 1}/{len(sequences)} done ({time.monotonic() - started:.0f}s)",
            flush=True,
        )
    return tallies, window, exact_r


def report(tallies: dict[int, Tally], window: int, exact_r: int, num_following: int) -> str:
    lines = [
        f"| R (replayed tokens) | mean KL, first {window} tokens | p99 KL, first {window} "
        f"| top-1 agree, first {window} | mean KL, {num_following} tokens | top-1 agree, "
        f"{num_following} tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r, t in sorted(tallies.items()):
        name = f"{r}" + (" (k x W, exact)" if r == exact_r else " (empty window)" if r == 0 else "")
        p99 = sorted(t.kl_near)[int(0.99 * (len(t.kl_near) - 1))]
        lines.append(
            f"| {name} | {statistics.fmean(t.kl_near):.4f} | {p99:.4f} "
            f"| {statistics.fmean(t.top1_near):.1%} | {statistics.fmean(t.kl_all):.4f} "
            f"| {statistics.fmean(t.top1_all):.1%} |"
        )
    return "\n".join(lines)


def load_sequences(model_dir: Path, files: list[Path], seq_len: int, num: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sequences = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            sequences.append(ids[start : start + seq_len])
            if len(sequences) == num:
                return sequences
    return sequences


def heldout_files() -> list[Path]:
    """The files tiny-coder never trained on (its training script's own split)."""
    from models.tiny_coder.data import list_sources, split

    _, held_out = split(list_sources())
    return [source.path for source in held_out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-coder"))
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-following", type=int, default=64)
    parser.add_argument("--boundaries", default="256,320,384,448")
    args = parser.parse_args()
    torch.set_num_threads(2)
    boundaries = [int(b) for b in args.boundaries.split(",")]
    if any(b % BLOCK for b in boundaries):
        parser.error(f"boundaries must be multiples of the block size {BLOCK}")
    sequences = load_sequences(args.model, heldout_files(), args.seq_len, args.num_sequences)
    print(f"{len(sequences)} held-out sequences of {args.seq_len} tokens, boundaries {boundaries}")
    tallies, window, exact_r = measure(args.model, sequences, boundaries, args.num_following)
    num = len(tallies[exact_r].kl_all)
    print(f"\nW = {window}, k x W = {exact_r}; {num} predicted tokens per row\n")
    print(report(tallies, window, exact_r, args.num_following))


if __name__ == "__main__":
    main()
