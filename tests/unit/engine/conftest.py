"""Fixtures for the engine tests; the tolerance table is in engine_helpers.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.unit.engine.engine_helpers import FAMILIES, SMALL


@pytest.fixture
def make_hf(tmp_path: Path) -> Callable[..., tuple[torch.nn.Module, Path]]:
    """make_hf(family, **config overrides) -> (transformers model, saved directory)."""
    counter = iter(range(1000))

    def build(family: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, Path]:
        config_cls, model_cls = FAMILIES[family]
        kwargs = dict(SMALL)
        if family == "qwen3":
            kwargs["head_dim"] = 8
        kwargs.update(overrides)
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs)).eval()
        out = tmp_path / f"{family}-{next(counter)}"
        model.save_pretrained(out)
        return model, out

    return build
