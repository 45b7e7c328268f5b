"""Run the ``mtl`` CLI with inductor settings that mtl's config does not expose, to measure a
compiler option (tensor-parallel communication overlap, issue 11) before it becomes a key.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu/inductor_flags.py \\
        --inductor reorder_for_compute_comm_overlap=True [--inductor NAME=VALUE ...] [--symm-mem-tp] \\
        -- train benchmarks/gpu/llama_reference.toml --set parallel.tp=2 --set parallel.sequence_parallel=true

- ``--inductor NAME=VALUE`` sets ``torch._inductor.config.NAME`` (VALUE a Python literal)
  before anything compiles. Candidates:
  - ``reorder_for_compute_comm_overlap=True``: moves the backward's reduce-scatter next to the
    weight-gradient GEMM that does not need it;
  - ``_micro_pipeline_tp=True``: torch's async TP, all-gather/reduce-scatter decomposed into
    the GEMMs over symmetric memory. Needs ``--symm-mem-tp``, and
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` on machines without NVLink multicast.
- ``--symm-mem-tp`` enables symmetric memory for each TP group as the topology creates it.

Everything after ``--`` is the ``mtl`` command line, unchanged. The settings apply to this
process only; nothing in mtl changes.
"""

from __future__ import annotations

import argparse
import ast
import sys


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--symm-mem-tp", action="store_true")
    args = parser.parse_args(argv[:split])

    import torch._inductor.config as inductor_config

    for item in args.inductor:
        name, _, value = item.partition("=")
        if not hasattr(inductor_config, name):
            parser.error(f"--inductor {item}: torch._inductor.config has no setting {name!r}")
        setattr(inductor_config, name, ast.literal_eval(value))
        print(f"inductor_flags: torch._inductor.config.{name} = {getattr(inductor_config, name)!r}", flush=True)
    if args.symm_mem_tp:
        _enable_symmetric_memory_for_tp()

    from mtl.cli.main import main as mtl_main

    mtl_main(argv[split + 1:])


def _enable_symmetric_memory_for_tp() -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    from mtl.parallel.topology import Topology

    create_groups = Topology._create_groups

    def create_groups_then_enable(self, world: int) -> None:
        create_groups(self, world)
        group = self.groups.get("tp")
        if group is not None and self.tp > 1:
            enable_symm_mem_for_group(group.group_name)

    Topology._create_groups = create_groups_then_enable


if __name__ == "__main__":
    main()
