"""Prefix reuse through the whole cluster: the same 8K-token prompts cold and at a 96% hit.

    python -m loadtest.bench_prefix_reuse [--model tiny-coder] [--context 8192] [--hit 0.96]
                                          [--prompts 3]

Brings up kv-index, swa-memcache, router, one prefill and one decode worker (the bundled
model, real store files, NIXL handoff) on free ports. For each prompt (tokenized source files
of this repository): a warm-up request stores its first `hit` fraction (whole blocks); then
the full prompt runs cold (a fresh cache salt: nothing hits) and warm (the stored prefix
hits), side by side, one token of output each. Reported per run: prefill time = load +
sliding-window restore + compute (what the prefill worker spends), its split, the NIXL
handoff, and TTFT as the caller saw it; the speedup cold/warm against the ideal 1/(1-h).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path

from tokenizers import Tokenizer

from services.admin.launcher import Cluster, ClusterSpec
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.engine.checkpoint import Checkpoint
from shared.models import model_path, served_name
from shared.subjects import DECODE, PREFILL
from shared.testing import unique_root

BLOCK = 64
REPO = Path(__file__).resolve().parents[1]


def corpus_tokens(tokenizer: Tokenizer, num_tokens: int, offset: int) -> list[int]:
    """`num_tokens` tokens of this repository's Python sources, starting at file `offset`."""
    files = sorted(REPO.glob("shared/**/*.py")) + sorted(REPO.glob("services/**/*.py"))
    ids: list[int] = []
    for path in files[offset:] + files[:offset]:
        ids += tokenizer.encode(path.read_text()).ids
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise SystemExit(f"the repository has fewer than {num_tokens} tokens of Python")


def prefill_ms(result: GenerateResult) -> tuple[float, dict[str, float]]:
    assert result.stats is not None
    p = result.stats.prefill
    split = {"load": p.load_ms, "restore": p.restore_ms, "compute": p.compute_ms,
             "transfer": p.transfer_ms}  # fmt: skip
    return p.load_ms + p.restore_ms + p.compute_ms, split


async def run(args: argparse.Namespace) -> None:
    tokenizer = Checkpoint(model_path(args.model)).tokenizer()
    model = served_name(args.model)
    # Room for the prompt and its one token: the handoff staging is sized for that length
    # (2.8 MiB a block for SmolLM2).
    worker_args = ["--num-kv-blocks", str(2 * args.context // BLOCK + 64),
                   "--max-model-len", str(args.context + 2 * BLOCK)]  # fmt: skip
    spec = ClusterSpec(
        state_dir=Path(tempfile.mkdtemp(prefix="kvf-bench-")), nats_port=0, http_port=0,
        root=unique_root(), extra_args={PREFILL: worker_args, DECODE: worker_args},
        log_level="warning", models=(args.model,),
    )  # fmt: skip
    cluster = Cluster(spec)
    cluster.start()
    bus = None
    try:
        bus = await Bus.connect(cluster.nats_url, service="bench", root=spec.root)
        await cluster.wait_ready(bus, timeout_s=180)
        num_cached = round(args.context * args.hit / BLOCK) * BLOCK
        ideal = 1 / (1 - num_cached / args.context)
        share = num_cached / args.context
        print(f"context {args.context} tokens, {num_cached} cached ({share:.1%}), "
              f"ideal speedup {ideal:.1f}x")  # fmt: skip
        ratios, ttft_ratios = [], []
        for i in range(args.prompts):
            prompt = corpus_tokens(tokenizer, args.context, offset=7 * i)

            def request(tokens: list[int], salt: str = ""):  # noqa: ANN202
                return build_request(tokens, model=model, block_size_tokens=BLOCK, max_tokens=1,
                                     cache_salt=salt)  # fmt: skip

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
            print(f"prompt {i}: cold {cold_ms:7.1f} ms  warm {warm_ms:6.1f} ms "
                  f"(hit {warm.usage.num_cached_tokens}, window by {restore})  "
                  f"speedup {ratio:5.1f}x = {ratio / ideal:.2f} of ideal; "
                  f"TTFT {(cold.ttft_s or 0) * 1000:7.1f} -> {(warm.ttft_s or 0) * 1000:6.1f} ms "
                  f"({ttft_ratio:.1f}x)")  # fmt: skip
            print("   split ms  cold " + "  ".join(f"{k} {v:.1f}" for k, v in cold_split.items()))
            print("             warm " + "  ".join(f"{k} {v:.1f}" for k, v in warm_split.items()))
        median = statistics.median(ratios)
        print(f"median prefill speedup {median:.1f}x = {median / ideal:.2f} of the ideal "
              f"{ideal:.1f}x (target >= {args.target}); median TTFT ratio "
              f"{statistics.median(ttft_ratios):.1f}x")  # fmt: skip
    finally:
        if bus is not None:
            await bus.close()
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--hit", type=float, default=0.96)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--model", default="tiny-coder", help="a name (kvfabric models list)")
    parser.add_argument(
        "--target", type=float, default=0.8, help="the fraction of the ideal to report against"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
