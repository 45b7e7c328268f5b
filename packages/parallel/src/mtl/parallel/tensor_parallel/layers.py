"""Column- and row-parallel linear layers (Megatron's), sequence-first ``[s, b, h]``.

A transformer MLP is ``Row(act(Column(x)))``: the column layer splits its output features
over TP, the row layer splits its input features, and the two need one all-reduce forward
and one backward between them. With ``sequence_parallel`` the replicated activations outside
the pair are split along the sequence instead (``[s/tp, b, h]``), and the all-reduce becomes
an all-gather before the column layer and a reduce-scatter after the row layer.

Both are a ``TensorParallelLinear``: it creates the local weight (and bias), records their
layout (``mtl.parallel.param_layout``: the weight's ``tp_split_dim`` is 0 for the column layer
and 1 for the row layer; a column layer's bias is split with its weight, a row layer's is
replicated, and under sequence parallelism its gradient is summed over TP once per step),
initialises them and prints them. The subclasses hold only the communication around the GEMM.
Biases are tagged ``init_kind = "zeros"`` (``mtl.core.model_protocol``). A weight's kind
depends on its role ("normal", or "residual_output" for a projection into the residual
stream), which only the module using the linear knows: that module tags it. A weight nobody
tagged (a third party's block built from these linears) gets initialisation's name rule.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.core.model_protocol import tag_init
from mtl.parallel.param_layout import param_layout, set_param_layout
from mtl.parallel.tensor_parallel import mappings, wgrad_fusion
from mtl.parallel.tensor_parallel.collectives import StartedCollectives
from mtl.parallel.tensor_parallel.gathered_linear import gathered_linear
from mtl.parallel.tensor_parallel.sharding import divide, shard_of, tp_size_and_rank


class TensorParallelLinear(nn.Module):
    """What the column- and row-parallel linears share: the TP group, this rank's weight
    ``weight_shape`` split on ``split_dim`` (and the bias), their layout records, their
    initialisation, loading from global tensors, the local GEMM and the printed form."""

    split_dim: int  # the weight dimension split over TP: 0 (output features) or 1 (input features)

    def __init__(self, input_size: int, output_size: int, *, topology, sequence_parallel: bool):
        super().__init__()
        self.tp, self.tp_rank, self.tp_group = tp_size_and_rank(topology)
        self.input_size = input_size
        self.output_size = output_size
        self.sequence_parallel = sequence_parallel and self.tp > 1

    def _create_parameters(self, weight_shape: tuple[int, int], *, bias: bool, stride: int, init_std: float,
                           params_dtype: torch.dtype, device) -> None:
        """The weight (``[out, in]`` with ``split_dim`` local) and the bias (split with the weight
        when the output features are; else whole), recorded and initialised."""
        self.stride = stride
        self.weight = nn.Parameter(torch.empty(*weight_shape, dtype=params_dtype, device=device))
        set_param_layout(self.weight, tp_split_dim=self.split_dim, tp_stride=stride)
        if bias:
            self.bias = nn.Parameter(torch.empty(weight_shape[0], dtype=params_dtype, device=device))
            tag_init(self.bias, "zeros")
            if self.split_dim == 0:
                set_param_layout(self.bias, tp_split_dim=0, tp_stride=stride)
            elif self.sequence_parallel:  # each rank adds it to its own tokens: a partial gradient
                set_param_layout(self.bias, sequence_parallel_grad=True)
        else:
            self.register_parameter("bias", None)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of a global ``[out, in]`` weight (and ``[out]`` bias)."""
        self.weight.copy_(shard_of(weight, self.split_dim, self.tp, self.tp_rank, self.stride))
        if bias is not None:
            split = param_layout(self.bias).tp_split_dim is not None
            self.bias.copy_(shard_of(bias, 0, self.tp, self.tp_rank, self.stride) if split else bias)

    def local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's GEMM between the TP communication; a quantized backend (mtl-quant's
        FP8 layers) replaces it and keeps the column/row-parallel contract around it."""
        return wgrad_fusion.linear(x, weight, bias)

    @property
    def gemm_accumulates_main_grad(self) -> bool:
        """The weight's only use is ``wgrad_fusion.linear`` (``local_linear`` not overridden), whose
        backward can add the weight gradient into ``main_grad`` (``enable_wgrad_fusion`` reads it)."""
        return type(self).local_linear is TensorParallelLinear.local_linear

    def extra_repr(self) -> str:
        local_in = f" (local {self.weight.shape[1]})" if self.split_dim == 1 else ""
        local_out = f" (local {self.weight.shape[0]})" if self.split_dim == 0 else ""
        return (
            f"in={self.input_size}{local_in}, out={self.output_size}{local_out}, "
            f"bias={self.bias is not None}, tp={self.tp}, sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(TensorParallelLinear):
    """y = x Wᵀ + b with W ``[out/tp, in]``: input ``[s, b, in]`` (``[s/tp, b, in]`` under
    sequence parallelism), output ``[s, b, out/tp]`` (``[s, b, out]`` with gather_output).
    ``stride`` > 1: the output features fuse ``stride`` parts (SwiGLU's gate and up), each split
    over TP on its own, so this rank holds ``[part0_local; part1_local; ...]``."""

    split_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        topology=None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        stride: int = 1,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__(input_size, output_size, topology=topology, sequence_parallel=sequence_parallel)
        if gather_output and sequence_parallel:
            raise ParallelError(
                "ColumnParallelLinear: gather_output=True with sequence_parallel=True is not a "
                "layout (the output would be full-sequence and full-width); use one of them"
            )
        self.output_size_per_partition = divide(output_size, self.tp, "ColumnParallelLinear output_size")
        divide(output_size, self.tp * stride, f"ColumnParallelLinear output_size (stride {stride})")
        self.gather_output = gather_output
        # gathered_linear's collectives, set up once: with sequence parallelism and the plain GEMM
        # (a subclass overriding local_linear, mtl-quant's FP8, keeps gather then local_linear)
        gathered = self.sequence_parallel and self.gemm_accumulates_main_grad
        self.sp_comm = StartedCollectives(self.tp_group) if gathered else None
        self._create_parameters((self.output_size_per_partition, input_size), bias=bias, stride=stride,
                                init_std=init_std, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_comm is not None:
            # gather and GEMM as one function: the backward's reduce-scatter beside the weight gradient
            return gathered_linear(x, self.weight, self.bias, self.sp_comm)  # [s/tp, b, in] -> [s, b, out/tp]
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel(x, self.tp_group)  # [s/tp, b, in] -> [s, b, in]
        else:
            x = mappings.copy_to_tensor_parallel(x, self.tp_group)
        y = self.local_linear(x, self.weight, self.bias)  # [s, b, out/tp]
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel(y, self.tp_group)  # [s, b, out]
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_output={self.gather_output}"


class RowParallelLinear(TensorParallelLinear):
    """y = x Wᵀ + b with W ``[out, in/tp]``: input ``[s, b, in/tp]`` (or ``[s, b, in]`` with
    input_is_parallel=False), output ``[s, b, out]`` summed over TP (``[s/tp, b, out]`` under
    sequence parallelism). The bias is replicated and added after the reduction."""

    split_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        topology=None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__(input_size, output_size, topology=topology, sequence_parallel=sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ParallelError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the input "
                "of a sequence-parallel row layer is the output of a column layer)"
            )
        self.input_size_per_partition = divide(input_size, self.tp, "RowParallelLinear input_size")
        self.input_is_parallel = input_is_parallel
        self._create_parameters((output_size, self.input_size_per_partition), bias=bias, stride=1,
                                init_std=init_std, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel(x, self.tp_group)  # [s, b, in] -> [s, b, in/tp]
        partial = self.local_linear(x, self.weight, None)  # [s, b, out], a partial sum on each TP rank
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel(partial, self.tp_group)  # -> [s/tp, b, out]
        else:
            y = mappings.reduce_from_tensor_parallel(partial, self.tp_group)
        if self.bias is None:
            return y
        return y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, input_is_parallel={self.input_is_parallel}"
