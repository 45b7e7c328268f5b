#!/usr/bin/env bash
# Several GPUs of one host, bf16, the Llama-style reference model (llama_reference.toml):
# first how the GPUs are linked and how fast (link_bandwidth.py; LINK=0 skips), then
# one GPU, then every two-way layout (dp, tp+sp, pp, pp interleaved, cp; with FA4 installed also one GPU
# and tp=2+sp on it) or, on 4 GPUs, dp=4 and tp=2 x dp=2;
# (SHORT=0 skips these); then cp=2 at sequence 8192 against one GPU at 8192 (LONG=0 skips); then the MoE reference
# (moe_reference.toml) on one GPU and at ep=2 (MOE=0 skips); on 8 GPUs dp=8, tp=2 x dp=4, pp=2 x dp=4,
# MoE at ep=8 and the 8B model at tp=8, tp=4 x pp=2 and ZeRO-3 dp=8, bf16 and FP8 (BIG=0 skips those).
# Run from the repository root on the GPU machine: bash benchmarks/gpu/bench_multi_gpu.sh
# Writes multi_gpu.md, long_multi_gpu.md, moe_multi_gpu.md and (8 GPUs) big_multi_gpu.md (tables with scaling efficiency
# against their one-GPU row) to $OUT. RUN_TIMEOUT (s, default 240) bounds each run.
# ROWS="gpu1 tp2_sp_mb8 ..." runs only the rows named (each table still needs its one-GPU row).
# TORCHRUN_ARGS adds arguments to every row's torchrun (a row may set its own). Each row's whole
# log goes to $OUT/row_NAME.log.
# DRY=N runs nothing and needs no GPU: it prints one line per row as if N GPUs were there,
# "DRY_ROW<TAB>name<TAB>processes<TAB>mtl train's arguments (config first), separated by US (0x1f)",
# for tests/test_bench_rows.py, which resolves every row's config before GPU time goes to a typo.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
ITERS=${ITERS:-10}
SHORT=${SHORT:-1}
MOE=${MOE:-1}
LONG=${LONG:-1}
if [ -n "${DRY:-}" ]; then
  if ! [[ $DRY =~ ^[0-9]+$ ]]; then echo "DRY=N needs the number of GPUs to list the rows for, got '$DRY'" >&2; exit 1; fi
  NGPU=$DRY LINK=0
else
  bash scripts/gpu/setup.sh
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
fi
if [ "$NGPU" -lt 2 ]; then echo "bench_multi_gpu.sh needs at least 2 GPUs, found $NGPU" >&2; exit 1; fi
if [ "${LINK:-1}" = 1 ]; then
  timeout 120 torchrun --standalone --nproc-per-node "$NGPU" benchmarks/gpu/link_bandwidth.py 2>&1 | grep -v "^\[rank[1-9]" \
    | tee "${OUT:-.}/link_bandwidth.md" || true
