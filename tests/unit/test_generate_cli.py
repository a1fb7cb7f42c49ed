"""`kvfabric generate` without a cluster: arguments, the chat template, the summary."""

from __future__ import annotations

import io
import json

import pytest
import typer
from tokenizers import Tokenizer
from typer.testing import CliRunner

from services.admin.cli import app
from services.admin.generate_cli import read_prompt, render_chat, result_json, summary_line
from shared.client import GenerateResult
from shared.models import BUNDLED_MODEL_DIR
from shared.schema import DecodeStats, PrefillTimings, RouteDecision, TokenUsage
from worker.engine.checkpoint import Checkpoint

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        ([], "PROMPT"),
        (["hi", "--prompt-file", "x.txt"], "not both"),
        (["hi", "--max-tokens", "0"], "max-tokens"),
        (["hi", "--temperature", "-1"], "temperature"),
        (["hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
        (["hi", "--model", "gpt-9"], "unknown model"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
        ([""], "empty"),
    ],
)
def test_bad_arguments_exit_2_before_connecting(args: list[str], complaint: str) -> None:
    # The NATS URL points nowhere: a usage error must come before any connection attempt.
    result = runner.invoke(app, ["generate", *args, "--nats-url", "nats://127.0.0.1:1"])
    assert result.exit_code == 2
    assert complaint in result.output
    assert "Traceback" not in result.output


def test_help_lists_the_options() -> None:
    result = runner.invoke(app, ["generate", "--help"])
    assert result.exit_code == 0
    for option in ("--prompt-file", "--chat", "--raw", "--stop", "--block-size", "--format"):
        assert option in result.output


def test_prompt_sources(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    assert read_prompt("-", None) == "from stdin\n"
    (tmp_path / "p.txt").write_text("from a file", encoding="utf-8")
    assert read_prompt(None, tmp_path / "p.txt") == "from a file"
    assert read_prompt("as given", None) == "as given"
    with pytest.raises(typer.BadParameter):
        read_prompt(None, None)


def test_chat_renders_the_models_template() -> None:
    text = render_chat(Checkpoint(BUNDLED_MODEL_DIR), "def add(a, b):")
    assert text == "<｜begin▁of▁sentence｜><｜User｜>def add(a, b):<｜Assistant｜>"
    tokenizer = Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [0, 3] and ids[-1] == 4  # bos, User ... Assistant: one id each


def test_chat_without_a_template_is_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(typer.BadParameter, match="no chat_template"):
        render_chat(Checkpoint(tmp_path), "hi")


def a_result() -> GenerateResult:
    prefill = PrefillTimings(
        load_ms=1.5,
        restore_ms=2.0,
        swa_restore="bounded",
        num_replay_tokens=40,
        compute_ms=30.0,
        store_ms=4.0,
        transfer_ms=0.5,
    )
    return GenerateResult(
        request_id="r-1",
        decision=RouteDecision(
            request_id="r-1",
            prefill_worker_id="p",
            decode_worker_id="d",
            num_prompt_tokens=200,
            num_cached_blocks=2,
        ),
        token_ids=[5, 6, 7, 8, 9],
        text="hello",
        finish_reason="length",
        usage=TokenUsage(num_prompt_tokens=200, num_cached_tokens=128, num_output_tokens=5),
        stats=DecodeStats(prefill=prefill, num_draft_tokens=8, num_accepted_draft_tokens=6),
        ttft_s=0.1,
        total_s=0.5,
    )


def test_summary_line_has_hits_timings_prefill_split_and_drafts() -> None:
    line = summary_line(a_result())
    assert "\n" not in line
    assert "prompt 200 tokens, cached 128 (64.0%), output 5 (length)" in line
    assert "TTFT 100 ms, total 500 ms, 10.0 tokens/s" in line
    assert "load 1.5 ms, restore 2.0 ms (bounded, 40 replayed), compute 30.0 ms" in line
    assert "store 4.0 ms, transfer 0.5 ms" in line
    assert "drafts accepted 6/8 (75%)" in line


def test_result_json_is_one_object() -> None:
    data = json.loads(result_json(a_result(), num_prompt_tokens=200))
    assert data["text"] == "hello" and data["token_ids"] == [5, 6, 7, 8, 9]
    assert data["num_cached_tokens"] == 128 and data["usage"]["num_output_tokens"] == 5
    assert data["stats"]["prefill"]["swa_restore"] == "bounded"
    assert (data["ttft_s"], data["total_s"]) == (0.1, 0.5)
