"""tiny-coder: a few-million-parameter Qwen3-architecture model trained on CPython's stdlib.

Scripts: `data` (file selection and split), `tokenizer` (byte-level BPE with DeepSeek-V3 chat
markers), `train` (CLI), `evaluate` (held-out loss, samples, model card).
"""
