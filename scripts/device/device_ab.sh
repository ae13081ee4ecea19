#!/usr/bin/env bash
# One device call that times this tree against a base tree, interleaved, on one bench GGUF.
# Here, before the call:
#   git archive BASE muse_mlx custom_kernels | (mkdir -p .device/base && tar x -C .device/base)
#   git rev-parse BASE > .device/base/revision; git rev-parse HEAD > .device/revision
# then on the device (carry .device/revision and .device/base; .device/part2 unless an earlier call
# on this machine unpacked MLX):
#   bash scripts/device/device_ab.sh
# Writes $OUT/ab-{new,base}-{1,2}.json (bench decode receipts, new-base-new-base so that a drift of
# the machine shows), $OUT/nvidia-smi.txt, and $OUT/gpu-tests.log / verification.json for GPU_TESTS.
#   VARIANTS   space-separated "tag:KERNEL_CONFIG" items: this tree is also timed in each pass with
#              `--kernel-config KERNEL_CONFIG` (muse_mlx.config.KernelConfig.parse), e.g.
#              VARIANTS="small:ring_chunk=16,plane_chunk=64 cw8:combine_warps=8" writes
#              ab-small-{1,2}.json and ab-cw8-{1,2}.json. The base tree is always timed with its
#              own defaults.
#   PASSES     interleaved passes (default 2; each tree once a pass)
#   NEW_CONFIG a --kernel-config string for this tree's own timings (e.g. pinned_upload=0)
#   BENCH_ARGS the bench's arguments (default below: decode only, depths 0 and 32,768)
#   GPU_TESTS, PYTEST_K, TEST_TIMEOUT: GPU checks of this tree after the timings
#   LLAMA_BUILD=1 (carry .device/llama-src.tar.xz): build llama-bench in the background meanwhile,
#              for device_b.sh in a later call (the build slows this call's host a little)
# Every carried base tree is timed: .device/base (receipts ab-base-N.json) and .device/base-TAG
# (ab-base-TAG-N.json), e.g. .device/base-0e4a0ae next to .device/base; without one, only this
# tree and its variants are timed.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1
NEW=$PWD
[ "${LLAMA_BUILD:-0}" = 1 ] && bash scripts/device/build_llama_bg.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
[ -f /tmp/bench.gguf ] || PYTHONPATH="$NEW:$PYTHONPATH" python3 scripts/make_bench_gguf.py /tmp/bench.gguf 2>&1 | tee "$OUT/make-gguf.log"
BENCH_ARGS=${BENCH_ARGS:-"--depths 0,32768 --prefill '' --no-matvecs --reps 3 --decode-tokens 48"}
run_bench() {  # TREE TAG [KERNEL_CONFIG]
  # the bench's module in that tree: muse_mlx.tools.bench, or muse_mlx.bench before the tools moved
  local module=muse_mlx.tools.bench
  [ -f "$1/muse_mlx/tools/bench.py" ] || module=muse_mlx.bench
  (cd "$1" && export PYTHONPATH="$1:$PYTHONPATH" \
    MUSE_GIT_REVISION="$(cat "$1/.device/revision" 2>/dev/null || cat "$1/revision")" && \
    eval timeout ${BENCH_TIMEOUT:-200} python3 -m $module --model /tmp/bench.gguf --synthetic $BENCH_ARGS \
    ${3:+--kernel-config "$3"} --receipt "$OUT/ab-$2.json") 2>&1 | grep -v "^$" | sed "s/^/[$2] /"
}
for round in $(seq 1 "${PASSES:-2}"); do
  run_bench "$NEW" "new-$round" "${NEW_CONFIG:-}"
  for v in ${VARIANTS:-}; do run_bench "$NEW" "${v%%:*}-$round" "${v#*:}"; done
  for base in .device/base .device/base-*; do
    [ -d "$base" ] && run_bench "$PWD/$base" "${base#.device/}-$round"
  done
done
if [ -n "${GPU_TESTS:-}" ]; then
  PYTHONPATH="$NEW:$PYTHONPATH" MUSE_GIT_REVISION="$(cat .device/revision)" MUSE_GPU_RECEIPT="$OUT/verification.json" \
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $GPU_TESTS ${PYTEST_K:+-k "$PYTEST_K"} -q -p no:cacheprovider -rf --tb=line > "$OUT/gpu-tests.log" 2>&1
  tail -8 "$OUT/gpu-tests.log"
  cp "$OUT/gpu-tests.log" /tmp/gpu-tests.log   # device_b.sh's CANDIDATE reads it
fi
bash scripts/device/pack_out.sh
