"""Connector benchmark: whole blocks between vLLM's paged cache and the store's payloads
(services.vllm_worker.connector), against a plain copy of as many bytes, side by side in one run.

    python -m loadtest.bench_connector [--device cpu|cuda] [--model smollm2|llama-8b]
                                       [--blocks 30] [--rounds 5] [--json FILE]

- scatter (a load): payloads in host memory (pinned, for a GPU) into n of the cache's
  blocks, in vLLM's layout for that device (`vec` on a CPU, `flash` on a GPU, in vLLM's GPU
  memory order), against one copy of the same bytes from the same host buffer into one
  contiguous tensor on the cache's device (memcpy on a CPU; host-to-device on a GPU);
- gather (a save): n blocks into host payloads, against one copy of as many bytes back;
- load from the store: `BlockLoader` reading the n slots from the store's files (checked:
  header, hash, checksum) and scattering them, against reading the same files' bytes into
  the host buffer and one copy to the device. The files were just written: the reads come
  from the page cache, so this measures memory and checks, not the disk (bench kv does).

Shapes: `smollm2` (30 layers, 3 KV heads of 64, float32: what the vllm-worker runs here),
`llama-8b` (32 layers, 8 KV heads of 128, bfloat16: a GPU deployment's). By default,
SmolLM2 on a CPU and Llama-8B on a GPU. Medians of `rounds`, ours and the copy taken in
turn in each round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loadtest.results import BenchResult, bench_options
from services.vllm_worker.connector.layout import VllmBlockConverter
from services.vllm_worker.connector.loading import PART_BYTES, BlockLoader
from services.vllm_worker.connector.loop import LoopThread
from worker.kvstore.slots import SlotRef
from worker.kvstore.store import KvStore, KvStoreConfig

BLOCK = 64  # tokens, the store's
MODELS = {  # layers, KV heads, head dim, dtype
    "smollm2": (30, 3, 64, torch.float32),
    "llama-8b": (32, 8, 128, torch.bfloat16),
}


def make_caches(model: str, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """vLLM's per-layer caches, [blocks, heads, B, 2 * D], as it allocates them on `device`."""
    layers, heads, dim, dtype = MODELS[model]
    if device.type == "cpu":  # its CPU backend: contiguous
        shape, order = (num_blocks, heads, BLOCK, 2 * dim), (0, 1, 2, 3)
    else:  # its GPU backends: [blocks, B, heads, 2 * D] in memory (LBNHC)
        shape, order = (num_blocks, BLOCK, heads, 2 * dim), (0, 2, 1, 3)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, device=device)
        .to(dtype)
        .permute(order)
        for i in range(layers)
    }


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure_moves(converter: VllmBlockConverter, n: int, rounds: int, result: BenchResult) -> None:
    device, layout = converter.device, converter.layout
    pinned = device.type == "cuda"
    payloads = torch.randn((n, *layout.block_shape)).to(layout.dtype)
    payloads = payloads.pin_memory() if pinned else payloads
    flat = torch.empty(payloads.numel(), dtype=layout.dtype, device=device)
    back = torch.empty_like(payloads).pin_memory() if pinned else torch.empty_like(payloads)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randperm(converter.num_blocks, generator=generator)[:n].tolist()
    scatter, copy_in, gather, copy_out = [], [], [], []
    gathered: list[torch.Tensor] = []
    for _ in range(rounds + 1):  # the first round warms both up
        scatter.append(timed(lambda: converter.scatter(targets, payloads), device))
        copy_in.append(timed(lambda: flat.copy_(payloads.view(-1)), device))
        gathered.clear()
        gather.append(timed(lambda: gathered.append(converter.gather(targets)), device))
        copy_out.append(timed(lambda: back.view(-1).copy_(flat), device))
    if not torch.equal(gathered[0], payloads):
        raise AssertionError("gather did not give back the scattered payloads")
    nbytes = payloads.numel() * payloads.element_size()
    peer = "host-to-device copy" if pinned else "memcpy"
    result.ratio(
        f"scatter {n} blocks ({nbytes / 1e6:,.0f} MB)",
        median_gbps(nbytes, scatter[1:]),
        median_gbps(nbytes, copy_in[1:]),
        f"one {peer}",
        "GB/s",
    )
    peer = "device-to-host copy" if pinned else "memcpy"
    result.ratio(
        f"gather {n} blocks",
        median_gbps(nbytes, gather[1:]),
        median_gbps(nbytes, copy_out[1:]),
        f"one {peer}",
        "GB/s",
    )


