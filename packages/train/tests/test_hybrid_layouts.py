"""The hybrid family (Mamba-2, attention and MLP layers) through ``mtl.train.loop.train`` trains
like one process: pp2 cut by the pattern's '|' with cp2 (losses within 1e-5 relative, gradients); tp2 x pp2
(stages split by FLOPs) saves at step 3, and dp2 with the distributed optimizer resumes it, steps
1-3 and 4-6 equal to one process's. (tp2 with and without sequence parallelism, gradients
included: packages/models/tests/test_hybrid_tensor_parallel.py.) Few launches: each costs seconds."""

import pytest

from mtl.core.config_io import load_config
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import LOSS_RTOL, TINY, compare_with_reference, run_tiny

HYBRID = [
    "model.family='hybrid'", "model.hybrid_pattern='M*M-'", "model.mamba_head_dim=16", "model.mamba_num_groups=2",
    "model.mamba_state_dim=8", "model.mamba_chunk_size=8", "train.lr_decay_iters=6",
]


def losses_of(overrides: list[str]) -> dict:
    result = train(load_config(None, [*TINY, *HYBRID, *overrides]), progress=False)
    return {"losses": result.losses, "last_stage": result.run.topology.is_last_stage}


@pytest.fixture(scope="module")
def reference():
    """One process, 6 steps: the losses every layout is held to, the gradients of step 6."""
    (result,) = run_distributed(run_tiny, 1, args=([*HYBRID, "train.iters=6"],))
    return result


def test_pipeline_cut_by_the_pattern_and_context_parallel_train_like_one_process(reference):
    """pp2 cut by '|' x cp2 (the mixers' all-to-all around conv and scan, the attention's ring)."""
    results = run_distributed(run_tiny, 4, args=([*HYBRID, "train.iters=6", "parallel.pp=2", "parallel.cp=2",
                                                  "model.hybrid_pattern='M*|M-'"],))
    compare_with_reference("pp2 cut by the pattern x cp2", results, reference)
    held = [sorted({int(n.split(".")[1]) for n in r["grads"] if n.startswith("layers.")}) for r in results]
    assert held == [[0, 1], [0, 1], [2, 3], [2, 3]], held  # M* on the first stage, M- on the last


def test_tp2_pp2_saves_and_dp2_distributed_optimizer_resumes(tmp_path, reference):
    save = [f"ckpt.save='{tmp_path}'", "train.iters=6", "train.exit_interval=3"]
    first = run_distributed(losses_of, 4, args=(["parallel.tp=2", "parallel.pp=2", *save],))
    first_losses = next(r["losses"] for r in first if r["last_stage"])
    resumed = run_distributed(losses_of, 2, args=([f"ckpt.load='{tmp_path}'", "train.iters=6",
                                                   "parallel.distributed_optimizer=true"],))
    losses = {**first_losses, **resumed[0]["losses"]}
    assert sorted(losses) == list(range(1, 7)) and sorted(resumed[0]["losses"]) == [4, 5, 6]
    for step, loss in reference["losses"].items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
