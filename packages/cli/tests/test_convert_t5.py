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
