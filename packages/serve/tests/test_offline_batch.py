"""`mtl generate --input prompts.jsonl --output out.jsonl`: every prompt through the engine, in
order, each with the tokens `mtl generate --prompt` gives it alone, and a progress bar."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mtl.cli.main import cli

PROMPTS = ["hello world", "the quick brown fox", "a", "pack my box with five dozen liquor jugs"]


def single(checkpoint: str, prompt: str, *options: str) -> list[int]:
    result = CliRunner().invoke(cli, ["generate", checkpoint, "--prompt", prompt, "--show-ids", *options])
    assert result.exit_code == 0, result.output
    return [int(i) for i in result.output.rstrip("\n").rsplit("\n", 1)[1].removeprefix("new ids:").split()]


def test_batch_file_equals_one_prompt_at_a_time(checkpoint, tmp_path):
    lines = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    lines[1]["temperature"] = 0.7  # a line's own sampling, seeded as the command's --seed
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = CliRunner().invoke(cli, ["generate", checkpoint["dir"], "--input", str(tmp_path / "in.jsonl"),
                                      "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "8",
                                      "--temperature", "0", "--seed", "3", "--kv-memory", "4MiB"])
    assert result.exit_code == 0, result.output
    assert "4/4" in result.output and "wrote 4 generations" in result.output  # the progress bar's end
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == [0, 1, 2, 3]
    for row, line in zip(rows, lines):
        temperature = str(line.get("temperature", 0))
        expected = single(checkpoint["dir"], line["prompt"], "--max-new-tokens", "8", "--temperature", temperature,
                          "--seed", "3")
        assert row["token_ids"] == expected
        assert row["finish_reason"] == ("length" if len(expected) == 8 else "stop")


def test_a_bad_line_is_named_before_any_compute(checkpoint, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n{"text": "no prompt"}\n')
    result = CliRunner().invoke(cli, ["generate", checkpoint["dir"], "--input", str(tmp_path / "in.jsonl"),
                                      "--output", str(tmp_path / "out.jsonl")])
    assert result.exit_code != 0
    assert "in.jsonl:2" in result.output and "prompt" in result.output
    assert not (tmp_path / "out.jsonl").exists()
    result = CliRunner().invoke(cli, ["generate", checkpoint["dir"], "--input", str(tmp_path / "in.jsonl")])
    assert result.exit_code != 0 and "--input and --output go together" in result.output
    # an option of the other mode is refused, not ignored
    result = CliRunner().invoke(cli, ["generate", checkpoint["dir"], "--prompt", "Hi", "--max-batch", "4"])
    assert result.exit_code != 0 and "--max-batch and --kv-memory" in result.output
    result = CliRunner().invoke(cli, ["generate", checkpoint["dir"], "--input", str(tmp_path / "in.jsonl"),
                                      "--output", str(tmp_path / "out.jsonl"), "--show-ids"])
    assert result.exit_code != 0 and "--show-ids" in result.output
