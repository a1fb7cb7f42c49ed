"""Where the bundled model lives: `models/tiny-coder/` at the repository's top (see its
README.md, the model card). It is the default model of `kvfabric up`."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-coder"
