"""Two pipeline stages run in-process one after the other equal the whole model, with global
layer names, and a tied output weight that starts equal to the word embedding."""

import pytest
import torch

from mtl.core.errors import ConfigError
from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters
from mtl.models.param_layout import WORD_EMBEDDING, gather_global_state
from mtl.parallel.param_layout import param_layout


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_two_stages_equal_the_full_model(make_config, backend, single, style):
    config = make_config(style, model={"num_layers": 3})
    full = build_gpt(config, single, backend)
    first = build_gpt(config, single, backend, post_process=False, layer_range=(0, 2))
    last = build_gpt(config, single, backend, pre_process=False, layer_range=(2, 3))
    for model in (full, first, last):
        initialize_parameters(model, 3, single)
    assert next(n for n, _ in last.named_parameters() if n.startswith("layers.")).startswith("layers.2.")

    ids, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    expected = full(ids, labels=labels)
    expected.sum().backward()

    hidden = first(ids)  # [s, b, h]
    assert hidden.shape == (16, 2, 32)
    last.set_input_tensor(hidden)
    loss = last(None, labels=labels)
    loss.sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)

    full_grads = gather_global_state(full, single, grads=True)
    stage_grads = [gather_global_state(stage, single, grads=True) for stage in (first, last)]
    if config.model.tie_embeddings:
        # each stage holds one use of the tied weight; the pipeline all-reduces the two
        assert param_layout(first.embedding.word_embeddings.weight).shared_embedding
        assert param_layout(last.output_layer.weight).shared_embedding
        assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
        tied = stage_grads[0].pop(WORD_EMBEDDING) + stage_grads[1].pop(WORD_EMBEDDING)
        torch.testing.assert_close(tied, full_grads.pop(WORD_EMBEDDING), rtol=1e-6, atol=1e-6)
    merged = {**stage_grads[0], **stage_grads[1]}
    assert merged.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_later_stage_without_input_tensor_is_refused(make_config, backend, single):
    last = build_gpt(make_config("llama"), single, backend, pre_process=False, layer_range=(1, 2))
    with pytest.raises(ConfigError, match="set_input_tensor"):
        last(None)
    with pytest.raises(ConfigError, match="layer_range = \\(1, 5\\)"):
        build_gpt(make_config("llama"), single, backend, layer_range=(1, 5))
