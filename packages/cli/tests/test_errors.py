"""Error paths: non-zero exit, a one-line message naming the key/value/file, no traceback."""

import json
import subprocess
import sys

import pytest
import torch


def test_unknown_key_from_set(mtl, clean_error, tiny_toml):
    out = clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "model.hiden_size=3"),
                      "model.hiden_size", "--set", "did you mean 'hidden_size'")
    assert str(tiny_toml) not in out  # the file is fine; the override is not


def test_unknown_key_in_the_toml_file(mtl, clean_error, tiny_toml):
    tiny_toml.write_text(tiny_toml.read_text().replace("hidden_size = 32", "hiden_size = 32"))
    clean_error(mtl("train", tiny_toml, "--dry-run"), str(tiny_toml), "model.hiden_size", "hidden_size")


def test_unknown_section(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "modle.num_layers=2"), "[modle]", "model")


def test_value_of_the_wrong_type(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "model.hidden_size=abc"),
                "model.hidden_size", "'abc'", "int")


def test_malformed_override(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "model.hidden_size"), "model.hidden_size", "=")


def test_invalid_toml_file(mtl, clean_error, workdir):
    (workdir / "bad.toml").write_text("[model\nnum_layers = 2\n")
    clean_error(mtl("train", "bad.toml", "--dry-run"), "bad.toml", "not valid TOML")


def test_unknown_backend_lists_the_installed_ones(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "model.backend='nope'"),
                "backend 'nope'", "local", "eager")


def test_unknown_tokenizer(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--dry-run", "--set", "data.tokenizer='nope'"),
                "tokenizer 'nope'", "byte", "gpt2-bpe")


def test_missing_config_file(mtl, clean_error, workdir):
    clean_error(mtl("train", "missing.toml", "--dry-run"), "missing.toml", "does not exist")


def test_missing_data_path(mtl, clean_error, tiny_toml, workdir):
    prefix = workdir / "nowhere" / "corpus_text_document"
    out = clean_error(mtl("train", tiny_toml, "--set", "data.dataset='gpt'",
                          "--set", f"data.paths=[{json.dumps(str(prefix))}]"), str(prefix), "mtl preprocess")
    assert not (workdir / "ckpt").exists(), out


@pytest.mark.parametrize("damage", ["truncate", "magic", "pointers"])
def test_corrupt_idx_names_the_file(mtl, ok, clean_error, tiny_toml, workdir, jsonl, damage):
    jsonl(workdir / "c.jsonl", [f"document number {i} " * 8 for i in range(20)])
    ok(mtl("preprocess", "--input", "c.jsonl", "--output-prefix", "P", "--append-eod"))
    idx = workdir / "P.idx"
    data = bytearray(idx.read_bytes())
    if damage == "truncate":
        data = data[:20]
    elif damage == "magic":
        data[:9] = b"GARBAGE!!"
    else:  # the document index: last 8 bytes
        data[-8:] = b"\xff" * 8
    idx.write_bytes(bytes(data))
    clean_error(mtl("train", tiny_toml, "--set", "data.dataset='gpt'", "--set", 'data.paths=["P"]'), "P.idx")


def test_resume_with_a_different_model_shape_names_the_key(mtl, ok, clean_error, tiny_toml, workdir):
    ok(mtl("train", tiny_toml))
    assert (workdir / "ckpt" / "latest").exists()
    out = clean_error(mtl("train", tiny_toml, "--set", "ckpt.load='ckpt'", "--set", "model.hidden_size=64",
                          "--set", "train.iters=4"), "model.hidden_size", "32 -> 64", "ckpt")
    assert "model.num_layers" not in out  # only what differs is named


def test_preprocess_missing_input(mtl, clean_error, workdir):
    clean_error(mtl("preprocess", "--input", "missing.jsonl", "--output-prefix", "P"), "missing.jsonl")
    assert not (workdir / "P.bin").exists()


def test_generate_and_inspect_missing_checkpoint(mtl, clean_error, workdir):
    clean_error(mtl("generate", "no_ckpt", "--prompt", "hi"), "no_ckpt", "does not exist")
    clean_error(mtl("ckpt", "inspect", "no_ckpt"), "no_ckpt")


def test_convert_from_a_directory_that_is_not_hf(mtl, clean_error, workdir):
    (workdir / "empty").mkdir()
    clean_error(mtl("convert", "--from", "hf", "--to", "mtl", "empty", "out"), "empty", "config.json")
    clean_error(mtl("convert", "--from", "hf", "--to", "hf", "empty", "out"), "hf", "hf -> mtl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_a_device_that_is_not_there(mtl, clean_error, trained_ckpt):
    clean_error(mtl("generate", trained_ckpt, "--prompt", "hi", "--device", "cuda"), "cuda", "not available")
    clean_error(mtl("generate", trained_ckpt, "--prompt", "hi", "--device", "bogus"), "'bogus'")
    clean_error(mtl("generate", trained_ckpt, "--prompt", ""), "--prompt", "no tokens")
    clean_error(mtl("generate", trained_ckpt, "--prompt", "hi", "--temperature", "-1"), "temperature")


def test_a_real_process_prints_one_line_and_exits_2_and_debug_shows_the_traceback(tmp_path):
    cmd = [sys.executable, "-m", "mtl.cli", "train", "missing.toml", "--dry-run"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2
    assert run.stderr.strip() == "error: config file missing.toml does not exist"
    assert run.stdout == ""
    debug = subprocess.run([sys.executable, "-m", "mtl.cli", "--debug", *cmd[3:]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=False)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "ConfigError: config file missing.toml" in debug.stderr


def test_fa4_on_a_cpu_run_is_refused_before_any_work(mtl, clean_error, tiny_toml):
    clean_error(mtl("train", tiny_toml, "--set", "train.attention_kernel='fa4'"),
                "train.attention_kernel = 'fa4' does not work with a CPU run", "train.attention_kernel = 'sdpa'")
