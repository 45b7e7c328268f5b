"""Transformer Engine modules behind mtl's column/row-parallel contract.

- TP and SP are TE's own (``parallel_mode`` "column"/"row", ``sequence_parallel``), driven by
  mtl's topology: ``tp_group``/``tp_size`` come from ``Topology``. Activations are mtl's
  sequence-first ``[s(/tp), b, h]``.
- Parameter names and layouts are mtl's (``weight``, ``bias``; ``linear_fc1.weight`` ...), every
  split parameter's ``ParamLayout`` recording its ``tp_split_dim`` (and SwiGLU's fc1 ``tp_stride = 2``: TE gates the
  first half of each rank's fc1 output, so each rank holds ``[gate_local; up_local]`` as mtl
  does), so mtl's initialisation, checkpoints and converters serve TE models unchanged.
- The fused leaves (``LayerNormLinear``, ``LayerNormMLP``) are handed the layer's norm module and
  use *its* parameters: TE's ``layer_norm_weight`` is replaced by the norm's ``weight``. The norm
  module is registered first in the layer, so ``named_parameters`` names them ``input_norm.weight``.
- Under sequence parallelism a replicated parameter that sees only ``[s/tp]`` of the tokens
  (norm weights, a row layer's bias) gets partial gradients from TE. It is marked
  (``mark_sequence_parallel_grad``), as the local backend's are, and ``DataParallel`` sums the
  marked gradients over TP once per step (Megatron's ``sequence_parallel`` attribute and its
  ``finalize_model_grads``).
- FP8: each module runs its forward inside ``transformer_engine.pytorch.autocast`` with the TE
  recipe of ``train.fp8`` (delayed, current, blockwise), amaxes reduced over the TP group.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.log import get_logger
from mtl.core.registrations import Fp8Settings
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.param_layout import set_param_layout
from mtl.parallel.sequence_parallel_grads import mark_sequence_parallel_grad
from mtl.te.availability import require_te
from mtl.te.config_checks import FAST_ACCUMULATION_REFUSED

require_te()

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as te_recipe  # noqa: E402

log = get_logger(__name__)


def te_recipe_for(fp8: Fp8Settings | None):
    """The TE recipe of mtl's FP8 settings (None: no FP8)."""
    if fp8 is None:
        return None
    if not fp8.fast_accumulation:  # resolve refuses it first (config_checks.py); modules built directly land here
        raise ConfigError(FAST_ACCUMULATION_REFUSED)
    fmt = te_recipe.Format.HYBRID if fp8.format == "hybrid" else te_recipe.Format.E4M3
    if fp8.recipe == "delayed":
        return te_recipe.DelayedScaling(margin=fp8.margin, fp8_format=fmt, amax_history_len=fp8.amax_history_len,
                                        amax_compute_algo=fp8.amax_compute_algo)
    if fp8.recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if fp8.recipe == "blockwise":
        return te_recipe.Float8BlockScaling(fp8_format=fmt)
    raise ConfigError(f"train.fp8 = '{fp8.recipe}' is not a recipe of the te backend (current, delayed, blockwise)")


def fp8_shape_ok(x: torch.Tensor, recipe) -> bool:
    """FP8 on, and TE's FP8 GEMM takes this many tokens (a multiple of 16). A KV-cache decoding
    step (a few tokens) runs in the compute precision instead: TE refuses it otherwise."""
    return recipe is not None and (x.numel() // x.shape[-1]) % 16 == 0


def _tag(param: nn.Parameter | None, split_dim: int | None, stride: int = 1) -> None:
    if param is None or not isinstance(param, nn.Parameter):
        return
    if split_dim is not None:
        set_param_layout(param, tp_split_dim=split_dim, tp_stride=stride)


def _tp(topology) -> tuple[int, object]:
    if topology is None or topology.tp == 1:
        return 1, None
    return topology.tp, topology.tp_group


# Dynamo cannot trace TE's FP8 autocast (InternalTorchDynamoError, TE 2.20.2 with torch 2.11 on
# an H100: benchmarks/log), so under ``train.compile`` an FP8 TE module runs eagerly
# between the compiled pieces of its layer. In bf16 too TE modules run eagerly there: TE keeps
# ``LayerNormLinear`` and ``LayerNormMLP`` out of dynamo (``no_torch_dynamo``) and runs a
# ``te.Linear`` accumulating into ``main_grad`` through its eager fallback.
@torch.compiler.disable
def _fp8_call(forward, recipe, amax_group, x: torch.Tensor, *args, **kwargs):
    with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group):
        return forward(x, *args, **kwargs)


