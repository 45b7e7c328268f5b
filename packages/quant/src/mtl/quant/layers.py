"""FP8 column- and row-parallel linears: mtl.parallel's layers with an FP8 local GEMM.

The TP communication (sequence-parallel all-gather and reduce-scatter, the all-reduce after
a row layer) and the parameter layout are mtl.parallel's, unchanged: only ``local_linear``,
the rank's GEMM between them, is replaced. Weights stay in their own dtype (fp32 or bf16
master/compute weights); they are quantized on the first call after a change (the weight
cache below; delayed scaling: every call). The bias is added in the compute dtype.

Which amaxes are reduced over TP so that every rank's scale is one process's: the weight's
always (TP splits it), the input's in a row layer (its features are split), the output
gradient's in a column layer (its features are split). Under sequence parallelism the column
layer's input is gathered before the GEMM and the row layer's output gradient is gathered by
the reduce-scatter's backward, so neither needs more. Context parallelism splits every
activation's tokens over the cp group, so the input's and the output gradient's amaxes (and,
row-wise, the weight gradient's scales along the tokens) are also reduced over cp; without
that, cp=2 trained with other scales than one process (weight gradients 15% apart on the
tiny model). Data parallelism splits micro-batches, not tokens: one process scales each
micro-batch on its own too, so current scaling reduces nothing over dp.

Delayed scaling keeps ``fp8_amax_history`` ``[3, L]`` (rows: input, weight, output gradient;
column 0 the most recent) as a parameter with ``requires_grad=False``: the model-state
checkpoint saves and restores it, the optimizer skips it. Its amaxes are also reduced over
the data/context-parallel group, so every replica holds the same history. The scale of a
call comes from the history (its max, or the most recent entry), or from the call's own amax
while the history is still empty (the first call); the call's amax then enters the history.
A forward recomputed for activation checkpointing reuses the scales its original forward used
(kept first in, first out until that micro-batch's backward) and records nothing; the ops of
``delayed.py`` decide this at run time, so the recipe compiles (one graph, no recompiles).

Current and row-wise scaling keep the weight's FP8 operands in a ``WeightCache``
(``weight_cache.py``): quantized on the first call after an optimizer step (or a load), reused
by the other micro-batches. Delayed scaling has none: its weight scale comes from the amax
history, which moves with every call, so the FP8 weight differs between micro-batches too.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.registrations import Fp8Settings
from mtl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mtl.parallel.tensor_parallel.wgrad_fusion import fused_main_grad
from mtl.quant import delayed
from mtl.quant.delayed import GRAD_OUTPUT, INPUT, WEIGHT
from mtl.quant.linear_function import Fp8Linear, GemmPlan, quantize_weight
from mtl.quant.scaling import E4M3, amax, formats, reduce_max, scale_from_amax
from mtl.quant.weight_cache import QuantizedWeight, WeightCache, caching_enabled

RECIPES = ("current", "delayed", "rowwise")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain linear would return here: autocast's when it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Fp8Gemm:
    """The FP8 ``local_linear`` shared by both layers; ``k_split`` says whether TP splits the
    input features (row-parallel) or the output features (column-parallel)."""

    def _setup_fp8(self, fp8: Fp8Settings, topology, k_split: bool) -> None:
        if fp8.recipe not in RECIPES:
            raise ConfigError(
                f"train.fp8 = '{fp8.recipe}' is not a recipe of the fp8 backend (it has {', '.join(RECIPES)})"
            )
        self.fp8 = fp8
        self.k_split = k_split
        self.grad_dtype = formats(fp8.format)[1]
        dp_group = topology.group("dp_cp") if topology is not None else None
        self.history_groups = (self.tp_group, dp_group)
        self.cp_group = topology.cp_group if topology is not None else None  # splits the tokens
        if fp8.recipe == "delayed":
            self.fp8_amax_history = nn.Parameter(torch.zeros(3, fp8.amax_history_len), requires_grad=False)
            self.fp8_key = delayed.new_layer_key(self)  # names this layer's pending scales (delayed.py)
        self.accumulates_main_grad = False  # enable_main_grad_accumulation switches it on
        cacheable = fp8.recipe in ("current", "rowwise") and caching_enabled()
        self.weight_cache = WeightCache() if cacheable else None
        if self.weight_cache is not None:  # a loaded weight is a new weight
            self.register_load_state_dict_post_hook(lambda module, _keys: module.weight_cache.invalidate())

    def _apply(self, fn, recurse=True):
        """``module.to(...)``, ``.cuda()``, ...: the cached FP8 weight is of the old tensor."""
        cache = self.__dict__.get("weight_cache")
        if cache is not None:
            cache.invalidate()
        return super()._apply(fn, recurse)

    def _groups(self, role: int) -> tuple:
        """The groups over which this role's amax is reduced (see the module docstring)."""
        split = role == WEIGHT or (role == INPUT) == self.k_split
        tp_group = self.tp_group if split else None
        if self.fp8.recipe == "delayed":  # the data/context-parallel group holds cp
            return (tp_group, self.history_groups[1])
        return (tp_group, None if role == WEIGHT else self.cp_group)

    def _current_scale(self, role: int, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scale_from_amax(reduce_max(amax(tensor), *self._groups(role)), dtype)

    # mtl.parallel's gradient-accumulation fusion (wgrad_fusion.enable_wgrad_fusion): the
    # weight-gradient GEMM adds into the weight's fp32 main_grad (linear_function.py), so no
    # bf16 gradient is written and no separate add runs per micro-batch
    def main_grad_accumulation_params(self) -> list[nn.Parameter]:
        return [self.weight]

    def enable_main_grad_accumulation(self) -> None:
        self.accumulates_main_grad = True

    def _layout_plan(self) -> GemmPlan:
        """The plan's fixed part: recipe, gradient format, TP layout, accumulation mode."""
        return GemmPlan(rowwise=self.fp8.recipe == "rowwise", grad_dtype=self.grad_dtype, tp_group=self.tp_group,
                        k_split=self.k_split, fast_accum=self.fp8.fast_accumulation, cp_group=self.cp_group)

    def _plan(self, x: torch.Tensor, weight: torch.Tensor) -> GemmPlan:
        recipe = self.fp8.recipe
        plan = self._layout_plan()
        if recipe == "current":
            plan.scale_x = self._current_scale(INPUT, x, E4M3)
            plan.weight = self._cached_weight(plan, weight)
            plan.scale_w = plan.weight.forward[1] if plan.weight is not None else self._current_scale(WEIGHT, weight, E4M3)
            plan.grad_scale = lambda dy: self._current_scale(GRAD_OUTPUT, dy, self.grad_dtype)
        elif recipe == "delayed":
            self._plan_delayed(plan, x, weight)
        else:
            plan.weight = self._cached_weight(plan, weight)
        return plan

    def _cached_weight(self, plan: GemmPlan, weight: torch.Tensor) -> QuantizedWeight | None:
        """W's FP8 operands from the weight cache (built when stale), or None without one: the
        GEMMs then quantize W per call."""
        if self.weight_cache is None:
            return None

        def build(w: torch.Tensor) -> QuantizedWeight:
            scale_w = None if plan.rowwise else self._current_scale(WEIGHT, w, E4M3)
            return quantize_weight(w, plan, scale_w)

        return self.weight_cache.get(weight, build)

    # train.cuda_graphs (mtl.models.gpt.cuda_graphs): the captured forward reads the cached
    # FP8 weight's tensors, so they are kept and refreshed in place, before each replay.
    def before_graph_capture(self) -> None:
        if self.fp8.recipe == "delayed":
            raise ConfigError("train.cuda_graphs = true does not work with train.fp8 = 'delayed'; use 'current'")
        if self.weight_cache is not None:
            self.weight_cache.keep_in_place()

    def before_graph_replay(self) -> None:
        # every time, not only when marked stale: the cache's own check also sees an in-place
        # edit of the weight (its version counter), which a captured forward cannot look at
        if self.weight_cache is not None:
            self._cached_weight(self._layout_plan(), self.weight)

    def _plan_delayed(self, plan: GemmPlan, x: torch.Tensor, weight: torch.Tensor) -> None:
        """The scales from the amax history, through the ops of ``delayed.py`` (which tell a
        recompute from a forward at run time, so this compiles as one graph)."""
        settings = self.fp8
        use_max, margin = settings.amax_compute_algo == "max", settings.margin
        history, key = self.fp8_amax_history, self.fp8_key
        record = self.training and torch.is_grad_enabled()  # and not a recompute: the op knows
        amax_x = reduce_max(amax(x), *self._groups(INPUT))
        amax_w = reduce_max(amax(weight), *self._groups(WEIGHT))
        plan.scale_x, plan.scale_w, token = delayed.forward_scales(history, amax_x, amax_w, key, record, use_max,
                                                                   margin)

        def grad_scale(dy: torch.Tensor) -> torch.Tensor:
            amax_dy = reduce_max(amax(dy), *self._groups(GRAD_OUTPUT))
            return delayed.grad_scale(history, amax_dy, key, token, use_max, margin, self.grad_dtype)

        plan.grad_scale = grad_scale

    # Compiles with the layer (``train.compile``): the GEMM itself is the ``mtl::fp8_gemm``
    # op, which inductor keeps whole. When inductor lowered ``torch._scaled_mm`` itself, the FP8
    # weights stopped learning on an H100 (benchmarks/log; tests/gpu/test_fp8.py).
    def local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] through FP8 GEMMs (forward and backward)."""
        out_dtype = compute_dtype(x)
        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # [s * b, K]
        main_grad = fused_main_grad(weight) if self.accumulates_main_grad else None
        y = Fp8Linear.apply(x2d, weight, self._plan(x2d, weight), out_dtype, main_grad)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)

    def fp8_repr(self) -> str:
        cache = ", weight_cache" if self.weight_cache is not None else ""
        fast = ", fast_accumulation" if self.fp8.fast_accumulation else ""
        return f"fp8={self.fp8.recipe}/{self.fp8.format}{cache}{fast}"


class Fp8ColumnParallelLinear(Fp8Gemm, ColumnParallelLinear):
    """``ColumnParallelLinear`` with FP8 GEMMs; ``fp8`` the resolved settings."""

    def __init__(self, input_size: int, output_size: int, *, fp8: Fp8Settings, topology=None, **kwargs):
        super().__init__(input_size, output_size, topology=topology, **kwargs)
        self._setup_fp8(fp8, topology, k_split=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fp8_repr()}"


class Fp8RowParallelLinear(Fp8Gemm, RowParallelLinear):
    """``RowParallelLinear`` with FP8 GEMMs; ``fp8`` the resolved settings."""

    def __init__(self, input_size: int, output_size: int, *, fp8: Fp8Settings, topology=None, **kwargs):
        super().__init__(input_size, output_size, topology=topology, **kwargs)
        self._setup_fp8(fp8, topology, k_split=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fp8_repr()}"
