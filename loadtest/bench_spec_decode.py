"""Speculative decoding (prompt lookup, adaptive draft length) on and off, side by side.

    python -m loadtest.bench_spec_decode [--model DIR] [--batch-sizes 1,8] [--new-tokens 128]

Each workload runs the same prompts through the engine with `SpecDecodeConfig()` (the
default) and with `SpecDecodeConfig(enabled=False)`, greedy, eos ignored, and reports
end-to-end tokens/s (prefill included) for both, the ratio, the acceptance rate, tokens per
sequence-step and whether the outputs are identical (they must be: greedy speculation only
moves which attention path computes the logits).

Workloads:
- edit: a chunk of stdlib Python source (~300 tokens), an instruction line, and the first
  lines of the chunk again; the answer is whatever the model writes. With the trained
  `models/tiny-coder` (if present) this is the honest figure: acceptance is however much it
  copies. With the random stand-in the answer is noise and this degenerates to "no-match".
- oracle: a model that copies by construction, so the ceiling of the mechanism on this
  machine does not hang on model quality. Random weights of tiny-coder's size, but every
  layer slides (window 32, 6 layers: the next token depends on the last 187 tokens only)
  and RoPE is relative: prompt = X + G + X where G is the model's own greedy continuation of
  X (|X| = 200): it writes G again, and prompt lookup finds G after the first X.
- no-match: uniformly random token ids as the prompt (no n-gram repeats) with the
  full-architecture stand-in: what speculation costs when it has nothing to offer.
- calibrate: scoring 1 + k tokens against one decode step, the cost model behind
  SpecDecodeConfig's cost terms.

Batch "8" is 8 requests started together: the run lasts as long as its slowest request,
so speeding up the ones that copy gains nothing unless the slowest copies too. Batch
"8q24" is 24 requests through 8 slots (continuous batching), closer to serving.

This machine is shared and noisy: only ratios measured in the same run mean anything; the
two sides of each row alternate in one process with the same thread count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtest.bench_engine import DEFAULT_MODEL, build_stand_in, make_tokenize, source_text
from loadtest.results import BenchResult
from worker.engine import Engine, ModelRunner, SamplingParams, SchedulerConfig, Sequence, load_model
from worker.engine.drafter import SpecDecodeConfig, SpecStats

BLOCK_SIZE_TOKENS = 64
INSTRUCTION = "\n\n# The same code, with the fix applied:\n"


def build_copier(out_dir: Path) -> Path:
    """tiny-coder's size with sliding windows only: a copier by construction (see above)."""
    return build_stand_in(
        out_dir,
        max_position_embeddings=4096,
        sliding_window=32,
        layer_types=["sliding_attention"] * 6,
    )


def generate_all(runner, prompts, new_tokens, spec: SpecDecodeConfig, num_slots: int | None = None):
    """Greedy outputs, end-to-end tokens/s, decode-phase tokens/s, the engine's counters.

    The decode phase starts once every sequence has its first token (prefill done); with
    fewer slots than prompts it is not measured (0)."""
    engine = Engine(
        runner,
        SchedulerConfig(max_num_seqs=num_slots or max(len(prompts), 1)),
        eos_token_ids=(),
        spec_decode=spec,
    )
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    seq_ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in seq_ids}
    start = time.perf_counter()
    decode_start, num_decode_tokens = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if decode_start is not None:
            num_decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        for out in outputs:
            tokens[out.seq_id].extend(out.new_token_ids)
        if decode_start is None and not num_slots and all(tokens.values()):
            decode_start = time.perf_counter()
    end = time.perf_counter()
    num_tokens = sum(len(t) for t in tokens.values())
    decode_tps = num_decode_tokens / (end - decode_start) if num_decode_tokens else 0.0
    return [tokens[i] for i in seq_ids], num_tokens / (end - start), decode_tps, engine.spec_stats