def _switch_on_main_grad_accumulation(te_module: nn.Module, weights: list[nn.Parameter]) -> None:
    """TE's ``fuse_wgrad_accumulation``: the weight-gradient GEMMs add into ``weight.main_grad``
    (fp32) in place. ``grad_added_to_main_grad`` present makes TE return a placeholder gradient
    rather than None, so autograd's post-accumulate hooks still fire (the DataParallel hook drops
    it: ``wgrad_fused``, mtl.parallel's wgrad_fusion)."""
    te_module.fuse_wgrad_accumulation = True
    for weight in weights:
        weight.grad_added_to_main_grad = False


class _MainGradAccumulation:
    """mtl.parallel's gradient-accumulation fusion contract (``enable_wgrad_fusion``) for a TE
    module whose one weight is ``self.weight``."""

    def main_grad_accumulation_params(self) -> list[nn.Parameter]:
        return [self.weight] if self.weight.requires_grad else []

    def enable_main_grad_accumulation(self) -> None:
        _switch_on_main_grad_accumulation(self, self.main_grad_accumulation_params())


_DELAYED_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


class _Fp8StateAsTensors:
    """TE's FP8 extra state (delayed scaling's scales and amax histories) as plain tensors.

    TE serialises it as a pickle inside a uint8 tensor and, rightly, refuses to unpickle it
    unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (a pickle can run code). mtl's checkpoints
    load extra state with ``torch.load(weights_only=True)``, so this state is a dict of
    tensors and numbers that needs no pickle; the recipe it belongs to is the run's own
    (``train.fp8``), not one read from the file. Stateless recipes (current, blockwise) and
    modules that never ran FP8 save TE's empty tensor, as TE does."""

    _fp8_num_gemms = 1  # GEMMs of one forward (TE's ``num_gemms``): LayerNormMLP has 2

    def get_extra_state(self):
        meta = self.fp8_meta
        recipe = meta.get("recipe")
        if recipe is None or not recipe.delayed() or "scaling_fwd" not in meta:
            return torch.empty(0, dtype=torch.uint8)
        fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
        tensors = (fwd.scale, fwd.amax_history, bwd.scale, bwd.amax_history)
        state = {name: t.detach().to("cpu", copy=True) for name, t in zip(_DELAYED_TENSORS, tensors)}
        state["num_gemms"] = int(meta["num_gemms"])
        return state

    def set_extra_state(self, state) -> None:
        if not isinstance(state, dict):  # TE's own format: empty, or a pickle TE guards itself
            return super().set_extra_state(state)
        recipe = getattr(self, "_te_recipe", None)
        if recipe is None or not recipe.delayed():
            _warn_once("recipe", "te backend: the checkpoint holds delayed-scaling FP8 state but train.fp8 is not "
                                 "'delayed' now; the FP8 state starts fresh")
            return None
        if state["num_gemms"] != self._fp8_num_gemms:
            _warn_once("gemms", "te backend: the checkpoint's FP8 state belongs to a module with another number "
                                "of GEMMs; the FP8 state starts fresh")
            return None
        self.fp8_meta["num_gemms"] = self._fp8_num_gemms
        self.fp8_meta["recipe"] = recipe
        self.init_fp8_meta_tensors(recipe)  # allocates scales and histories for this recipe
        fwd, bwd = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        targets = (fwd.scale, fwd.amax_history, bwd.scale, bwd.amax_history)
        if any(state[name].shape != t.shape for name, t in zip(_DELAYED_TENSORS, targets)):
            _warn_once("shape", "te backend: the checkpoint's FP8 amax histories have another length than "
                                "train.fp8_amax_history_len now; the FP8 state starts fresh")
            return None
        with torch.no_grad():
            for name, target in zip(_DELAYED_TENSORS, targets):
                target.copy_(state[name])
        return None


class _Fp8Forward:
    """Runs the TE module's forward inside TE's autocast when FP8 is on."""

    def _setup_fp8(self, fp8: Fp8Settings | None, tp_group) -> None:
        self._te_recipe = te_recipe_for(fp8)
        self._amax_group = tp_group

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if not fp8_shape_ok(x, self._te_recipe):
            return super().forward(x, *args, **kwargs)
        return _fp8_call(super().forward, self._te_recipe, self._amax_group, x, *args, **kwargs)


class _PlainLinearAccumulation(_MainGradAccumulation):
    """A plain ``te.Linear`` accumulates into ``main_grad`` only under FP8.

    Under torch.compile TE 2.20.2 runs a ``te.Linear`` with ``fuse_wgrad_accumulation`` through
    its eager fallback, behind a graph break; without it the linear compiles with its layer and
    the DataParallel hook adds its gradient. Measured in one call on an H100 (reference model, te
    bf16 compiled, benchmarks/log): 1.202 s/iter with only the fused leaves accumulating
    against 1.300 s with this linear accumulating too (1.173 against 1.170 under
    ``train.cuda_graphs``, where host work no longer shows). An FP8 TE module runs eagerly in any
    case (``_fp8_call``), so there the fused accumulation costs nothing and saves the add."""

    def main_grad_accumulation_params(self) -> list[nn.Parameter]:
        return super().main_grad_accumulation_params() if self._te_recipe is not None else []


