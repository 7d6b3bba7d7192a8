"""`deepinfer generate`, in-process on the real SmolLM2 weights."""

from __future__ import annotations

import json

import pytest

from shared.worker.generate import main


def test_generate_json_greedy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 3 and out["text"].startswith(" Paris")


@pytest.mark.parametrize("argv", [["--prompt-ids", ""], ["--prompt-ids", "1,x"], ["--model", "/nonexistent"]])
def test_generate_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--prompt", "hi"] if "--model" in argv else []
    assert main([*argv, *args, "--max-tokens", "2"]) == 2
    assert "deepinfer generate:" in capsys.readouterr().err
