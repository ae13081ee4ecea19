#!/usr/bin/env bash
# Issue 16's slot counts side by side with llama.cpp, in one device call on a machine where an
# earlier call unpacked MLX, wrote the bench GGUF and built llama.cpp
# (LLAMA_BUILD=1 LLAMA_TARGETS="... llama-batched-bench"):
#   1. tools/bench_serving.py --scheduler: the server's engine loop (slots.Scheduler, no HTTP)
#      with N requests of SCHED_PROMPT + SCHED_TOKENS tokens at once, N in SLOTS, and the packed
#      step alone over the same slot counts (--batch, at DEPTH rows, default 0), for each kernel
#      configuration of CONFIGS ("tag:name=value,...;tag2:...", default "default:"), the
#      configurations interleaved over PASSES passes (default 1): $OUT/sched-TAG-PASS.json / .log;
#   2. llama-batched-bench -npp SCHED_PROMPT -ntg SCHED_TOKENS -npl SLOTS -fa on, the issue's
#      anchor ($OUT/llama-batched-bench.jsonl / .err), after pass LLAMA_AFTER (default 1; 0: never).
# A llama.cpp build still running (build_llama_bg.sh in an earlier call) is waited for first.
# Carry .device/revision. One tree: the checkout's (PYTHONSAFEPATH=1, so nothing else shadows it).
set -uo pipefail
cd "$(dirname "$0")/../.."
source ~/.muse-device/env.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
SLOTS=${SLOTS:-1,2,3,4} P=${SCHED_PROMPT:-512} N=${SCHED_TOKENS:-128}
G=/tmp/bench.gguf
[ -f $G ] || { echo "no $G: run a call that writes it first"; exit 1; }
wait_build() {   # a llama.cpp build on the host's cores moved the packed step 5-20 % (ledger, 2026-12-04)
  [ -d /tmp/llama ] || return 0
  local t0=$(date +%s)
  for i in $(seq 1 90); do [ -f /tmp/llama/build.rc ] && break; sleep 5; done
  echo "llama.cpp build rc: $(cat /tmp/llama/build.rc 2>/dev/null) (waited $(( $(date +%s) - t0 )) s)"
}
llama() {
  B=/tmp/llama/llama.cpp/build/bin/llama-batched-bench
  if [ -x $B ]; then
    timeout 180 $B -m $G -ngl 99 -fa on -c 4096 -b 2048 -ub 512 -npp $P -ntg $N -npl "$SLOTS" \
      --output-format jsonl > "$OUT/llama-batched-bench.jsonl" 2> "$OUT/llama-batched-bench.err"
    tail -6 "$OUT/llama-batched-bench.jsonl"; tail -3 "$OUT/llama-batched-bench.err"
  fi
}
IFS=';' read -ra CONFIGS <<< "${CONFIGS:-default:}"
wait_build   # no pass runs beside the build
for pass in $(seq 1 "${PASSES:-1}"); do
  for item in "${CONFIGS[@]}"; do
    tag=${item%%:*} cfg=${item#*:}
    timeout ${SCHED_TIMEOUT:-300} python3 -m muse_mlx.tools.bench_serving --model $G --synthetic --warm '' \
      --batch "$SLOTS" --depth "${DEPTH:-0}" --scheduler "$SLOTS" --sched-prompt $P --sched-tokens $N \
      --kernel-config "$cfg" --receipt "$OUT/sched-$tag-$pass.json" > "$OUT/sched-$tag-$pass.log" 2>&1
    echo "[$tag, pass $pass] rc $?"; grep -E "^batch|^engine|rror" "$OUT/sched-$tag-$pass.log"
  done
  [ "$pass" = "${LLAMA_AFTER:-1}" ] && llama
done
bash scripts/device/pack_out.sh
