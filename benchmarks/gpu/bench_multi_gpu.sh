#!/usr/bin/env bash
# Several GPUs of one host, bf16, the Llama-style reference model (llama_reference.toml):
# one GPU, then every two-way layout (dp, tp+sp, pp, cp) or, on 4 GPUs, dp=4 and tp=2 x dp=2.
# Run from the repository root on the GPU machine: bash benchmarks/gpu/bench_multi_gpu.sh
# Writes multi_gpu.md (a table with scaling efficiency against one GPU) to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash benchmarks/gpu/setup.sh
export PYTHONUNBUFFERED=1
ITERS=${ITERS:-10}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then echo "bench_multi_gpu.sh needs at least 2 GPUs, found $NGPU" >&2; exit 1; fi
rm -rf runs/multi_*  # metrics.jsonl appends, and the table lists every runs/multi_* folder
run() {  # run NAME NPROC [--set ...]
  local name=$1 nproc=$2; shift 2
  echo "== $name on $nproc GPU(s)"
  torchrun --standalone --nproc-per-node "$nproc" -m mtl.cli train benchmarks/gpu/llama_reference.toml \
    --set train.iters="$ITERS" --set logging.dir="'runs/multi_$name'" "$@" 2>&1 | grep -v "^\[rank[1-9]" | tail -4
}
run gpu1 1
if [ "$NGPU" -ge 4 ]; then
  run dp4 4
  run tp2_dp2 4 --set parallel.tp=2 --set parallel.sequence_parallel=true
else
  run dp2 2
  run tp2_sp 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
  run pp2 2 --set parallel.pp=2
  run cp2 2 --set parallel.cp=2
fi
python3 benchmarks/gpu/summarize.py --baseline gpu1 $(for d in runs/multi_*; do echo "${d#runs/multi_}=$d/metrics.jsonl"; done) \
  | tee "${OUT:-.}/multi_gpu.md"
