"""Where the bundled model lives: `models/tiny-coder/` at the repository's top (see its
README.md, the model card). `kvfabric up` serves it beside SmolLM2 by default."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-coder"
