"""The MoE layer on one process: grouped GEMMs equal the per-expert loop, dispatch equals a
token-by-token reference, dropped slots contribute nothing and are reported, the aux losses'
gradient is exactly that of adding them to the loss (once), and an MoE GPT trains."""

import pytest
import torch
import torch.utils.checkpoint

from mtl.core.plugins import registry
from mtl.models.gpt import build_gpt
from mtl.models.moe import GroupedExperts, LocalDispatcher, MoELayer, MoESubmodules, moe_step_metrics, set_aux_loss_scale
from mtl.models.moe.experts import _grouped_mm_works
from mtl.parallel.topology import Topology

MOE = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16}


def experts(hidden=32, ffn=16, activation="swiglu", num_experts=4):
    return GroupedExperts(num_experts=num_experts, hidden_size=hidden, ffn_hidden_size=ffn, activation=activation,
                          init_std=0.5, output_init_std=0.5, topology=Topology.single())


def expert_reference(module: GroupedExperts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert on one token, written out: fc2(act(fc1 x))."""
    h = module.linear_fc1.weight[expert] @ x
    if module.gated:
        gate, up = h.chunk(2)
        h = torch.nn.functional.silu(gate) * up
    else:
        h = torch.nn.functional.gelu(h)
    return module.linear_fc2.weight[expert] @ h


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_mm_equals_the_loop(activation):
    if not _grouped_mm_works("cpu", torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build: only the loop exists here")
    module = experts(activation=activation)
    assert module.grouped_mm_usable(torch.zeros(1, 32))
    tokens = torch.randn(10, 32, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])  # an expert without tokens too
    grad_out = torch.randn(10, 32)
    results = {}
    for grouped in (True, False):
        module.use_grouped_mm = None if grouped else False
        out = module(tokens, counts)
        grads = torch.autograd.grad(out, (tokens, module.linear_fc1.weight, module.linear_fc2.weight), grad_out)
        results[grouped] = (out, *grads)
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    row = 4  # token 4 belongs to expert 2 (rows 3..7)
    torch.testing.assert_close(results[True][0][row], expert_reference(module, 2, tokens[row]), rtol=1e-5, atol=1e-6)


def test_unaligned_widths_fall_back_to_the_loop():
    module = experts(hidden=30, ffn=14)  # rows of 30 / 14 fp32 values are not 16-byte multiples
    assert not module.grouped_mm_usable(torch.zeros(1, 30))
    out = module(torch.randn(3, 30), torch.tensor([1, 0, 2, 0]))
    assert out.shape == (3, 30)


def test_local_dispatch_equals_a_token_by_token_sum():
    module = experts()
    hidden = torch.randn(5, 32)
    expert_ids = torch.tensor([[0, 2], [2, 1], [3, 0], [1, 2], [0, 3]])
    probs = torch.rand(5, 2)
    keep = torch.tensor([[True, True], [False, True], [True, True], [True, False], [True, True]])
    out = LocalDispatcher(4)(hidden, probs, expert_ids, keep, module)
    for t in range(5):
        expected = sum(probs[t, j] * expert_reference(module, expert_ids[t, j].item(), hidden[t])
                       for j in range(2) if keep[t, j])
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-6)


def moe_layer(**kwargs):
    options = dict(hidden_size=4, num_experts=2, top_k=1, ffn_hidden_size=8, activation="swiglu", router="softmax",
                   norm_topk_prob=False, aux_loss_coeff=0.0, z_loss_coeff=0.0, capacity_factor=None,
                   shared_expert_gate=False, init_std=0.5, output_init_std=0.5, sequence_parallel=False,
                   aux_loss_scale=1.0, topology=Topology.single(), submodules=MoESubmodules())
    return MoELayer(**{**options, **kwargs})


def test_dropped_tokens_get_no_expert_output_and_are_reported():
    layer = moe_layer(capacity_factor=1.0)
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2], [0.3, 0.7]])  # as in test_moe_router
    with torch.no_grad():
        layer.router.weight.copy_(scores.log().t())
    hidden = torch.eye(4).view(4, 1, 4)  # [s, b, h]: token t is the t-th unit vector
    out = layer(hidden)
    ids = torch.tensor([0, 0, 0, 1])
    for t in range(4):
        expected = torch.zeros(4) if t == 1 else scores[t, ids[t]] * expert_reference(layer.experts, ids[t].item(), hidden[t, 0])
        torch.testing.assert_close(out[t, 0], expected, rtol=1e-5, atol=1e-6)
    layer(hidden)  # a second micro-batch of the step
    metrics = moe_step_metrics([layer], Topology.single())
    assert metrics["moe_dropped_tokens"] == 2 and metrics["moe_dropped_fraction"] == pytest.approx(2 / 8)
    assert moe_step_metrics([layer], Topology.single())["moe_dropped_tokens"] == 0  # cleared


def tiny_moe(make_config, **model):
    config = make_config("llama", model={**MOE, **model})
    return build_gpt(config, Topology.single(), registry("backend").get("local"))


def test_aux_losses_enter_the_gradient_once_and_leave_the_loss_clean(make_config):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    coeffs = {"moe_aux_loss_coeff": 0.5, "moe_z_loss_coeff": 0.1, "moe_shared_expert_ffn_hidden_size": 16}
    model = tiny_moe(make_config, **coeffs)
    set_aux_loss_scale(model, 1.0)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}

    # the reference adds every layer's aux losses to the loss by hand, the injection switched off
    model.zero_grad()
    set_aux_loss_scale(model, 0.0)
    aux = []
    for layer in model.layers.values():
        layer.mlp.router.register_forward_hook(lambda mod, args, routing: aux.append(routing.aux_loss + routing.z_loss))
    reference_loss = model(ids, labels=labels)
    assert len(aux) == 2 and all(a.item() > 0 for a in aux)
    (reference_loss.mean() + sum(aux)).backward()
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(injected[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)

    # and the LM loss the model returns does not depend on the coefficients
    clean = tiny_moe(make_config, moe_shared_expert_ffn_hidden_size=16, moe_aux_loss_coeff=0.0)
    torch.testing.assert_close(clean(ids, labels=labels), loss)


def test_moe_gpt_trains_on_cpu(make_config):
    model = tiny_moe(make_config, moe_capacity_factor=1.25, moe_router="sigmoid", moe_layer_freq=2)
    assert type(model.layers["0"].mlp).__name__ == "MoELayer" and type(model.layers["1"].mlp).__name__ == "MLP"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (4, 16), generator=generator)
    labels = torch.roll(ids, -1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(ids, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    metrics = moe_step_metrics([model], Topology.single())
    assert metrics["moe_aux_loss"] > 0 and 0 <= metrics["moe_dropped_fraction"] < 1


def test_full_recompute_gives_the_same_gradients_and_counts_each_forward_once(make_config):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    grads = {}
    for recompute in ("none", "full"):
        config = make_config("llama", model={**MOE, "moe_capacity_factor": 1.0}, train={"recompute": recompute})
        model = build_gpt(config, Topology.single(), registry("backend").get("local"))
        # without early stop the recompute runs each layer's forward to its end, stats included
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            model(ids, labels=torch.roll(ids, -1, 1)).mean().backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
        assert [layer.mlp.stats.forwards for layer in model.layers.values()] == [1, 1]
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], grad, rtol=0, atol=0, msg=name)


def test_the_grouped_mm_probe_does_not_depend_on_grad_mode():
    """First asked from generation (no_grad / inference mode), the answer must be the same."""
    from mtl.models.moe import experts as experts_module

    answers = []
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        experts_module._GROUPED_MM_WORKS.clear()
        with mode():
            answers.append(_grouped_mm_works("cpu", torch.float32))
    assert answers == [answers[-1]] * 3