class TEColumnParallelLinear(_PlainLinearAccumulation, _Fp8StateAsTensors, _Fp8Forward, te.Linear):
    def __init__(self, input_size: int, output_size: int, *, bias: bool, init_std: float, topology,
                 gather_output: bool = False, sequence_parallel: bool = False, stride: int = 1,
                 fp8: Fp8Settings | None = None):
        if gather_output:
            raise ConfigError("the te backend's column linear does not gather its output; use model.backend = 'local'")
        tp, group = _tp(topology)
        super().__init__(input_size, output_size, bias=bias, tp_group=group, tp_size=tp,
                         sequence_parallel=sequence_parallel and tp > 1, parallel_mode="column", device="cuda")
        _tag(self.weight, 0, stride)
        _tag(self.bias if bias else None, 0, stride)
        self._setup_fp8(fp8, group)


class TERowParallelLinear(_PlainLinearAccumulation, _Fp8StateAsTensors, _Fp8Forward, te.Linear):
    def __init__(self, input_size: int, output_size: int, *, bias: bool, init_std: float, topology,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, fp8: Fp8Settings | None = None):
        if not input_is_parallel:
            raise ConfigError("the te backend's row linear takes a TP-split input (input_is_parallel=True) only")
        tp, group = _tp(topology)
        sp = sequence_parallel and tp > 1
        super().__init__(input_size, output_size, bias=bias, tp_group=group, tp_size=tp, sequence_parallel=sp,
                         parallel_mode="row", device="cuda")
        _tag(self.weight, 1)
        if bias and sp:  # added after the reduce-scatter: each rank sees its tokens only
            mark_sequence_parallel_grad(self.bias)
        self._setup_fp8(fp8, group)


def build_norm(hidden_size: int, *, kind: str, eps: float, topology=None, sequence_parallel: bool = False) -> nn.Module:
    classes = {"rmsnorm": te.RMSNorm, "layernorm": te.LayerNorm}
    if kind not in classes:
        raise ConfigError(f"model.normalization = '{kind}' is not a norm the te backend builds ({sorted(classes)})")
    norm = classes[kind](hidden_size, eps=eps, device="cuda")
    norm.mtl_kind, norm.mtl_eps = kind, eps  # what a fused leaf needs to apply it
    if sequence_parallel and _tp(topology)[0] > 1:
        for param in norm.parameters():
            mark_sequence_parallel_grad(param)
    return norm


def _norm_kind(norm: nn.Module) -> tuple[str, float]:
    kind = getattr(norm, "mtl_kind", None)
    if kind is None:
        raise ConfigError("the te backend fuses only norms built by its own norm factory")
    return ("RMSNorm" if kind == "rmsnorm" else "LayerNorm"), norm.mtl_eps


def _share_norm(module: nn.Module, norm: nn.Module) -> None:
    """Make the TE module use the layer's norm parameters (registered under the norm's names)."""
    module.layer_norm_weight = norm.weight
    if getattr(norm, "bias", None) is not None and hasattr(module, "layer_norm_bias"):
        module.layer_norm_bias = norm.bias


class TENormColumnParallelLinear(_MainGradAccumulation, _Fp8StateAsTensors, _Fp8Forward,
                                 te.LayerNormLinear):
    """``column_linear(norm(x))`` in one TE module (``LayerNormLinear``)."""

    def __init__(self, input_size: int, output_size: int, *, norm: nn.Module, bias: bool, init_std: float, topology,
                 sequence_parallel: bool = False, stride: int = 1, fp8: Fp8Settings | None = None):
        tp, group = _tp(topology)
        normalization, eps = _norm_kind(norm)
        super().__init__(input_size, output_size, eps=eps, bias=bias, normalization=normalization, tp_group=group,
                         tp_size=tp, sequence_parallel=sequence_parallel and tp > 1, parallel_mode="column",
                         device="cuda")
        _share_norm(self, norm)
        _tag(self.weight, 0, stride)
        _tag(self.bias if bias else None, 0, stride)
        self._setup_fp8(fp8, group)


class _Params(nn.Module):
    """Holds a linear's parameters under mtl's names (``weight``, ``bias``)."""

    mtl_parameter_view = True  # the TE module uses them; this module only names them (wgrad fusion)

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        super().__init__()
        self.weight = weight
        self.bias = bias


