#!/usr/bin/env bash
# One GPU, bf16: the GPT-2-style and Llama-style reference models, steady-state throughput.
# Run from the repository root on the GPU machine: bash benchmarks/gpu/bench_single_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/gpu/setup.sh
export PYTHONUNBUFFERED=1
ITERS=${ITERS:-10}
rm -rf runs/bench_llama runs/bench_gpt2  # metrics.jsonl appends: start from empty logs
for model in llama gpt2; do
  python3 -m mtl.cli train "benchmarks/gpu/${model}_reference.toml" --set train.iters=$ITERS "$@" 2>&1 | tee "${OUT:-.}/${model}.log" | tail -5
done
python3 benchmarks/gpu/summarize.py llama=runs/bench_llama/metrics.jsonl gpt2=runs/bench_gpt2/metrics.jsonl | tee "${OUT:-.}/single_gpu.md"
