"""T5 from Hugging Face: ``T5ForConditionalGeneration`` 1.0 (ReLU, decoder output rescaled) and
1.1 (gated GELU, not rescaled; transformers 5 keeps its head tied), random tiny models made here: the converted ``T5Model``'s logits
equal transformers' within 1e-4 relative (padded encoder input, the decoder's causal bias,
cross-attention), and HF -> mtl -> HF is bit-exact."""

import pytest
import torch

from mtl.core.plugins import registry
from mtl.models.convert_hf.common import DictSource, stream
from mtl.models.convert_hf.t5 import t5_from_mtl, t5_ignored, t5_shape, t5_to_mtl
from mtl.models.param_layout import gather_global_state, load_global_state
from mtl.models.t5.model import T5Model
from mtl.parallel.topology import Topology

transformers = pytest.importorskip("transformers")


def hf_t5(version: str):
    torch.manual_seed(2)
    config = transformers.T5Config(
        vocab_size=120, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
        feed_forward_proj="relu" if version == "1.0" else "gated-gelu", tie_word_embeddings=version == "1.0",
        decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at one: make them count
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_t5_logits_and_round_trip(version):
    hf = hf_t5(version)
    hf_state = hf.state_dict()
    shape = t5_shape(hf.config.to_dict(), "config.json")
    converted = dict(stream(lambda read: t5_to_mtl(shape, read), DictSource(hf_state), ignored=t5_ignored(shape)))
    model = T5Model(shape, Topology.single(), registry("backend").get("local")).eval()
    load_global_state(model, Topology.single(), converted)
    generator = torch.Generator().manual_seed(3)
    source = torch.randint(1, 120, (2, 24), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 17:] = 0
    target = torch.randint(1, 120, (2, 30), generator=generator)  # longer than max_distance: far buckets used
    with torch.no_grad():
        expected = hf(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        logits = model(source, decoder_input_ids=target, padding_mask=mask)
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    back = dict(stream(lambda read: t5_from_mtl(shape, read), DictSource(gather_global_state(model, Topology.single()))))
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_state[name]), name


def test_t5_greedy_generation_equals_hf_generate():
    from mtl.models.t5.generate import greedy_generate

    hf = hf_t5("1.1")
    shape = t5_shape(hf.config.to_dict(), "config.json")
    converted = dict(stream(lambda read: t5_to_mtl(shape, read), DictSource(hf.state_dict()), ignored=t5_ignored(shape)))
    model = T5Model(shape, Topology.single(), registry("backend").get("local")).eval()
    load_global_state(model, Topology.single(), converted)
    source = torch.randint(2, 120, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(source)
    mask[0, 8:] = 0
    expected = hf.generate(input_ids=source, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=1,
                           eos_token_id=1, pad_token_id=0, decoder_start_token_id=0,
                           use_cache=False)  # its cache is sized by num_layers, not num_decoder_layers
    ours = greedy_generate(model, source, mask, max_new_tokens=10)  # with the KV and cross-attention caches
    assert ours.shape[1] > 4 and torch.equal(ours, expected)
    assert torch.equal(greedy_generate(model, source, mask, max_new_tokens=10, use_cache=False), expected)
