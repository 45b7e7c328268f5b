"""``clip_and_step``: clipping and the skip of a non-finite step on the device.

The trainer's step clips and updates without reading the norm on the host. Checked against
the host path it replaces (``torch.nn.utils.clip_grad_norm_`` then AdamW): the same weights
and moments after a clipped step and after an unclipped one. A non-finite gradient leaves
weights, moments and the step count as they were. And no tensor is read on the host while
it runs.
"""

import pytest
import torch
from torch import nn

from mtl.parallel.optimizer import build_optimizer
from mtl.parallel.optimizer.param_groups import uses_weight_decay
from mtl.parallel.topology import Topology

HP = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    grads = [torch.randn_like(p) * 3 for p in model.parameters()]
    return model, grads


def set_grads(model: nn.Module, grads) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def reference_step(model: nn.Module, grads, max_norm: float) -> torch.optim.AdamW:
    """The host path: torch's clip_grad_norm_, then torch's AdamW (with mtl's weight-decay groups)."""
    decay = [p for n, p in model.named_parameters() if uses_weight_decay(n, p)]
    rest = [p for n, p in model.named_parameters() if not uses_weight_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HP["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    set_grads(model, grads)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return opt


@pytest.mark.parametrize("clip_fraction", [0.5, 2.0])  # clipped, and a max_norm above the norm
def test_equals_clip_then_adamw(clip_fraction):
    model, grads = model_and_grads()
    ref_model, _ = model_and_grads()
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    max_norm = clip_fraction * norm
    reference_step(ref_model, grads, max_norm)

    opt = build_optimizer(model, Topology.build(), use_distributed_optimizer=False, **HP)
    set_grads(model, grads)
    measured, found_inf = opt.clip_and_step(max_norm)
    assert measured.item() == pytest.approx(norm, rel=1e-6)
    assert found_inf.item() == 0.0
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7, msg=name)
    assert opt.common_state()["step"] == 1


def test_non_finite_gradient_skips_the_update():
    model, grads = model_and_grads()
    opt = build_optimizer(model, Topology.build(), use_distributed_optimizer=False, **HP)
    set_grads(model, grads)
    opt.clip_and_step(1.0)  # one good step: moments exist
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [{k: v.clone() for k, v in opt.inner.state[e.piece].items()} for e in opt.entries]
    grads[1] = grads[1].clone()
    grads[1][0] = float("nan")
    set_grads(model, grads)
    norm, found_inf = opt.clip_and_step(1.0)
    assert not torch.isfinite(norm) and found_inf.item() == 1.0
    for p, before in zip(model.parameters(), weights):
        assert torch.equal(p, before)
    for e, before in zip(opt.entries, moments):
        for key, value in before.items():
            assert torch.equal(opt.inner.state[e.piece][key], value), key
    assert opt.common_state()["step"] == 1  # the skipped step is not counted


def test_reads_nothing_on_the_host(monkeypatch):
    model, grads = model_and_grads()
    opt = build_optimizer(model, Topology.build(), use_distributed_optimizer=False, **HP)
    set_grads(model, grads)

    def host_read(*_args, **_kwargs):
        raise AssertionError("clip_and_step read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    opt.clip_and_step(0.1)
    monkeypatch.undo()
    assert opt.common_state()["step"] == 1


def test_skip_flag_skips_a_finite_step():
    """The trainer's other reason to skip (a non-finite loss with finite gradients)."""
    model, grads = model_and_grads()
    opt = build_optimizer(model, Topology.build(), use_distributed_optimizer=False, **HP)
    set_grads(model, grads)
    weights = [p.detach().clone() for p in model.parameters()]
    norm, found_inf = opt.clip_and_step(1.0, skip=torch.tensor(1.0))
    assert torch.isfinite(norm) and found_inf.item() == 1.0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.common_state()["step"] == 0


def test_bad_max_norm_and_a_loaded_state_keep_the_contract():
    model, grads = model_and_grads()
    opt = build_optimizer(model, Topology.build(), use_distributed_optimizer=False, **HP)
    set_grads(model, grads)
    with pytest.raises(Exception, match="max_norm = 0"):
        opt.clip_and_step(0.0)
    opt.clip_and_step(1.0)
    state = opt.state_dict()
    for group in state["adamw"]["param_groups"]:  # as saved by an optimizer that was not fused
        group["fused"] = None
    opt.load_state_dict(state)
    set_grads(model, grads)
    opt.clip_and_step(1.0)  # grad_scale/found_inf need the fused kernel: still chosen after the load
    assert opt.common_state()["step"] == 2
