"""Weight-gradient GEMMs that accumulate straight into the fp32 ``main_grad`` (Megatron's
gradient-accumulation fusion).

With bf16 weights and fp32 gradient buffers (``train.params_dtype = "bf16"``), autograd
would write each micro-batch's weight gradient as a bf16 tensor and the DataParallel hook
would then add it into ``param.main_grad``: an extra pass over every weight per micro-batch
(62 ms of a 1.15 s step on one H100 for the reference model) and a bf16 rounding of each
micro-batch's gradient. Here the backward computes ``main_grad += dyᵀ x`` as one GEMM with an
fp32 accumulator and output (cuBLAS's beta = 1), so the bf16 gradient never exists.

Autograd still needs a gradient for the weight, or the DataParallel post-accumulate hook
(which marks buckets ready and launches their reduction) would never fire: the backward
returns an uninitialised tensor, and the hook, seeing ``param.wgrad_fused``, drops it instead
of adding it. That is only sound for a weight whose every use accumulates this way, so fusion
is switched on per weight by ``enable_wgrad_fusion``: linears, an untied output layer (its
fused loss, ``linear_cross_entropy``, accumulates the same way) and an untied word embedding
(``VocabParallelEmbedding`` adds each token's gradient row into its row of ``main_grad``,
embedding_grad.py: no dense bf16 ``[V, h]`` gradient, about 5 ms of a 1.06 s step on an H100),
never a weight tied between the word embedding and the output layer.

Another backend's module may take part by accumulating into ``main_grad`` in its own backward
(mtl-te over Transformer Engine's ``fuse_wgrad_accumulation``, mtl-quant's FP8 GEMM over
cuBLASLt); ``enable_wgrad_fusion`` says how.

The accumulation is a ``torch.library`` op (``mtl::accumulate_weight_grad``) that mutates
``main_grad``, so ``torch.compile`` traces the linear (no graph break) and keeps the GEMM as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.parallel.param_layout import param_layout


# A torch.library.Library op rather than torch.library.custom_op: it runs for every linear in
# every micro-batch, and custom_op's Python wrapper costs the host several microseconds more
# per call (an empty op: 6.7 against 2.4 us on a CPU).
_LIB = torch.library.Library("mtl", "FRAGMENT")
_LIB.define("accumulate_weight_grad(Tensor(a!) main_grad, Tensor grad_output, Tensor inputs) -> ()")


def _accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_outputᵀ [out, T] @ inputs [T, in]`` with fp32 accumulation."""
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = inputs.reshape(-1, inputs.shape[-1])
    if main_grad.is_cuda and dy.dtype != main_grad.dtype:
        # one cuBLAS GEMM: bf16 operands, fp32 accumulator, C = D = main_grad with beta = 1
        torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU has no mixed-dtype GEMM; the same sum, computed in fp32
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


