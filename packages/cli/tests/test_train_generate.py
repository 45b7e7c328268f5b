"""``mtl train`` for real (tiny, mock data), then ``mtl generate`` and ``mtl ckpt inspect`` on
its checkpoint; ``mtl demo`` end to end with a shrunken config."""

import json
import re


def test_train_writes_checkpoint_and_metrics(mtl, ok, tiny_toml, workdir):
    out = ok(mtl("train", tiny_toml))
    assert re.search(r"step\s+2/2 \| loss \d", out)
    assert (workdir / "ckpt" / "latest").read_text().strip().endswith("2")
    metrics = [json.loads(line) for line in (workdir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    # resuming continues from iteration 2 up to the new train.iters
    out = ok(mtl("train", tiny_toml, "--set", "ckpt.load='ckpt'", "--set", "train.iters=3"))
    assert re.search(r"step\s+3/3", out) and not re.search(r"step\s+1/3", out)
    assert (workdir / "ckpt" / "latest").read_text().strip().endswith("3")


def test_generate_from_a_trained_checkpoint(mtl, ok, trained_ckpt):
    args = ("generate", trained_ckpt, "--prompt", "Hello", "--max-new-tokens", 6, "--temperature", 0, "--show-ids")
    out = ok(mtl(*args))
    text, prompt_ids, new_ids = out.rstrip("\n").rsplit("\n", 2)
    assert text.startswith("Hello")
    assert prompt_ids == "prompt ids: " + " ".join(str(b) for b in b"Hello")
    new = [int(i) for i in new_ids.removeprefix("new ids: ").split()]
    assert len(new) <= 6 and all(0 <= i < 256 for i in new)  # bytes; 256 (eod) ends the text
    assert text.encode("utf-8", "replace") == b"Hello" + bytes(new).decode("utf-8", "replace").encode("utf-8", "replace")
    assert ok(mtl(*args)) == out  # greedy is deterministic
    sampled = [ok(mtl("generate", trained_ckpt, "--prompt", "Hello", "--max-new-tokens", 6, "--seed", s))
               for s in (1, 1)]
    assert sampled[0] == sampled[1] and sampled[0].startswith("Hello")


def test_generate_past_the_learned_positions_is_a_clean_error(mtl, clean_error, trained_ckpt):
    clean_error(mtl("generate", trained_ckpt, "--prompt", "Hello", "--max-new-tokens", 64),
                "max_position_embeddings = 16")


def test_ckpt_inspect_lists_keys_with_shapes(mtl, ok, trained_ckpt):
    out = ok(mtl("ckpt", "inspect", trained_ckpt))
    assert out.startswith("{")
    meta = json.loads(out[: out.index("\n}\n") + 2])
    assert meta["iteration"] == 2 and meta["consumed_samples"] == 8
    # the resolved model section: the config's values and what was derived from them
    model = meta["model"]
    assert (model["num_layers"], model["hidden_size"], model["seq_length"], model["position_embedding"]) == \
        (2, 32, 16, "learned")
    assert model["vocab_size"] == 257
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("model.", "optimizer."))}
    # the byte tokenizer's 257 rows: the padding to 384 is not stored
    assert "(257, 32)" in rows["model.embedding.word_embeddings.weight"]
    assert "(257, 32)" in rows["optimizer.embedding.word_embeddings.weight.exp_avg"]
    assert "(16, 32)" in rows["model.embedding.position_embeddings.weight"]
    assert "(32,)" in rows["model.final_norm.weight"]
    assert any(k.startswith("model.layers.1.") for k in rows)
    assert any(k.startswith("optimizer.") for k in rows)
    assert all("float32" in line for key, line in rows.items() if key.startswith("model."))
    table = out[out.index("\nkey ") + 1:].splitlines()
    assert table[-1] == f"{len(table) - 2} tensors, {sum(_numel(line) for line in table[1:-1]):,} values"
    # a committed iteration that is not there
    result = mtl("ckpt", "inspect", trained_ckpt, "--iteration", 7)
    assert result.exit_code == 2 and "iteration 7" in result.output


def test_demo_end_to_end(mtl, ok, workdir):
    overrides = ["model.num_layers=2", "model.hidden_size=32", "model.seq_length=32", "train.iters=3",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.warmup_iters=1",
                 "train.eval_interval=2", "train.eval_iters=1", "logging.interval=1"]
    args = ["demo", "--workdir", "d", "--prompt", "On Monday"]
    for item in overrides:
        args += ["--set", item]
    out = ok(mtl(*args))
    for step in ("1/4", "2/4", "3/4", "4/4"):
        assert step in out
    assert re.search(r"[\d,]+ docs, [\d,]+ tokens", out)
    assert re.search(r"loss \d+\.\d+ -> \d+\.\d+", out)
    # the sample (prompt + continuation) comes last; a 3-step model may sample a newline
    sample = out[out.rindex("On Monday"):]
    assert sample.startswith("On Monday") and len(sample) > len("On Monday")
    assert (workdir / "d" / "corpus_text_document.idx").is_file()
    assert (workdir / "d" / "checkpoints" / "latest").read_text().strip().endswith("3")
    assert (workdir / "d" / "logs" / "metrics.jsonl").is_file()


def _numel(row: str) -> int:
    n = 1
    for d in re.search(r"\(([\d, ]*)\)", row).group(1).replace(",", " ").split():
        n *= int(d)
    return n


def test_a_tokenizer_that_cannot_cover_the_vocabulary_is_refused_before_generating(mtl, ok, clean_error, tiny_toml,
                                                                                   monkeypatch):
    # a 1000-token model on mock data; the byte tokenizer (257) cannot decode ids 257..999
    ok(mtl("train", tiny_toml, "--set", "model.vocab_size=1000", "--set", "train.iters=1"))

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran before the tokenizer was checked")

    monkeypatch.setattr("mtl.cli.text_generation.generate", no_generation)
    for extra in ((), ("--tokenizer", "byte")):
        out = clean_error(mtl("generate", "ckpt", "--prompt", "Hello", *extra),
                          "vocabulary has 1000 tokens", "tokenizer 'byte' has 257", "--tokenizer NAME")
        assert len(out.strip().splitlines()) == 1, out
