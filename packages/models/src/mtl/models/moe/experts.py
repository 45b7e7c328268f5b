"""The expert MLPs of one MoE layer as grouped GEMMs over tokens sorted by expert.

One parameter per projection holds every local expert, so a checkpoint stores each
projection as one global tensor ``[num_experts, ...]``:

- ``linear_fc1.weight`` ``[E/ep, fc1_width/tp, h]``; SwiGLU's fc1 holds ``[gate_local; up_local]``
  per expert (``ParamLayout.tp_stride = 2``, as the dense MLP), so its global tensor is ``[E, 2, ffn, h]``;
  GELU's and squared ReLU's (Nemotron-H) are ``[E, ffn, h]``;
- ``linear_fc2.weight`` ``[E/ep, h, ffn/tp]``, global ``[E, h, ffn]``.

Each weight's ``ParamLayout`` (``mtl.parallel.param_layout``), read by the checkpoint layout and
the parallel code: ``expert_split_dim = 0`` (experts split over the ep ranks) and
``tp_split_dim`` (the ffn dimension, split over TP as Megatron splits experts); its
``init_kind`` (fc2 writes into the residual stream) is read by the initialiser.

``forward(tokens [N, h], tokens_per_expert [E/ep])`` returns this TP rank's partial sums
``[N, h]`` (the caller reduces them over TP). ``torch._grouped_mm`` runs all experts in one
kernel where it works for the dtype, device and strides (it wants 16-byte aligned rows); a
loop of per-expert matmuls over the sorted tokens is the fallback, with the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.model_protocol import tag_init
from mtl.models.swiglu import swiglu
from mtl.parallel.param_layout import set_param_layout


def _ep_size_and_rank(topology) -> tuple[int, int]:
    if topology is None:
        return 1, 0
    return getattr(topology, "ep", 1), getattr(topology, "ep_rank", 0)


def _tp_size(topology) -> int:
    return 1 if topology is None else topology.tp


class _ExpertWeight(nn.Module):
    """Holds one projection of every local expert as ``weight``, so that its name reads
    ``experts.linear_fc1.weight`` like the dense MLP's."""

    def __init__(self, shape: tuple[int, ...], *, tp_split_dim: int, tp_stride: int, init_kind: str, init_std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        set_param_layout(self.weight, expert_split_dim=0, tp_split_dim=tp_split_dim, tp_stride=tp_stride)
        tag_init(self.weight, init_kind)
        nn.init.normal_(self.weight, std=init_std)


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.assume_constant_result  # torch.compile runs it eagerly and keeps the answer
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (forward and backward) on this device and dtype."""
    key = (device_type, dtype)
    if key not in _GROUPED_MM_WORKS:
        _GROUPED_MM_WORKS[key] = _probe_grouped_mm(device_type, dtype)
    return _GROUPED_MM_WORKS[key]


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # with gradients on even when first asked from inference (generation, evaluation)
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
        with torch.inference_mode(False), torch.enable_grad():
            return _run_grouped_mm(device, dtype)
    except (RuntimeError, NotImplementedError):
        return False


def _run_grouped_mm(device, dtype: torch.dtype) -> bool:
    a = torch.ones(4, 16, dtype=dtype, device=device, requires_grad=True)
    b = torch.ones(2, 16, 16, dtype=dtype, device=device, requires_grad=True)
    # b transposed in its last two dims, as the layer passes its weights
    out = torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
    torch.autograd.grad(out, (a, b), torch.ones_like(out))  # a dense gradient, as the layer's
    return bool(out.shape == (4, 16))


class GroupedExperts(nn.Module):
    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str,
                 init_std: float, output_init_std: float, topology):
        super().__init__()
        if activation not in ("swiglu", "gelu", "relu2"):
            raise ConfigError(f"model.activation = {activation!r}: the experts implement swiglu, gelu and relu2")
        ep, self.ep_rank = _ep_size_and_rank(topology)
        tp = _tp_size(topology)
        self.num_local_experts = num_experts // ep
        self.gated, self.activation = activation == "swiglu", activation
        ffn_local = ffn_hidden_size // tp
        fc1_width = 2 * ffn_local if self.gated else ffn_local
        self.linear_fc1 = _ExpertWeight((self.num_local_experts, fc1_width, hidden_size), tp_split_dim=1,
                                        tp_stride=2 if self.gated else 1, init_kind="normal", init_std=init_std)
        self.linear_fc2 = _ExpertWeight((self.num_local_experts, hidden_size, ffn_local), tp_split_dim=2,
                                        tp_stride=1, init_kind="residual_output", init_std=output_init_std)
        self.use_grouped_mm: bool | None = None  # None: where it works; False: always the loop

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        if self.gated:  # [gate | up], each [N, ffn/tp]
            return swiglu(intermediate)
        if self.activation == "relu2":  # squared ReLU (Nemotron-H); relu * relu as the dense MLP's (gpt/mlp.py)
            relu = F.relu(intermediate)
            return relu * relu
        return F.gelu(intermediate)

    def grouped_mm_usable(self, tokens: torch.Tensor) -> bool:
        if self.use_grouped_mm is False:
            return False
        dtype = _compute_dtype(tokens)
        if torch.compiler.is_compiling() and dtype != torch.bfloat16:
            return False  # the op's shape function (what torch.compile traces) accepts bf16 only
        align = 16 // torch.empty((), dtype=dtype).element_size()  # elements per 16 bytes
        widths = (*self.linear_fc1.weight.shape[1:], self.linear_fc2.weight.shape[2])
        return all(w % align == 0 for w in widths) and _grouped_mm_works(tokens.device.type, dtype)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """tokens [N, h] sorted by local expert, ``tokens_per_expert [E/ep]`` -> [N, h] partial over TP."""
        if self.grouped_mm_usable(tokens):
            return self._grouped(tokens, tokens_per_expert)
        return self._loop(tokens, tokens_per_expert)

    def _grouped(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(tokens)  # _grouped_mm is not on autocast's list: cast as it would
        offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)  # end row of each expert's group
        w1 = self.linear_fc1.weight.to(dtype).transpose(1, 2)  # [E, h, fc1/tp]
        w2 = self.linear_fc2.weight.to(dtype).transpose(1, 2)  # [E, ffn/tp, h]
        intermediate = torch._grouped_mm(tokens.to(dtype), w1, offs=offsets)  # [N, fc1/tp]
        return torch._grouped_mm(self._activation(intermediate), w2, offs=offsets)  # [N, h]

    # Eager under torch.compile: the split sizes are data (a host read), and a graph per new
    # set of sizes would recompile on every step until dynamo's limit.
    @torch.compiler.disable
    def _loop(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outputs = []
        for expert, chunk in enumerate(tokens.split(tokens_per_expert.tolist())):
            intermediate = F.linear(chunk, self.linear_fc1.weight[expert])  # [n_e, fc1/tp]
            outputs.append(F.linear(self._activation(intermediate), self.linear_fc2.weight[expert]))  # [n_e, h]
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, tokens.shape[-1])


def _compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    device_type = tokens.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tokens.dtype
