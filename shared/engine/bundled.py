"""The bundled model's directory, for engine code (defined in `shared/bundled.py`)."""

from __future__ import annotations

from shared.bundled import BUNDLED_MODEL_DIR

__all__ = ["BUNDLED_MODEL_DIR"]
