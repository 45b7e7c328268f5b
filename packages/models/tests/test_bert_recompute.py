"""``train.recompute`` = 'selective' and 'full' on the ``bert`` family: the recomputed backward
uses the micro-batch's padding mask (an argument of the checkpointed call), so the gradients
equal those of the plain run exactly; and a padded key changes nothing for real tokens."""

import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.models.bert import build_encoder
from mtl.parallel.topology import Topology


def config(recompute: str) -> RunConfig:
    cfg = RunConfig()
    for key, value in dict(family="bert", norm_position="post", num_layers=2, hidden_size=32, num_attention_heads=4,
                           type_vocab_size=2, binary_head=True, normalization="layernorm", activation="gelu",
                           position_embedding="learned", bias=True, seq_length=16).items():
        setattr(cfg.model, key, value)
    cfg.train.recompute = recompute
    return cfg.resolve(1, 100)


def batch():
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 100, (2, 16), generator=generator)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 9:] = 0
    labels = torch.where(torch.rand(2, 16, generator=generator) < 0.3, ids, torch.full_like(ids, -1))
    return ids, mask, labels


def grads(recompute: str) -> dict[str, torch.Tensor]:
    model = build_encoder(config(recompute), Topology.single(), registry("backend").get("local"))
    ids, mask, labels = batch()
    out = model(ids, labels=labels, padding_mask=mask, binary_labels=torch.tensor([0, 1]))
    ((out["mlm_loss"] * (labels >= 0)).sum() + out["binary_loss"].sum()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_recompute_keeps_the_padding_mask():
    plain = grads("none")
    for recompute in ("selective", "full"):
        for name, grad in grads(recompute).items():
            assert torch.equal(grad, plain[name]), (recompute, name)


def test_padded_keys_are_invisible():
    model = build_encoder(config("none"), Topology.single(), registry("backend").get("local")).eval()
    ids, mask, _ = batch()
    changed = ids.clone()
    changed[0, 9:] = 7  # other tokens behind the padding of sample 0
    with torch.no_grad():
        before, after = model(ids, padding_mask=mask), model(changed, padding_mask=mask)
    torch.testing.assert_close(after[0, :9], before[0, :9], rtol=0, atol=0)
    assert not torch.equal(model(changed)[0, :9], before[0, :9])  # without the mask they would matter