def compare(
    name,
    runner,
    prompts,
    new_tokens,
    repeats,
    result: BenchResult,  # noqa: PLR0913
    num_slots: int | None = None,
) -> None:
    """Off and on alternately, `repeats` times each; the median tokens/s of each side."""
    off_tps, on_tps, off_dec, on_dec = [], [], [], []
    stats = SpecStats()
    off_spec = SpecDecodeConfig(enabled=False)
    for _ in range(repeats):
        plain, tps, dec, _ = generate_all(runner, prompts, new_tokens, off_spec, num_slots)
        off_tps.append(tps)
        off_dec.append(dec)
        spec, tps, dec, stats = generate_all(
            runner, prompts, new_tokens, SpecDecodeConfig(), num_slots
        )
        on_tps.append(tps)
        on_dec.append(dec)
    off, on = statistics.median(off_tps), statistics.median(on_tps)
    off_d, on_d = statistics.median(off_dec), statistics.median(on_dec)
    identical = sum(a == b for a, b in zip(plain, spec, strict=True))
    batch = f"{num_slots}q{len(prompts)}" if num_slots else str(len(prompts))
    what = f"{name}, batch {batch}"
    result.ratio(
        f"tok/s with drafts / without, {what}, end to end",
        on,
        off,
        "the same engine without drafts",
        "tokens/s",
    )
    if off_d:
        result.ratio(
            f"tok/s with drafts / without, {what}, decode phase",
            on_d,
            off_d,
            "the same engine without drafts",
            "tokens/s",
        )
    result.figure(f"draft acceptance, {what}", stats.acceptance_rate, "share")
    result.figure(f"tokens per sequence-step, {what}", stats.tokens_per_forward, "tokens")
    result.figure(
        f"outputs identical with and without drafts, {what}", identical / len(prompts), "share", 1.0
    )
    print(f"{what}: {on / off:.2f}x", flush=True)


def edit_prompts(ids: list[int], count: int, tokenize, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    instruction = tokenize(INSTRUCTION)
    prompts = []
    for _ in range(count):
        start = rng.randrange(0, len(ids) - 400)
        chunk = ids[start : start + 300]
        prompts.append(chunk + instruction + chunk[:24])
    return prompts


def oracle_prompts(runner, ids: list[int], count: int, new_tokens: int) -> list[list[int]]:
    rng = random.Random(7)
    contexts = []
    for _ in range(count):
        start = rng.randrange(0, len(ids) - 200)
        contexts.append(ids[start : start + 200])
    again, _, _, _ = generate_all(runner, contexts, new_tokens, SpecDecodeConfig(enabled=False))
    return [x + g + x for x, g in zip(contexts, again, strict=True)]


def random_prompts(vocab_size: int, count: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(vocab_size) for _ in range(300)] for _ in range(count)]


def calibrate(
    runner, ids: list[int], batch_size: int, result: BenchResult, repeats: int = 30
) -> None:
    """ms of one decode step vs one score_drafts of 1 + k tokens per sequence."""
    seqs = [Sequence(10**6 + i, ids[i * 50 : i * 50 + 300]) for i in range(batch_size)]
    for seq in seqs:
        seq.append(int(runner.prefill([seq])[0].argmax()))
    timings = {}
    for k in (1, 2, 4, 8, 16):
        drafts = [ids[:k]] * batch_size
        start = time.perf_counter()
        for _ in range(repeats):
            runner.score_drafts(seqs, drafts)  # nothing committed: repeatable
        timings[k] = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        logits = runner.decode(seqs)
        for seq, t in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            seq.append(t)
    decode_s = (time.perf_counter() - start) / repeats
    for seq in seqs:
        runner.release(seq)
    rel = {k: t / decode_s for k, t in timings.items()}
    slope = (rel[16] - rel[1]) / 15
    result.note(
        f"calibrate batch {batch_size}: decode {decode_s * 1e3:.1f} ms/step; score 1+k tokens "
        f"= {', '.join(f'k={k}: {r:.2f}' for k, r in rel.items())} decode steps "
        f"-> verify_overhead ~{rel[1] - slope - 1:.2f}, draft_token_cost ~{slope:.3f}"
    )


