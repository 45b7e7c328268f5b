"""``train.recompute`` on t5 recomputes what it says in backward: 'full' runs every encoder and
decoder layer's forward again, 'selective' only the core attentions (self- and cross-), each
with the bias it had the first time; the gradients equal a run keeping every activation."""

import dataclasses

import pytest
import torch

from mtl.core.plugins import registry
from mtl.models.t5.attention import BiasedCoreAttention
from mtl.models.t5.layer import T5Layer
from mtl.models.t5.model import T5Model, T5Shape
from mtl.parallel.topology import Topology

SHAPE = T5Shape(vocab_size=100, padded_vocab_size=128, hidden_size=32, num_layers=2, num_decoder_layers=2,
                num_attention_heads=4, head_dim=8, ffn_hidden_size=48, activation="gated-gelu",
                relative_attention_num_buckets=8, relative_attention_max_distance=20, tie_embeddings=False)


def forwards_and_grads(recompute: str, watched: type, method: str, monkeypatch):
    model = T5Model(dataclasses.replace(SHAPE, recompute=recompute), Topology.single(),
                    registry("backend").get("local")).train()
    weights = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the same weights for every run
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=weights) * 0.1)
    calls = [0]
    original = getattr(watched, method)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(watched, method, counted)
    generator = torch.Generator().manual_seed(0)
    tokens, decoder_tokens = (torch.randint(0, 100, (2, n), generator=generator) for n in (12, 8))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 9:] = 0  # a padded row: the bias must reach the recompute
    loss = model(tokens, labels=decoder_tokens, decoder_input_ids=decoder_tokens, padding_mask=padding).sum()
    forward_calls = calls[0]
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    monkeypatch.setattr(watched, method, original)
    return forward_calls, calls[0] - forward_calls, grads


@pytest.mark.parametrize("recompute, watched, method, recomputed", [
    ("full", T5Layer, "forward", 4),  # 2 encoder + 2 decoder layers
    ("selective", BiasedCoreAttention, "_attend", 6),  # 2 + 2 self-attentions, 2 cross-attentions
])
def test_t5_recompute_runs_again_in_backward_with_the_same_gradients(recompute, watched, method, recomputed,
                                                                     monkeypatch):
    forwards, again, grads = forwards_and_grads(recompute, watched, method, monkeypatch)
    plain_forwards, plain_again, plain_grads = forwards_and_grads("none", watched, method, monkeypatch)
    assert (forwards, again) == (recomputed, recomputed) and (plain_forwards, plain_again) == (recomputed, 0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
