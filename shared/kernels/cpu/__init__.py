"""CPU kernels in C, built on first use with the system's C compiler and called through ctypes.

- `quant_matmul.c` multiplies by weights kept in a GGUF block format (Q4_0, Q4_1, Q8_0),
  with AVX2 + FMA where present and a scalar loop elsewhere.
- `paged_attention.c` runs a prefill chunk's causal attention over the paged KV pool in
  place; only AVX-512F builds have it (`attention_simd()`), else the engine uses SDPA.
- `fused_ops.c` does a decoder layer's elementwise steps (residual add + RMSNorm, RoPE,
  SiLU * up) in one pass each, for float32 activations (worker/engine/fused_ops.py).

All go into one library, compiled for this CPU (`-march=native`) into `$KVF_KERNEL_CACHE`,
else `~/.cache/kvfabric/kernels`, under a name that hashes the sources, the flags, the
compiler and the CPU's feature flags, so a shared home directory never hands one machine
another's build. The build takes a few seconds; concurrent builders each write their own
temporary file and rename it into place. No compiler, or a failed build, raises
KernelUnavailable with the compiler's message; callers fall back to float32 weights and SDPA.

Not torch's C++ extension machinery: that compiles against the torch headers (a minute on two
cores) for what are plain C functions over raw pointers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("quant_matmul.c", "paged_attention.c", "fused_ops.c")
)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
BLOCK = 32  # weights per block in every format here

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    override = os.environ.get("KVF_KERNEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "kvfabric" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH; set CC to one")
    return compiler


def build() -> Path:
    """The shared library for this machine, compiled now unless already in the cache."""
    compiler = _compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    key = hashlib.sha256(
        "\0".join(
            (*(s.read_text() for s in SOURCES), " ".join(CFLAGS), version, _cpu_flags())
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise KernelUnavailable(
                f"building {names} with {compiler} failed:\n{result.stderr.strip()}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL:
    """The loaded kernels (built on the first call in a process); KernelUnavailable if not."""
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise KernelUnavailable(_failure)
        try:
            lib = ctypes.CDLL(str(build()))
        except (KernelUnavailable, OSError) as exc:
            _failure = str(exc)
            raise KernelUnavailable(_failure) from exc
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvf_quant_matmul.argtypes = [
            ctypes.c_int,
            ptr,
            i64,
            i64,
            ptr,
            ptr,
            ptr,
            i64,
            ptr,
            ptr,
            ctypes.c_int,
        ]
        lib.kvf_quant_matmul.restype = None
        lib.kvf_quant_dequantize.argtypes = [ctypes.c_int, i64, i64, ptr, ptr, ptr, ptr]
        lib.kvf_quant_dequantize.restype = None
        lib.kvf_quant_simd.restype = ctypes.c_int
        i32, f32 = ctypes.c_int, ctypes.c_float
        lib.kvf_paged_attention.argtypes = [
            ptr,
            i64,
            i64,
            i32,
            i32,
            i32,
            ptr,
            i64,
            i64,
            i32,
            ptr,
            f32,
            ptr,
            ptr,
            i32,
        ]
        lib.kvf_paged_attention.restype = ctypes.c_int
        lib.kvf_attention_simd.restype = ctypes.c_int
        lib.kvf_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i32]
        lib.kvf_add_rms_norm.restype = None
        lib.kvf_rope.argtypes = [ptr, i64, ptr, i64, i64, i32, i32, ptr, ptr, i32]
        lib.kvf_rope.restype = None
        lib.kvf_silu_mul.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i32]
        lib.kvf_silu_mul.restype = None
        _library = lib
        return lib


def available() -> bool:
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def simd() -> bool:
    """Whether the build took the AVX2 + FMA path (else the portable scalar loop)."""
    return bool(library().kvf_quant_simd())


def attention_simd() -> bool:
    """Whether `kvf_paged_attention` is built (AVX-512F); without it the engine uses SDPA."""
    return bool(library().kvf_attention_simd())
