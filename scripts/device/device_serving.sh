#!/usr/bin/env bash
# The serving round, in one device call on a machine where device_train.sh ran (MLX unpacked, the
# bench GGUF written, the tiny model's weights in $TINY, the llama.cpp build started with
# LLAMA_TARGETS="llama-bench llama-batched-bench llama-quantize"):
#   1. tools/bench_serving.py on the bench GGUF: warm prefix reuse through kvpack, the packed step
#      over 1..4 slots, the server's engine loop with 1..4 slots of 512 + 128 tokens (synthetic);
#   2. the tiny model on the GPU: its F16 GGUF written here, quantized to Q8_0 by the pinned
#      llama.cpp's llama-quantize, perplexity on its held-out pages through the kernels and through
#      the MLX-ops reference, and the default greedy generation;
#   3. llama-batched-bench on the bench GGUF, 1..4 parallel sequences.
# carry .device/revision and .device/tinytok (tokenizer.json). Inputs: TINY (folder of the weight
# shards on this machine, default /tmp/tiny), SERVING_ARGS.
set -uo pipefail
cd "$(dirname "$0")/../.."
source ~/.muse-device/env.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
TINY=${TINY:-/tmp/tiny}
while [ ! -f /tmp/bench.gguf ]; do sleep 2; done
SERVING_ARGS=${SERVING_ARGS:-"--warm 2048,32768,65536 --cold-max 2048 --batch 1,2,3,4 --depth 0 --scheduler 1,2,3,4"}
eval timeout 300 python3 -m muse_mlx.tools.bench_serving --model /tmp/bench.gguf --synthetic $SERVING_ARGS \
  --workdir /tmp/serving --receipt "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log"
{
  while [ ! -f /tmp/llama/build.rc ]; do sleep 2; done
  echo "llama.cpp build rc $(cat /tmp/llama/build.rc)"
  python3 -m muse_mlx.tools.tiny_export "$TINY" .device/tinytok/tokenizer.json "$TINY" --quantize ''
  /tmp/llama/llama.cpp/build/bin/llama-quantize "$TINY/muse-glimmer-tiny-f16.gguf" "$TINY/muse-glimmer-tiny-q8_0.gguf" Q8_0 > /tmp/quantize.log 2>&1
  sha256sum "$TINY"/*.gguf
  for lane in f16 q8_0; do
    for backend in "" "--reference"; do
      echo "== perplexity $lane ${backend:-kernels}"
      timeout 120 python3 -m muse_mlx.perplexity --model "$TINY/muse-glimmer-tiny-$lane.gguf" \
        --text muse_mlx/data/tiny-heldout.txt $backend 2>&1 | tail -1
    done
  done
  echo "== generate (GPU, greedy, default prompt)"
  timeout 60 python3 -m muse_mlx.generate --model "$TINY/muse-glimmer-tiny-q8_0.gguf" --max-tokens 40
  echo "== generate (reference, greedy, default prompt)"
  timeout 60 python3 -m muse_mlx.generate --model "$TINY/muse-glimmer-tiny-q8_0.gguf" --max-tokens 40 --reference 2>/dev/null
} > "$OUT/tiny-gpu.log" 2>&1
tail -30 "$OUT/tiny-gpu.log"
timeout 120 /tmp/llama/llama.cpp/build/bin/llama-batched-bench -m /tmp/bench.gguf -ngl 99 -fa on -c 4096 -b 512 -ub 512 \
  -npp 128 -ntg 128 -npl 1,2,3,4 --output-format jsonl > "$OUT/llama-batched-bench.jsonl" 2> "$OUT/llama-batched-bench.err"
tail -6 "$OUT/llama-batched-bench.jsonl"; tail -3 "$OUT/llama-batched-bench.err"
bash scripts/device/pack_out.sh
