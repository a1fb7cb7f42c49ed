"""The benchmarks `kvfabric bench` runs: a name, the module whose `run(quick)` measures it
(loadtest/results.py), and what it compares. Modules are imported only when run: several
load torch, transformers or a cluster's worth of processes."""

from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any

from loadtest.results import BenchResult, OptionError, UnknownOption


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    compares: str
    in_suite: bool = True  # False: installs another stack (a peer), kept out of CI
    has_peer_option: bool = False  # run(peer=False) measures ours alone (what CI runs)

    def run(
        self, quick: bool = False, *, peer: bool = True, options: dict[str, Any] | None = None
    ) -> BenchResult:
        """`options`: the module's own (its `run`'s keywords, what its CLI's flags set);
        UnknownOption names one it does not take."""
        module = importlib.import_module(self.module)
        options = dict(options or {})
        params = inspect.signature(module.run).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            known = set(params) - {"quick", "peer"}
            if unknown := set(options) - known:
                raise UnknownOption(
                    f"unknown option(s): {', '.join(sorted(unknown))}; "
                    f"known: {', '.join(sorted(known))}"
                )
            hints = typing.get_type_hints(module.run)
            options = {k: _as_hinted(k, v, hints.get(k)) for k, v in options.items()}
        if self.has_peer_option:
            return module.run(quick=quick, peer=peer, **options)
        if not peer:
            raise ValueError(f"{self.name} has no peer to leave out")
        return module.run(quick=quick, **options)


def _as_hinted(name: str, value: Any, hint: Any) -> Any:
    """A `--set` value for a keyword typed `tuple[T, ...]`: its comma-separated items as Ts
    (`--set models=tiny-coder,SmolLM2-135M-Instruct`, `--set batch-sizes=1,8`); any other
    value as it came."""
    candidates = (hint, *typing.get_args(hint))  # the hint, or the members of `X | None`
    tuple_hint = next((h for h in candidates if typing.get_origin(h) is tuple), None)
    if tuple_hint is None or isinstance(value, tuple):
        return value
    item_type = typing.get_args(tuple_hint)[0]
    try:
        return tuple(item_type(item.strip()) for item in str(value).split(",") if item.strip())
    except ValueError:
        raise OptionError(
            f"{name}: {value!r} is not a comma-separated list of {item_type.__name__}"
        ) from None


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark(
            "bus",
            "loadtest.bench_bus",
            "request/reply and events through shared.bus against raw nats-py",
        ),
        Benchmark(
            "engine",
            "loadtest.bench_engine",
            "decode and prefill tokens/s against transformers on the same weights; "
            "oneDNN-packed linear layers against F.linear; attention over the pool in "
            "place against SDPA",
        ),
        Benchmark(
            "kv",
            "loadtest.bench_kv",
            "store GB/s against raw file I/O; NIXL transfers against memcpy",
        ),
        Benchmark(
            "connector",
            "loadtest.bench_connector",
            "vLLM's paged cache to and from store payloads (its CPU layout here, its "
            "GPU layout on a GPU) and a load from the store's files, against one copy "
            "of as many bytes",
        ),
        Benchmark(
            "kv-index",
            "loadtest.bench_kv_index",
            "match latency, ingest and memory against NVIDIA Dynamo's indexer "
            "(its own venv, built on demand)",
            has_peer_option=True,
        ),
        Benchmark(
            "prefix",
            "loadtest.bench_prefix_reuse",
            "prefill time and TTFT after a cached prefix against the ideal 1/(1-h)",
        ),
        Benchmark(
            "spec",
            "loadtest.bench_spec_decode",
            "tokens/s with prompt-lookup drafts against without",
        ),
        Benchmark(
            "tokenize",
            "loadtest.bench_tokenize",
            "segment-cached chat tokenization against tokenizing the whole text",
        ),
        Benchmark(
            "ingress", "loadtest.bench_ingress", "HTTP ingress against calling the router directly"
        ),
        Benchmark(
            "observability",
            "loadtest.bench_observability",
            "requests/s and p50 with tracing (1% and 100%) and metrics scraped against neither",
        ),
        Benchmark(
            "limits",
            "loadtest.bench_limits",
            "rate limits: two ingress replicas offered 3x a limit against the limit; a "
            "request's bus round trip with the limiter against without",
        ),
        Benchmark(
            "ledger",
            "loadtest.bench_ledger",
            "usage records into the ledger against a bare batched INSERT",
        ),
        Benchmark(
            "agent",
            "loadtest.bench_agent",
            "coding-agent sessions over HTTP: warm steps against the cold first step",
        ),
        Benchmark(
            "fairness",
            "loadtest.bench_fairness",
            "agent sessions at twice FCFS's saturation: short and long sessions' TTFT p99 "
            "and throughput with the fair prefill queue against first come, first served",
        ),
        Benchmark(
            "staging",
            "loadtest.bench_staging",
            "agent sessions on SmolLM2 whose steps end in tool calls: the next turn's TTFT "
            "with the session staged on its prefill worker over the tool's run against without",
        ),
        Benchmark(
            "faults",
            "loadtest.bench_faults",
            "per fault under agent load: requests failed, time to full service, usage lost; "
            "kv-index's restart from its snapshot against replaying its whole log",
        ),
        Benchmark(
            "peers",
            "loadtest.bench_peers",
            "the agent workload against vLLM (CPU build, its own venv) on the same "
            "SmolLM2 weights, for kvfabric's engine and for kvfabric with vLLM workers: "
            "warm TTFT, TTFT after a restart and on another worker, decode tokens/s",
            in_suite=False,
        ),
        Benchmark(
            "trace",
            "loadtest.bench_trace",
            "the production trace: our routing's hit rate against the upper bound "
            "and other policies",
        ),
    )
}


def get(name: str) -> Benchmark:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise KeyError(f"no benchmark {name!r}; known: {', '.join(BENCHMARKS)}") from None
