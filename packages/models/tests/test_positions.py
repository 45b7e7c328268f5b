"""``position_ids`` override the default positions (context parallelism passes each rank's
global positions): RoPE depends only on relative positions, learned positions do not."""

import torch

from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters


def logits_with_positions(make_config, backend, single, style, offset):
    model = build_gpt(make_config(style, model={"init_std": 0.2, "max_position_embeddings": 32}), single, backend)
    initialize_parameters(model, 4, single)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(ids, position_ids=torch.arange(offset, offset + 8).expand(2, 8))


def test_rope_is_shift_invariant_learned_positions_are_not(make_config, backend, single):
    rope = [logits_with_positions(make_config, backend, single, "llama", offset) for offset in (0, 7)]
    torch.testing.assert_close(rope[1], rope[0], rtol=1e-5, atol=1e-5)
    learned = [logits_with_positions(make_config, backend, single, "gpt2", offset) for offset in (0, 7)]
    assert (learned[1] - learned[0]).abs().max() > 1e-2
