#!/usr/bin/env bash
# One device call for what does not time end to end (so it may share the CPUs with the
# llama.cpp build): start llama-bench's build in the background (LLAMA_BUILD=1, carry
# .device/llama-src.tar.xz), make the bench GGUF, Nsight Compute listings of one warm token per
# kernel configuration, then this tree's GPU checks (last: what the call's limit cuts). The
# end-to-end timings follow in a later call on the same machine (device_ab.sh, then device_b.sh).
#   carry .device/part2 (or the machine already set up by an earlier call), .device/revision
#   GPU_TESTS=tests/gpu/test_kernels.py PYTEST_K="logits or attention" TEST_TIMEOUT=280 \
#   NCU_RUNS="full|muse|default:;small:ring_chunk=16,plane_chunk=64 @ attn|attention|default:;cw8:combine_warps=8" \
#   bash scripts/device/device_checks.sh
# NCU_RUNS: runs "TAG|KERNEL REGEX|VARIANTS" joined by "@"; each is one ncu process (durations
# only, caches left warm: --cache-control none) at depth NCU_DEPTH (32768), one token per
# variant (VARIANTS: "tag:KERNEL_CONFIG;tag2:...", profile_decode.py --variants; "default:" is the
# defaults), NCU_TIMEOUT seconds at most (default 200). The regex cannot hold "|" (the field
# separator here): for "muse|copy|scatter" run profile_decode.sh with KERNELS set. Variants whose
# tokens launch different numbers of kernels are folded apart with
# `scripts/ncu_summary.py CSV --parts a,b --ends _202048_` (the LM head ends each token).
# Writes $OUT/nvidia-smi.txt, make-gguf.log, ncu-token-TAG.csv / .err / -summary.txt per run,
# gpu-tests.log, verification.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
[ "${LLAMA_BUILD:-0}" = 1 ] && bash scripts/device/build_llama_bg.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
[ -f /tmp/bench.gguf ] || python3 scripts/make_bench_gguf.py /tmp/bench.gguf 2>&1 | tail -2 | tee "$OUT/make-gguf.log"
IFS='@' read -ra runs <<< "${NCU_RUNS:-}"
for run in "${runs[@]}"; do
  run=$(echo "$run" | sed 's/^ *//; s/ *$//'); [ -n "$run" ] || continue
  IFS='|' read -r tag regex variants <<< "$run"
  t0=$(date +%s)
  METRICS=gpu__time_duration.sum DETAIL="" NCU_ARGS="--cache-control none" KERNELS="$regex" TAG="-$tag" VARIANTS="$variants" \
    bash scripts/device/profile_decode.sh /tmp/bench.gguf "$OUT" "${NCU_DEPTH:-32768}" | tail -40
  echo "ncu run $tag took $(( $(date +%s) - t0 )) s"
done
if [ -n "${GPU_TESTS:-}" ]; then
  t0=$(date +%s)
  MUSE_GPU_RECEIPT="$OUT/verification.json" timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $GPU_TESTS ${PYTEST_K:+-k "$PYTEST_K"} \
    -p no:cacheprovider -rf --tb=line -v > "$OUT/gpu-tests.log" 2>&1
  echo "GPU tests rc $? in $(( $(date +%s) - t0 )) s"; grep -cE "PASSED" "$OUT/gpu-tests.log"; grep -E "FAILED|ERROR" "$OUT/gpu-tests.log" | head; tail -2 "$OUT/gpu-tests.log"
  cp "$OUT/gpu-tests.log" /tmp/gpu-tests.log   # device_b.sh's CANDIDATE reads it
fi
bash scripts/device/pack_out.sh
