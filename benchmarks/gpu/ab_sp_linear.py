"""Run a benchmark script with sequence parallelism's column linear as the two autograd functions
it was before ``gathered_linear`` (commit 2f61179): the all-gather (``_GatherFromSP``), then the
linear; the backward's reduce-scatter then starts only after the weight-gradient GEMM. An A/B
of the two in one call, e.g. a tp=2 rank alone:

    python3 benchmarks/gpu/ab_sp_linear.py queue_time --steps 3 \\
        --set parallel.tp=2 --set parallel.sequence_parallel=true --as-rank 0/2

The first argument names the script in benchmarks/gpu (queue_time, profile_step), whose
``main()`` then runs with the remaining arguments.
"""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mtl.parallel.tensor_parallel import layers, mappings, wgrad_fusion  # noqa: E402

gathered_forward = layers.ColumnParallelLinear.forward


def two_function_forward(self, x):
    if self.sp_comm is None:  # no sequence parallelism here: unchanged
        return gathered_forward(self, x)
    return wgrad_fusion.linear(mappings.gather_from_sequence_parallel(x, self.tp_group), self.weight, self.bias)


layers.ColumnParallelLinear.forward = two_function_forward
script = importlib.import_module(sys.argv[1])
sys.argv = [sys.argv[1]] + sys.argv[2:]
script.main()
