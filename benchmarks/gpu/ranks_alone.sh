#!/usr/bin/env bash
# One rank of each two-way layout, alone on one GPU, with collectives that move nothing
# (queue_time.py --as-rank: torch's fake process group). Its step time is the floor the
# layout could reach if every transfer were hidden: compute plus host time, no waiting on the
# peer, no pipeline bubble. Against the layout measured on 2 GPUs (bench_multi_gpu.sh), the
# difference is what communication costs; against the one-GPU row, what splitting the work
# costs by itself. Needs one GPU. Run from the repository root: bash benchmarks/gpu/ranks_alone.sh
# ROWS picks rows (default all): gpu1 tp2_sp pp2 pp2_vpp2 cp2 long_gpu1 long_cp2 long_cp2_allgather
# (the cp rows name their cp_comm_type: compiled at cp=2 the config's own choice is all_gather).
# EXTRA adds settings to every row, e.g. EXTRA="--set parallel.overlap_layer_comm=true" or
# EXTRA="--set train.compile_cpp_wrapper=true" (inductor's C++ wrapper: a host-bound rank's launches).
# A rank whose kernels are short can be bound by the host: its time then depends on the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
ROWS=${ROWS:-"gpu1 tp2_sp pp2 pp2_vpp2 cp2 long_gpu1 long_cp2 long_cp2_allgather"}
STEPS=${STEPS:-4}
LONG=(--set model.seq_length=8192 --set train.micro_batch_size=1 --set train.global_batch_size=8)
alone() {  # alone NAME R/W [--set ...]: prints queue_time's line for that rank (R/W "-": one plain process)
  local name=$1 spec=$2; shift 2
  echo "== $name, rank $spec"
  local as=(--as-rank "$spec"); [ "$spec" = - ] && as=()
  # shellcheck disable=SC2086  # EXTRA is a list of words
  timeout "${RUN_TIMEOUT:-200}" ${PYTHON:-python3} benchmarks/gpu/queue_time.py --steps "$STEPS" "${as[@]}" "$@" ${EXTRA:-} 2>&1 \
    | grep -E "queueing|Error|error" | tail -2 || true
}
for row in $ROWS; do
  case $row in
    gpu1) alone gpu1 - ;;
    tp2_sp) alone tp2_sp 0/2 --set parallel.tp=2 --set parallel.sequence_parallel=true ;;
    # the stages differ (the last holds the LM head and the loss): both
    pp2) alone pp2 0/2 --set parallel.pp=2; alone pp2 1/2 --set parallel.pp=2 ;;
    pp2_vpp2) alone pp2_vpp2 0/2 --set parallel.pp=2 --set parallel.vpp=2
              alone pp2_vpp2 1/2 --set parallel.pp=2 --set parallel.vpp=2 ;;
    cp2) alone cp2 0/2 --set parallel.cp=2 --set parallel.cp_comm_type=p2p ;;
    long_gpu1) alone long_gpu1 - "${LONG[@]}" ;;
    long_cp2) alone long_cp2 0/2 "${LONG[@]}" --set parallel.cp=2 --set parallel.cp_comm_type=p2p ;;
    long_cp2_allgather) alone long_cp2_allgather 0/2 "${LONG[@]}" --set parallel.cp=2 --set parallel.cp_comm_type=all_gather ;;
    *) echo "unknown row $row" >&2; exit 2 ;;
  esac
done
