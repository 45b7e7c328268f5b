"""Expert parallelism trains like one process (fp32, CPU gloo, dropless, a 2-layer model with
4 experts top-2, the load-balancing and z-losses on).

- ep=2 (dp=2), ep=2 x tp=2 with sequence parallelism, ep=2 x pp=2 (4 processes): the first 3
  losses within 1e-5 relative, and every gradient, gathered to its full global shape (experts
  from every ep rank), within 1e-5 relative in L2 norm (``||g - g_ref|| / ||g_ref||``; the
  element-wise spread of TP's reordered sums is ~1e-5 of the largest element, with or
  without ep). The router's gradient carries the auxiliary losses, and a run without them
  gives a router gradient far outside that tolerance: so they are counted once at every layout.
- Checkpoints reshard across ep: a save at ep=2 resumes at ep=1, and a save at ep=1 resumes
  at ep=2 under the distributed optimizer; steps 4-6 equal a straight 6-step run.
- The writer rule picks exactly one writer for every box of every expert tensor.

Processes are shared: one single-process spawn runs the reference, the straight run and the
run without auxiliary losses; one 2-process spawn runs ep=2 and the ep=1 -> ep=2 resume; one
4-process spawn runs both 4-process layouts.
"""

import pytest
import torch
from torch import nn

from mtl.models.param_layout import ParamEntry
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.train.checkpointing import _replica_id
from mtl.train.testing import LOSS_RTOL, MOE_LAYOUTS, MOE_TINY, assemble, compare_with_reference, run_layouts, run_tiny
from mtl.parallel.param_layout import set_param_layout

MOE = MOE_TINY
NO_AUX = ["model.moe_aux_loss_coeff=0.0", "model.moe_z_loss_coeff=0.0"]
FOUR_PROCESS_LAYOUTS = {name: overrides for name, (world, overrides) in MOE_LAYOUTS.items() if world == 4}
GRAD_RTOL = 1e-5
ROUTER = "layers.0.mlp.router.weight"


def run_moe(overrides: list[str], with_grads: bool = True) -> dict:
    return run_tiny([*MOE, *overrides], with_grads)


def single_process_runs(save_dir: str) -> dict:
    return {"reference": run_moe([f"ckpt.save='{save_dir}'"]),
            "straight": run_moe(["train.iters=6"], with_grads=False)["losses"],
            "no_aux": run_moe(NO_AUX)["grads"]}


def ep2_runs(ep1_dir: str, save_dir: str) -> dict:
    fresh = run_moe(["parallel.ep=2", f"ckpt.save='{save_dir}'"])
    resumed = run_moe(["parallel.ep=2", "parallel.distributed_optimizer=true", "train.iters=6",
                       f"ckpt.load='{ep1_dir}'"], with_grads=False)
    return {"fresh": fresh, "resumed": resumed}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {"ep1": str(root / "ep1"), "ep2": str(root / "ep2")}


@pytest.fixture(scope="module")
def single(dirs):
    (result,) = run_distributed(single_process_runs, 1, args=(dirs["ep1"],))
    return result


@pytest.fixture(scope="module")
def ep2(single, dirs):  # after `single`: it resumes from the ep=1 checkpoint
    return run_distributed(ep2_runs, 2, args=(dirs["ep1"], dirs["ep2"]))


def relative_grad_errors(results: list[dict], reference: dict) -> dict[str, float]:
    grads, ref = assemble(results), assemble([reference])
    assert grads.keys() == ref.keys()
    return {name: ((grads[name] - r).norm() / r.norm()).item() for name, r in ref.items()}


def assert_matches(layout: str, results: list[dict], reference: dict) -> None:
    # the losses within 1e-5 relative (the gradients by the L2 criterion above, not element-wise)
    compare_with_reference(layout, [{**r, "grads": {}} for r in results], reference)
    errors = relative_grad_errors(results, reference)  # assemble checks that replicas agree
    assert any(".experts." in name for name in errors) and ROUTER in errors
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{layout}: {worst} differs by {errors[worst]:.2e} relative"


def assert_continues(losses: dict, straight: dict) -> None:
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(losses[step] - straight[step]) <= LOSS_RTOL * abs(straight[step]), (step, losses, straight)


def test_ep2_matches_single_process(ep2, single):
    assert_matches("ep2", [r["fresh"] for r in ep2], single["reference"])


def test_auxiliary_losses_reach_the_router_gradient(single):
    """Without them the router's gradient differs by far more than the tolerance above, so
    equal gradients mean they were counted, and counted once."""
    no_aux, ref = single["no_aux"][ROUTER], single["reference"]["grads"][ROUTER]
    assert ((no_aux - ref).norm() / ref.norm()).item() > 100 * GRAD_RTOL


@pytest.fixture(scope="module")
def four_process_layouts():
    return run_layouts(list(FOUR_PROCESS_LAYOUTS), model=MOE)  # one 4-process spawn for both


@pytest.mark.parametrize("layout", list(FOUR_PROCESS_LAYOUTS))
def test_ep2_with_tp_or_pp_matches_single_process(layout, single, four_process_layouts):
    assert_matches(layout, four_process_layouts[layout], single["reference"])


def test_ep1_checkpoint_resumes_at_ep2_with_the_distributed_optimizer(ep2, single):
    assert_continues(next(r["resumed"]["losses"] for r in ep2 if r["resumed"]["last_stage"]), single["straight"])


def test_ep2_checkpoint_resumes_at_ep1(ep2, single, dirs):
    (resumed,) = run_distributed(run_moe, 1, args=(["train.iters=6", f"ckpt.load='{dirs['ep2']}'"], False))
    assert_continues(resumed["losses"], single["straight"])


def test_one_writer_per_box_of_every_expert_tensor():
    """dp=4, ep=2, tp=2: each (ep rank, tp rank) box of an expert tensor is held by 2 ranks and
    written by one of them; dense tensors by one rank per TP box, as before."""
    tp, dp, ep = 2, 4, 2
    expert = nn.Parameter(torch.zeros(2, 3))
    set_param_layout(expert, expert_split_dim=0, tp_split_dim=1)
    dense = nn.Parameter(torch.zeros(3))  # replicated over TP too
    for index in range(6):  # the turn moves with the parameter's index
        for param, box_of in ((expert, lambda t: (t.ep_rank, t.tp_rank)), (dense, lambda t: ())):
            writers: dict[tuple, list[int]] = {}
            for rank in range(tp * dp):
                topo = Topology(tp=tp, dp=dp, ep=ep, rank=rank)
                entry = ParamEntry("w", "w", param, (4, 6), (0, 0))
                if _replica_id(topo, entry, index) == 0:
                    writers.setdefault(box_of(topo), []).append(rank)
            boxes = {(e, t) for e in range(ep) for t in range(tp)} if param is expert else {()}
            assert set(writers) == boxes and all(len(w) == 1 for w in writers.values()), (index, writers)
