#!/usr/bin/env bash
# Train the tiny muse-glimmer (docs/tiny-model.md) on the GPU, in one device call.
# Here, before the call:
#   python -m muse_mlx.tools.corpus DEB_DIR .device/corpus       (an unpacked python3.11-doc)
#   python -m muse_mlx.tools.tiny_data .device/corpus .device/tinydata
# then on the device (carry .device/tinydata, .device/revision, and .device/part2 unless an earlier
# call on this machine unpacked MLX):
#   bash scripts/device/device_train.sh
# Writes $OUT/weights-*.safetensors, $OUT/train-receipt.json, $OUT/train.log.
#   TRAIN_ARGS  tiny_train's options (default below: up to 1,500 steps in a 240 s budget)
#   LLAMA_BUILD=1 (carry .device/llama-src.tar.xz): start the llama.cpp build (LLAMA_TARGETS) meanwhile
#   BENCH_GGUF=1  also write the bench GGUF (/tmp/bench.gguf) in the background meanwhile, for a
#               later device_ab.sh call on this machine
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
[ "${LLAMA_BUILD:-0}" = 1 ] && bash scripts/device/build_llama_bg.sh
if [ "${BENCH_GGUF:-0}" = 1 ] && [ ! -f /tmp/bench.gguf ]; then
  setsid nohup python3 scripts/make_bench_gguf.py /tmp/bench.gguf > /tmp/make-gguf.log 2>&1 < /dev/null &
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
TRAIN_ARGS=${TRAIN_ARGS:-"--steps 1500 --time-budget 240 --max-seconds 330"}
eval timeout 540 python3 -m muse_mlx.tools.tiny_train .device/tinydata "$OUT" $TRAIN_ARGS 2>&1 | tee "$OUT/train.log"
mkdir -p /tmp/tiny && cp "$OUT"/weights-*.safetensors /tmp/tiny/   # for device_serving.sh on this machine
ls -la "$OUT"
