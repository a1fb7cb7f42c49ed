"""Why a sequence ended (torch-free: the engine's callers name it without loading torch)."""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # eos or one of the request's stop token ids (the token is included)
    LENGTH = "length"  # max_new_tokens, or the engine's max_model_len
    ABORT = "abort"
