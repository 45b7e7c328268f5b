"""The aux-loss-free expert-bias update on hand-made routing: each bias moves by the rate toward
balance from the slots counted over every training forward since the last update, and only those."""

import torch

from mtl.models.moe import TopKRouter, update_expert_biases

RATE = 0.01


def router_over_one_hot_tokens() -> TopKRouter:
    """4 experts, top 1; a one-hot token i scores expert (weight row argmax) as the weight says."""
    router = TopKRouter(hidden_size=4, num_experts=4, top_k=1, score_function="sigmoid", norm_topk_prob=False,
                        aux_loss_coeff=0.0, z_loss_coeff=0.0, capacity_factor=None, expert_bias=True,
                        bias_update_rate=RATE)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4) * 4.0)  # token i (one-hot) chooses expert i
    return router


def test_each_bias_moves_toward_balance_from_every_micro_batchs_counts():
    router = router_over_one_hot_tokens()
    tokens = torch.eye(4)
    router(tokens[[0, 0, 1]])  # micro-batch 1: experts 0, 0, 1
    router(tokens[[0, 2, 1]])  # micro-batch 2: experts 0, 2, 1 -> counts 3, 2, 1, 0, mean 1.5
    router.eval()
    router(tokens[[3, 3, 3]])  # evaluation: not counted
    router.train()
    with torch.no_grad():
        router(tokens[[3, 3, 3]])  # no gradient (generation): not counted
    assert router.tokens_since_update.tolist() == [3, 2, 1, 0]
    update_expert_biases([router], group=None)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-RATE, -RATE, RATE, RATE]))
    assert router.tokens_since_update.tolist() == [0, 0, 0, 0]
    # a second step from fresh counts: balanced experts keep their bias
    router(tokens[[0, 1, 2, 3]])
    update_expert_biases([router], group=None)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-RATE, -RATE, RATE, RATE]))


def test_the_bias_changes_the_choice_once_large_enough():
    """Expert 0 scores sigmoid(4) = 0.982 for its token, the others sigmoid(0) = 0.5: a bias of
    -0.4 on expert 0 keeps it first, -0.9 hands the token to another, at its unbiased weight."""
    router = router_over_one_hot_tokens()
    token = torch.eye(4)[:1]
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([-0.4, 0.0, 0.0, 0.0]))
    routing = router(token)
    assert routing.expert_ids.item() == 0
    torch.testing.assert_close(routing.probs, torch.sigmoid(torch.full((1, 1), 4.0)))
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([-0.9, 0.0, 0.0, 0.0]))
    routing = router(token)
    assert routing.expert_ids.item() in (1, 2, 3)
    torch.testing.assert_close(routing.probs, torch.full((1, 1), 0.5))  # the unbiased score sigmoid(0)


def update_on_rank_tokens(token_ids_per_rank: list[list[int]]) -> torch.Tensor:
    """One rank's router counts its own tokens, then the update sums the counts over all ranks."""
    import torch.distributed as dist

    router = router_over_one_hot_tokens()
    router(torch.eye(4)[token_ids_per_rank[dist.get_rank()]])
    update_expert_biases([router], group=dist.group.WORLD)
    return router.expert_bias.detach().clone()


def test_counts_are_summed_over_the_data_parallel_ranks():
    """Rank 0 alone would move expert 0 down (counts 2, 1, 0, 1) and rank 1 alone expert 3 down;
    summed (2, 2, 1, 3, mean 2) experts 0 and 1 keep their bias, 2 goes up, 3 down, on both ranks."""
    from mtl.parallel.testing import run_distributed

    per_rank = [[0, 0, 1, 3], [1, 2, 3, 3]]
    for bias in run_distributed(update_on_rank_tokens, 2, args=(per_rank,)):
        torch.testing.assert_close(bias, torch.tensor([0.0, 0.0, RATE, -RATE]))
