"""Engine benchmark: continuous batching against transformers `generate`, and prefill resumed
after a cached prefix against a cold prefill, side by side in one run on the same weights.

    python -m loadtest.bench_engine [--model NAME|PATH] [--batch-sizes 1,8,32] [--new-tokens 128]

(a) Decode: the same prompts (128-256 tokens of stdlib Python source), greedy, eos ignored,
    `--new-tokens` each, through `Engine.generate` and through transformers `generate`
    (left padding, use_cache=True, float32 both). Tokens/s are end to end (prefill + decode)
    for both sides; ours is also given for the decode steps alone. The greedy outputs are
    compared sequence by sequence. Target (issue): ours >= 3x transformers at batch >= 8.
(b) Prefill: an 8192-token prompt cold (chunked at the scheduler's budget), against
    transformers' forward over the whole prompt at once, and against the same prompt resumed
    after 123 cached blocks of 64 (7872 tokens, 96%) + the sliding window at 7872, computing
    the last 320. Ideal speedup 1 / (1 - 0.96) = 25x.

`--model` is a name (`kvfabric models list`: tiny-coder, SmolLM2-135M-Instruct) or a path (an
HF directory or a .gguf file; transformers loads the same file).

This machine is shared and noisy: only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from shared.engine import (
    Checkpoint,
    Engine,
    ModelRunner,
    SamplingParams,
    SchedulerConfig,
    Sequence,
    load_model,
)
from shared.engine.quant import block_formats
from shared.models import model_path

DEFAULT_MODEL = Path("models/tiny-coder")
STDLIB_FILES = ("os.py", "argparse.py", "typing.py", "dataclasses.py", "inspect.py", "pathlib.py")
BLOCK_SIZE_TOKENS = 64


def build_stand_in(out_dir: Path, **overrides: object) -> Path:
    """Random weights with tiny-coder's shape (the trained model may not exist yet);
    `overrides` change Qwen3Config fields (bench_spec_decode builds a copier from it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    fields: dict[str, object] = {
        "vocab_size": 8192,
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 3,
        # Wider than the 0.02 default so logits are not flat: with flat logits greedy
        # agreement would only measure round-off ties.
        "initializer_range": 0.08,
    }
    Qwen3ForCausalLM(Qwen3Config(**(fields | overrides))).save_pretrained(out_dir)
    return out_dir


def resolve_model(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg:
        return model_path(arg), f"{arg} (given)"
    if (DEFAULT_MODEL / "config.json").exists():
        return DEFAULT_MODEL, f"{DEFAULT_MODEL} (trained)"
    return build_stand_in(tmp / "stand-in"), "random-initialised stand-in of tiny-coder's shape"


def source_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((lib / name).read_text() for name in STDLIB_FILES)


def make_tokenize(model_dir: Path, vocab_size: int):
    """The model's tokenizer if it has one (a GGUF always does), else UTF-8 bytes as ids."""
    if model_dir.suffix == ".gguf" or (model_dir / "tokenizer.json").exists():
        tokenizer = Checkpoint(model_dir).tokenizer()
        return lambda text: tokenizer.encode(text, add_special_tokens=False).ids, "model tokenizer"
    return lambda text: [b % vocab_size for b in text.encode()], "utf-8 bytes (no tokenizer)"


def make_prompts(ids: list[int], count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(128, 256)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def run_ours(runner: ModelRunner, prompts: list[list[int]], new_tokens: int):
    engine = Engine(runner, SchedulerConfig(max_num_seqs=max(len(prompts), 1)), eos_token_ids=())
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    start = time.perf_counter()
    decode_start, decode_tokens = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if (
            decode_start is None
            and all(tokens[o.seq_id] for o in outputs)
            and len(outputs) == len(ids)
        ):
            decode_start = time.perf_counter()  # every sequence past prefill from here on
        elif decode_start is not None:
            decode_tokens += len(outputs)
        for out in outputs:
            tokens[out.seq_id].extend(out.new_token_ids)
    end = time.perf_counter()
    decode_tps = decode_tokens / (end - decode_start) if decode_start and decode_tokens else 0.0
    return [tokens[i] for i in ids], len(prompts) * new_tokens / (end - start), decode_tps


def run_hf(model, prompts: list[list[int]], new_tokens: int):
    """transformers' greedy `generate`: (tokens, tokens/s over the whole call)."""
    out, elapsed = _hf_generate(model, prompts, new_tokens)
    return out, len(prompts) * new_tokens / elapsed


def hf_decode_tps(model, prompts: list[list[int]], new_tokens: int, total_s: float) -> float:
    """transformers' decode phase alone: the same call with one new token (prefill + the
    first token) timed too, and the other new_tokens - 1 tokens over the difference."""
    _, first_s = _hf_generate(model, prompts, 1)
    return len(prompts) * (new_tokens - 1) / max(total_s - first_s, 1e-9)


def _hf_generate(model, prompts: list[list[int]], new_tokens: int):
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    return out[:, width:].tolist(), time.perf_counter() - start


def load_hf(model_dir: Path, impls: tuple[str, ...] = ("sdpa", "eager")):
    """transformers' model from the same files (a GGUF: dequantized, as ours), float32."""
    import os

    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    where = {"gguf_file": model_dir.name} if model_dir.suffix == ".gguf" else {}
    source = model_dir.parent if where else model_dir
    models = {}
    for impl in impls:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, attn_implementation=impl, **where
        ).eval()
        model.generation_config.eos_token_id = None  # ignore eos, like our side
        models[impl] = model
    return models


def bench_decode(args, model_dir: Path, runner: ModelRunner, ids: list[int]) -> None:
    hf_models = load_hf(model_dir)
    warm = make_prompts(ids, 2, seed=99)
    run_ours(runner, warm, 8)
    timings = {impl: run_hf(m, warm, 8)[1] for impl, m in hf_models.items()}
    # Pick the faster attention implementation at batch 8 once, then use it throughout.
    probe = make_prompts(ids, 8, seed=98)
    timings = {impl: run_hf(m, probe, 16)[1] for impl, m in hf_models.items()}
    impl = max(timings, key=timings.get)
    print(
        f"transformers attn_implementation: {impl} "
        f"(probe at batch 8: {', '.join(f'{k} {v:.0f} tok/s' for k, v in timings.items())})"
    )
    hf = hf_models[impl]
    print(
        "tok/s: new tokens over the whole run (prefill of the 128-256-token prompts included), "
        "and over the decode phase alone (transformers': generate(n) - generate(1))"
    )
    print(
        f"{'batch':>5} {'ours':>6} {'hf':>6} {'ratio':>6} {'decode: ours':>13} {'hf':>6} "
        f"{'ratio':>6} {'identical seqs':>15} {'same tokens':>12}",
        flush=True,
    )
    for batch_size in args.batch_sizes:
        prompts = make_prompts(ids, batch_size, seed=batch_size)
        ours, ours_tps, decode_tps = run_ours(runner, prompts, args.new_tokens)
        theirs, hf_tps = run_hf(hf, prompts, args.new_tokens)
        hf_decode = hf_decode_tps(
            hf, prompts, args.new_tokens, batch_size * args.new_tokens / hf_tps
        )
        identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
        same = sum(
            x == y for a, b in zip(ours, theirs, strict=True) for x, y in zip(a, b, strict=False)
        )
        total = sum(len(a) for a in ours)
        print(
            f"{batch_size:>5} {ours_tps:>6.0f} {hf_tps:>6.0f} {ours_tps / hf_tps:>5.2f}x "
            f"{decode_tps:>13.0f} {hf_decode:>6.0f} {decode_tps / hf_decode:>5.2f}x "
            f"{identical:>9}/{batch_size:<5} "
            f"{same / total:>11.1%}",
            flush=True,
        )


def bench_prefix(args, runner: ModelRunner, ids: list[int], hf=None) -> None:  # noqa: ANN001
    prompt = (ids * (args.prefill_tokens // len(ids) + 1))[: args.prefill_tokens]
    num_prefix_blocks = round(args.prefill_tokens * 0.96 / BLOCK_SIZE_TOKENS)  # 8192: 123
    num_prefix = num_prefix_blocks * BLOCK_SIZE_TOKENS
    config = SchedulerConfig(max_num_batched_tokens=args.chunk_tokens, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_new_tokens=1)

    engine = Engine(runner, config, eos_token_ids=(), max_model_len=len(prompt) + 1)
    start = time.perf_counter()
    cold = engine.generate([prompt], params)[0]
    cold_s = time.perf_counter() - start
    print(
        f"cold prefill: {len(prompt)} tokens in {cold_s:.2f} s "
        f"= {len(prompt) / cold_s:.0f} tok/s (chunks of {args.chunk_tokens})",
        flush=True,
    )
    if hf is not None:  # transformers' forward over the whole prompt at once (its best case)
        with torch.inference_mode():
            start = time.perf_counter()
            hf(torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
            hf_s = time.perf_counter() - start
        print(
            f"transformers forward: {len(prompt)} tokens in {hf_s:.2f} s = "
            f"{len(prompt) / hf_s:.0f} tok/s; ours {hf_s / cold_s:.2f}x",
            flush=True,
        )

    # The cached prefix: blocks in the pool + the window at its end, made off the clock.
    holder = Sequence(10**9, prompt[:num_prefix])
    while holder.num_computed_tokens < num_prefix:
        runner.prefill([holder], num_new_tokens=[args.chunk_tokens])
    start = time.perf_counter()
    seq_id = engine.add_request(
        prompt,
        params,
        prefix_block_ids=holder.block_table[:num_prefix_blocks],
        prefix_window=holder.window,
    )
    warm_tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id == seq_id:
                warm_tokens.extend(out.new_token_ids)
    warm_s = time.perf_counter() - start
    runner.release(holder)
    num_suffix = len(prompt) - num_prefix
    print(
        f"warm prefill: {num_prefix_blocks} cached blocks ({num_prefix} tokens, "
        f"{num_prefix / len(prompt):.0%}), {num_suffix} computed in {warm_s:.3f} s "
        f"= {num_suffix / warm_s:.0f} tok/s",
        flush=True,
    )
    ideal = len(prompt) / num_suffix
    print(
        f"time to first token: {cold_s / warm_s:.1f}x faster warm than cold "
        f"(ideal {ideal:.1f}x, {cold_s / warm_s / ideal:.0%} of ideal); "
        f"same first token: {warm_tokens == cold.completion_token_ids}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    # One thread for both sides by default: on this 2-core box, shared with a training job,
    # two threads made a batch-8 decode step 3-15x slower (57-678 ms vs 19-43 ms), as each
    # op waits for the thread the other job has descheduled.
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-hf-prefill", action="store_true", help="no transformers forward")
    parser.add_argument(
        "--no-block-kernel",
        action="store_true",
        help="decode from the float32 weights too (a GGUF model's blocks unused)",
    )
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, description = resolve_model(args.model, Path(tmp))
        print(f"model: {description}; float32; torch threads: {torch.get_num_threads()}")
        model = load_model(model_dir, block_kernel=not args.no_block_kernel)
        formats = block_formats(model)
        print(
            "decode weights: "
            + (f"{'/'.join(formats)} blocks (kernels/cpu)" if formats else "float32")
            + f"; transformers: float32{' (dequantized from the same file)' if formats else ''}"
        )
        tokenize, how = make_tokenize(model_dir, model.config.vocab_size)
        ids = tokenize(source_text())
        print(f"prompts: stdlib Python source, {how}, {len(ids)} tokens available", flush=True)
        # 512 blocks of 64: batch 32 x 384 tokens needs 192; the 8K prefill test needs 258.
        runner = ModelRunner(model, num_blocks=512, block_size_tokens=BLOCK_SIZE_TOKENS)
        if not args.skip_decode:
            bench_decode(args, model_dir, runner, ids)
        if not args.skip_prefill:
            hf = None if args.skip_hf_prefill else load_hf(model_dir, ("sdpa",))["sdpa"]
            bench_prefix(args, runner, ids, hf)


if __name__ == "__main__":
    main()
