#!/usr/bin/env bash
# One device call that times this tree against a base tree, interleaved, on one bench GGUF:
#   git archive BASE muse_mlx custom_kernels | (mkdir -p .device/base && tar x -C .device/base)
#   git rev-parse BASE > .device/base/revision; git rev-parse HEAD > .device/revision
# then on the device (carry .device/part2, .device/base, .device/revision):
#   bash scripts/device_ab.sh
# Writes $OUT/ab-{new,base}-{1,2}.json (muse_mlx.bench decode receipts, new-base-new-base so
# that a drift of the machine shows) and $OUT/gpu-tests.log / verification.json for GPU_TESTS.
# VARIANTS="tag:VAR=value ..." also times this tree with those settings in each pass
# (e.g. VARIANTS="butterfly:MUSE_MLX_ATTN_LOOP=butterfly" writes ab-butterfly-{1,2}.json; several
# settings of one variant joined by "+": "small:MUSE_MLX_ATTN_CHUNK=16,64+MUSE_MLX_COMBINE_WARPS=auto").
# Without .device/base carried, only this tree and its variants are timed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1
NEW=$PWD BASE=$PWD/.device/base
# LLAMA_BUILD=1 (carry .device/llama-src.tar.xz): build llama-bench in the background meanwhile,
# for device_b.sh's llama-bench in a later call (the build slows this call's host a little).
[ "${LLAMA_BUILD:-0}" = 1 ] && bash scripts/build_llama_bg.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
[ -f /tmp/bench.gguf ] || python3 scripts/make_bench_gguf.py /tmp/bench.gguf 2>&1 | tee "$OUT/make-gguf.log"
BENCH_ARGS=${BENCH_ARGS:-"--depths 0,32768 --prefill '' --no-matvecs --reps 3 --decode-tokens 48"}
run_bench() {  # tree tag [VAR=value]
  local assigns=${3:-MUSE_AB_VARIANT=none}
  (cd "$1" && export ${assigns//+/ } && PYTHONPATH="$1:$PYTHONPATH" \
    MUSE_GIT_REVISION="$(cat "$1/.device/revision" 2>/dev/null || cat "$1/revision")" \
    eval timeout 150 python3 -m muse_mlx.bench --model /tmp/bench.gguf --synthetic $BENCH_ARGS \
    --receipt "$OUT/ab-$2.json") 2>&1 | grep -v "^$" | sed "s/^/[$2] /"
}
for round in 1 2; do
  run_bench "$NEW" "new-$round"
  for v in ${VARIANTS:-}; do run_bench "$NEW" "${v%%:*}-$round" "${v#*:}"; done
  [ -d "$BASE" ] && run_bench "$BASE" "base-$round"   # skipped when .device/base is not carried
done
if [ -n "${GPU_TESTS:-}" ]; then
  PYTHONPATH="$NEW:$PYTHONPATH" MUSE_GIT_REVISION="$(cat .device/revision)" MUSE_GPU_RECEIPT="$OUT/verification.json" \
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $GPU_TESTS ${PYTEST_K:+-k "$PYTEST_K"} -q -p no:cacheprovider -rf --tb=line > "$OUT/gpu-tests.log" 2>&1
  tail -8 "$OUT/gpu-tests.log"
fi