def measure_load(  # noqa: PLR0913
    converter: VllmBlockConverter,
    n: int,
    rounds: int,
    part_bytes: int,
    workdir: Path,
    result: BenchResult,
) -> None:
    device, layout = converter.device, converter.layout
    loop = LoopThread("bench-connector")
    config = KvStoreConfig(
        root_dir=workdir,
        writer_id="bench",
        payload_nbytes=layout.block_nbytes,
        capacity_bytes=4 * n * layout.block_nbytes,
        file_nbytes=max(1 << 26, n * layout.block_nbytes),
        backend="aiofiles",
    )
    store = KvStore.open(config)
    try:
        payloads = torch.randn((n, *layout.block_shape)).to(layout.dtype)
        raw = payloads.view(torch.uint8).numpy().reshape(n, -1)
        written = loop.call(
            store.write_blocks([(7000 + i, memoryview(raw[i])) for i in range(n)]), timeout_s=600
        )
        refs = [SlotRef(s.block_hash, "bench", s.file_id, s.slot, s.generation) for s in written]
        loader = BlockLoader(store, converter, loop, part_bytes=part_bytes)
        files = sorted((workdir / "bench").glob("*.kvs"))
        nbytes = n * layout.block_nbytes
        pinned = device.type == "cuda"
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        targets = list(range(n))

        def read_and_copy() -> None:  # the peer: the files' bytes, then one copy
            view, done = memoryview(buffer.numpy()), 0
            for path in files:
                with path.open("rb", buffering=0) as f:
                    while done < nbytes and (got := f.readinto(view[done:])):
                        done += got
            on_device.copy_(buffer)

        ours, peer = [], []
        loaded = []
        for _ in range(rounds + 1):
            ours.append(timed(lambda: loaded.append(loader.load(refs, targets, "bench")), device))
            peer.append(timed(read_and_copy, device))
        if loaded[-1].num_blocks != n or not torch.equal(converter.gather(targets), payloads):
            raise AssertionError(f"loaded {loaded[-1].num_blocks} of {n} blocks, or not these")
        result.ratio(
            f"load {n} blocks from the store",
            median_gbps(nbytes, ours[1:]),
            median_gbps(nbytes, peer[1:]),
            "read the files + one copy",
            "GB/s",
        )
        last = loaded[-1]  # where the load's time went: reads not hidden, and scatters
        result.figure("load: waiting for reads", last.read_s * 1000, "ms")
        result.figure("load: scattering", last.scatter_s * 1000, "ms")
        result.note(f"load in parts of {loader.blocks_per_part} blocks, through two buffers")
    finally:
        store.close()
        loop.stop()


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: device (cpu, cuda; default cuda where there is one), model (smollm2,
    llama-8b; default by device), blocks, rounds, dir, part_mb (the loader's part, MiB).
    Quick: 4 blocks, 2 rounds."""
    defaults = {
        "device": None,
        "model": None,
        "blocks": 30,
        "rounds": 5,
        "dir": None,
        "part_mb": PART_BYTES >> 20,
    }
    args = bench_options(defaults, options, {"blocks": 4, "rounds": 2} if quick else None)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model or ("smollm2" if device.type == "cpu" else "llama-8b")
    if model not in MODELS:
        raise ValueError(f"model {model!r}: known are {', '.join(MODELS)}")
    n, rounds = int(args.blocks), int(args.rounds)
    result = BenchResult("connector", quick)
    converter = VllmBlockConverter.of(
        make_caches(model, 2 * n, device), BLOCK, "vec" if device.type == "cpu" else "flash"
    )
    layout = converter.layout
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result.note(
        f"{model} on {where}: {layout.num_full_layers} layers x {layout.num_kv_heads} "
        f"KV heads x {layout.head_dim}, {layout.dtype}; a block is "
        f"{layout.block_nbytes / 1e6:.2f} MB; {converter.head.name!r} layout"
    )
    measure_moves(converter, n, rounds, result)
    with tempfile.TemporaryDirectory(prefix="bench-connector-", dir=args.dir) as workdir:
        measure_load(converter, n, rounds, int(args.part_mb) << 20, Path(workdir), result)
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--model", choices=tuple(MODELS))
    parser.add_argument("--blocks", type=int, help="blocks moved each time (default 30)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5)")
    parser.add_argument("--part-mb", type=int, help="the loader's part, MiB (default 64)")
    parser.add_argument("--dir", help="where the store's files go (default: the temp dir)")
    parser.add_argument("--json", type=Path, help="write the result here too")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = vars(parser.parse_args())
    quick, json_path = args.pop("quick"), args.pop("json")
    result = run(quick, **{k: v for k, v in args.items() if v is not None})
    result.print()
    if json_path:
        result.write_json(json_path)


if __name__ == "__main__":
    main()
