"""Prefix reuse through the whole cluster: the same 8K-token prompts cold and at a 96% hit.

    python -m loadtest.bench_prefix_reuse [--models tiny-coder SmolLM2-135M-Instruct]
                                          [--context 8192] [--hit 0.96] [--prompts 3]

Brings up kv-index, swa-memcache, router, one prefill and one decode worker per model (real
store files, NIXL handoff) on free ports. For each prompt (tokenized source files of this
repository): a warm-up request stores its first `hit` fraction (whole blocks); then the full
prompt runs cold (a fresh cache salt: nothing hits) and warm (the stored prefix hits), side by
side, one token of output each. Reported per model, as medians over the prompts: the prefill
time ratio cold/warm (prefill time = load + sliding-window restore + compute, what the
prefill worker spends) and the end-to-end TTFT ratio as the caller saw it, each against the
ideal 1/(1-h) (goal: >= 0.85 of it); per prompt, the split and the NIXL handoff, as notes.

The ideal counts tokens; the arithmetic does not scale with them alone: each of the warm
step's new tokens still attends to every cached key in the full-attention layers. The cold
prompt's FLOPs over the warm step's (`prefill_flops`, from the model's config) is what an
engine running both at the same FLOP rate would gain; it is printed beside the ideal, and
the measured prefill ratio against it (above 1: the warm step ran at a higher FLOP rate).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path

from tokenizers import Tokenizer

from loadtest.results import BenchResult
from services.admin.launcher import Cluster, ClusterSpec
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.models import model_path, served_name
from shared.subjects import DECODE, PREFILL
from shared.testing import unique_root
from worker.engine.checkpoint import Checkpoint
from worker.engine.config import FULL, ModelConfig

BLOCK = 64
REPO = Path(__file__).resolve().parents[1]


def corpus_tokens(tokenizer: Tokenizer, num_tokens: int, offset: int) -> list[int]:
    """`num_tokens` tokens of this repository's Python sources, starting at file `offset`."""
    files = [
        p for top in ("shared", "worker", "services") for p in sorted(REPO.glob(f"{top}/**/*.py"))
    ]
    ids: list[int] = []
    for path in files[offset:] + files[:offset]:
        ids += tokenizer.encode(path.read_text()).ids
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise SystemExit(f"the repository has fewer than {num_tokens} tokens of Python")


