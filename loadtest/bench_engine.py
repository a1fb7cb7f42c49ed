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
(c) Linear layers: a warm agent step's prefill (256 new tokens after up to 1,600 cached)
    with every linear layer through oneDNN's packed weights (the engine's default,
    layers.pack_linears) against the same model through F.linear (MKL), interleaved, the
    median of 5 each; outputs compared.
(d) Attention: the same warm step with full layers' attention read from the pool in place
    (shared/kernels/cpu/paged_attention.c, the engine's default where it is built) against the SDPA
    path, interleaved, the median of 5 each, outputs compared; then one layer alone, 256
    queries after 1,600 and 8,000 keys (not in quick mode).

`--model` is a name (`kvfabric models list`: tiny-coder, SmolLM2-135M-Instruct) or a path (an
HF directory or a .gguf file; transformers loads the same file).

This machine is shared and noisy: only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from loadtest.results import BenchResult
from shared.models import model_path
from worker.engine import (
    Checkpoint,
    Engine,
    ModelRunner,
    SamplingParams,
    SchedulerConfig,
    Sequence,
    load_model,
)
from worker.engine.attention import (
    attend_after_prefix,
    paged_attention,
    paged_attention_scratch,
    paged_attention_serves,
)
from worker.engine.layers import can_pack
from worker.engine.model import CausalLM
from worker.engine.quant import block_formats

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


def bench_decode(  # noqa: ANN001
    args, model_dir: Path, runner: ModelRunner, ids: list[int], result: BenchResult
) -> None:
    hf_models = load_hf(model_dir)
    warm = make_prompts(ids, 2, seed=99)
    run_ours(runner, warm, 8)
    timings = {impl: run_hf(m, warm, 8)[1] for impl, m in hf_models.items()}
    # Pick the faster attention implementation at batch 8 once, then use it throughout.
    probe = make_prompts(ids, 8, seed=98)
    timings = {impl: run_hf(m, probe, 16)[1] for impl, m in hf_models.items()}
    impl = max(timings, key=timings.get)
    result.note(
        f"transformers attn_implementation: {impl} "
        f"(probe at batch 8: {', '.join(f'{k} {v:.0f} tok/s' for k, v in timings.items())})"
    )
    hf = hf_models[impl]
    result.note(
        "decode tok/s: new tokens over the whole run (prefill of the 128-256-token prompts "
        "included), and over the decode phase alone (transformers': generate(n) - generate(1))"
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
        target = 1.5 if batch_size == 8 else None
        result.ratio(
            f"decode tok/s, batch {batch_size}, whole run",
            ours_tps,
            hf_tps,
            "transformers generate",
            "tokens/s",
            target,
        )
        result.ratio(
            f"decode tok/s, batch {batch_size}, decode phase",
            decode_tps,
            hf_decode,
            "transformers generate",
            "tokens/s",
        )
        result.figure(
            f"greedy sequences identical to transformers', batch {batch_size}",
            identical / batch_size,
            "share",
            1.0,
        )
        result.figure(f"tokens equal to transformers', batch {batch_size}", same / total, "share")
        print(
            f"batch {batch_size}: ours {ours_tps:.0f} tok/s, transformers {hf_tps:.0f}", flush=True
        )


def bench_prefix(  # noqa: ANN001
    args, runner: ModelRunner, ids: list[int], result: BenchResult, hf=None
) -> None:
    prompt = (ids * (args.prefill_tokens // len(ids) + 1))[: args.prefill_tokens]
    num_prefix_blocks = round(args.prefill_tokens * 0.96 / BLOCK_SIZE_TOKENS)  # 8192: 123
    num_prefix = num_prefix_blocks * BLOCK_SIZE_TOKENS
    config = SchedulerConfig(max_num_batched_tokens=args.chunk_tokens, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_new_tokens=1)

    engine = Engine(runner, config, eos_token_ids=(), max_model_len=len(prompt) + 1)
    start = time.perf_counter()
    cold = engine.generate([prompt], params)[0]
    cold_s = time.perf_counter() - start
    result.figure(
        f"cold prefill of {len(prompt)} tokens (chunks of {args.chunk_tokens})",
        len(prompt) / cold_s,
        "tokens/s",
    )
    if hf is not None:  # transformers' forward over the whole prompt at once (its best case)
        with torch.inference_mode():
            start = time.perf_counter()
            hf(torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
            hf_s = time.perf_counter() - start
        result.ratio(
            f"prefill tok/s, {len(prompt)} tokens",
            len(prompt) / cold_s,
            len(prompt) / hf_s,
            "transformers forward",
            "tokens/s",
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
    result.figure(
        f"warm prefill: {num_suffix} tokens computed after {num_prefix} cached "
        f"({num_prefix / len(prompt):.0%})",
        num_suffix / warm_s,
        "tokens/s",
    )
    ideal = len(prompt) / num_suffix
    result.ratio(
        "prefill speedup after a cached prefix, cold / warm",
        cold_s / warm_s,
        ideal,
        "the ideal 1 / (1 - hit share)",
        "x",
        0.85,
    )
    result.figure(
        "warm first token equals cold", float(warm_tokens == cold.completion_token_ids), "bool", 1.0
    )


def warm_steps(
    runners: list[ModelRunner], ids: list[int], max_positions: int
) -> tuple[int, int, list[float], list[torch.Tensor]]:
    """A warm agent step's prefill (256 new tokens after up to 1,600 cached) on each runner,
    interleaved, six rounds of which the first is a warm-up: (new, cached, the median
    seconds of each runner, each runner's logits)."""
    num_new = 256
    num_cached = min(1600, max_positions - num_new - 1)
    prompt = (ids * ((num_cached + num_new) // len(ids) + 1))[: num_cached + num_new + 1]

    def step(runner: ModelRunner) -> tuple[float, torch.Tensor]:
        seq = Sequence(-1, prompt)
        try:
            runner.prefill([seq], num_new_tokens=[num_cached])
            start = time.perf_counter()
            [logits] = runner.prefill([seq], num_new_tokens=[num_new])
            return time.perf_counter() - start, logits
        finally:
            runner.release(seq)

    times: list[list[float]] = [[] for _ in runners]
    for _ in range(6):
        for side, runner in enumerate(runners):
            times[side].append(step(runner)[0])
    logits = [step(runner)[1] for runner in runners]
    return num_new, num_cached, [statistics.median(t[1:]) for t in times], logits


def bench_linears(
    packed: CausalLM, model_dir: Path, ids: list[int], result: BenchResult, block_kernel: bool
) -> None:
    """`packed`: the model as `load_model` gives it; the same weights are loaded again without
    oneDNN's copies for the other side."""
    if not can_pack(packed.model.embed_tokens.weight.dtype, torch.device("cpu")):
        result.note("linear layers: oneDNN cannot pack them here (layers.can_pack); skipped")
        return
    plain = load_model(model_dir, block_kernel=block_kernel, onednn=False)
    runners = [
        ModelRunner(m, num_blocks=64, block_size_tokens=BLOCK_SIZE_TOKENS) for m in (plain, packed)
    ]
    num_new, num_cached, (mkl_s, onednn_s), logits = warm_steps(
        runners, ids, packed.config.max_position_embeddings
    )
    result.ratio(
        f"warm-step prefill, {num_new} tokens after {num_cached}: oneDNN packed "
        "linears vs F.linear",
        1 / onednn_s,
        1 / mkl_s,
        "F.linear (MKL)",
        "steps/s",
        1.0,
    )
    result.figure(
        "packed vs F.linear: max |logit difference|", float((logits[0] - logits[1]).abs().max()), ""
    )


def bench_attention(model: CausalLM, ids: list[int], result: BenchResult, quick: bool) -> None:
    """Full layers' attention over the pool in place (shared/kernels/cpu/paged_attention.c) against
    the SDPA path (a gather of the prefix, SDPA's flash kernel twice, a merge): a whole warm
    step, then one layer alone at deeper contexts (not in quick mode)."""
    runners = [
        ModelRunner(model, num_blocks=64, block_size_tokens=BLOCK_SIZE_TOKENS, paged_kernel=kernel)
        for kernel in (False, True)
    ]
    if not paged_attention_serves(runners[1].pool):
        result.note(
            "attention: shared/kernels/cpu/paged_attention.c does not serve this pool here "
            "(it needs AVX-512F, float32 and 64-token blocks); skipped"
        )
        return
    num_new, num_cached, (sdpa_s, kernel_s), logits = warm_steps(
        runners, ids, model.config.max_position_embeddings
    )
    result.ratio(
        f"warm-step prefill, {num_new} tokens after {num_cached}: attention over the "
        "pool in place vs SDPA",
        1 / kernel_s,
        1 / sdpa_s,
        "SDPA flash + merge",
        "steps/s",
        1.0,
    )
    result.figure(
        "attention in place vs SDPA: max |logit difference|",
        float((logits[0] - logits[1]).abs().max()),
        "",
    )
    if quick:
        return
    cfg = model.config
    for num_cached in (1600, 8000):
        pool = runners[1].pool.__class__(runners[1].layout, -(-(num_cached + num_new) // 64))
        pool.kv.normal_()
        table = torch.arange(pool.num_blocks)
        q = torch.randn(num_new, cfg.num_heads, cfg.head_dim)
        scratch = paged_attention_scratch(pool, num_cached + num_new)

        def sdpa(num_cached=num_cached, pool=pool, table=table, q=q) -> None:
            keys, values = pool.gather_blocks(0, table)
            attend_after_prefix(
                q,
                keys[:num_cached],
                values[:num_cached],
                keys[num_cached : num_cached + num_new],
                values[num_cached : num_cached + num_new],
            )

        def kernel(num_cached=num_cached, pool=pool, table=table, q=q, scratch=scratch) -> None:
            paged_attention(pool, 0, table, num_cached, q, scratch)

        times: list[list[float]] = [[], []]
        for _ in range(11):
            for side, call in enumerate((sdpa, kernel)):
                start = time.perf_counter()
                call()
                times[side].append(time.perf_counter() - start)
        sdpa_s, kernel_s = (statistics.median(t[1:]) for t in times)
        result.ratio(
            f"one layer's attention, {num_new} queries after {num_cached} keys: in place vs SDPA",
            1 / kernel_s,
            1 / sdpa_s,
            "SDPA flash + merge",
            "calls/s",
            1.0,
        )


def run(  # noqa: PLR0913
    quick: bool = False,
    *,
    model: str | None = None,
    batch_sizes: tuple[int, ...] | None = None,
    new_tokens: int | None = None,
    prefill_tokens: int | None = None,
    chunk_tokens: int = 512,
    num_threads: int = 1,
    skip_decode: bool = False,
    skip_prefill: bool = False,
    skip_hf_prefill: bool = False,
    skip_linears: bool = False,
    skip_attention: bool = False,
    block_kernel: bool = True,
) -> BenchResult:
    """Quick: batches 1 and 4 of 16 new tokens, a 1,024-token prefill."""
    args = argparse.Namespace(
        batch_sizes=batch_sizes or ((1, 4) if quick else (1, 8, 32)),
        new_tokens=new_tokens or (16 if quick else 128),
        prefill_tokens=prefill_tokens or (1024 if quick else 8192),
        chunk_tokens=chunk_tokens,
    )
    result = BenchResult("engine", quick)
    torch.set_num_threads(num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, description = resolve_model(model, Path(tmp))
        loaded = load_model(model_dir, block_kernel=block_kernel)
        formats = block_formats(loaded)
        result.note(
            f"model: {description}; float32; torch threads: {torch.get_num_threads()}; decode "
            "weights: "
            + (f"{'/'.join(formats)} blocks (shared/kernels/cpu)" if formats else "float32")
            + f"; transformers: float32{' (dequantized from the same file)' if formats else ''}"
        )
        tokenize, how = make_tokenize(model_dir, loaded.config.vocab_size)
        ids = tokenize(source_text())
        result.note(f"prompts: stdlib Python source, {how}, {len(ids)} tokens available")
        # 512 blocks of 64: batch 32 x 384 tokens needs 192; the 8K prefill test needs 258.
        runner = ModelRunner(loaded, num_blocks=512, block_size_tokens=BLOCK_SIZE_TOKENS)
        if not skip_decode:
            bench_decode(args, model_dir, runner, ids, result)
        if not skip_prefill:
            hf = None if skip_hf_prefill else load_hf(model_dir, ("sdpa",))["sdpa"]
            bench_prefix(args, runner, ids, result, hf)
        if not skip_linears:
            bench_linears(loaded, model_dir, ids, result, block_kernel)
        if not skip_attention:
            bench_attention(loaded, ids, result, quick)
    return result.finish()


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
        "--skip-linears", action="store_true", help="no oneDNN-packed vs F.linear comparison"
    )
    parser.add_argument(
        "--skip-attention",
        action="store_true",
        help="no in-place paged attention vs SDPA comparison",
    )
    parser.add_argument(
        "--no-block-kernel",
        action="store_true",
        help="decode from the float32 weights too (a GGUF model's blocks unused)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    sizes = (
        {}
        if args.quick
        else {
            "batch_sizes": tuple(int(b) for b in args.batch_sizes.split(",")),
            "new_tokens": args.new_tokens,
            "prefill_tokens": args.prefill_tokens,
        }
    )
    run(
        args.quick,
        model=args.model,
        chunk_tokens=args.chunk_tokens,
        num_threads=args.num_threads,
        skip_decode=args.skip_decode,
        skip_prefill=args.skip_prefill,
        skip_hf_prefill=args.skip_hf_prefill,
        skip_linears=args.skip_linears,
        skip_attention=args.skip_attention,
        block_kernel=not args.no_block_kernel,
        **sizes,
    ).print()


if __name__ == "__main__":
    main()
