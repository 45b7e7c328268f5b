"""The hybrid family's activation memory for ``--dry-run``: a Mamba-2 layer's count is within 5% of
the bytes autograd saves for it on CPU (saved tensors counted once per storage, parameters and
their casts left out), in fp32 and under bf16 autocast, with and without a partial last chunk.
The estimate comes out 2-3% low here: PyTorch's CPU RMSNorm also keeps its normalised values (the
fused CUDA kernel keeps the input and rstd, as counted)."""

import pytest
import torch

from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.hybrid.memory import activation_bytes_per_layer
from mtl.parallel.topology import Topology

MARGIN = 0.05


def saved_bytes(layer: torch.nn.Module, hidden: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd keeps for backward of ``layer(hidden)``, without
    the parameters' and their 1-D casts (per channel or head: every activation has batch and
    sequence dimensions)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and tensor.dim() > 1:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(hidden)
    return sum(kept.values())


@pytest.mark.parametrize("precision, chunk, seq", [("fp32", 8, 32), ("bf16", 16, 32), ("bf16", 16, 24)])
def test_mamba_layer_estimate_is_within_five_percent_of_the_saved_tensors(make_hybrid_config, precision, chunk, seq):
    config = make_hybrid_config(model={"mamba_chunk_size": chunk, "seq_length": seq},
                                train={"precision": precision, "micro_batch_size": 2})
    family, backend = registry("model family").get("hybrid"), registry("backend").get("local")
    model = build_model(family, config, Topology.single(), backend)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = next(m for m in model.modules() if getattr(m, "symbol", None) == "M")
    layer.to(dtype)  # the weights as train.params_dtype casts them
    hidden = torch.randn(seq, 2, config.model.hidden_size, dtype=dtype, requires_grad=True)
    measured = saved_bytes(layer, hidden, autocast=precision == "bf16")
    estimate = activation_bytes_per_layer(config)[layer.layer_number]
    assert config.model.hybrid_pattern[layer.layer_number] == "M"
    assert abs(estimate - measured) <= MARGIN * measured, (estimate, measured)
