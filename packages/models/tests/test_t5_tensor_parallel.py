"""A converted T5 (1.1: gated GELU, untied head) at tp=2 gives the logits of tp=1 (heads, the
position-bias table, MLP and vocabulary split over TP) and the same greedy tokens."""

import torch

from mtl.core.plugins import registry
from mtl.models.param_layout import load_global_state
from mtl.models.t5.generate import greedy_generate
from mtl.models.t5.model import T5Model, T5Shape
from mtl.parallel.tensor_parallel import gather_from_tensor_parallel
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

SHAPE = T5Shape(vocab_size=120, padded_vocab_size=128, hidden_size=32, num_layers=2, num_decoder_layers=2,
                num_attention_heads=4, head_dim=8, ffn_hidden_size=48, activation="gated-gelu",
                relative_attention_num_buckets=8, relative_attention_max_distance=20, tie_embeddings=False,
                scale_decoder_output=False)


def inputs():
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(2, 120, (2, 12), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 9:] = 0
    return source, mask, torch.randint(2, 120, (2, 10), generator=generator)


def logits_and_tokens(tp: int, state=None):
    topology = Topology.build(tp=tp) if tp > 1 else Topology.single()
    torch.manual_seed(0)
    model = T5Model(SHAPE, topology, registry("backend").get("local")).eval()
    if state is not None:
        load_global_state(model, topology, state)
    source, mask, target = inputs()
    with torch.no_grad():
        logits = model(source, decoder_input_ids=target, padding_mask=mask)
        if tp > 1:
            logits = gather_from_tensor_parallel(logits, topology.tp_group)
    return logits, greedy_generate(model, source, mask, max_new_tokens=6, eos_token_id=None)


def reference_state():
    """tp=1 weights drawn here (the model has no seeded initialisation yet), as global tensors."""
    from mtl.models.param_layout import gather_global_state

    torch.manual_seed(0)
    model = T5Model(SHAPE, Topology.single(), registry("backend").get("local"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return gather_global_state(model, Topology.single())


def tp2_worker(state):
    torch.set_num_threads(1)
    return logits_and_tokens(2, state)


def test_t5_tp2_equals_tp1():
    state = reference_state()
    logits, tokens = logits_and_tokens(1, state)
    for rank_logits, rank_tokens in run_distributed(tp2_worker, 2, (state,)):
        torch.testing.assert_close(rank_logits[..., :120], logits[..., :120], rtol=1e-5, atol=1e-5)  # true rows
        assert torch.equal(rank_tokens, tokens)
