"""Typed errors of the model engine.

Every message names the file and the field or tensor at fault, so an operator can fix a bad
checkpoint without reading a stack trace.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class UnsupportedModelError(EngineError):
    """The checkpoint describes an architecture or option this engine does not implement."""


class CheckpointError(EngineError):
    """config.json or a safetensors file is malformed: a field or tensor is missing,
    unexpected, or has the wrong shape."""


class OutOfBlocksError(EngineError):
    """The paged KV pool has too few free blocks for the request."""


class SequenceStateError(EngineError):
    """A sequence's cached state (block table, window buffer) does not match its tokens."""


class KVLayoutError(EngineError):
    """A KV block or window buffer handed in does not match this model's layout."""


class SamplingParamsError(EngineError):
    """A request's sampling parameters are out of range."""


class DraftError(EngineError):
    """A speculative draft is inconsistent with the probabilities it claims to come from."""
