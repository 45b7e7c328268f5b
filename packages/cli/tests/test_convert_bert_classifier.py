"""``mtl convert`` of a Hugging Face BertForSequenceClassification: ``model.num_labels`` from
its id2label, its pooler and classifier carried; mtl's logits (token types, padding) within
1e-4 of HF's and the same loss; exported back as a BertForSequenceClassification, bit-exact."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_sequence_classifier_converts_both_ways(tmp_path, mtl, ok, word_tokenizer):
    from mtl.train.inference import load_for_inference

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / "hf")
    word_tokenizer(300).save_pretrained(tmp_path / "hf")
    ok(mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl", "--tp", 2))
    ours, _, cfg = load_for_inference(tmp_path / "mtl")
    assert cfg.model.num_labels == 3 and not cfg.model.binary_head
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 300, (4, 16), generator=generator)
    types = (torch.arange(16) >= 9).long().expand(4, 16)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 12:] = mask[3, 5:] = 0
    labels = torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        expected = model(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
        logits = ours(ids, token_type_ids=types, padding_mask=mask)
        losses = ours(ids, token_type_ids=types, padding_mask=mask, sequence_labels=labels)
    assert logits.shape == (4, 3)
    assert (logits - expected.logits).abs().max() <= 1e-4 * expected.logits.abs().max()
    assert losses["sequence_loss"].mean().item() == pytest.approx(expected.loss.item(), rel=1e-5)

    ok(mtl("convert", "--from", "mtl", "--to", "hf", tmp_path / "mtl", tmp_path / "back"))
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded).__name__ == "BertForSequenceClassification" and reloaded.config.num_labels == 3
    back = dict(reloaded.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_regression_head_is_refused(tmp_path, mtl, word_tokenizer):
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32, num_labels=1)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "hf")
    word_tokenizer(300).save_pretrained(tmp_path / "hf")
    result = mtl("convert", "--from", "hf", "--to", "mtl", tmp_path / "hf", tmp_path / "mtl")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "1 label(s)" in result.output and "single-label classification" in result.output