fi
if [ -z "${DRY:-}" ]; then rm -rf runs/multi_*; fi  # metrics.jsonl appends, and the table lists every runs/multi_* folder
run() {  # run NAME NPROC [--set ...]; CONFIG= picks another model (default: the reference)
  local name=$1 nproc=$2; shift 2
  if [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $name "* ]]; then return 0; fi
  local train_args=("${CONFIG:-benchmarks/gpu/llama_reference.toml}" --set train.iters="$ITERS"
                    --set logging.dir="'runs/multi_$name'" "$@")
  if [ -n "${DRY:-}" ]; then
    local IFS=$'\x1f'
    printf 'DRY_ROW\t%s\t%s\t%s\n' "$name" "$nproc" "${train_args[*]}"
    return 0
  fi
  echo "== $name on $nproc GPU(s)"
  timeout "${RUN_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$nproc" ${TORCHRUN_ARGS:-} -m mtl.cli train \
    "${train_args[@]}" 2>&1 | tee "${OUT:-.}/row_$name.log" \
    | grep -v "^\[rank[1-9]" | tail -4 || true  # the whole log beside the tables: a failed row's traceback
}
if [ "$SHORT" = 1 ]; then
  run gpu1 1
  if [ "$NGPU" -ge 8 ]; then  # issue 40's rows: dp8 (goal 93%), tp=2 and pp=2 each with dp=4
    run dp8 8
    run tp2_dp4 8 --set parallel.tp=2 --set parallel.sequence_parallel=true
    run pp2_dp4 8 --set parallel.pp=2
  elif [ "$NGPU" -ge 4 ]; then
    run dp4 4
    run tp2_dp2 4 --set parallel.tp=2 --set parallel.sequence_parallel=true
  else
    run dp2 2
    run tp2_sp 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
    # a tp=2 rank is bound by its host (benchmarks/log, thirteenth session: 683-888 ms per step for
    # ~500 ms of kernels); micro-batches of 8 (the same global batch, 20 GiB at 4) halve its launches
    run tp2_sp_mb8 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.micro_batch_size=8
    # at micro-batch 8 the rank waits on its collectives more than on its host (82%, MFU 58% against 71% on
    # one GPU; async TP changed nothing there, benchmarks/log, fifteenth session): 2 micro-batches of 16 (44 GiB: 84%)
    run tp2_sp_mb16 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.micro_batch_size=16
    # 84% at 16 (fifteenth session); async TP there 88-89%, the whole batch as one micro-batch 82% (74 GiB, H200
    # only; sixteenth session)
    run tp2_sp_mb16_async 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.micro_batch_size=16 \
      --set parallel.async_tp=true
    run tp2_sp_mb32 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.micro_batch_size=32
    # torch's async TP (parallel.async_tp): each sequence-parallel all-gather + matmul and matmul + reduce-scatter as
    # one op that overlaps the transfer with the matmul's pieces; its ops add host work to a host-bound rank
    # (micro-batch 4: 35%; 8: 81%, as without; sixteenth session)
    run tp2_sp_async 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.async_tp=true
    run tp2_sp_mb8_async 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.async_tp=true \
      --set train.micro_batch_size=8
    # each rank's process kept on the CPUs of its GPU's NUMA node: the tp=2 step varied 0.7-0.95 s from run to run
    # on one machine (benchmarks/log, fourteenth session) for ~0.5 s of kernels
    TORCHRUN_ARGS="--numa-binding node" run tp2_sp_numa 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
    # the last stage also runs the LM head and loss (~1.9 layers' FLOPs at vocab 50304): by default the
    # stages are sized by FLOPs (parallel.pipeline_split), 13 layers and 11 + the head: 90% against 85%
    # for 12 + 12 (seventeenth session)
    run pp2 2 --set parallel.pp=2
    run pp2_even 2 --set parallel.pp=2 --set parallel.pipeline_split=even
    # 16 micro-batches of 2 shrink the 1F1B bubble from 1/9 to 1/17 of the step but cost more host per
    # token (0.634 s against 0.600 s for 8 of 4, fourteenth session); vpp=2 halves the bubble instead
    run pp2_mb2 2 --set parallel.pp=2 --set train.micro_batch_size=2
    # interleaved: by FLOPs 7, 6, 6, 5 layers (92-93%; 88-91% for an even 6 each, seventeenth session),
    # and vpp=4 halves the bubble again (4, 3, 3, 3, 3, 3, 3, 2: 92-95%)
    run pp2_vpp2 2 --set parallel.pp=2 --set parallel.vpp=2
    run pp2_vpp2_even 2 --set parallel.pp=2 --set parallel.vpp=2 --set parallel.pipeline_split=even
    run pp2_vpp4 2 --set parallel.pp=2 --set parallel.vpp=4
    run cp2 2 --set parallel.cp=2  # compiled at cp=2 the config picks k/v all-gathered
    run cp2_ring 2 --set parallel.cp=2 --set parallel.cp_comm_type=p2p
    run cp2_mb8 2 --set parallel.cp=2 --set train.micro_batch_size=8  # bound by the host as tp=2 is
    # FlashAttention-4 behind SDPA, where installed (scripts/gpu/fa4_install.sh, carry .whl/fa4): its
    # Python launches cost ~0.7 ms of host per forward + backward (benchmarks/log, ninth session), which a
    # host-bound tp=2 rank may not hide
    if [ -n "${DRY:-}" ] || python3 -c "import flash_attn.cute.interface" 2>/dev/null; then
      run gpu1_fa4 1 --set "train.attention_kernel='fa4'"
      run tp2_sp_fa4 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set "train.attention_kernel='fa4'"
    fi
  fi
fi
# cp at a sequence it is meant for: 8192 tokens, one sequence per micro-batch (the same 65,536
# tokens per step as the reference: global batch 8)
LONG_SET=(--set model.seq_length=8192 --set train.micro_batch_size=1 --set train.global_batch_size=8)
if [ "$LONG" = 1 ]; then
  run long_gpu1 1 "${LONG_SET[@]}"
  run long_cp2 2 "${LONG_SET[@]}" --set parallel.cp=2  # k/v all-gathered: compiles with the layer
  # the ring (point-to-point, overlapped, eager between the layer's graphs)
  run long_cp2_ring 2 "${LONG_SET[@]}" --set parallel.cp=2 --set parallel.cp_comm_type=p2p
fi
# The MoE reference (issue 8) on one GPU and with its experts split over 2 GPUs (ep=2 = dp=2),
# plus dp=2 over those at 4 GPUs; its own table, against its own one-GPU row.
if [ "$MOE" = 1 ]; then
  CONFIG=benchmarks/gpu/moe_reference.toml run moe_gpu1 1
  CONFIG=benchmarks/gpu/moe_reference.toml run moe_ep2 2 --set parallel.ep=2
  if [ "$NGPU" -ge 4 ]; then
    CONFIG=benchmarks/gpu/moe_reference.toml run moe_dp4_ep2 4 --set parallel.ep=2
  fi
  if [ "$NGPU" -ge 8 ]; then  # one expert per GPU
    CONFIG=benchmarks/gpu/moe_reference.toml run moe_ep8 8 --set parallel.ep=8
  fi
fi
# The 8B Llama-3 shape (llama8b_reference.toml) at full node scale, bf16 and FP8 current scaling
# (the fp8 backend), in TFLOP/s per GPU: no one-GPU row (it does not fit one GPU). Goals (issue
# 40): 520 in bf16 (4xH200 at tp2 x dp2 + ZeRO-1: 523), 750 in FP8 (4xH200: 660). BIG=0 skips.
FP8_SET=(--set "model.backend='fp8'" --set "train.fp8='current'")
if [ "${BIG:-1}" = 1 ] && [ "$NGPU" -ge 8 ]; then
  for precision in bf16 fp8; do
    extra=(); if [ "$precision" = fp8 ]; then extra=("${FP8_SET[@]}"); fi
    CONFIG=benchmarks/gpu/llama8b_reference.toml run "big_tp8_$precision" 8 --set parallel.tp=8 \
      --set parallel.sequence_parallel=true "${extra[@]}"
    CONFIG=benchmarks/gpu/llama8b_reference.toml run "big_tp4_pp2_$precision" 8 --set parallel.tp=4 \
      --set parallel.sequence_parallel=true --set parallel.pp=2 "${extra[@]}"
    CONFIG=benchmarks/gpu/llama8b_reference.toml run "big_dp8_zero3_$precision" 8 \
      --set "parallel.sharding='parameters'" "${extra[@]}"
  done
fi
if [ -n "${DRY:-}" ]; then exit 0; fi
table() {  # table BASELINE OUTFILE ROW-FOLDERS...
  local baseline=$1 out=$2; shift 2
  python3 benchmarks/gpu/summarize.py --baseline "$baseline" $(for d in "$@"; do echo "${d#runs/multi_}=$d/metrics.jsonl"; done) \
    | tee "${OUT:-.}/$out" || true  # a run that failed has no metrics: its table is missing, not the others
}
if [ "$SHORT" = 1 ] && [ -d runs/multi_gpu1 ]; then table gpu1 multi_gpu.md $(ls -d runs/multi_* | grep -v "^runs/multi_\(moe\|long\)_"); fi
if [ "$LONG" = 1 ] && [ -d runs/multi_long_gpu1 ]; then table long_gpu1 long_multi_gpu.md runs/multi_long_*; fi
if [ "$MOE" = 1 ] && [ -d runs/multi_moe_gpu1 ]; then table moe_gpu1 moe_multi_gpu.md runs/multi_moe_*; fi
if ls -d runs/multi_big_* >/dev/null 2>&1; then
  python3 benchmarks/gpu/summarize.py $(for d in runs/multi_big_*; do echo "${d#runs/multi_}=$d/metrics.jsonl"; done) \
    | tee "${OUT:-.}/big_multi_gpu.md" || true
fi
