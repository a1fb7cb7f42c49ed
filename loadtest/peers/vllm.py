"""The vLLM peer's smoke check: one chat completion through the official `openai` client,
its greedy tokens against our engine's for the same prompt.

    python -m loadtest.peers.vllm [--model SmolLM2-135M-Instruct] [--max-tokens 48]

vLLM's venv, the exported checkpoint and the server are `services.vllm_worker.vllm_env`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from services.vllm_worker.vllm_env import VllmServer, export_checkpoint
from shared.models import model_path, served_name
from worker.engine.checkpoint import Checkpoint

SMOKE_QUESTION = "Write a Python function that returns the maximum of a list of numbers."


def our_greedy(model_name: str, messages: list[dict[str, str]], max_tokens: int):
    """(prompt ids, greedy completion ids) of our engine, in process, for a chat."""
    from worker.engine import Engine, ModelRunner, SamplingParams, load_model

    checkpoint = Checkpoint(model_path(model_name))
    text = checkpoint.chat_template().render(messages)
    prompt = checkpoint.tokenizer().encode(text, add_special_tokens=False).ids
    runner = ModelRunner(load_model(checkpoint.path), num_blocks=64, block_size_tokens=64)
    engine = Engine(runner, eos_token_ids=checkpoint.eos_token_ids())
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    return prompt, list(engine.generate([prompt], params)[0].completion_token_ids)


def leading_agreement(ours: list[int], theirs: list[int]) -> int:
    """How many tokens the two sequences share from the start."""
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


def smoke(model_name: str = "SmolLM2-135M-Instruct", max_tokens: int = 48) -> dict[str, Any]:
    """One greedy chat completion from vLLM through the openai client, beside ours."""
    import openai

    messages = [{"role": "user", "content": SMOKE_QUESTION}]
    name = served_name(model_name)
    with VllmServer(export_checkpoint(model_name), name, max_model_len=2048) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        startup_s = server.startup_s
    choice = reply.choices[0]
    theirs_prompt = list(getattr(reply, "prompt_token_ids", None) or [])
    theirs = list(getattr(choice, "token_ids", None) or [])
    prompt, ours = our_greedy(model_name, messages, max_tokens)
    if not choice.message.content:
        raise RuntimeError(f"vLLM answered with empty content: {reply}")
    return {
        "vllm_startup_s": startup_s,
        "vllm_text": choice.message.content,
        "same_prompt_ids": theirs_prompt == prompt,
        "num_prompt_tokens": len(prompt),
        "num_ours": len(ours),
        "num_vllm": len(theirs),
        "num_leading_equal": leading_agreement(ours, theirs),
        "identical": ours == theirs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="vLLM smoke check: " + __doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    result = smoke(args.model, args.max_tokens)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["identical"] and result["same_prompt_ids"] else 1)


if __name__ == "__main__":
    main()
