#!/usr/bin/env bash
# The slots round's calls on one warm machine (issues 15 and 16), by MODE (the first argument):
#   batch  call 2 of a round (carry .device/part2, .device/revision, .device/llama-src.tar.xz): MLX
#          unpacked, the llama.cpp build started in the background (LLAMA_TARGETS, exported), the
#          bench GGUF written, the GPU checks GPU_TESTS / PYTEST_K, then tools/bench_serving.py's
#          packed-step cells over 1..4 slots under the default kernel configuration and under each
#          of BATCH_CONFIGS (space-separated "tag:KERNEL_CONFIG", e.g. "inc:stream_batch=0"), each
#          within BATCH_TIMEOUT seconds (300: at 200 the B = 4 cell of 2026-12-01 was cut);
#          BATCH_DEFAULT="" skips the default configuration's cells. With MATVEC_CONFIGS
#          ("tag:KERNEL_CONFIG;tag2:..."), first one step's matrix products alone at MATVEC_ROWS
#          (1,2,3,4) rows under each (bench_serving --matvec-rows), and the configuration whose
#          products over 2..4 rows took least is added to the batch cells as "best".
#   warm   a later call: tools/bench_serving.py's warm cells (WARM, default 2048,32768,65536; cold
#          prefill up to COLD_MAX), llama-batched-bench on the same file (1..4 sequences), and the
#          first-token process times of `generate --max-tokens 1` and `llama-completion -n 1`
#          (twice each, the file in the page cache); without a llama.cpp build started on this
#          machine, the warm cells only.
# Writes to $OUT: batch: nvidia-smi.txt, make-gguf.log, gpu-tests.log, verification.json,
# matvecs.json / .log, slots-default.json / .log, slots-TAG.json / .log; warm: warm.json / .log,
# llama-batched-bench.jsonl / .err, first-token.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
LLAMA=/tmp/llama/llama.cpp/build/bin
case "${1:-}" in
batch)
  [ -f .device/llama-src.tar.xz ] && [ ! -d /tmp/llama ] && bash scripts/device/build_llama_bg.sh
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
  [ -f /tmp/bench.gguf ] || python3 scripts/make_bench_gguf.py /tmp/bench.gguf 2>&1 | tee "$OUT/make-gguf.log"
  if [ -n "${GPU_TESTS:-}" ]; then
    MUSE_GPU_RECEIPT="$OUT/verification.json" timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $GPU_TESTS \
      ${PYTEST_K:+-k "$PYTEST_K"} -q -p no:cacheprovider -rf --tb=line > "$OUT/gpu-tests.log" 2>&1
    tail -8 "$OUT/gpu-tests.log"
  fi
  if [ -n "${MATVEC_CONFIGS:-}" ]; then   # "tag:cfg;tag:cfg": one step's products alone at 1..4 rows under each
    timeout "${MATVEC_TIMEOUT:-240}" python3 -m muse_mlx.tools.bench_serving --model /tmp/bench.gguf --synthetic \
      --warm '' --batch '' --matvec-rows "${MATVEC_ROWS:-1,2,3,4}" --matvec-configs "$MATVEC_CONFIGS" \
      --receipt "$OUT/matvecs.json" 2>&1 | tee "$OUT/matvecs.log"
    # the configuration whose products over 2..4 rows took least, added to the batch cells as "best"
    best=$(python3 -c 'import json, sys
cells = json.load(open(sys.argv[1]))["metrics"]["matvec_rows"]
configs = dict(i.split(":", 1) for i in sys.argv[2].split(";") if i)
total = {}
for c in cells:
    if c["rows"] > 1:
        total[c["config"]] = total.get(c["config"], 0) + c["ms"]["mean"]
tag = min(total, key=total.get)
print(f"best:{configs[tag]}")' "$OUT/matvecs.json" "$MATVEC_CONFIGS") && echo "matvec cells: $best" && \
      BATCH_CONFIGS="${BATCH_CONFIGS:-} $best"
  fi
  for v in ${BATCH_DEFAULT-default:} ${BATCH_CONFIGS:-}; do
    tag=${v%%:*} config=${v#*:}
    timeout "${BATCH_TIMEOUT:-300}" python3 -m muse_mlx.tools.bench_serving --model /tmp/bench.gguf --synthetic --warm '' \
      --batch "${BATCH:-1,2,3,4}" --depth "${DEPTH:-0}" --kernel-config "$config" \
      --receipt "$OUT/slots-$tag.json" 2>&1 | tee "$OUT/slots-$tag.log"
  done
  ;;
warm)
  timeout 300 python3 -m muse_mlx.tools.bench_serving --model /tmp/bench.gguf --synthetic --warm "${WARM:-2048,32768,65536}" \
    --cold-max "${COLD_MAX:-2048}" --batch '' --workdir /tmp/serving --receipt "$OUT/warm.json" 2>&1 | tee "$OUT/warm.log"
  [ -d /tmp/llama ] || { echo "no llama.cpp build on this machine: warm cells only"; bash scripts/device/pack_out.sh; exit 0; }
  while [ ! -f /tmp/llama/build.rc ]; do sleep 2; done
  echo "llama.cpp build rc $(cat /tmp/llama/build.rc)"
  timeout 120 $LLAMA/llama-batched-bench -m /tmp/bench.gguf -ngl 99 -fa on -c 4096 -b 512 -ub 512 \
    -npp 128 -ntg 128 -npl 1,2,3,4 --output-format jsonl > "$OUT/llama-batched-bench.jsonl" 2> "$OUT/llama-batched-bench.err"
  tail -4 "$OUT/llama-batched-bench.jsonl"
  timed() {  # COMMAND...: its lines about load / prompt / first token, wall time, peak RSS
    python3 -c 'import resource, subprocess, sys, time
t = time.perf_counter(); r = subprocess.run(sys.argv[1:], capture_output=True, text=True); s = time.perf_counter() - t
keys = ("load", "prompt", "first token", "error", "eval time")
print("\n".join(l for l in (r.stdout + r.stderr).splitlines() if any(k in l for k in keys)))
print(f"elapsed {s:.2f} s, peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6:.2f} GB, rc {r.returncode}")' "$@"
  }
  {
    for i in 1 2; do
      echo "== generate --max-tokens 1, run $i"
      timed timeout 120 python3 -m muse_mlx.generate --model /tmp/bench.gguf -p "The capital of France is" --max-tokens 1
      echo "== llama-completion -n 1, run $i"
      timed timeout 120 $LLAMA/llama-completion -m /tmp/bench.gguf -ngl 99 -p "The capital of France is" -n 1 -no-cnv
    done
  } > "$OUT/first-token.log" 2>&1
  cat "$OUT/first-token.log"
  ;;
*)
  echo "usage: device_slots.sh batch|warm" >&2
  exit 2
  ;;
esac
bash scripts/device/pack_out.sh
