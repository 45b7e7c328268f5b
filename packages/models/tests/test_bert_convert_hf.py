"""BERT / RoBERTa from Hugging Face: logits of the converted model equal transformers' (random
tiny models made here, with padding and token types), and HF -> mtl -> HF is bit-exact."""

import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.models.bert import build_encoder
from mtl.models.convert_hf.safetensors_io import SafetensorsReader
from mtl.models.param_layout import gather_global_state, load_global_state
from mtl.parallel.topology import Topology

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def hf_model(kind: str):
    torch.manual_seed(3)
    if kind == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(**TINY, layer_norm_eps=1e-12))
    elif kind == "bert_pretraining":
        model = transformers.BertForPreTraining(transformers.BertConfig(**TINY))
    else:
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            **dict(TINY, max_position_embeddings=26), type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5))
    with torch.no_grad():  # HF zero-initialises biases and norms: make every tensor count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def mtl_model(section: dict, state: dict):
    config = RunConfig()
    for key, value in section.items():
        setattr(config.model, key, value)
    config.model.seq_length = 16
    config = config.resolve(1, section["vocab_size"])
    model = build_encoder(config, Topology.single(), registry("backend").get("local"))
    load_global_state(model, Topology.single(), state)
    return model.eval()


def inputs(kind: str):
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 99, (2, 16), generator=generator)
    types = torch.zeros_like(ids) if kind == "roberta" else (torch.arange(16) >= 9).long().expand(2, 16)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # the second sample is padded
    return ids, types, mask


@pytest.mark.parametrize("kind", ["bert", "bert_pretraining", "roberta"])
def test_hf_logits_and_round_trip(kind, tmp_path):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    converter = registry("model family").get("bert").converters["hf"]
    section, state = converter.to_mtl(tmp_path / "hf")
    model = mtl_model(section, state)
    ids, types, mask = inputs(kind)
    with torch.no_grad():
        theirs = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        position_ids = None
        if kind == "roberta":  # HF counts positions from padding_idx + 1; ours add the offset themselves
            position_ids = torch.arange(16).expand(2, 16)
        ours = model(ids, position_ids, token_type_ids=types, padding_mask=mask)
    hf_logits = theirs.logits if kind != "bert_pretraining" else theirs.prediction_logits
    real = mask.bool()  # a padded position's output is never used (and HF gives it another position)
    torch.testing.assert_close(ours[real][:, :99], hf_logits[real], rtol=1e-4, atol=1e-4 * hf_logits.abs().max().item())
    if kind == "bert_pretraining":
        hidden = model.encode(ids, token_type_ids=types, padding_mask=mask)
        binary = model.binary_head(model.pooler(hidden))
        torch.testing.assert_close(binary, theirs.seq_relationship_logits, rtol=1e-4, atol=1e-5)

    # HF -> mtl -> HF: every tensor bit-exact
    converter.from_mtl(model.config.model, gather_global_state(model, Topology.single()), tmp_path / "back")
    original, back = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "back")
    for name in back.entries:
        assert torch.equal(back.get(name), original.get(name)), name
    reloaded = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids, token_type_ids=types, attention_mask=mask)
    assert torch.equal(getattr(again, "logits", None) if kind != "bert_pretraining" else again.prediction_logits,
                       hf_logits)
