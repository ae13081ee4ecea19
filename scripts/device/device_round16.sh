#!/usr/bin/env bash
# Issue 16's round (ledger, 2026-12-05 "the device round, not run a third time"), by MODE:
#   lean   call 2 (carry .device/part2, .device/revision; call 1 ran `stash.sh` and
#          build_llama_bg.sh): MLX unpacked, the bench GGUF, the GPU checks of the batched step
#          against each sequence alone (GPU_TESTS_K), then the packed step at B = 1..4 (depth 512)
#          with the default and with each of VARIANTS ("tag:KERNEL_CONFIG ..."), interleaved twice. The
#          llama.cpp build runs beside this call: its packed-step figures compare the two arms only.
#          GPU_TESTS_LIMIT (seconds, default 300): the checks' limit; on a fresh machine they print
#          nothing within 120 s (their first kernel builds; e728462's and 3bcbcd1's leases).
#          DIAG=1: after the checks, scripts/device/diag_mma_warps.py here (then its 256-row Q4_K
#          case with the 21-warp plan first in its process, and with MLX's CUDA graphs off) and in
#          .device/base.
#          PROBE ("tag:KERNEL_CONFIG;..."): before the packed step, the products alone
#          (probe_mma.py at B = 2 and 4) under each configuration; PROBE_SHAPES (probe_mma.py's
#          names, ";"-separated): only those products. With a base tree in .device/base (carry it;
#          `git archive BASE muse_mlx custom_kernels | (mkdir -p .device/base && tar x -C
#          .device/base)`, `git rev-parse --short BASE > .device/base/revision`), each pass also
#          times its packed step with its own defaults (packed-base-PASS).
#   final  call 3 (carry .device/revision): with the build done, the engine loop (SCHED slots) and
#          the packed step, in turn: the default; llama-batched-bench; the default with
#          --sched-constraint lazy, then text (llguidance must be among part 2's wheels), then dry
#          (DRY on every request); the default again (STEPS names them: "default-1 llama lazy-1
#          text-1 dry-1 default-2"; mb-1, the default under MLX_MAX_MB_PER_BUFFER=100000, on
#          request; v-TAG-PASS: the engine loop under the VARIANTS entry TAG; a later call may
#          take the rest).
# STOP_AFTER (seconds from the call's start): no step starts after it, and each step's timeout is
# cut to what is left. Writes to $OUT: nvidia-smi.txt, make-gguf.log, gpu-tests.log,
# verification.json, packed-TAG-PASS.json / .log (lean), sched-TAG.json / .log,
# llama-batched-bench.jsonl / .err (final).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s) STOP_AFTER=${STOP_AFTER:-420}
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
G=/tmp/bench.gguf SLOTS=${SLOTS:-1,2,3,4} SCHED=${SCHED:-1,4}
left() { echo $(( STOP_AFTER - ($(date +%s) - T0) )); }
limit() {  # SECONDS: the smaller of SECONDS and what is left; fails when nothing is left
  local l; l=$(left); [ "$l" -gt 10 ] || { echo "STOP_AFTER reached: $(( $(date +%s) - T0 )) s" >&2; return 1; }
  echo $(( $1 < l ? $1 : l ))
}
packed() {  # TAG KERNEL_CONFIG [ENV=VALUE ...]: the packed step's cells alone
  local tag=$1 cfg=$2 t; shift 2; t=$(limit 150) || return 1
  env "$@" timeout "$t" python3 -m muse_mlx.tools.bench_serving --model $G --synthetic --warm '' \
    --batch "$SLOTS" --depth 512 --kernel-config "$cfg" --receipt "$OUT/packed-$tag.json" > "$OUT/packed-$tag.log" 2>&1
  echo "[packed $tag] rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^batch|rror" "$OUT/packed-$tag.log" | cut -c1-200
}
packed_base() {  # TAG: the packed step's cells in the base tree .device/base (its own defaults)
  local tag=$1 t; t=$(limit 150) || return 1
  (cd .device/base && PYTHONPATH="$PWD:$PYTHONPATH" MUSE_GIT_REVISION="$(cat revision)" timeout "$t" \
    python3 -m muse_mlx.tools.bench_serving --model $G --synthetic --warm '' --batch "$SLOTS" --depth 512 \
    --receipt "$OUT/packed-$tag.json" > "$OUT/packed-$tag.log" 2>&1)
  echo "[packed $tag] rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^batch|rror" "$OUT/packed-$tag.log" | cut -c1-200
}
sched() {  # TAG KERNEL_CONFIG CONSTRAINT [ENV=VALUE ...]: the engine loop and the packed step
  local tag=$1 cfg=$2 constraint=$3 t; shift 3; t=$(limit 200) || return 1
  env "$@" timeout "$t" python3 -m muse_mlx.tools.bench_serving --model $G --synthetic --warm '' \
    --batch "$SLOTS" --depth 512 --scheduler "$SCHED" --sched-reps 2 --sched-constraint "$constraint" \
    --kernel-config "$cfg" --receipt "$OUT/sched-$tag.json" > "$OUT/sched-$tag.log" 2>&1
  echo "[sched $tag] rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^batch|^engine|rror" "$OUT/sched-$tag.log" | cut -c1-200
}
case "${1:-}" in
lean)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
  [ -f $G ] || python3 scripts/make_bench_gguf.py $G > "$OUT/make-gguf.log" 2>&1
  echo "bench GGUF at $(( $(date +%s) - T0 )) s"
  t=$(limit "${GPU_TESTS_LIMIT:-300}") && MUSE_GPU_RECEIPT="$OUT/verification.json" timeout "$t" python3 -m pytest tests/gpu \
    -k "${GPU_TESTS_K:-batched_decode_equals_each_sequence_alone}" -q -p no:cacheprovider -rf --tb=line \
    > "$OUT/gpu-tests.log" 2>&1
  tail -4 "$OUT/gpu-tests.log"; echo "checks at $(( $(date +%s) - T0 )) s"
  if [ -n "${DIAG:-}" ] && t=$(limit 120); then   # the tensor-core plans that summed wrong, here and in the base tree
    timeout "$t" python3 scripts/device/diag_mma_warps.py head > "$OUT/diag-head.log" 2>&1
    echo "[diag head] rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-240 "$OUT/diag-head.log"
    if t=$(limit 40); then   # the 21-warp plan first in its process (no earlier graph of its shape)
      timeout "$t" python3 scripts/device/diag_mma_warps.py fresh 256 uncapped,uncapped-again,default,uncapped,after-q6k \
        > "$OUT/diag-fresh.log" 2>&1
      echo "[diag fresh] rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-240 "$OUT/diag-fresh.log"
    fi
    if t=$(limit 60); then   # the 21-warp plan's case again, MLX's CUDA graphs off
      MLX_USE_CUDA_GRAPHS=0 timeout "$t" python3 scripts/device/diag_mma_warps.py nographs 256 > "$OUT/diag-nographs.log" 2>&1
      echo "[diag nographs] rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-240 "$OUT/diag-nographs.log"
    fi
    if [ -d .device/base ] && t=$(limit 120); then
      (cd .device/base && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$t" python3 ../../scripts/device/diag_mma_warps.py base \
        > "$OUT/diag-base.log" 2>&1)
      echo "[diag base] rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-240 "$OUT/diag-base.log"
    fi
  fi
  if [ -n "${PROBE:-}" ] && t=$(limit 150); then   # the products alone, by kernel configuration
    timeout "$t" python3 scripts/device/probe_mma.py 2,4 "$PROBE" "$OUT/probe-mma.json" 20 ${PROBE_SHAPES:+"$PROBE_SHAPES"} \
      > "$OUT/probe-mma.log" 2>&1
    echo "[probe] rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-90 "$OUT/probe-mma.log"
  fi
  for pass in 1 2; do
    packed "default-$pass" "" || break
    for v in ${VARIANTS:-}; do packed "${v%%:*}-$pass" "${v#*:}" || break 2; done
    if [ -d .device/base ]; then packed_base "base-$pass" || break; fi
  done
  ;;
final)
  [ -f $G ] || { echo "no $G: run the lean call first"; exit 1; }
  for i in $(seq 1 60); do [ -f /tmp/llama/build.rc ] || [ ! -d /tmp/llama ] && break; sleep 5; done
  echo "llama.cpp build rc: $(cat /tmp/llama/build.rc 2>/dev/null) at $(( $(date +%s) - T0 )) s"
  for step in ${STEPS:-default-1 llama lazy-1 text-1 dry-1 default-2}; do
    case $step in
    llama)
      B=/tmp/llama/llama.cpp/build/bin/llama-batched-bench
      [ -x $B ] || { echo "no $B"; continue; }
      t=$(limit 120) || break
      timeout "$t" $B -m $G -ngl 99 -fa on -c 4096 -b 2048 -ub 512 -npp 512 -ntg 128 -npl "$SLOTS" \
        --output-format jsonl > "$OUT/llama-batched-bench.jsonl" 2> "$OUT/llama-batched-bench.err"
      tail -4 "$OUT/llama-batched-bench.jsonl" | cut -c1-300 ;;
    default-*) sched $step "" none || break ;;
    v-*)   # v-TAG-PASS: the VARIANTS entry TAG:KERNEL_CONFIG
      tag=${step#v-}; tag=${tag%-*}; cfg=""
      for v in ${VARIANTS:-}; do [ "${v%%:*}" = "$tag" ] && cfg=${v#*:}; done
      [ -n "$cfg" ] || { echo "no variant $tag in VARIANTS"; continue; }
      sched "${step#v-}" "$cfg" none || break ;;
    mb-*) sched $step "" none MLX_MAX_MB_PER_BUFFER=100000 || break ;;
    lazy-*) sched $step "" lazy || break ;;
    text-*) sched $step "" text || break ;;
    dry-*) sched $step "" dry || break ;;
    *) echo "unknown step $step" ;;
    esac
  done
  ;;
*) echo "usage: device_round16.sh lean|final" >&2; exit 2 ;;
esac
bash scripts/device/pack_out.sh
