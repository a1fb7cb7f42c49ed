"""Checkpoint: a model on disk, an HF directory or a GGUF file, as the services see it.

Torch-free (a GGUF's metadata needs only numpy and gguf), so a router or ingress process can
read a model's config, tokenizer and chat template without paying for torch; the weights are
weights.load_model's job, which takes the same path.

ChatTemplate renders a chat with jinja2 the way transformers' `apply_chat_template` does:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), the loopcontrols
extension, a `tojson` that keeps non-ASCII text, and the `raise_exception` / `strftime_now`
globals templates call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from worker.engine.config import ModelConfig
from worker.engine.errors import CheckpointError, EngineError
from worker.engine.gguf import GGUFFile, config_from_gguf, eos_token_ids, read_gguf
from worker.engine.gguf_tokenizer import special_token, tokenizer_from_gguf


class ChatTemplateError(EngineError):
    """A chat template failed to compile or render (or called raise_exception)."""


@dataclass(frozen=True)
class ChatTemplate:
    template: str
    bos_token: str = ""
    eos_token: str = ""
    source: str = "<str>"

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's prompt text (no tokenization)."""
        try:
            return _compile(self.template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: chat template: {exc}") from exc


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' (and so ours) does not.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


@dataclass(frozen=True)
class Checkpoint:
    """A model on disk: an HF directory (config.json, tokenizer.json, ...) or a `.gguf` file."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def config(self) -> ModelConfig:
        """config.json, or the GGUF metadata (no tensor is read)."""
        return config_from_gguf(self._gguf()) if self.is_gguf else ModelConfig.from_hf(self.path)

    def tokenizer(self) -> Tokenizer:
        if self.is_gguf:
            return tokenizer_from_gguf(self._gguf())
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise CheckpointError(f"{path}: not a tokenizers file ({exc})") from exc

    def chat_template(self) -> ChatTemplate:
        """GGUF: tokenizer.chat_template and the bos/eos tokens' text. HF: chat_template.jinja
        or tokenizer_config.json's chat_template, with its bos_token / eos_token."""
        if self.is_gguf:
            gguf = self._gguf()
            template = gguf.metadata.get("tokenizer.chat_template")
            if not isinstance(template, str):
                raise CheckpointError(f"{self.path}: no field 'tokenizer.chat_template'")
            bos, eos = special_token(gguf, "bos_token_id"), special_token(gguf, "eos_token_id")
            return ChatTemplate(template, bos, eos, source=str(self.path))
        config_path = self.path / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        jinja_path = self.path / "chat_template.jinja"
        template = (
            jinja_path.read_text(encoding="utf-8")
            if jinja_path.is_file()
            else _named_template(config.get("chat_template"))
        )
        if template is None:
            raise CheckpointError(f"{config_path}: no chat_template (and no {jinja_path.name})")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        return ChatTemplate(template, bos, eos, source=str(config_path))

    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops on. HF: generation_config.json's eos_token_id, else
        config.json's. GGUF: tokenizer.ggml.eos_token_id (+ eot/eom ids where present)."""
        if self.is_gguf:
            return eos_token_ids(self._gguf())
        for name in ("generation_config.json", "config.json"):
            path = self.path / name
            eos = _read_json(path).get("eos_token_id") if path.is_file() else None
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
        return ()

    def _gguf(self) -> GGUFFile:
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        return _read_gguf_cached(self.path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _read_gguf_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    # config(), tokenizer(), chat_template() and eos_token_ids() each need the metadata
    # (0.1 s for SmolLM2); keyed by mtime and size, so a replaced file is read again.
    del mtime_ns, size
    return read_gguf(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: top level is not a JSON object")
    return raw


def _named_template(value: Any) -> str | None:
    # tokenizer_config.json holds one template, or a list of {"name", "template"}.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _token_text(token: object) -> str:
    # tokenizer_config.json spells a special token as a string or as {"content": ...}.
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
