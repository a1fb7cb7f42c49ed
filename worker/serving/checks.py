"""The checks every prefill and decode worker, model or mock, makes of a job's request before
taking it: in one place, so that both engines refuse the same requests in the same words."""

from __future__ import annotations

from shared.blocks import BlockLayoutError, RequestBlocks
from shared.schema import BadRequest, unpack_token_ids
from shared.schema.inference import GenerateRequest


def checked_prompt(
    request: GenerateRequest,
    *,
    model_name: str,
    block_size_tokens: int,
    max_model_len: int,
    vocab_size: int | None = None,
) -> tuple[list[int], RequestBlocks]:
    """The prompt's token ids and block layout (the chain it carries, as the router checked
    it); `BadRequest` when this worker cannot serve it: another model or block size, an empty
    prompt, a token id outside the vocabulary (`vocab_size`, when given), one that leaves no
    room to generate, or a chain of the wrong length."""
    if request.model != model_name:
        raise BadRequest(f"model {request.model!r} is not served here ({model_name})")
    if request.block_size_tokens != block_size_tokens:
        raise BadRequest(
            f"block_size_tokens {request.block_size_tokens} != this worker's {block_size_tokens}"
        )
    token_ids = unpack_token_ids(request.prompt_token_ids).tolist()
    if not token_ids:
        raise BadRequest("prompt is empty")
    if vocab_size is not None and max(token_ids) >= vocab_size:
        raise BadRequest(
            f"token id {max(token_ids)} is outside the vocabulary of {model_name} "
            f"({vocab_size} tokens)"
        )
    if len(token_ids) >= max_model_len:
        raise BadRequest(
            f"prompt of {len(token_ids)} tokens leaves no room to generate "
            f"(max_model_len {max_model_len})"
        )
    try:
        return token_ids, RequestBlocks.of_request(request)
    except BlockLayoutError as exc:
        raise BadRequest(f"block_hashes: {exc}") from exc
