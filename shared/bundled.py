"""Where the bundled model lives: `models/tiny-coder/` at the repository's top (see its
README.md, the model card). It is the default model of `kvfabric up`.

Outside `shared/engine/` on purpose: importing anything in that package runs its
`__init__`, which imports torch (2-10 s), and every service process and the CLI need this
path without the engine."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-coder"
