"""``mtl convert`` of a Hugging Face T5 1.1 (picked as the ``t5`` family by its config.json),
stored for tp=2, read back by one process to HF's logits, and exported with every tensor equal."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_t5_converts_at_tp2_and_back(tmp_path, mtl, ok):
    from mtl.models.convert_hf.safetensors_io import SafetensorsReader
    from mtl.train.inference import load_for_inference

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "hf")
    out = ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl", "--tp", 2))
    assert "tp=2" in out
    ours, _, cfg = load_for_inference(tmp_path / "mtl", tokenizer="byte")  # no tokenizer files: the weights alone
    assert cfg.model.family == "t5" and cfg.model.activation == "gated-gelu"
    source = torch.randint(2, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    target = torch.randint(2, 257, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=target).logits
        logits = ours(source, decoder_input_ids=target)[..., :300]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back"))
    original, back = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "back")
    for name in back.entries:
        assert torch.equal(back.get(name), original.get(name)), name


def test_mtl_generate_answers_like_hf_generate(tmp_path, mtl, ok, word_tokenizer):
    """A converted T5 with its WordPiece tokenizer: ``mtl generate`` (greedy) prints the
    decoded answer of HF's ``generate``, encoder input = the prompt, [SEP] as the end token."""
    torch.manual_seed(1)
    tokenizer = word_tokenizer(100)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=3)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl"))
    prompt = "w3 w17 w40 w8 w61"
    out = ok(mtl("generate", tmp_path / "mtl", "--prompt", prompt, "--temperature", 0, "--max-new-tokens", 8,
                 "--show-ids"))
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    expected = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, num_beams=1)[0, 1:].tolist()
    expected = expected[:expected.index(3)] if 3 in expected else expected
    assert expected, "the random model ends at once: nothing would be compared"
    assert f"new ids: {' '.join(map(str, expected))}" in out
    assert out.splitlines()[0] == tokenizer.decode(expected)
