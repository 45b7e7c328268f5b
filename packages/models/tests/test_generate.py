"""KV-cache decoding equals recomputing the whole sequence; sampling is seeded."""

import pytest
import torch

from mtl.core.errors import ConfigError
from mtl.models.generate import generate
from mtl.models.gpt import InferenceContext, build_gpt
from mtl.models.initialization import initialize_parameters


def model_of(make_config, backend, single, style):
    # a large init std makes the distribution peaked enough that greedy paths are not flat
    model = build_gpt(make_config(style, model={"init_std": 0.3}), single, backend)
    initialize_parameters(model, 5, single)
    return model.eval()


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_incremental_logits_equal_full_forward(make_config, backend, single, style):
    model = model_of(make_config, backend, single, style)
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        full = model(ids)  # [b, s, V]
        context = InferenceContext(max_batch_size=2, max_sequence_length=12)
        pieces = [model(ids[:, :5], inference_context=context)]  # prefill 5, then chunks of 1 and 6
        pieces.append(model(ids[:, 5:6], inference_context=context))
        pieces.append(model(ids[:, 6:], inference_context=context))
    assert context.sequence_offset == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_cached_generation_equals_uncached(make_config, backend, single, style):
    model = model_of(make_config, backend, single, style)
    prompt = [3, 14, 15, 92]
    greedy = generate(model, prompt, max_new_tokens=8, temperature=0)
    assert greedy == generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=False)
    assert len(greedy) == 8 and len(set(greedy)) > 1
    sampled = generate(model, prompt, max_new_tokens=8, temperature=0.8, top_k=5, seed=7)
    assert sampled == generate(model, prompt, max_new_tokens=8, temperature=0.8, top_k=5, seed=7, use_cache=False)
    assert all(token < 100 for token in sampled)  # padded vocabulary rows are never sampled


def test_generation_stops_before_eod_and_checks_lengths(make_config, backend, single):
    model = model_of(make_config, backend, single, "gpt2")
    greedy = generate(model, [1, 2], max_new_tokens=6, temperature=0)
    assert generate(model, [1, 2], max_new_tokens=6, temperature=0, eod=greedy[2]) == greedy[: greedy.index(greedy[2])]
    with pytest.raises(ConfigError, match="max_position_embeddings = 16"):
        generate(model, [1, 2, 3], max_new_tokens=14)
    with pytest.raises(ConfigError, match="non-empty prompt"):
        generate(model, [], max_new_tokens=1)
