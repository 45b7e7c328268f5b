"""``mtl convert`` to and from Megatron-Core: HF -> mtl -> Megatron -> mtl -> HF is bit-exact
(tiny random GPT-2 and Llama models made locally with transformers), the save directory a
Megatron user points at, the true vocabulary, and one-line errors. That Megatron-Core itself
loads the export with mtl's logits is mtl-models' test_convert_megatron_export.py."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from mtl.cli.conversion import CheckpointSource

pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location("convert_hf_tests", Path(__file__).with_name("test_convert_hf.py"))
_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hf)  # its tiny HF models and tokenizer (pytest's importlib mode imports tests by path)
save_hf, assert_same_tensors = _hf.save_hf, _hf.assert_same_tensors


@pytest.mark.parametrize("arch, flags", [("llama", ("--tp", 2, "--te")), ("gpt2", ("--pp", 2))])
def test_hf_mtl_megatron_mtl_hf_is_bit_exact(tmp_path, mtl, ok, arch, flags):
    _, tokenizer = save_hf(tmp_path, arch)
    ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl"))
    out = ok(mtl("convert", "--from", "mtl", "--to", "megatron", tmp_path / "mtl", tmp_path / "megatron", *flags))
    assert "(megatron," in out
    megatron = tmp_path / "megatron"
    assert (megatron / "latest_checkpointed_iteration.txt").read_text() == "release"  # a converted model
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in (megatron / "release").iterdir()}
    assert (megatron / "tokenizer" / "tokenizer.json").is_file()
    args = torch.load(megatron / "release" / "common.pt", weights_only=False)["args"]
    assert args.vocab_size == len(tokenizer) and args.padded_vocab_size % (128 * args.tensor_model_parallel_size) == 0

    out = ok(mtl("convert", "--from", "megatron", "--to", "mtl", megatron, tmp_path / "mtl2"))
    assert "warning" not in out  # true vocabulary from the args, tokenizer carried along
    first, second = CheckpointSource(tmp_path / "mtl"), CheckpointSource(tmp_path / "mtl2")
    assert sorted(first.names()) == sorted(second.names())
    for name in first.names():
        assert torch.equal(first.get(name), second.get(name)), name
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl2", tmp_path / "back"))
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")


def test_megatron_save_directory_vocabulary_and_errors(tmp_path, mtl, ok, clean_error):
    _, tokenizer = save_hf(tmp_path, "llama")
    ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl"))
    save = tmp_path / "save"
    ok(mtl("convert", "--from", "mtl", "--to", "megatron", tmp_path / "mtl", save, "--iteration", 3))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
    # args without the true vocabulary (a run that used a tokenizer) and no tokenizer files
    common = save / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)
    del state["args"].vocab_size
    torch.save(state, common)
    shutil.rmtree(save / "tokenizer")
    out = ok(mtl("convert", "--from", "megatron", "--to", "mtl", save, tmp_path / "padded"))
    assert "true vocabulary size is unknown" in out and "--tokenizer" in out
    assert CheckpointSource(tmp_path / "padded").meta("embedding.word_embeddings.weight").shape[0] == 384
    ok(mtl("convert", "--from", "megatron", "--to", "mtl", save, tmp_path / "tok", "--tokenizer", tmp_path / "hf",
           "--iteration", 3))
    assert CheckpointSource(tmp_path / "tok").meta("embedding.word_embeddings.weight").shape[0] == len(tokenizer)
    assert (tmp_path / "tok" / "tokenizer" / "tokenizer.json").is_file()

    convert = ("convert", "--from", "megatron", "--to", "mtl")
    clean_error(mtl(*convert, save, tmp_path / "x", "--iteration", 9), "iter_0000009 does not exist", "iter_0000003")
    clean_error(mtl(*convert, save, tmp_path / "x", "--vocab-size", 5000), "vocab_size = 5000", "384 vocabulary rows")
    clean_error(mtl(*convert, tmp_path / "mtl", tmp_path / "x"), "latest_checkpointed_iteration.txt")
    clean_error(mtl(*convert, save, tmp_path / "x", "--tokenizer", save), "no tokenizer files")
    (save / "latest_checkpointed_iteration.txt").unlink()
    clean_error(mtl(*convert, save, tmp_path / "x"), "no latest_checkpointed_iteration.txt", "--iteration")
    export = ("convert", "--from", "mtl", "--to", "megatron", tmp_path / "mtl")
    clean_error(mtl(*export, tmp_path / "y", "--tp", 3), "--tp 3", "heads")
    clean_error(mtl(*export, save, "--iteration", 3), "iter_0000003 exists and is not empty")
    clean_error(mtl(*export, tmp_path / "y", "--vocab-size", 7), "apply to an import")
    clean_error(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "z", "--te"), "--te")
    clean_error(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "z", "--iteration", 2),
                "--iteration applies to --from megatron")


def test_a_trained_checkpoint_exports_its_iteration_weights_only(trained_ckpt, tmp_path, mtl, ok):
    out = ok(mtl("convert", "--from", "mtl", "--to", "megatron", trained_ckpt, tmp_path / "megatron"))
    assert "weights only" in out and "--no-load-optim" in out  # its optimizer state stays behind
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "2"
    ok(mtl("convert", "--from", "megatron", "--to", "mtl", tmp_path / "megatron", tmp_path / "back"))
    first, second = CheckpointSource(trained_ckpt), CheckpointSource(tmp_path / "back")
    assert sorted(first.names()) == sorted(second.names())
    assert all(torch.equal(first.get(n), second.get(n)) for n in first.names())
