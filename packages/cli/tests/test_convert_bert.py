"""``mtl convert`` of a Hugging Face BERT: picked as the ``bert`` family by its config.json
(no --family), stored for tp=2 x pp=2, read back by one process to HF's logits, exported
with its tokenizer files."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_bert_converts_at_tp2_pp2_and_back(tmp_path, mtl, ok, word_tokenizer):
    from mtl.train.inference import load_for_inference

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / "hf")
    tokenizer = word_tokenizer(300)
    tokenizer.save_pretrained(tmp_path / "hf")
    out = ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl", "--tp", 2, "--pp", 2))
    assert "tp=2 pp=2" in out
    ours, _, cfg = load_for_inference(tmp_path / "mtl")
    assert cfg.model.family == "bert" and cfg.model.norm_position == "post"
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, logits = model(ids).logits, ours(ids)[..., :300]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back"))
    reloaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    carried = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")  # the tokenizer files travel
    assert carried("w3 w17 w200").input_ids == tokenizer("w3 w17 w200").input_ids == [8, 22, 205]