def prefill_flops(config: ModelConfig, num_cached: int, num_new: int) -> float:
    """Multiply-adds x 2 of computing tokens [num_cached, num_cached + num_new) after the
    cached ones: the linear layers per token, attention per (token, key it attends: every
    earlier one in a full layer, the last `sliding_window` in a sliding one), and the last
    token's logits. Norms, RoPE and activations are left out (a few percent)."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    per_token += 3 * c.hidden_size * c.intermediate_size
    flops = 2.0 * num_new * per_token * c.num_layers + 2.0 * c.hidden_size * c.vocab_size

    def keys(num_tokens: int, window: int | None) -> int:
        """Keys attended by tokens 0..num_tokens-1, causally, within `window`."""
        if window is None or num_tokens <= window:
            return num_tokens * (num_tokens + 1) // 2
        return window * (window + 1) // 2 + (num_tokens - window) * window

    end = num_cached + num_new
    per_key = 4.0 * c.num_heads * c.head_dim  # q.k and p.v, 2 each per dimension
    for layer_type in c.layer_types:
        window = None if layer_type == FULL else c.sliding_window
        flops += per_key * (keys(end, window) - keys(num_cached, window))
    return flops


def prefill_ms(result: GenerateResult) -> tuple[float, dict[str, float]]:
    assert result.stats is not None
    p = result.stats.prefill
    split = {
        "load": p.load_ms,
        "restore": p.restore_ms,
        "compute": p.compute_ms,
        "transfer": p.transfer_ms,
    }
    return p.load_ms + p.restore_ms + p.compute_ms, split


async def measure(
    models: tuple[str, ...], context: int, hit: float, num_prompts: int, result: BenchResult
) -> None:
    # Room for the prompt and its one token: the handoff staging is sized for that length
    # (2.8 MiB a block for SmolLM2).
    worker_args = [
        "--num-kv-blocks",
        str(2 * context // BLOCK + 64),
        "--max-model-len",
        str(context + 2 * BLOCK),
    ]
    spec = ClusterSpec(
        state_dir=Path(tempfile.mkdtemp(prefix="kvf-bench-")),
        nats_port=0,
        http_port=0,
        root=unique_root(),
        extra_args={PREFILL: worker_args, DECODE: worker_args},
        log_level="warning",
        models=models,
    )
    cluster = Cluster(spec)
    cluster.start()
    bus = None
    try:
        bus = await Bus.connect(
            cluster.nats_url, service="bench", root=spec.root, creds=cluster.nats_creds
        )
        await cluster.wait_ready(bus, timeout_s=300)
        num_cached = round(context * hit / BLOCK) * BLOCK
        ideal = 1 / (1 - num_cached / context)
        result.note(
            f"context {context} tokens, {num_cached} cached "
            f"({num_cached / context:.1%}): ideal speedup {ideal:.1f}x"
        )
        for name in models:
            await one_model(bus, name, context, num_cached, ideal, num_prompts, result)
    finally:
        if bus is not None:
            await bus.close()
        cluster.stop()


async def one_model(
    bus: Bus,
    name: str,
    context: int,
    num_cached: int,
    ideal: float,  # noqa: PLR0913
    num_prompts: int,
    result: BenchResult,
) -> None:
    checkpoint = Checkpoint(model_path(name))
    tokenizer = checkpoint.tokenizer()
    model = served_name(name)
    config = checkpoint.config()
    ratios, ttft_ratios = [], []
    for i in range(num_prompts):
        prompt = corpus_tokens(tokenizer, context, offset=7 * i)

        def request(tokens: list[int], salt: str = ""):  # noqa: ANN202
            return build_request(
                tokens, model=model, block_size_tokens=BLOCK, max_tokens=1, cache_salt=salt
            )

        await generate(bus, request(prompt[: num_cached + 1]))  # stores the prefix
        await asyncio.sleep(0.3)  # kv-index applies the event log asynchronously
        cold = await generate(bus, request(prompt, salt=uuid.uuid4().hex))
        warm = await generate(bus, request(prompt))
        assert warm.usage is not None and cold.usage is not None
        cold_ms, cold_split = prefill_ms(cold)
        warm_ms, warm_split = prefill_ms(warm)
        ratio, ttft_ratio = cold_ms / warm_ms, (cold.ttft_s or 0) / (warm.ttft_s or 1)
        ratios.append(ratio)
        ttft_ratios.append(ttft_ratio)
        restore = warm.stats.prefill.swa_restore if warm.stats else "?"
        result.note(
            f"{model} prompt {i}: prefill {cold_ms:.1f} -> {warm_ms:.1f} ms (hit "
            f"{warm.usage.num_cached_tokens}, window by {restore}), TTFT "
            f"{(cold.ttft_s or 0) * 1000:.1f} -> {(warm.ttft_s or 0) * 1000:.1f} ms; split ms "
            "cold "
            + " ".join(f"{k} {v:.1f}" for k, v in cold_split.items())
            + "; warm "
            + " ".join(f"{k} {v:.1f}" for k, v in warm_split.items())
        )
        print(
            f"{model} prompt {i}: prefill speedup {ratio:.1f}x, TTFT {ttft_ratio:.1f}x", flush=True
        )
    result.ratio(
        f"{model}: prefill time cold / warm",
        statistics.median(ratios),
        ideal,
        "the ideal 1 / (1 - h)",
        "x",
        0.85,
    )
    result.ratio(
        f"{model}: TTFT cold / warm",
        statistics.median(ttft_ratios),
        ideal,
        "the ideal 1 / (1 - h)",
        "x",
        0.85,
    )
    cold_flops = prefill_flops(config, 0, context)
    arithmetic = cold_flops / prefill_flops(config, num_cached, context - num_cached)
    result.ratio(
        f"{model}: FLOPs cold / warm (the same FLOP rate both ways)",
        arithmetic,
        ideal,
        "the ideal 1 / (1 - h)",
        "x",
    )
    result.ratio(
        f"{model}: prefill time cold / warm, against the FLOPs' ratio",
        statistics.median(ratios),
        arithmetic,
        "FLOPs cold / warm",
        "x",
    )


def run(
    quick: bool = False,
    *,
    models: tuple[str, ...] | None = None,
    context: int | None = None,
    hit: float = 0.96,
    prompts: int | None = None,
) -> BenchResult:
    """Quick: tiny-coder alone, a 1,024-token context, one prompt."""
    result = BenchResult("prefix", quick)
    models = models or (("tiny-coder",) if quick else ("tiny-coder", "SmolLM2-135M-Instruct"))
    asyncio.run(
        measure(
            models,
            context or (1024 if quick else 8192),
            hit,
            prompts or (1 if quick else 3),
            result,
        )
    )
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=None, help="default 8192 (quick: 1024)")
    parser.add_argument("--hit", type=float, default=0.96)
    parser.add_argument("--prompts", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--models", nargs="+", default=None, help="names (kvfabric models list); default: both"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    run(
        args.quick,
        models=tuple(args.models) if args.models else None,
        context=args.context,
        hit=args.hit,
        prompts=args.prompts,
    ).print()


if __name__ == "__main__":
    main()
