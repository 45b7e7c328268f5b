"""Activation recomputation with the ``te`` backend, on one GPU: ``train.recompute`` = selective
or full trains as without it, in bf16 and FP8 current scaling; delayed scaling with selective
recompute also ends with the same amax histories and scales. Delayed scaling with full recompute
is refused (``mtl.te.config_checks``): the recomputed forward recorded its amaxes a second time.

Runs only where Transformer Engine imports and sees a GPU (skipped, named, elsewhere)."""

import pytest
import torch

from mtl.te.availability import te_import_error
from mtl.train.backend_suite import _assert_same_state
from mtl.train.testing import TINY

pytestmark = pytest.mark.skipif(te_import_error() is not None, reason=f"Transformer Engine not usable: {te_import_error()}")

TE = ["model.backend='te'", "train.precision='bf16'", "train.device='cuda'"]
RECIPES = {"bf16": [], "fp8-current": ["train.fp8='current'"], "fp8-delayed": ["train.fp8='delayed'"]}


def _train(overrides: list[str]):
    from mtl.core.config_io import load_config  # noqa: PLC0415
    from mtl.train.loop import train  # noqa: PLC0415

    base = [o for o in TINY if not o.startswith("train.iters")]
    result = train(load_config(None, [*base, "train.iters=6", *TE, *overrides]), progress=False)
    chunk = result.run.chunks[0]
    return result.losses, getattr(chunk, "module", chunk)


def _extra_states(model) -> dict:
    from mtl.train.extra_state import modules_with_extra_state  # noqa: PLC0415

    return {name: module.get_extra_state() for name, module in modules_with_extra_state([model]).items()}


# fp8-delayed with full recompute is refused at resolve (mtl.te.config_checks): measured here
# before that, its step-1 loss was 5.55308 against 5.55300 without recompute
CASES = [(recipe, recompute) for recipe in RECIPES for recompute in ("selective", "full")
         if (recipe, recompute) != ("fp8-delayed", "full")]


@pytest.mark.parametrize(("recipe", "recompute"), CASES)
def test_recompute_trains_as_without(recipe, recompute):
    plain_losses, plain = _train(RECIPES[recipe])
    losses, model = _train([*RECIPES[recipe], f"train.recompute='{recompute}'"])
    assert sorted(losses) == sorted(plain_losses)
    for step, loss in plain_losses.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), f"{recipe} {recompute} step {step}: {losses[step]} vs {loss}"
    plain_state, state = _extra_states(plain), _extra_states(model)
    assert plain_state.keys() == state.keys()
    for name in plain_state:
        _assert_same_state(state[name], plain_state[name], f"{recipe} {recompute} {name}")
