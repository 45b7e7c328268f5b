"""The router on fixed cases worked out by hand: top-k choice and weights, the load-balancing
loss, the z-loss, and capacity dropping with its count."""

import math

import pytest
import torch

from mtl.models.moe import TopKRouter
from mtl.models.moe.router import load_balancing_loss, z_loss

# 4 tokens over 3 experts; each row sums to one, so with logits = log(scores) softmax gives them back
SCORES = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.1, 0.7], [0.7, 0.2, 0.1]])


def router_with_logits(logits: torch.Tensor, **kwargs) -> tuple[TopKRouter, torch.Tensor]:
    """A router whose logits for one-hot tokens are ``logits [T, E]``: weight = logits.T."""
    num_tokens, num_experts = logits.shape
    options = dict(score_function="softmax", norm_topk_prob=True, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                   capacity_factor=None, top_k=2)
    router = TopKRouter(hidden_size=num_tokens, num_experts=num_experts, **{**options, **kwargs})
    with torch.no_grad():
        router.weight.copy_(logits.t())
    return router, torch.eye(num_tokens)


def test_softmax_top2_renormalised_and_load_balancing_loss():
    router, tokens = router_with_logits(SCORES.log(), aux_loss_coeff=0.1)
    routing = router(tokens)
    assert routing.expert_ids.tolist() == [[0, 1], [1, 2], [2, 0], [0, 1]]
    torch.testing.assert_close(routing.probs[0], torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    # slots per expert 3, 3, 2 of 8: f = (3/8, 3/8, 2/8); mean probabilities P = (0.375, 0.3, 0.325)
    expected = 0.1 * 3 * (3 / 8 * 0.375 + 3 / 8 * 0.3 + 2 / 8 * 0.325)
    assert expected == pytest.approx(0.1003125)
    assert routing.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    assert routing.keep is None and routing.dropped.item() == 0
    # perfect balance gives the coefficient itself
    uniform = torch.full((4, 2), 0.5)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [0], [1]]), 0.1).item() == pytest.approx(0.1)


def test_softmax_without_renormalisation_keeps_the_probabilities():
    router, tokens = router_with_logits(SCORES.log(), norm_topk_prob=False)
    torch.testing.assert_close(router(tokens).probs[1], torch.tensor([0.6, 0.3]))


def test_sigmoid_router_normalises_the_top_k():
    logits = torch.tensor([[0.0, 2.0, -1.0], [1.0, -2.0, 0.5]])
    router, tokens = router_with_logits(logits, score_function="sigmoid", aux_loss_coeff=1.0)
    routing = router(tokens)
    s = torch.sigmoid(logits)
    assert routing.expert_ids.tolist() == [[1, 0], [0, 2]]
    torch.testing.assert_close(routing.probs[0], torch.stack([s[0, 1], s[0, 0]]) / (s[0, 1] + s[0, 0]))
    # the aux loss uses the scores normalised over all experts
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    expected = 3 * (2 / 4 * p[0] + 1 / 4 * p[1] + 1 / 4 * p[2])
    assert routing.aux_loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_z_loss():
    logits = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])  # logsumexp = 1 + ln 3, 2 + ln 3
    expected = 1e-2 * ((1 + math.log(3)) ** 2 + (2 + math.log(3)) ** 2) / 2
    assert z_loss(logits, 1e-2).item() == pytest.approx(expected, rel=1e-6)
    router, tokens = router_with_logits(logits, z_loss_coeff=1e-2)
    assert router(tokens).z_loss.item() == pytest.approx(expected, rel=1e-6)


def test_capacity_drops_the_lowest_scored_slots_and_counts_them():
    # top-1 over 2 experts: tokens 0, 1, 2 choose expert 0 (scores 0.9, 0.6, 0.8), token 3 expert 1.
    # capacity = ceil(4 tokens * 1 / 2 experts * 1.0) = 2: expert 0 keeps tokens 0 and 2, drops token 1.
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2], [0.3, 0.7]])
    router, tokens = router_with_logits(scores.log(), top_k=1, capacity_factor=1.0)
    routing = router(tokens)
    assert routing.expert_ids.flatten().tolist() == [0, 0, 0, 1]
    assert routing.keep.flatten().tolist() == [True, False, True, True]
    assert routing.dropped.item() == 1
    # a factor of 1.5 gives capacity 3: nothing dropped
    router.capacity_factor = 1.5
    assert router(tokens).dropped.item() == 0


def test_expert_bias_chooses_but_does_not_weight_and_the_weights_are_scaled():
    """Sigmoid scores s; the bias moves expert 2 ahead of expert 0 for the choice, the weights stay
    the unbiased scores, normalised over the two chosen, times the scaling factor."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    router, tokens = router_with_logits(logits, score_function="sigmoid", expert_bias=True, scaling_factor=2.5)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.9, 0.0]))  # s + b: 0.881, 0.731, 1.4, 0.269
    routing = router(tokens)
    s = torch.sigmoid(logits[0])
    assert routing.expert_ids.tolist() == [[2, 0]]
    torch.testing.assert_close(routing.probs[0], 2.5 * torch.stack([s[2], s[0]]) / (s[2] + s[0]))
    assert not router.expert_bias.requires_grad and router.expert_bias.dtype == torch.float32


def test_group_limited_routing_keeps_the_best_groups():
    """6 experts in 3 groups of 2, top 2 from 1 group: a group counts the sum of its top 2 scores
    (2 // 1). Group 1 (0.6 + 0.5) beats group 0 (0.9 + 0.0) and group 2 (0.3 + 0.2), so the token
    takes experts 2 and 3 although expert 0 scores highest."""
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.5, 0.3, 0.2]])
    logits = torch.log(scores / (1 - scores)).clamp(min=-30)  # sigmoid(logits) = scores
    router, tokens = router_with_logits(logits, score_function="sigmoid", norm_topk_prob=False,
                                        num_groups=3, group_top_k=1)
    routing = router(tokens)
    assert sorted(routing.expert_ids[0].tolist()) == [2, 3]
    torch.testing.assert_close(routing.probs[0].sort().values, torch.tensor([0.5, 0.6]))
    router.group_top_k = 2  # then top 1 per group (2 // 2) ranks them: groups 0 (0.9) and 1 (0.6)
    assert sorted(router(tokens).expert_ids[0].tolist()) == [0, 2]
