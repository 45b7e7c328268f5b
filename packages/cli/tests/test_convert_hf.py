"""``mtl convert`` both ways and ``mtl generate`` on the result, against tiny random GPT-2 and
Llama models built locally with transformers (nothing downloaded)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny corpus",
             "models learn to predict the next token"] * 4
PROMPT = "the quick brown"


def build_tokenizer():
    """A byte-level BPE trained on three sentences, with <|endoftext|> as its eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def build_model(arch: str, vocab_size: int):
    torch.manual_seed(0 if arch == "gpt2" else 1)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                         activation_function="gelu", bos_token_id=0, eos_token_id=0,
                                         initializer_range=0.3)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rope_theta=500.0, bos_token_id=0,
                                          eos_token_id=0, initializer_range=0.2)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # HF norms start at exactly one and biases at zero: perturb them
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = build_tokenizer()
    model = build_model(request.param, len(tokenizer))
    model.save_pretrained(root / "hf", safe_serialization=True)
    tokenizer.save_pretrained(root / "hf")
    assert (root / "hf" / "tokenizer.json").is_file() and (root / "hf" / "model.safetensors").is_file()
    return request.param, root, model, tokenizer


@pytest.fixture(scope="module")
def converted(hf_checkpoint):
    from click.testing import CliRunner

    from mtl.cli.main import cli

    root = hf_checkpoint[1]
    result = CliRunner().invoke(cli, ["convert", "--from", "hf", "--to", "mtl", str(root / "hf"), str(root / "mtl")])
    assert result.exit_code == 0, result.output
    return hf_checkpoint


def test_converted_checkpoint_is_an_mtl_checkpoint(converted, mtl, ok):
    _, root, _, tokenizer = converted
    assert (root / "mtl" / "latest").is_file()
    assert (root / "mtl" / "tokenizer" / "tokenizer.json").is_file()  # carried along
    out = ok(mtl("ckpt", "inspect", root / "mtl"))
    h, v = 32, len(tokenizer)
    assert "model.embedding.word_embeddings.weight" in out
    assert f"({128 * ((v + 127) // 128)}, {h})" in out  # the vocabulary padded to a multiple of 128
    assert "optimizer." not in out  # model only


def test_greedy_generation_matches_transformers(converted, mtl, ok):
    _, root, model, tokenizer = converted
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        hf_new = model.generate(prompt_ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                eos_token_id=tokenizer.eos_token_id)[0, prompt_ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in hf_new:  # mtl stops before the end-of-document token
        hf_new = hf_new[:hf_new.index(tokenizer.eos_token_id)]
    assert len(hf_new) > 0
    out = ok(mtl("generate", root / "mtl", "--prompt", PROMPT, "--max-new-tokens", 8, "--temperature", 0,
                 "--show-ids"))
    lines = out.splitlines()
    assert lines[-2] == "prompt ids: " + " ".join(map(str, prompt_ids[0].tolist()))
    assert lines[-1] == "new ids: " + " ".join(map(str, hf_new))
    expected_text = tokenizer.decode(prompt_ids[0].tolist() + hf_new)
    assert out[: -len(lines[-2]) - len(lines[-1]) - 3] == expected_text  # before the two id lines
    # without --show-ids the output is just the text
    assert ok(mtl("generate", root / "mtl", "--prompt", PROMPT, "--max-new-tokens", 8,
                  "--temperature", 0)) == expected_text + "\n"


def test_round_trip_back_to_hf_is_bit_exact(converted, mtl, ok):
    arch, root, model, tokenizer = converted
    ok(mtl("convert", "--from", "mtl", "--to", "hf", root / "mtl", root / "back"))
    original = safetensors_torch.load_file(str(root / "hf" / "model.safetensors"))
    exported = safetensors_torch.load_file(str(root / "back" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((root / "back" / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == 0 and config["bos_token_id"] == 0  # kept from the original
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(root / "back").eval()
    assert type(reloaded) is type(model)
    ids = torch.randint(0, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(root / "back")
    assert reloaded_tokenizer(PROMPT).input_ids == tokenizer(PROMPT).input_ids
