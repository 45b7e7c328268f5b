"""ZeRO-2 and ZeRO-3 inside ``DataParallel`` at dp=2, on a 3-layer MLP whose layers are its
``compile_units`` (ZeRO-3's gather units):

- the reduced gradient shards equal this rank's flat piece of one process's gradient of the
  whole batch (2 micro-batches, the first inside ``no_sync``, which does not hold them back);
- ZeRO-3 keeps no layer's weights between forwards: each layer is gathered for its forward and
  again for its backward (2 gathers per layer per micro-batch), but the last, kept whole from its
  forward into its backward, which comes next (1 gather); and after the step's sync the
  buffers hold the shards only (``held_bytes``), half what ZeRO-1 holds for weights and grads;
- ``whole_parameters(write_back=True)`` puts what is loaded into every rank's shard.
"""

import torch
from torch import nn

from mtl.parallel.ddp import DataParallel
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

TOL = dict(rtol=1e-6, atol=1e-6)


class Layered(nn.Sequential):
    def compile_units(self) -> list[nn.Module]:
        return [self[0], self[2], self[4]]


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return Layered(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def run_step(model: DataParallel, rank: int) -> None:
    x, y = batch()
    xs, ys = x[rank * 4:(rank + 1) * 4].chunk(2), y[rank * 4:(rank + 1) * 4].chunk(2)
    model.zero_grad()
    with model.no_sync():
        (nn.functional.mse_loss(model(xs[0]), ys[0]) / 2).backward()
    (nn.functional.mse_loss(model(xs[1]), ys[1]) / 2).backward()
    model.finish_grad_sync()


def sharded_runs() -> dict:
    topo = Topology.build()
    reference = make_mlp()
    x, y = batch()
    nn.functional.mse_loss(reference(x), y).backward()
    expected = [r.grad.reshape(-1) for r in reference.parameters()]  # in parameter order
    out = {}
    for sharding in ("optimizer", "gradients", "parameters"):
        module = make_mlp()
        ref_of = dict(zip(map(id, module.parameters()), expected))
        model = DataParallel(module, topo, sharding=sharding, bucket_size_mb=1.0)
        run_step(model, topo.dp_rank)
        for p in module.parameters():  # this rank's reduced piece of each gradient
            first, last = p.dp_owned_grad_range
            if sharding == "optimizer":
                piece = p.grad.reshape(-1)[first:last]
            else:
                piece = p.dp_owned_grad
            torch.testing.assert_close(piece, ref_of[id(p)][first:last], **TOL)
        out[sharding] = {"held": model.held_bytes.now, "buckets": len(model.buckets)}
        if sharding == "parameters":
            out["gathers"] = model.layer_gather.num_gathers
            out["freed"] = all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
            with model.whole_parameters(write_back=True):
                for p in module.parameters():
                    p.data.fill_(1.5)
            with model.whole_parameters():
                out["loaded"] = all(bool((p == 1.5).all()) for p in module.parameters())
    return out


def test_zero2_and_zero3_reduce_to_the_single_process_gradient_and_hold_shards():
    for result in run_distributed(sharded_runs, 2):
        assert result["parameters"]["buckets"] == 3  # one per layer
        # (3 layers x (forward + backward) - the last layer's backward) x 2 micro-batches
        assert result["gathers"] == 10, result
        assert result["freed"] and result["loaded"]
        # ZeRO-1 keeps whole weights and grads (2 x 4 bytes per parameter): ZeRO-3 half of each
        assert result["parameters"]["held"] * 2 <= result["optimizer"]["held"] + 64 * 4, result
        assert result["parameters"]["held"] < result["gradients"]["held"] < result["optimizer"]["held"]
