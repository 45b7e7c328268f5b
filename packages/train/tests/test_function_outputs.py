"""No autograd Function of mtl returns a tensor its forward filled in place or got back as is.

Under torch 2.11's ``torch.compile`` (the GPU machines' release), a custom ``autograd.Function``
whose forward mutates a tensor in place and returns that very tensor loses its gradient: the
tangent reaches the backward as zeros, and the layers before it train on wrong gradients (on 2
H200s the compiled backward also read past the gradient buffer). torch 2.13, the CI's, compiles it
right, so no equivalence test here can see it (benchmarks/log, fifteenth session). Hence this
rule, checked in eager: one training step of the tiny model in each layout whose layers call mtl's
Functions, recording every tensor an op writes in place (its schema's mutable arguments; the result
argument of torch.distributed's in-place ops) or returns as one of its own inputs (in-place ops,
``_c10d_functional.wait_tensor``) while a Function's forward runs; a returned tensor among them
fails, naming the Function. A view of such a tensor is fine (torch 2.11 handles it:
``mtl.parallel.function_output.fresh_output``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtl.parallel.testing import run_distributed
from mtl.train.testing import LAYOUTS, MOE_LAYOUTS, MOE_TINY, run_tiny


class _InPlaceWrites(TorchDispatchMode):
    """Collects, for each Function forward running (a stack: Functions nest), the tensors that
    ops write in place."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[list[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        if self.frames:
            inputs = _tensors([args, kwargs])
            # written in place, or passed through as its own result (an in-place op's self, the
            # tensor c10d's in-place ops return, _c10d_functional.wait_tensor's): either way the
            # traced forward holds this tensor as one more intermediate
            passed = [t for t in _tensors(outputs) if any(t is i for i in inputs)]
            for tensor in [*_tensors(_written(func, args, kwargs)), *passed]:
                for frame in self.frames:  # a write through a view writes its base too
                    frame.extend(t for t in (tensor, tensor._base) if t is not None)
        return outputs


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes: those its schema marks mutable (``Tensor(a!)``), and for
    torch.distributed's in-place ops (``c10d.allreduce_``, ``c10d._allgather_base_``, ...), whose
    schemas mark none, the first, which holds their result."""
    schema = func._schema
    if schema.name.startswith("c10d::") and schema.name.endswith("_"):
        return [args[0]]
    return [args[index] if index < len(args) else kwargs.get(argument.name)
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write]


@contextlib.contextmanager
def watching_functions(module_prefix: str):
    """Within it, every ``autograd.Function`` defined under ``module_prefix`` that returns a tensor
    its forward wrote in place is added (by qualified name) to the set it yields."""
    writes = _InPlaceWrites()
    offenders: set[str] = set()
    original = torch.autograd.Function.apply.__func__

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith(module_prefix):
            return original(cls, *args, **kwargs)
        writes.frames.append([])
        try:
            outputs = original(cls, *args, **kwargs)
        finally:
            written = writes.frames.pop()
        for output in outputs if isinstance(outputs, tuple) else (outputs,):
            if isinstance(output, torch.Tensor) and any(output is tensor for tensor in written):
                offenders.add(f"{cls.__module__}.{cls.__qualname__}")
        return outputs

    torch.autograd.Function.apply = classmethod(apply)
    try:
        with writes:
            yield offenders
    finally:
        torch.autograd.Function.apply = classmethod(original)


def run_recording(overrides: list[str]) -> list[str]:
    """One training step of the tiny model with every mtl Function watched."""
    with watching_functions("mtl.") as offenders:
        run_tiny([*overrides, "train.iters=1"], False)
    return sorted(offenders)


# One process as rank 0 of two over torch's fake process group: the collectives take the path
# they take on NCCL (gloo has no reduce-scatter, and mtl sums by all-reduce there instead), and
# move nothing, so the losses are garbage; only the Functions' outputs are looked at.
FAKE_GROUP_SCRIPT = textwrap.dedent("""
    import json, sys
    from mtl.parallel.testing import join_fake_group

    join_fake_group(rank=0, world_size=2)
    sys.path.insert(0, {tests!r})
    from test_function_outputs import watching_functions
    from mtl.train.testing import run_tiny

    with watching_functions("mtl.") as offenders:
        run_tiny({overrides!r} + ["train.iters=1"], False)
    print("OFFENDERS " + json.dumps(sorted(offenders)))
""")


def run_over_fake_group(overrides: list[str]) -> list[str]:
    script = FAKE_GROUP_SCRIPT.format(tests=os.path.dirname(__file__), overrides=overrides)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("OFFENDERS "))[10:])


# Between them these call every Function of a layer: the TP mappings with and without sequence
# parallelism (the vocab-parallel embedding and cross-entropy too) over NCCL's path, both cp
# attentions and MoE's all-to-all over gloo; fp32, where a forward's ``.to(dtype)`` returns its
# accumulator itself.
FAKE_GROUP_CASES = {"tp2": LAYOUTS["tp2"][1], "tp2_sp": LAYOUTS["tp2_sp"][1]}
GLOO_CASES = {
    "cp2": LAYOUTS["cp2"][1],
    "cp2_allgather": LAYOUTS["cp2_allgather"][1],
    "moe_ep2": [*MOE_TINY, *MOE_LAYOUTS["ep2"][1]],
}


@pytest.mark.parametrize("case", list(FAKE_GROUP_CASES))
def test_tp_functions_return_no_tensor_they_filled_in_place(case):
    offenders = run_over_fake_group(FAKE_GROUP_CASES[case])
    assert offenders == [], f"{case}: Functions returning a tensor their forward wrote in place: {offenders}"


@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_functions_return_no_tensor_they_filled_in_place(case):
    per_rank = run_distributed(run_recording, 2, args=(GLOO_CASES[case],))
    assert per_rank == [[], []], f"{case}: Functions returning a tensor their forward wrote in place: {per_rank}"


def test_the_check_sees_a_tensor_filled_in_place():
    """The recorder itself: a Function returning the tensor it filled is reported, one returning a
    view of it is not."""

    class Filled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = torch.empty_like(x)
            out.copy_(x * 2)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class FilledView(Filled):
        @staticmethod
        def forward(ctx, x):
            return Filled.forward(ctx, x).view_as(x)

    with watching_functions(__name__) as offenders:
        x = torch.ones(3, requires_grad=True)
        Filled.apply(x).sum().backward()
        FilledView.apply(x).sum().backward()
    assert offenders == {f"{__name__}.{Filled.__qualname__}"}
