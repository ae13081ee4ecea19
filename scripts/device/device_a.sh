#!/usr/bin/env bash
# Device call A, the first call after the stash (carry .device/part2, .device/revision, and
# .device/llama-src.tar.xz unless LLAMA_BUILD=0): MLX's CUDA backend unpacked from .device/part2,
# the pinned llama.cpp's CUDA build started in the background (build_llama_bg.sh), the GPU
# checks (tests/gpu), the full-geometry bench GGUF written to /tmp/bench.gguf, our benchmark.
# Writes $OUT/nvidia-smi.txt, gpu-tests.log, verification.json, make-gguf.log, bench-ours.json,
# bench.log.
#   GPU_TESTS     the test ids to run (default: all of tests/gpu); TEST_TIMEOUT (300 s)
#   BENCH_ARGS    more arguments to the bench (e.g. --kernel-config ring_chunk=16)
#   LLAMA_BUILD=0 no llama.cpp build (device_b.sh needs it)
set -uo pipefail
cd "$(dirname "$0")/../.."
source .device/part2/env.sh || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# The device gets the working tree without .git: carry .device/revision, written before the
# call with `git rev-parse HEAD > .device/revision`, so receipts name the revision.
[ -f .device/revision ] && export MUSE_GIT_REVISION="$(cat .device/revision)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"

[ "${LLAMA_BUILD:-1}" = 1 ] && bash scripts/device/build_llama_bg.sh

MUSE_GPU_RECEIPT="$OUT/verification.json" timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${GPU_TESTS:-tests/gpu} -v -p no:cacheprovider -rf \
  --tb=line > "$OUT/gpu-tests.log" 2>&1
cp "$OUT/gpu-tests.log" /tmp/gpu-tests.log   # device_b reads it
grep -E "PASSED|FAILED|ERROR" "$OUT/gpu-tests.log" | awk '{print $2}' | sort | uniq -c; grep -E "^FAILED|Error" "$OUT/gpu-tests.log" | head -12

python3 scripts/make_bench_gguf.py /tmp/bench.gguf 2>&1 | tee "$OUT/make-gguf.log"
timeout 240 python3 -m muse_mlx.tools.bench --model /tmp/bench.gguf --synthetic ${BENCH_ARGS:-} \
  --receipt "$OUT/bench-ours.json" 2>&1 | tee "$OUT/bench.log"
echo "llama.cpp build: $(cat /tmp/llama/build.rc 2>/dev/null || echo running)"; tail -2 /tmp/llama/build.log 2>/dev/null
bash scripts/device/pack_out.sh
