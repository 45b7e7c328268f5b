"""Run a benchmark script with sequence parallelism's column linear as the two autograd functions
it was before ``gathered_linear`` (commit 2f61179): the all-gather (``_GatherFromSP``), then the
linear; the backward's reduce-scatter then starts only after the weight-gradient GEMM. An A/B
of the two in one call, e.g. a tp=2 rank alone:

    python3 benchmarks/gpu/ab_sp_linear.py benchmarks/gpu/queue_time.py --steps 3 \
        --set parallel.tp=2 --set parallel.sequence_parallel=true --as-rank 0/2
"""

import runpy
import sys

sys.path.insert(0, "benchmarks/gpu")
from mtl.parallel.tensor_parallel import layers  # noqa: E402

# Defined inside the layers module (its globals: ``mappings``), where dynamo resolves the names
# a compiled layer's code uses; a function defined here would look them up in the __main__ that
# runpy replaces.
TWO_FUNCTIONS = """
def _two_function_forward(self, x):
    if self.sequence_parallel:
        x = mappings.gather_from_sequence_parallel(x, self.tp_group)
    else:
        x = mappings.copy_to_tensor_parallel(x, self.tp_group)
    y = self.local_linear(x, self.weight, self.bias)
    if self.gather_output:
        y = mappings.gather_from_tensor_parallel(y, self.tp_group)
    return y
"""
exec(TWO_FUNCTIONS, layers.__dict__)
layers.ColumnParallelLinear.forward = layers.__dict__["_two_function_forward"]
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