class _LayerNormMLP(_Fp8StateAsTensors, te.LayerNormMLP):
    """TE's LayerNormMLP with its FP8 state saved as tensors; ``_te_recipe`` is set by TENormMLP."""

    _te_recipe = None
    _fp8_num_gemms = 2  # fc1 and fc2


class TENormMLP(nn.Module):
    """The whole MLP block in one TE ``LayerNormMLP``; parameters named as mtl's MLP."""

    def __init__(self, *, norm: nn.Module, hidden_size: int, ffn_hidden_size: int, activation: str, bias: bool,
                 init_std: float, output_init_std: float, topology, sequence_parallel: bool,
                 fp8: Fp8Settings | None = None):
        super().__init__()
        tp, group = _tp(topology)
        sp = sequence_parallel and tp > 1
        normalization, eps = _norm_kind(norm)
        fused = _LayerNormMLP(hidden_size, ffn_hidden_size, eps=eps, bias=bias, normalization=normalization,
                                activation=activation, tp_group=group, tp_size=tp, sequence_parallel=sp,
                                set_parallel_mode=True, device="cuda")
        _share_norm(fused, norm)
        gated = activation == "swiglu"
        # registered before the TE module: these are the names named_parameters reports
        self.linear_fc1 = _Params(fused.fc1_weight, fused.fc1_bias if bias else None)
        self.linear_fc2 = _Params(fused.fc2_weight, fused.fc2_bias if bias else None)
        self.fused = fused
        for param in self.linear_fc1.parameters():
            _tag(param, 0, 2 if gated else 1)
        _tag(self.linear_fc2.weight, 1)
        if bias and sp:
            mark_sequence_parallel_grad(self.linear_fc2.bias)
        self._te_recipe = te_recipe_for(fp8)
        fused._te_recipe = self._te_recipe
        self._amax_group = group

    def main_grad_accumulation_params(self) -> list[nn.Parameter]:
        return [w for w in (self.linear_fc1.weight, self.linear_fc2.weight) if w.requires_grad]

    def enable_main_grad_accumulation(self) -> None:
        _switch_on_main_grad_accumulation(self.fused, self.main_grad_accumulation_params())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] (un-normalised) -> [s(/tp), b, h]."""
        if not fp8_shape_ok(hidden, self._te_recipe):
            return self.fused(hidden)
        return _fp8_call(self.fused, self._te_recipe, self._amax_group, hidden)


# TE's DotProductAttention selects its kernel again whenever the shapes, mask or training flag
# change, in code dynamo cannot trace (InternalTorchDynamoError in get_attention_backend, TE
# 2.20.2 with torch 2.11, H100): an evaluation or a KV-cache generation step inside a compiled
# layer runs it eagerly. Training keeps one configuration, selected once.
@torch.compiler.disable
def _attention_outside_compile(attention, q, k, v, mask):
    return attention(q, k, v, attn_mask_type=mask)


class TECoreAttention(nn.Module):
    """TE's ``DotProductAttention`` on the backend contract's ``[b, s, heads, d]`` tensors."""

    def __init__(self, *, num_heads: int, num_query_groups: int, head_dim: int, causal: bool, dropout: float,
                 topology, softmax_scale: float | None = None):
        super().__init__()
        if topology is not None and topology.cp > 1:
            raise ConfigError("the te backend does not drive context parallelism yet; use parallel.cp = 1 "
                              "or model.backend = 'local'")
        self.num_heads, self.head_dim, self.causal = num_heads, head_dim, causal
        self._tp_split = topology is not None and topology.tp > 1
        # local (per-TP-rank) head counts, so TE's own TP arithmetic stays at 1
        self.attention = te.DotProductAttention(num_heads, head_dim, num_gqa_groups=num_query_groups,
                                                attention_dropout=dropout, qkv_format="bshd",
                                                attn_mask_type="causal" if causal else "no_mask",
                                                softmax_scale=softmax_scale)
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s_q = q.shape[0], q.shape[1]
        mask = "no_mask"
        if self.causal:  # a KV-cache step: the queries are the last s_q positions
            mask = "causal" if s_q == k.shape[1] else "causal_bottom_right"
        if not self.training:
            out = _attention_outside_compile(self.attention, q, k, v, mask)
        elif self.dropout > 0 and self._tp_split:
            with get_rng_tracker().fork():
                out = self.attention(q, k, v, attn_mask_type=mask)
        else:
            out = self.attention(q, k, v, attn_mask_type=mask)
        return out.view(b, s_q, self.num_heads, self.head_dim)  # [b, s, heads * d] -> [b, s, heads, d]
