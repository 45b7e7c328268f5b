"""``parallel.async_tp``: inductor's micro-pipeline TP pass fuses a compiled sequence-parallel
layer's all-gather + matmul and matmul + reduce-scatter into symmetric-memory ops that overlap
the transfer with the matmul's pieces.

The fused ops run on CUDA only, so the CPU checks what the pass needs from mtl's layer: every
sequence-parallel collective of its forward and backward graphs sits next to its matmul, in the
patterns torch's pass matches (read from the graphs the training run compiles, one process as
rank 0 of two over torch's fake process group). A reshape or permute in between hides a
collective from the pass: an identity permute once hid the row linears' (collectives.py).
On two GPUs the tiny model trains with async TP to the one-GPU losses and gradients. Settings it
cannot serve are refused before any work, naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.train.testing import TINY

# A post-grad pass beside inductor's own (as the micro-pipeline TP pass runs) that counts, per
# compiled graph, the collectives torch's pass would fuse. No cache: every graph is compiled, so
# the pass sees it.
SCRIPT = textwrap.dedent("""
    import json
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp as async_tp
    from mtl.parallel.testing import join_fake_group

    join_fake_group(rank=0, world_size=2)
    collectives = ("_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor")
    graphs = []

    def count(graph):
        gathers, scatters = async_tp.find_all_gather_patterns(graph), async_tp.find_reduce_scatter_patterns(graph)
        graphs.append({
            "backward": any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes),
            "collectives": sum(str(n.target).startswith(collectives) for n in graph.nodes),
            "gather_then_matmul": sum(bool(async_tp._find_consumer_matmuls(g.res_node)) for g in gathers),
            "matmul_then_scatter": sum(async_tp._find_producer_matmul(s.input_node) is not None for s in scatters),
        })

    inductor_config.fx_graph_cache = False
    inductor_config.post_grad_custom_post_pass = count
    from mtl.train.testing import run_tiny
    run_tiny(["parallel.tp=2", "parallel.sequence_parallel=true", "train.compile=true", "model.num_layers=1",
              "train.iters=1"], False)
    print("GRAPHS " + json.dumps(graphs))
""")


def test_sequence_parallel_layer_collectives_sit_next_to_their_matmuls():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    graphs = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("GRAPHS "))[7:])
    layer_graphs = [g for g in graphs if g["collectives"]]
    # the layer's forward and its backward; the final norm's graphs hold no collective
    assert sorted(g["backward"] for g in layer_graphs) == [False, True], graphs
    for graph in layer_graphs:
        # the qkv and fc1 column linears gather their input (forward) or the gradient of the
        # proj and fc2 row linears' output (backward); the row linears' outputs (forward) and the
        # column linears' input gradients (backward) are reduce-scattered: 2 + 2, every one fusable
        assert graph == {**graph, "collectives": 4, "gather_then_matmul": 2, "matmul_then_scatter": 2}, graph


def _resolve(*overrides: str, world_size: int = 2):
    # resolving a config touches no device: 'cuda' resolves on a machine without one
    cfg = load_config(None, [*TINY, "train.device='cuda'", "parallel.tp=2", "parallel.sequence_parallel=true",
                             "train.compile=true", "parallel.async_tp=true", *overrides])
    cfg.resolve(world_size=world_size, tokenizer_vocab_size=257)


@pytest.mark.parametrize("overrides, world_size, names", [
    (["parallel.tp=1"], 1, "parallel.tp = 1"),
    (["parallel.sequence_parallel=false"], 2, "parallel.tp = 2, sequence_parallel = false"),
    (["train.compile=false"], 2, "train.compile = false"),
    (["train.device='cpu'"], 2, "a CPU run"),
])
def test_refused_where_it_cannot_work(overrides, world_size, names):
    with pytest.raises(ConfigError, match=rf"parallel.async_tp = true does not work with {names}.*"
                                          r"or set parallel.async_tp = false"):
        _resolve(*overrides, world_size=world_size)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the fused ops are CUDA ops over NCCL)")
def test_two_gpus_train_to_the_one_gpu_numbers():
    from mtl.parallel.testing import run_distributed
    from mtl.train.testing import compare_with_reference, run_layout, run_tiny

    cuda = ["train.device='cuda'"]
    (reference,) = run_distributed(run_tiny, 1, args=(cuda,), backend="nccl")
    compare_with_reference("tp2_sp_async_tp", run_layout("tp2_sp_async_tp", cuda, backend="nccl"), reference)
