"""The backend test suite: every backend passes the same tests, each in its own precision.

A backend package's tests import the tests from here and name their cases in a
``backend_case`` fixture; pytest collects the imported functions as that module's tests::

    import pytest
    from mtl.train.backend_suite import BackendCase
    from mtl.train.backend_suite import *  # noqa: F403 (the suite's tests)

    @pytest.fixture(params=[BackendCase("fp8-current", ["model.backend='fp8'", "train.fp8='current'"],
                                        loss_rtol=1e-3, grad_rel=1e-2)], ids=lambda c: c.name)
    def backend_case(request):
        return request.param

The tests (the tiny model of ``mtl.train.testing``, CPU and gloo):

- ``test_layouts_equal_one_process``: each layout of ``case.layouts`` (tp2, tp2_sp, pp2, ...)
  gives the one-process losses of the same backend within ``loss_rtol`` and gradients within
  ``grad_rel`` (norm of the difference over the norm, per parameter; None: losses only);
- ``test_checkpoint_round_trip``: stop after 2 steps, resume, and the resumed steps equal an
  uninterrupted run bit for bit (model, optimizer, RNG and the backend's own state, such as
  FP8 amax histories, restored);
- ``test_generation_with_kv_cache``: after a few training steps, each decoding step's logits
  with the KV cache equal a full forward over the sequence within ``logits_atol``, and
  greedy generation returns the asked number of tokens.

mtl-train's tests run the ``local`` case, mtl-quant's the ``fp8`` recipes, mtl-te's the
``te`` ones (where Transformer Engine is installed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtl.core.config_io import load_config
from mtl.parallel.testing import run_distributed
from mtl.train.testing import TINY, assemble, run_layouts, run_tiny

__all__ = ["test_layouts_equal_one_process", "test_checkpoint_round_trip", "test_generation_with_kv_cache"]


@dataclass(frozen=True)
class BackendCase:
    """One backend configuration under test: its overrides and how close its layouts must be."""

    name: str
    overrides: list[str]
    loss_rtol: float = 1e-5
    grad_rel: float | None = 1e-4  # None: losses only (bf16 + FP8 gradients are rounding-dominated)
    logits_atol: float = 1e-4
    layouts: tuple[str, ...] = ("tp2", "tp2_sp", "pp2")
    device: str = "cpu"  # "cuda": the GPU variant (NCCL, one GPU per rank)


def _run(case: BackendCase, overrides: list[str], world: int) -> list[dict]:
    device = [f"train.device='{case.device}'"]
    return run_distributed(run_tiny, world, args=([*case.overrides, *overrides, *device],),
                           backend="nccl" if case.device == "cuda" else "gloo")


def test_layouts_equal_one_process(backend_case: BackendCase) -> None:
    (reference,) = _run(backend_case, [], 1)
    ref_losses = reference["losses"]
    ref_grads = assemble([reference])
    device = [f"train.device='{backend_case.device}'"]
    by_layout = run_layouts(list(backend_case.layouts), extra=device, model=backend_case.overrides,
                            backend="nccl" if backend_case.device == "cuda" else "gloo")
    for layout, results in by_layout.items():
        losses = next(r["losses"] for r in results if r["last_stage"])
        assert list(losses) == list(ref_losses), f"{backend_case.name} {layout}: steps differ"
        for step, ref in ref_losses.items():
            assert abs(losses[step] - ref) <= backend_case.loss_rtol * abs(ref), (
                f"{backend_case.name} {layout} step {step}: loss {losses[step]} vs one process {ref}")
        if backend_case.grad_rel is None:
            continue
        grads = assemble(results)
        assert set(grads) == set(ref_grads), f"{backend_case.name} {layout}: {set(grads) ^ set(ref_grads)}"
        for name, ref in ref_grads.items():
            rel = ((grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert rel <= backend_case.grad_rel, f"{backend_case.name} {layout} {name}: gradient off by {rel:.2e}"


def _train(overrides: list[str]):
    from mtl.train.loop import train  # noqa: PLC0415 (the suite's import stays light for collection)

    return train(load_config(None, overrides), progress=False)


def test_checkpoint_round_trip(backend_case: BackendCase, tmp_path) -> None:
    base = [o for o in TINY if not o.startswith("train.iters")]
    base += ["train.iters=4", f"train.device='{backend_case.device}'", *backend_case.overrides]
    ckpt = tmp_path / "ckpt"
    straight = _train(base)
    first = _train([*base, f"ckpt.save='{ckpt}'", "train.exit_interval=2"])
    assert first.final_iteration == 2 and (ckpt / "latest").exists()
    second = _train([*base, f"ckpt.load='{ckpt}'", f"ckpt.save='{ckpt}'"])
    assert sorted(second.losses) == [3, 4]
    for step in (3, 4):
        assert second.losses[step] == straight.losses[step], (
            f"{backend_case.name}: resumed step {step} loss {second.losses[step]} vs {straight.losses[step]}")
    # every non-trainable piece of backend state (FP8 amax histories) came back as saved
    saved = {n: p for n, p in _model(straight).named_parameters() if not p.requires_grad}
    resumed = {n: p for n, p in _model(second).named_parameters() if not p.requires_grad}
    assert saved.keys() == resumed.keys()
    for name in saved:
        assert torch.equal(saved[name], resumed[name]), name
    # and every module's extra state (Transformer Engine's delayed-scaling scales and histories)
    from mtl.train.extra_state import modules_with_extra_state  # noqa: PLC0415

    ended = modules_with_extra_state([_model(straight)])
    again = modules_with_extra_state([_model(second)])
    assert ended.keys() == again.keys()
    for name, module in ended.items():
        _assert_same_state(module.get_extra_state(), again[name].get_extra_state(), f"{backend_case.name} {name}")


def _assert_same_state(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


def _model(result):
    chunk = result.run.chunks[0]
    return getattr(chunk, "module", chunk)


def test_generation_with_kv_cache(backend_case: BackendCase) -> None:
    from mtl.models.generate import generate  # noqa: PLC0415
    from mtl.models.gpt.inference_context import InferenceContext  # noqa: PLC0415

    base = [o for o in TINY if not o.startswith("train.iters")]
    model = _model(_train([*base, "train.iters=3", f"train.device='{backend_case.device}'", *backend_case.overrides]))
    model.eval()
    device = next(model.parameters()).device
    tokens = [5, 17, 42, 7, 99]
    context = InferenceContext(max_batch_size=1, max_sequence_length=len(tokens) + 6)
    pending = list(tokens)
    with torch.no_grad():
        for _ in range(6):
            cached = model(torch.tensor([pending], device=device), inference_context=context)[0, -1].float()
            full = model(torch.tensor([tokens], device=device))[0, -1].float()
            torch.testing.assert_close(cached, full, atol=backend_case.logits_atol, rtol=0,
                                       msg=lambda m: f"{backend_case.name}: cached vs full logits: {m}")
            next_token = int(full[: model.vocab_size].argmax())
            tokens.append(next_token)
            pending = [next_token]
    assert len(generate(model, tokens[:5], max_new_tokens=6, temperature=0.0)) == 6
