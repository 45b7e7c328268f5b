"""``mtl convert`` both ways, at any layout, and ``mtl generate`` on the result, against tiny
random GPT-2, Llama, Mistral, Qwen2, Mamba2 and Nemotron-H (with an MoE layer) models built locally
with transformers (nothing downloaded)."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny corpus",
             "models learn to predict the next token"] * 4
PROMPT = "the quick brown"
LLAMA_FIELDS = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, bos_token_id=0,
                    eos_token_id=0, initializer_range=0.2)
ARCHS = {  # name -> (config class, model class, fields)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                   activation_function="gelu", bos_token_id=0, eos_token_id=0,
                                                   initializer_range=0.3)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_FIELDS),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA_FIELDS, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA_FIELDS, tie_word_embeddings=True)),
    # the hybrid family's converter: `mtl convert --from hf` picks the family by config.json's model_type
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                                         n_groups=2, state_size=8, chunk_size=8, bos_token_id=0,
                                                         eos_token_id=0, pad_token_id=0, initializer_range=0.2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=32, num_hidden_layers=4, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        initializer_range=0.2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24)),
}


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
    config_class, model_class, fields = ARCHS[arch]
    torch.manual_seed(sorted(ARCHS).index(arch))
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=vocab_size, **fields))
    with torch.no_grad():  # HF norms start at exactly one and biases at zero: perturb them
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def save_hf(root, arch):
    tokenizer = build_tokenizer()
    model = build_model(arch, len(tokenizer))
    model.save_pretrained(root / "hf", safe_serialization=True)
    tokenizer.save_pretrained(root / "hf")
    return model, tokenizer


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model, tokenizer = save_hf(root, request.param)
    assert (root / "hf" / "tokenizer.json").is_file() and (root / "hf" / "model.safetensors").is_file()
    return request.param, root, model, tokenizer


@pytest.fixture(scope="module")
def converted(hf_checkpoint):
    from click.testing import CliRunner

    from mtl.cli.main import cli

    root = hf_checkpoint[1]
    result = CliRunner().invoke(cli, ["convert", "--from", "hf", "--to", "mtl", str(root / "hf"), str(root / "mtl")])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    return hf_checkpoint


def assert_same_tensors(original_dir, exported_dir):
    original = safetensors_torch.load_file(str(original_dir / "model.safetensors"))
    exported = safetensors_torch.load_file(str(exported_dir / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_converted_checkpoint_is_an_mtl_checkpoint(converted, mtl, ok):
    _, root, _, tokenizer = converted
    assert (root / "mtl" / "latest").is_file()
    assert (root / "mtl" / "tokenizer" / "tokenizer.json").is_file()  # carried along
    out = ok(mtl("ckpt", "inspect", root / "mtl"))
    assert "model.embedding.word_embeddings.weight" in out
    assert f"({len(tokenizer)}, 32)" in out  # the true vocabulary: padding is the model's business
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
    assert_same_tensors(root / "hf", root / "back")
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


def test_tp2_pp2_checkpoint_loads_at_tp1_with_the_same_logits(tmp_path, mtl, ok):
    """Stored for tp=2 x pp=2: its config says so, its chunks are the tp=2 shards, and a
    single process reads it to HF's logits and exports it bit-exactly."""
    from mtl.ckpt.directory import read_manifest
    from mtl.train.inference import load_for_inference

    model, tokenizer = save_hf(tmp_path, "llama")
    out = ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl", "--tp", 2, "--pp", 2))
    assert "tp=2 pp=2" in out
    manifest = read_manifest(str(tmp_path / "mtl"))
    assert manifest["metadata"]["config"]["parallel"]["tp"] == 2 and manifest["metadata"]["config"]["parallel"]["pp"] == 2
    tensors = manifest["tensors"]
    assert tensors["model.layers.0.self_attention.linear_qkv.weight"]["chunk_shape"] == [32, 32]  # of [64, 32]
    assert tensors["model.layers.0.mlp.linear_fc1.weight"]["chunk_shape"] == [2, 24, 32]  # of [2, 48, 32]
    assert tensors["model.layers.0.self_attention.linear_proj.weight"]["chunk_shape"] == [32, 16]  # of [32, 32]
    assert tensors["model.final_norm.weight"]["chunk_shape"] == [32]
    vocab = len(tokenizer)
    embedding = tensors["model.embedding.word_embeddings.weight"]
    assert embedding["global_shape"] == [vocab, 32] and embedding["chunk_shape"] == [min(vocab, 256), 32]

    mtl_model, _, cfg = load_for_inference(tmp_path / "mtl")
    assert cfg.parallel.tp == 1
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, ours = model(ids).logits, mtl_model(ids)[..., :vocab]
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back"))
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")


def test_a_source_without_tokenizer_files(tmp_path, mtl, ok, clean_error):
    model, tokenizer = save_hf(tmp_path, "gpt2")
    (tmp_path / "bare").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(tmp_path / "hf" / name, tmp_path / "bare" / name)
    out = ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "bare", tmp_path / "mtl"))
    assert out.count("warning:") == 1 and "no tokenizer files" in out
    from mtl.ckpt import read_metadata

    assert read_metadata(str(tmp_path / "mtl"))["has_tokenizer"] is False
    clean_error(mtl("generate", tmp_path / "mtl", "--prompt", PROMPT), "has no tokenizer", "--tokenizer NAME",
                "--tokenizer-model PATH")
    clean_error(mtl("generate", tmp_path / "mtl", "--prompt", PROMPT, "--tokenizer-model", "x.json"),
                "--tokenizer-model needs --tokenizer")
    out = ok(mtl("generate", tmp_path / "mtl", "--prompt", PROMPT, "--max-new-tokens", 3, "--temperature", 0,
                 "--tokenizer", "hf", "--tokenizer-model", tmp_path / "hf" / "tokenizer.json"))
    assert out.startswith(PROMPT)
    # the export still works and keeps the HF token ids
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 0


def test_export_options_and_errors(tmp_path, mtl, ok, clean_error):
    save_hf(tmp_path, "qwen2")
    ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl"))
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back", "--max-shard-size", "20KB"))
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    clean_error(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "x",
                    "--hf-architecture", "llama"), "Qwen2")
    clean_error(mtl("convert", "--from", "nope", "--to", "mtl", tmp_path / "hf", tmp_path / "y"),
                "--from nope", "hf")
    clean_error(mtl("convert", "--from", "hf", "--to", "hf", tmp_path / "hf", tmp_path / "y"), "one side must be mtl")
    clean_error(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl"), "already committed")
    clean_error(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "z", "--tp", 3),
                "tp")