_LIB.impl("accumulate_weight_grad", _accumulate_weight_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("mtl::accumulate_weight_grad")
def _(main_grad, grad_output, inputs) -> None:
    return None


accumulate_weight_grad = torch.ops.mtl.accumulate_weight_grad.default


class _LinearAccumulatingMainGrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient goes into ``main_grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        # not saved_tensors: main_grad is a view of a buffer that other weights' gradients
        # write to before this backward, which autograd's version check would refuse
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        accumulate_weight_grad(ctx.main_grad, grad_output, x)
        # The hook that follows ignores this tensor (param.wgrad_fused); it only has to exist.
        grad_weight = torch.empty_like(weight)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def fused_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """The buffer a GEMM must accumulate ``weight``'s gradient into, or None: the weight's
    ``main_grad`` where ``enable_wgrad_fusion`` switched it on and a gradient buffer gave it one."""
    if not getattr(weight, "wgrad_fused", False) or not torch.is_grad_enabled():
        return None
    return getattr(weight, "main_grad", None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, with the weight gradient accumulated into ``fused_main_grad(weight)``."""
    main_grad = fused_main_grad(weight)
    if main_grad is None:
        return F.linear(x, weight, bias)
    return _LinearAccumulatingMainGrad.apply(x, weight, bias, main_grad)


def enable_wgrad_fusion(module: nn.Module) -> int:
    """Fuse the weight-gradient accumulation of every weight in ``module`` whose only holders
    are modules whose GEMM is ``linear`` above (they say so with ``gemm_accumulates_main_grad``:
    the tensor-parallel linears, unless a backend overrides their ``local_linear``, which then
    keeps its own backward), or backend modules that accumulate into ``main_grad`` themselves
    (the contract below; mtl-quant's FP8 linears, mtl-te's modules, the word embedding
    ``VocabParallelEmbedding``). A weight tied to anything else, the word embedding (a module
    with ``word_embedding_table = True``) tied to the output layer, or to another pipeline
    stage's copy (``ParamLayout.shared_embedding``) keeps the hook's path. Returns how many
    weights were switched on; it takes effect only where the weight also has a ``main_grad``.

    The contract for another backend's module (e.g. mtl-te's, over Transformer Engine's
    ``fuse_wgrad_accumulation``): it defines ``main_grad_accumulation_params()``, the weights
    its own backward can accumulate into ``param.main_grad`` (with an fp32 accumulator) while
    still returning a gradient tensor for autograd's hooks, and
    ``enable_main_grad_accumulation()``, which switches that on; this function calls it only
    when every holder of every such weight agrees, and for modules sharing a weight, for all
    of them or none. A module that merely re-exposes another module's parameters under mtl's
    names sets ``mtl_parameter_view = True`` and is no holder. A claim covers the module and
    all its submodules: none of them may use a claimed weight in a way that does not
    accumulate into ``main_grad`` (that gradient would be dropped).
    Switched on, such a module must find ``param.main_grad`` at every backward (the trainer
    calls this only with fp32 gradient buffers, which give every weight one)."""
    # backend modules that accumulate themselves -> the ids of the weights they claim
    claims = {sub: {id(p) for p in sub.main_grad_accumulation_params()} for sub in module.modules()
              if callable(getattr(sub, "main_grad_accumulation_params", None))}
    claimed: dict[int, set[int]] = {}  # param id -> ids of the modules that accumulate it themselves
    for sub, ids in claims.items():
        inside = {id(m) for m in sub.modules()}  # the module and its submodules hold them
        for key in ids:
            claimed.setdefault(key, set()).update(inside)

    def fusable(holder: nn.Module, name: str, param: nn.Parameter) -> bool:
        if id(holder) in claimed.get(id(param), ()):
            return True
        return name == "weight" and getattr(holder, "gemm_accumulates_main_grad", False)

    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        if getattr(sub, "mtl_parameter_view", False):
            continue  # it only names the parameters: no holder (a parameter held only so stays unfused)
        for name, param in sub.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((sub, name))
            params[id(param)] = param

    def tied_word_embedding(held_by: list[tuple[nn.Module, str]]) -> bool:
        # The table shared with the output layer keeps the hook's path, as its copies split
        # over pipeline stages (shared_embedding) must: every layout of a tied model then sums
        # the two uses' gradients the same way.
        return len(held_by) > 1 and any(getattr(sub, "word_embedding_table", False) for sub, _ in held_by)

    fused: set[int] = set()
    for key, held_by in holders.items():
        param = params[key]
        if (all(fusable(sub, name, param) for sub, name in held_by) and not tied_word_embedding(held_by)
                and not param_layout(param).shared_embedding):
            fused.add(key)
    # A module switches all its weights or none, so a weight it cannot take takes its others
    # out too, which may leave another module sharing one of them short: repeat until stable,
    # then switch on only the modules whose every weight is still in.
    changed = True
    while changed:
        changed = False
        for ids in claims.values():
            if ids and not ids <= fused and ids & fused:
                fused -= ids
                changed = True
    for sub, ids in claims.items():
        if ids and ids <= fused:
            sub.enable_main_grad_accumulation()
    for key in fused:
        params[key].wgrad_fused = True
    return len(fused)
