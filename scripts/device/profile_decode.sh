#!/usr/bin/env bash
# One warm decode token under Nsight Compute (device side; the machine's image has ncu).
#   bash scripts/device/profile_decode.sh MODEL.gguf OUTDIR [DEPTH]
# Needs MLX (source ~/.muse-device/env.sh) and the package on PYTHONPATH (the device scripts set both).
# Writes OUTDIR/ncu-token.csv (each of our kernels in the token: time, DRAM bytes, instructions,
# occupancy, issue activity), OUTDIR/ncu-token-summary.txt (the same folded by kernel name)
# and OUTDIR/ncu-details-*.txt (full sections, stall reasons and the hottest SASS, for the
# first kernels of the token whose names match each DETAIL regex). Clocks are left alone (--clock-control none).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=$1 OUTDIR=$2 DEPTH=${3:-512}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
METRICS=${METRICS:-gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__grid_size,launch__block_size,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio}
# METRICS=gpu__time_duration.sum: durations only, one pass a kernel (the whole token in ~1 min).
# KERNELS: the kernels listed (default: ours, regex muse); DETAIL="": no detail passes.
# Our kernels only (-k muse): ncu could not replay one of MLX's own (binary_g_nd) in the
# embedding lookup, and hung there.
# NCU_ARGS: more ncu options, e.g. "--cache-control none" (by default ncu flushes the caches
# before each kernel, which overstates small kernels that normally find their inputs in L2).
timeout "${NCU_TIMEOUT:-200}" "$NCU" --profile-from-start off --clock-control none ${NCU_ARGS:-} --target-processes all -k "regex:${KERNELS:-muse}" --metrics "$METRICS" \
  --csv --page raw python3 scripts/device/profile_decode.py --model "$MODEL" --depth "$DEPTH" ${VARIANTS:+--variants "$VARIANTS"} ${BATCH:+--batch "$BATCH"} \
  > "$OUTDIR/ncu-token${TAG:-}.csv" 2> "$OUTDIR/ncu-token${TAG:-}.err"
echo "ncu token rc $?"; tail -3 "$OUTDIR/ncu-token${TAG:-}.err"
# VARIANTS="tag:name=value,...;tag2:..." (kernel configurations, profile_decode.py --variants): one token
# per variant, folded apart. BATCH=1,2,3,4: one packed step per count of sequences (profile_decode.py
# --batch), folded apart by `ncu_summary.py LISTING --parts b1,b2,b3,b4 --ends _202048_` (not here).
PARTS=$(python3 -c 'import sys; print(",".join(v.split(":")[0] for v in sys.argv[1].split(";") if v))' "${VARIANTS:-}")
python3 scripts/ncu_summary.py "$OUTDIR/ncu-token${TAG:-}.csv" ${PARTS:+--parts "$PARTS"} | tee "$OUTDIR/ncu-token${TAG:-}-summary.txt"
# Full sections for the first kernels of the token matching each regex (name:count), in the same
# steps (BATCH: e.g. DETAIL="matvec_mma_q4_k:2" BATCH=4 for the tensor-core form's stall reasons).
for spec in ${DETAIL-"matvec_stream|attention_partial:8" "silu_q4_k:1"}; do
  rx=${spec%:*} count=${spec##*:} tag=$(echo "${spec%:*}" | tr -c 'a-z0-9_\n' '-' | cut -c1-30)
  timeout 200 "$NCU" --profile-from-start off --clock-control none --target-processes all -k "regex:$rx" \
    --launch-count "$count" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters \
    python3 scripts/device/profile_decode.py --model "$MODEL" --depth "$DEPTH" ${BATCH:+--batch "$BATCH"} \
    > "$OUTDIR/ncu-details-$tag.txt" 2>&1
  echo "ncu details $spec rc $?"
done