def run(  # noqa: PLR0913
    quick: bool = False,
    *,
    model: str | None = None,
    batch_sizes: tuple[int, ...] | None = None,
    new_tokens: int | None = None,
    repeats: int | None = None,
    workloads: tuple[str, ...] = ("calibrate", "edit", "oracle", "no-match"),
    num_threads: int = 1,
) -> BenchResult:
    """Quick: batch 1 only, 32 new tokens, one repeat."""
    batch_sizes = batch_sizes or ((1,) if quick else (1, 8))
    new_tokens = new_tokens or (32 if quick else 128)
    repeats = repeats or (1 if quick else 2)
    result = BenchResult("spec", quick)
    torch.set_num_threads(num_threads)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if model:
            model_dir, description = Path(model), f"{model} (given)"
        elif (DEFAULT_MODEL / "config.json").exists():
            model_dir, description = DEFAULT_MODEL, f"{DEFAULT_MODEL} (trained)"
        else:
            model_dir = build_stand_in(tmp / "stand-in")
            description = "random stand-in of tiny-coder's shape (no trained model found)"
        loaded = load_model(model_dir)
        tokenize, how = make_tokenize(model_dir, loaded.config.vocab_size)
        ids = tokenize(source_text())
        result.note(
            f"model: {description}; float32; torch threads {torch.get_num_threads()}; "
            f"prompts tokenized with {how}; {new_tokens} new tokens, greedy; "
            f"default {SpecDecodeConfig()}"
        )
        runner = ModelRunner(loaded, num_blocks=256, block_size_tokens=BLOCK_SIZE_TOKENS)
        generate_all(runner, edit_prompts(ids, 2, tokenize, 99), 8, SpecDecodeConfig())  # warm
        if "calibrate" in workloads:
            for batch_size in batch_sizes:
                calibrate(runner, ids, batch_size, result)
        if "edit" in workloads:
            for batch_size in batch_sizes:
                prompts = edit_prompts(ids, batch_size, tokenize, batch_size)
                compare("edit", runner, prompts, new_tokens, repeats, result)
            for batch_size in [b for b in batch_sizes if b > 1]:
                # Serving: a queue of 3x the slots, so a request that finishes early (it
                # copied) frees its slot for the next instead of idling until the slowest.
                prompts = edit_prompts(ids, 3 * batch_size, tokenize, 3 * batch_size)
                compare("edit", runner, prompts, new_tokens, repeats, result, batch_size)
        if "no-match" in workloads:
            stand_in = load_model(build_stand_in(tmp / "no-match"))
            other = ModelRunner(stand_in, num_blocks=256, block_size_tokens=BLOCK_SIZE_TOKENS)
            for batch_size in batch_sizes:
                prompts = random_prompts(stand_in.config.vocab_size, batch_size)
                compare("no-match", other, prompts, new_tokens, repeats, result)
        if "oracle" in workloads:
            copier = load_model(build_copier(tmp / "copier"))
            copier_ids = [t % copier.config.vocab_size for t in ids]
            other = ModelRunner(copier, num_blocks=256, block_size_tokens=BLOCK_SIZE_TOKENS)
            for batch_size in batch_sizes:
                prompts = oracle_prompts(other, copier_ids, batch_size, new_tokens)
                compare("oracle", other, prompts, new_tokens, repeats, result)
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default="calibrate,edit,oracle,no-match")
    # One thread, as bench_engine: on this shared 2-core box two threads made steps 3-15x
    # slower and far noisier.
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    sizes = (
        {}
        if args.quick
        else {
            "batch_sizes": tuple(int(b) for b in args.batch_sizes.split(",")),
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
        }
    )
    run(
        args.quick,
        model=args.model,
        workloads=tuple(args.workloads.split(",")),
        num_threads=args.num_threads,
        **sizes,
    ).print()


if __name__ == "__main__":
    main()
