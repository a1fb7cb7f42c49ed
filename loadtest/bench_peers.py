"""Peer benchmark: vLLM's CPU build against kvfabric serving SmolLM2-135M-Instruct (the same
weights: vLLM loads services.vllm_worker.vllm_env's export of our GGUF), under the same agent
workload through the same client, side by side in one run. Three sides:
(a) vLLM alone, with its own prefix caching; (b) kvfabric with two vLLM workers, kvfabric's
store as their KV connector; (c) kvfabric on its own engine (a prefill and a decode worker).

    python -m loadtest.bench_peers [--quick] [--sessions 3] [--steps 5] [--context 1024]
                                   [--gap-s 1.5] [--mode interleaved|alone|together]
                                   [--no-vllm-workers] [--no-move]

The workload: agent sessions, each step re-sending the whole conversation (a shared system
prompt, a task with a slice of stdlib Python source, then per step the model's answer and a
tool result of `--growth` tokens), streamed through `openai.AsyncOpenAI` at temperature 0.
Each timed request at batch 1 starts after `--gap-s` of quiet (vLLM's engine busy-polls a
core for 1 s after each step). `--mode`:
- `interleaved` (the default): every side is started first (one after another) and stays
  up; each step goes to every side in turn, the order rotating from one step to the next,
  and while one side runs, every process of the others is stopped (SIGSTOP; SIGCONT before
  its own turn, its quiet gap counted after it). A change in the load of this shared machine
  then falls on every side alike, step by step, and no side runs beside the others' idle
  processes.
- `alone`: one side at a time, as a user would deploy it: started, driven through the whole
  measurement, stopped; then the next. The sides' medians are minutes apart: on this VM a
  side's median moved ~10% from one run to the next (docs/benchmarks.md).
- `together`: as `interleaved`, the others' processes left running (idle, they used 35-92
  ms of CPU a second, and every side's times to first token were 6-65% above those of the
  runs one side at a time in the one such run, 2026-12-03).
Measured:
- TTFT of each session's first step (cold) and of its later steps (warm: the previous
  step's prompt and answer are cached), and decode tokens/s after the first token, at
  batch 1 (one session at a time);
- as many sessions again, driven the same way (their steps count as cold and warm too), take
  one more step each before any restart: the step the others will take after it, on
  workers that kept their cache (`same_step_warm`). Against it, the step after a restart
  shows what the restart itself costs; vLLM's own is the best any KV connector could give
  a restarted vLLM;
- then every side's model workers restart, one side after another (vLLM: the server
  process, whose prefix cache is in its memory; kvfabric: the worker processes, whose KV is
  in the SSD store) and each session's next step is timed: TTFT after a restart;
- (a) and (b): the sessions move to another worker for one more step each (vLLM: a second
  server, started after the first stops; kvfabric + vLLM workers: the worker that served them
  is stopped and the router sends them to the other): TTFT on another worker;
- requests/s with `--concurrency` fresh sessions at once (`--think-s` between a session's
  steps), one side at a time; a request that fails there is counted, with its error, and
  ends its session (the run goes on).
In `interleaved` mode every vLLM gets a step deadline of a day
(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, unless set): vLLM's 300 s counts the minutes a side
spends stopped, and a side stopped mid-step for longer found its engine dead when resumed.
A line per step goes to stderr as the run goes. A run that fails, or one where a request
failed, keeps its clusters' logs (their state directories are temporary) and says where.
Targets: (c) against (a): warm-step TTFT <= 1x, after a restart <= 0.2x (vLLM's >= 5x ours),
decode tokens/s >= 0.8x. (b) against (a): warm-step TTFT <= 1.1x; after the restart and on
another worker <= 0.2x.

The sessions are driven here (`drive`), not by loadtest.agent's runner: a restart must fall
between two steps of a session. This 2-core machine is shared: only ratios from the same run
mean anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai

from loadtest.peers.vllm import leading_agreement
from loadtest.results import BenchResult, bench_options
from services.admin.launcher import Child, Cluster, ClusterSpec
from services.vllm_worker.vllm_env import VllmServer, ensure_vllm, export_checkpoint
from shared.bus import Bus
from shared.discovery import discover
from shared.models import model_path
from shared.natsd import die_with_parent
from shared.subjects import BILLING, DECODE, PREFILL, VLLM_WORKER
from shared.testing import unique_root
from shared.venvs import venvs_dir
from worker.engine.checkpoint import Checkpoint

MODEL = "SmolLM2-135M-Instruct"
KEY = "kvf-bench-peers-key"
SYSTEM = (
    "You are a coding agent working in a Python repository. Read the code and tool output "
    "you are given, then answer with the next change to make, as a short code block."
)
STDLIB_FILES = ("argparse.py", "dataclasses.py", "pathlib.py", "inspect.py", "typing.py")
PROBE = [{"role": "user", "content": "Say hi."}]  # untimed; shares no prefix with the sessions
VLLM_KV_CACHE_BYTES = 2 << 30  # every vLLM's (the workers' default): three stacks share the RAM
OURS, WORKERS, PEER = "kvfabric", "kvfabric + vLLM workers", "vLLM"
MODES = ("interleaved", "alone", "together")  # see the module's docstring
VLLM_STEP_DEADLINE_S = 86400  # replaces vLLM's 300 s in interleaved runs: `_vllm_step_deadline`


@dataclass(frozen=True)
class Session:
    task: str
    tool_results: tuple[str, ...]

    def messages(self, answers: list[str]) -> list[dict[str, str]]:
        out = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task}]
        for answer, result in zip(answers, self.tool_results, strict=False):
            out += [{"role": "assistant", "content": answer}, {"role": "user", "content": result}]
        return out


def make_sessions(num: int, num_steps: int, context: int, growth: int) -> list[Session]:
    """Sessions of stdlib source: a task of `context` tokens, `num_steps - 1` tool results of
    `growth` tokens each; session i's text is the i-th of `num` equal slices of the corpus,
    so no two share text (the system prompt apart)."""
    tokenizer = Checkpoint(model_path(MODEL)).tokenizer()
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids = tokenizer.encode("\n".join((lib / f).read_text() for f in STDLIB_FILES)).ids
    per_session = context + (num_steps - 1) * growth
    stride = len(ids) // num
    if per_session > stride:
        raise ValueError(
            f"{num} sessions of {per_session} tokens need more than the "
            f"{len(ids)} tokens of {', '.join(STDLIB_FILES)}"
        )
    sessions = []
    for index in range(num):
        piece = ids[index * stride : index * stride + per_session]
        task = "Fix the bug in this module:\n" + tokenizer.decode(piece[:context])
        results = tuple(
            "Tool output (read_file):\n"
            + tokenizer.decode(piece[context + k * growth : context + (k + 1) * growth])
            for k in range(num_steps - 1)
        )
        sessions.append(Session(task, results))
    return sessions


@dataclass
class Step:
    ttft_s: float
    e2e_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def decode_s(self) -> float:
        return self.e2e_s - self.ttft_s


async def send(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int) -> Step:
    """One streamed chat completion, timed from the call to the first text and to the end."""
    sent = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, text, usage = None, "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter()
            text += delta
        usage = chunk.usage or usage
    done = time.perf_counter()
    if first is None or usage is None:
        raise RuntimeError(f"a stream without {'text' if first is None else 'usage'}")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return Step(
        first - sent, done - sent, text, usage.prompt_tokens, cached, usage.completion_tokens
    )


@dataclass
class SideResult:
    cold: list[Step] = field(default_factory=list)
    warm: list[Step] = field(default_factory=list)
    after_restart: list[Step] = field(default_factory=list)
    # The step after_restart's sessions take, taken by the control sessions before any
    # restart (their workers' caches intact).
    same_step_warm: list[Step] = field(default_factory=list)
    moved: list[Step] = field(default_factory=list)  # the next step on another worker
    restart_s: float = 0.0  # until the first request after the restart was answered
    requests_per_s: float = 0.0  # answered ones
    # The concurrent phase's failed requests (each ends its session), as the client saw them.
    errors: list[str] = field(default_factory=list)


# SideResult's lists of steps, as the progress lines name them.
PHASES = {
    "cold": "cold",
    "warm": "warm",
    "same_step_warm": "same step, no restart",
    "after_restart": "after the restart",
    "moved": "on another worker",
}


@dataclass
class Side:
    """One stack under test, started and answering: what `drive` needs of it."""

    name: str
    client: openai.AsyncOpenAI
    restart: Callable[[], Awaitable[None]]  # its model workers, until it answers again
    # Put its sessions on another worker; returns the client that reaches it (None: no move).
    move: Callable[[], Awaitable[openai.AsyncOpenAI]] | None = None
    # The processes it started, as they are now (their descendants are its too).
    processes: Callable[[], list[int]] = list
    result: SideResult = field(default_factory=SideResult)

    def pause(self) -> None:
        """Stop every process of this side (SIGSTOP), and wait until each is stopped: none
        runs while another side is timed. Twice over the tree: a child forked while the
        first pass ran is stopped by the second."""
        for _ in range(2):
            signal_tree(self.processes(), signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while any(process_state(pid) not in "TtZX" for pid in process_tree(self.processes())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes still running 5 s after SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        signal_tree(self.processes(), signal.SIGCONT)


def process_tree(roots: list[int]) -> list[int]:
    """`roots` and every live process descended from them (parents read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def process_state(pid: int) -> str:
    """/proc's one-letter state (T: stopped, Z: ended, not yet reaped); X: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def signal_tree(roots: list[int], signum: int) -> None:
    for pid in process_tree(roots):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


async def drive(sides: list[Side], args: argparse.Namespace) -> None:
    """The whole measurement (see the module's docstring) over `sides`, all up: each step is
    sent to every side in turn, the order rotating from one step to the next. Each timed
    request starts after `gap_s` of quiet (nothing else timed runs meanwhile); the concurrent
    phase runs one side at a time. `args.mode == "interleaved"`: every side but the one whose
    turn it is stays stopped (`Side.pause`), its quiet gap counted after it resumes."""
    n = args.sessions
    every = make_sessions(
        2 * n + args.concurrency,
        max(args.steps + 1, args.concurrent_steps),
        args.context,
        args.growth,
    )
    sessions, fresh = every[: 2 * n], every[2 * n :]
    restarted, controls = range(n), range(n, 2 * n)
    answers = {side.name: [[] for _ in sessions] for side in sides}
    clients = {side.name: side.client for side in sides}
    rounds = 0
    pausing = args.mode == "interleaved" and len(sides) > 1

    @asynccontextmanager
    async def turn(side: Side) -> AsyncIterator[None]:
        """`side`'s turn: the others stopped where `pausing`."""
        if pausing:
            side.resume()
        try:
            yield
        finally:
            if pausing:
                side.pause()

    async def round_of(index: int, taking: list[Side], phase: str) -> None:
        """Session `index`'s next step on each side of `taking`, one after another, into
        each side's `SideResult.<phase>`; one progress line when every side has taken it."""
        nonlocal rounds
        shift = rounds % len(taking)
        rounds += 1
        took = []
        for side in taking[shift:] + taking[:shift]:
            async with turn(side):
                await asyncio.sleep(args.gap_s)
                done = answers[side.name][index]
                step = await send(
                    clients[side.name], sessions[index].messages(done), args.max_tokens
                )
            getattr(side.result, phase).append(step)
            done.append(step.text)
            took.append(
                f"{side.name} {step.ttft_s * 1e3:,.0f} ms "
                f"({step.cached_tokens}/{step.prompt_tokens} cached)"
            )
        number = len(answers[taking[0].name][index])
        _say(
            f"session {index + 1}/{len(sessions)}, step {number} ({PHASES[phase]}), TTFT: "
            + "; ".join(took)
        )

    each = ", each step on every side in turn" if len(sides) > 1 else ""
    paused = " (the others stopped)" if pausing else ""
    _say(f"batch 1: sessions one at a time{each}{paused}")
    try:
        for side in sides:
            if pausing:
                side.pause()
        for side in sides:
            async with turn(side):  # first-use costs of the client and the server, untimed
                await send(side.client, PROBE, 4)
        for index in range(len(sessions)):
            for k in range(args.steps - 1):
                await round_of(index, sides, "warm" if k else "cold")
        for index in controls:
            await round_of(index, sides, "same_step_warm")
        for side in sides:
            _say(f"{side.name}: restarting the model workers")
            async with turn(side):
                started = time.perf_counter()
                await side.restart()
                await _until_answered(side.client)
                side.result.restart_s = time.perf_counter() - started
        for index in restarted:
            await round_of(index, sides, "after_restart")
        movers = [side for side in sides if side.move is not None]
        for side in movers:
            _say(f"{side.name}: moving the sessions to another worker")
            assert side.move is not None
            async with turn(side):
                clients[side.name] = await side.move()
                await send(clients[side.name], PROBE, 1)  # untimed: its first-use costs
        for index in restarted if movers else ():
            await round_of(index, movers, "moved")
        for side in sides:
            _say(f"{side.name}: {args.concurrency} sessions at once")
            async with turn(side):
                await asyncio.sleep(args.gap_s)
                started = time.perf_counter()
                num_done = await asyncio.gather(
                    *(_session(clients[side.name], s, args, side.result.errors) for s in fresh)
                )
                side.result.requests_per_s = sum(num_done) / (time.perf_counter() - started)
                if side.result.errors:
                    _say(
                        f"{side.name}: {len(side.result.errors)} request(s) failed at "
                        f"concurrency: {side.result.errors[0]}"
                    )
    finally:
        for side in sides:  # stopped processes would not see the SIGTERM that ends them
            if pausing:
                side.resume()


async def _session(
    client: openai.AsyncOpenAI, session: Session, args: argparse.Namespace, errors: list[str]
) -> int:
    """The session's steps answered; a failed one is added to `errors` and ends it (the
    others go on: an error there is a finding, not a reason to lose the run)."""
    answers: list[str] = []
    for index in range(args.concurrent_steps):
        if index:
            await asyncio.sleep(args.think_s)
        try:
            step = await send(client, session.messages(answers), args.max_tokens)
        except openai.APIError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            break
        answers.append(step.text)
    return len(answers)


async def _until_answered(client: openai.AsyncOpenAI, timeout_s: float = 120.0) -> None:
    """The probe until it is answered: a restarted worker may not be routed to at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await send(client, PROBE, 1)
            return
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def _say(text: str) -> None:
    print(f"[bench_peers] {text}", file=sys.stderr, flush=True)


def _client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)


@asynccontextmanager
async def vllm_side(args: argparse.Namespace, result: BenchResult) -> AsyncIterator[Side]:
    """(a) vLLM alone: restarted = its server process; moved = a second server, started
    after the first stops."""
    _say("vLLM: starting (its first start compiles the model: minutes)")
    checkpoint = export_checkpoint(MODEL)
    bind = {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_cores} if args.vllm_cores else {}
    # A KV cache of a set size, as each vLLM worker has: its default (a share of the host's
    # RAM) does not fit beside the other sides.
    servers = [
        VllmServer(
            checkpoint,
            MODEL,
            python=ensure_vllm(),
            block_size_tokens=args.block,
            dtype=args.dtype,
            env=bind,
            kv_cache_bytes=VLLM_KV_CACHE_BYTES,
            log_path=venvs_dir() / "vllm" / name,
        )
        for name in ("server.log", "server-2.log")
    ]
    server, other = servers
    async with AsyncExitStack() as stack:
        stack.callback(other.stop)
        stack.callback(server.stop)
        await asyncio.to_thread(server.start)
        how = f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_cores}" if args.vllm_cores else "its choice"
        cores = re.findall(r"core ids=\[([^\]]*)\]", server.log_tail(1 << 20))
        result.note(
            f"vLLM: ready {server.startup_s:.0f} s after start; OpenMP threads on "
            f"core(s) {cores[-1] if cores else '?'} ({how})"
        )
        client = _client(server.base_url, "unused")
        stack.push_async_callback(client.close)

        async def restart() -> None:
            await asyncio.to_thread(server.restart)

        async def move() -> openai.AsyncOpenAI:  # another vLLM: its own prefix cache, empty
            await asyncio.to_thread(server.stop)  # one engine of this side at a time
            await asyncio.to_thread(other.start)
            moved = _client(other.base_url, "unused")
            stack.push_async_callback(moved.close)
            return moved

        def processes() -> list[int]:
            return [s.process.pid for s in servers if s.process is not None]

        yield Side(PEER, client, restart, move if args.move else None, processes)


@asynccontextmanager
async def _cluster(
    spec_of: Callable[[Path], ClusterSpec], timeout_s: float, side: SideResult
) -> AsyncIterator[tuple[Cluster, Bus, openai.AsyncOpenAI, float]]:
    """A cluster of `spec_of(state_dir)` started, answering and stopped: (cluster, a bus
    client, an openai client through its ingress, seconds until it was ready). Its logs are
    kept where the run failed or `side` counted a failed request."""
    with tempfile.TemporaryDirectory(prefix="kvf-bench-peers-") as state:
        cluster = Cluster(spec_of(Path(state)))
        ended = False
        cluster.start()
        try:
            bus = await Bus.connect(
                cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
            )
            try:
                started = time.perf_counter()
                await cluster.wait_ready(bus, timeout_s=timeout_s)
                ready_s = time.perf_counter() - started
                client = _client(cluster.http_urls[0] + "/v1", KEY)
                try:
                    yield cluster, bus, client, ready_s
                    ended = True
                finally:
                    await client.close()
            finally:
                await bus.close()
        finally:
            cluster.stop()
            logs = Path(state) / "logs"
            if (not ended or side.errors) and logs.is_dir():  # they outlive the state dir
                kept = Path(tempfile.mkdtemp(prefix="kvf-bench-peers-logs-"))
                shutil.copytree(logs, kept, dirs_exist_ok=True)
                what = "requests failed" if ended else "the run failed"
                _say(f"{what}: the cluster's logs are kept in {kept}")


@asynccontextmanager
async def vllm_workers_side(args: argparse.Namespace, result: BenchResult) -> AsyncIterator[Side]:
    """(b) kvfabric's cluster with two vLLM workers (its store as their KV connector) in
    place of prefill and decode: restarted both; moved = the worker that served the sessions
    stopped."""
    _say("kvfabric + vLLM workers: starting the cluster (each worker starts a vLLM)")

    def spec_of(state: Path) -> ClusterSpec:
        return ClusterSpec(
            state_dir=state,
            nats_port=0,
            http_port=0,
            root=unique_root(),
            replicas={BILLING: 0, PREFILL: 0, DECODE: 0, VLLM_WORKER: 2},
            models=(MODEL,),
            log_level="warning",
            dev_api_key=KEY,
            extra_args={
                VLLM_WORKER: [
                    "--kv-block-size-tokens",
                    str(args.block),
                    "--dtype",
                    args.dtype,
                    "--kv-cache-bytes",
                    str(VLLM_KV_CACHE_BYTES),
                ]
            },
        )

    side = SideResult()
    async with _cluster(spec_of, 900, side) as (cluster, bus, client, ready_s):
        workers = [i for i, _ in cluster.spec.instances(VLLM_WORKER)]
        cores = []
        for instance_id in workers:
            log = (cluster.spec.state_dir / "logs" / f"{instance_id}.vllm.log").read_text()
            found = re.findall(r"core ids=\[([^\]]*)\]", log)
            cores.append(f"{instance_id} on core(s) {found[-1] if found else '?'}")
        result.note(
            f"kvfabric + vLLM workers: ready {ready_s:.0f} s after start (two vLLM "
            f"servers starting at once); OpenMP threads (vLLM's choice): "
            f"{', '.join(cores)}"
        )

        async def restart() -> None:
            for instance_id in workers:
                await asyncio.to_thread(cluster.stop_instance, instance_id)
            for instance_id in workers:
                await asyncio.to_thread(cluster.restart_instance, instance_id)
            await cluster.wait_ready(bus, timeout_s=900)

        async def move() -> openai.AsyncOpenAI:
            busiest = await _busiest_vllm_worker(bus)
            result.note(f"kvfabric + vLLM workers: moved off {busiest} (stopped)")
            await asyncio.to_thread(cluster.stop_instance, busiest)
            return client

        yield Side(
            WORKERS,
            client,
            restart,
            move if args.move else None,
            lambda: cluster_processes(cluster),
            side,
        )


async def _busiest_vllm_worker(bus: Bus) -> str:
    """The vLLM worker that ended the most requests: the one the sessions were on."""
    counted = {}
    for instance in await discover(bus, service=VLLM_WORKER):
        counted[instance.instance_id] = sum(
            v
            for k, v in instance.metrics.items()
            if k.startswith("kvfabric_vllm_worker_requests_total")
        )
    return max(sorted(counted), key=lambda i: counted[i])


@asynccontextmanager
async def kvfabric_side(args: argparse.Namespace, result: BenchResult) -> AsyncIterator[Side]:
    """(c) kvfabric on its own engine: restarted = the prefill and decode processes."""
    _say("kvfabric: starting the cluster")
    worker_args = ["--kv-block-size-tokens", str(args.block), "--dtype", args.dtype]

    def spec_of(state: Path) -> ClusterSpec:
        return ClusterSpec(
            state_dir=state,
            nats_port=0,
            http_port=0,
            root=unique_root(),
            replicas={BILLING: 0},
            models=(MODEL,),
            log_level="warning",
            dev_api_key=KEY,
            extra_args={PREFILL: worker_args, DECODE: worker_args},
        )

    side = SideResult()
    async with _cluster(spec_of, 300, side) as (cluster, bus, client, ready_s):
        threads = [
            f"{i.instance_id} {i.metadata.get('num_threads', '?')}"
            for i in await discover(bus)
            if i.service in (PREFILL, DECODE)
        ]
        result.note(
            f"kvfabric: ready {ready_s:.0f} s after start; torch threads (cores shared "
            f"through the OS): {', '.join(threads)}"
        )

        async def restart() -> None:
            await asyncio.to_thread(restart_workers, cluster)
            await cluster.wait_ready(bus, timeout_s=300)

        yield Side(OURS, client, restart, processes=lambda: cluster_processes(cluster), result=side)


def cluster_processes(cluster: Cluster) -> list[int]:
    """The cluster's service processes and its embedded nats-server."""
    nats = [cluster.nats.pid] if cluster.nats is not None and cluster.nats.pid else []
    return [child.process.pid for child in cluster.children] + nats


def restart_workers(cluster: Cluster) -> None:
    """SIGTERM the prefill and decode workers, wait for them, start each again with the same
    command line and log (the same instance ids: each adopts its store files)."""
    workers = [c for c in cluster.children if c.service in (PREFILL, DECODE)]
    for child in workers:
        child.process.send_signal(signal.SIGTERM)
    for child in workers:
        try:
            child.process.wait(timeout=cluster.spec.shutdown_grace_s + 5)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
    for child in workers:
        _respawn(child)


def _respawn(child: Child) -> None:
    with child.log_path.open("ab") as log:
        child.process = subprocess.Popen(
            child.process.args,
            env=child.env,  # its role's NATS credentials
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def report(
    ours: SideResult,
    peer: SideResult,
    workers: SideResult | None,
    concurrency: int,
    result: BenchResult,
) -> None:
    """Ratios against vLLM: kvfabric's engine (ours), then kvfabric + vLLM workers."""
    ms = lambda steps: statistics.median(s.ttft_s for s in steps) * 1e3  # noqa: E731
    name = "vLLM 0.32 (CPU)"
    result.ratio(
        "TTFT, first step (cold), median",
        ms(ours.cold),
        ms(peer.cold),
        name,
        "ms",
        lower_is_better=True,
    )
    result.ratio(
        "TTFT, later steps (warm), median",
        ms(ours.warm),
        ms(peer.warm),
        name,
        "ms",
        1.0,
        lower_is_better=True,
    )
    result.ratio(
        "TTFT, next step after a worker restart (target: vLLM's >= 5x ours)",
        ms(ours.after_restart),
        ms(peer.after_restart),
        name,
        "ms",
        0.2,
        lower_is_better=True,
    )
    result.ratio(
        "decode tokens/s at batch 1", decode_tps(ours), decode_tps(peer), name, "tokens/s", 0.8
    )
    # What the restart itself costs each side, and the floor of the ratios after a restart:
    # a restarted vLLM that got its KV back at no cost would take its same step warm.
    result.figure(
        "vLLM: TTFT of the same step warm (no restart) / after a restart: the best "
        "ratio any KV connector could give it",
        ms(peer.same_step_warm) / ms(peer.after_restart),
        "x",
    )
    result.ratio(
        "TTFT after a worker restart against the same step without one",
        ms(ours.after_restart),
        ms(ours.same_step_warm),
        "kvfabric, no restart",
        "ms",
        lower_is_better=True,
    )
    result.ratio(
        f"requests/s at concurrency {concurrency}",
        ours.requests_per_s,
        peer.requests_per_s,
        name,
        "requests/s",
    )
    sides = [("kvfabric", ours), ("vLLM", peer)]
    if workers is not None:
        w = "kvfabric + vLLM workers"
        result.ratio(
            f"{w}: TTFT, later steps (warm), median",
            ms(workers.warm),
            ms(peer.warm),
            name,
            "ms",
            1.1,
            lower_is_better=True,
        )
        result.ratio(
            f"{w}: TTFT, next step after both workers restart",
            ms(workers.after_restart),
            ms(peer.after_restart),
            name,
            "ms",
            0.2,
            lower_is_better=True,
        )
        result.ratio(
            f"{w}: TTFT after both workers restart against vLLM's same step without one",
            ms(workers.after_restart),
            ms(peer.same_step_warm),
            "vLLM, no restart",
            "ms",
            lower_is_better=True,
        )
        if workers.moved and peer.moved:
            result.ratio(
                f"{w}: TTFT, next step on another worker (vLLM: another server)",
                ms(workers.moved),
                ms(peer.moved),
                name,
                "ms",
                0.2,
                lower_is_better=True,
            )
        result.ratio(
            f"{w}: decode tokens/s at batch 1",
            decode_tps(workers),
            decode_tps(peer),
            name,
            "tokens/s",
        )
        result.ratio(
            f"{w}: requests/s at concurrency {concurrency} (one worker left)",
            workers.requests_per_s,
            peer.requests_per_s,
            name,
            "requests/s",
        )
        sides.insert(1, (w, workers))
    for side, r in sides:
        result.figure(f"{side}: cached share of warm steps' prompts", hit_share(r.warm), "share")
        result.figure(
            f"{side}: cached share after the restart", hit_share(r.after_restart), "share"
        )
        if r.moved:
            result.figure(f"{side}: cached share on another worker", hit_share(r.moved), "share")
        result.figure(f"{side}: restart until the first answer", r.restart_s, "s")
        result.figure(
            f"{side}: failed requests at concurrency {concurrency}", len(r.errors), "requests"
        )
        if r.errors:
            result.note(f"{side}: failed at concurrency: " + "; ".join(r.errors))
        # The medians above hide which session paid what: the first step a restarted worker
        # serves has been the slow one (docs/vllm.md).
        for label, steps in (
            ("warm", r.warm),
            ("the same step warm, no restart", r.same_step_warm),
            ("after the restart", r.after_restart),
            ("moved", r.moved),
        ):
            if steps:
                each = ", ".join(f"{s.ttft_s * 1e3:,.0f}" for s in steps)
                result.note(f"{side}: TTFT {label}, step by step: {each} ms")
    tokenizer = Checkpoint(model_path(MODEL)).tokenizer()
    first = [tokenizer.encode(r.cold[0].text, add_special_tokens=False).ids for r in (ours, peer)]
    result.figure(
        f"first greedy answer: share of kvfabric's {len(first[0])} tokens that vLLM's "
        "matches from the start (re-tokenized text)",
        leading_agreement(*first) / max(1, len(first[0])),
        "share",
        1.0,
    )


def decode_tps(side: SideResult) -> float:
    steps = side.cold + side.warm
    return sum(s.output_tokens - 1 for s in steps) / sum(s.decode_s for s in steps)


def hit_share(steps: list[Step]) -> float:
    return sum(s.cached_tokens for s in steps) / max(1, sum(s.prompt_tokens for s in steps))


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's. Quick: two sessions of 3 steps (2 before the restart) from a
    256-token task, and 4 sessions of 2 steps at concurrency 4."""
    defaults = {
        "sessions": 3,
        "steps": 5,
        "context": 1024,
        "growth": 192,
        "max_tokens": 48,
        "concurrency": 4,
        "concurrent_steps": 3,
        "think_s": 1.0,
        "gap_s": 1.5,
        "mode": "interleaved",
        "block": 64,
        "dtype": "float32",
        "vllm_cores": "",
        "vllm_workers": True,
        "move": True,
    }
    if quick:
        defaults |= {
            "sessions": 2,
            "steps": 3,
            "context": 256,
            "growth": 64,
            "max_tokens": 24,
            "concurrent_steps": 2,
        }
    args = bench_options(defaults, options)
    if args.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {args.mode!r}")
    if args.steps < 3:
        raise ValueError("steps must be >= 3: a cold step, a warm one, one after the restart")
    result = BenchResult("peers", quick)
    result.note(
        f"{args.sessions} session(s) of {args.steps} steps at batch 1 ({args.steps - 1} before "
        f"the restart) and {args.sessions} more of {args.steps} before it, task "
        f"{args.context} tokens, +{args.growth} a step, {args.max_tokens} new tokens, "
        + {
            "interleaved": "each step sent to every side in turn (all up at once, the order "
            "rotating; the others' processes stopped meanwhile) ",
            "together": "each step sent to every side in turn (all up at once, the order "
            "rotating; the others idle beside it) ",
            "alone": "one side at a time (the others not started or stopped), ",
        }[args.mode]
        + f"after {args.gap_s:g} s of quiet; then per side {args.concurrency} fresh sessions of "
        f"{args.concurrent_steps} steps at once, {args.think_s:g} s think time; KV blocks of "
        f"{args.block} tokens and {args.dtype} arithmetic on every side, every vLLM's KV "
        f"cache {VLLM_KV_CACHE_BYTES >> 30} GiB"
    )
    load_before = os.getloadavg()[0]
    sides = asyncio.run(_run_sides(args, result))
    report(sides[OURS], sides[PEER], sides.get(WORKERS), args.concurrency, result)
    result.note(
        f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"on {os.cpu_count()} CPUs (the sides' own processes count in it)"
    )
    return result.finish()


async def _run_sides(args: argparse.Namespace, result: BenchResult) -> dict[str, SideResult]:
    """`alone`: each side started, driven and stopped in turn; otherwise all started (one
    after another), then driven together."""
    makers = [vllm_side, *([vllm_workers_side] if args.vllm_workers else []), kvfabric_side]
    with _vllm_step_deadline(args.mode, result):
        if args.mode == "alone":
            sides = []
            for make in makers:
                async with make(args, result) as side:
                    await drive([side], args)
                    sides.append(side)
        else:
            async with AsyncExitStack() as stack:
                sides = [await stack.enter_async_context(make(args, result)) for make in makers]
                await drive(sides, args)
    return {side.name: side.result for side in sides}


@contextlib.contextmanager
def _vllm_step_deadline(mode: str, result: BenchResult) -> Iterator[None]:
    """In `interleaved` mode, VLLM_STEP_DEADLINE_S in the environment every vLLM the run
    starts inherits (the vLLM workers' too), unless set already, for the run. A side may be
    stopped mid-step (its connector's save after a request's last token, for one) for longer
    than vLLM's 300 s; resumed, its engine found the deadline passed and died."""
    name = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
    if mode != "interleaved" or name in os.environ:
        yield
        return
    os.environ[name] = str(VLLM_STEP_DEADLINE_S)
    result.note(
        f"every vLLM's step deadline ({name}) {VLLM_STEP_DEADLINE_S} s: stopped mid-step "
        "for longer than vLLM's 300 s, a side's engine died when resumed"
    )
    try:
        yield
    finally:
        del os.environ[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="per session, >= 3")
    parser.add_argument("--context", type=int, default=1024, help="first task's tokens")
    parser.add_argument("--growth", type=int, default=192, help="tool-result tokens a step")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--concurrent-steps", type=int, default=3)
    parser.add_argument(
        "--think-s", type=float, default=1.0, help="between a session's steps at concurrency"
    )
    parser.add_argument(
        "--gap-s",
        type=float,
        default=1.5,
        help="quiet before each timed step at batch 1 (vLLM's engine "
        "busy-polls for 1 s after a step)",
    )
    parser.add_argument("--block", type=int, default=64, help="KV block size, both sides")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="every side's weights, arithmetic and KV cache",
    )
    parser.add_argument(
        "--vllm-cores",
        default="",
        help="VLLM_CPU_OMP_THREADS_BIND (`0-1`: both cores); default vLLM's own",
    )
    parser.add_argument(
        "--no-vllm-workers",
        dest="vllm_workers",
        action="store_false",
        help="leave out the side of kvfabric with vLLM workers",
    )
    parser.add_argument(
        "--mode",
        default="interleaved",
        choices=MODES,
        help="interleaved: every side up, each step sent to each in turn, the "
        "others stopped; alone: one side at a time; together: as interleaved, "
        "the others left running",
    )
    parser.add_argument(
        "--no-move",
        dest="move",
        action="store_false",
        help="no step on another worker after the restart",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    sizes = (
        "sessions",
        "steps",
        "context",
        "growth",
        "max_tokens",
        "concurrency",
        "concurrent_steps",
    )
    options = {k: v for k, v in vars(args).items() if k != "quick"}
    if args.quick:  # the quick sizes, with the other options as given
        options = {k: v for k, v in options.items() if k not in sizes}
    run(args.quick, **options).print()


if __name__ == "__main__":
    main()
