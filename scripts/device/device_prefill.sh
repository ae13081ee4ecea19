#!/usr/bin/env bash
# One device call for issue 17's prefill and cold start, side by side with llama.cpp where an
# earlier call on this machine built it (LLAMA_BUILD=1 LLAMA_TARGETS="llama-bench llama-completion").
# PARTS (default "cold prefill"); those named run in this order:
#   checks  the GPU checks selected by PYTEST_K (tests/gpu/test_kernels.py; $OUT/gpu-tests.log,
#           verification.json), at most TEST_TIMEOUT seconds (default 200)
#   probe   scripts/device/probe_prefill.py: one layer's steps timed alone ($OUT/prefill-probe.json)
#   prefill the bench's --prefill 512,2048 at --prefill-depths 0,32768 on each of LANES (default
#           "f16 f32": prefill_f16 = 1 / 0; "noflash": the f16 lane with prefill_flash = 0;
#           "inflight1": with prefill_layers_in_flight = 1; "fused": prefill_flash = 2, MLX's fused attention;
#           PREFILL_LENGTHS and PREFILL_DEPTHS replace the lists),
#           then llama-bench -p 512,2048 -d 0,32768 when built
#           ($OUT/prefill-LANE.json, llama-prefill.json, bench-compare-LANE.json)
#   unseen  on each of LANES, shapes no earlier chunk had (no warm-up, one rep, a fresh process
#           each): prompts of 700, 1,300, 1,900, 2,600 and 3,300 tokens, then one of 131,072
#           ($OUT/unseen-LANE.json, unseen-131072-LANE.json): what cuDNN's plan a new shape costs
#           the fused attention (ledger, 2026-12-03); after `prefill`, so the kernels are compiled
#   cold    scripts/device/cold_start.py: `generate --max-tokens 1` on the bench GGUF, page cache
#           warm, MLX's kernel disk cache in a fresh folder: once to fill it (our kernel cache
#           and MLX's own JIT kernels), then twice each, interleaved, with each of COLD_CONFIGS
#           ("tag:name=value,...;tag2:..."; default "default:"); the imports alone; then
#           `llama-completion -n 1` twice when built ($OUT/cold-start.json)
#   fresh   scripts/device/probe_fresh_memory.py: fresh device memory and the weights' paths,
#           a fresh process a cell ($OUT/probe-fresh-memory.json)
# LLAMA_WAIT=0: do not wait for a llama.cpp build still running (its parts are skipped).
# Carry .device/revision (and .device/part2 on a machine no call has set up yet).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f ~/.muse-device/env.sh ] && [ -d ~/mlxsite/mlx ]; then source ~/.muse-device/env.sh; else source .device/part2/env.sh || exit 1; fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 MUSE_GIT_REVISION="$(cat .device/revision)"
PARTS=${PARTS:-"cold prefill"}
G=/tmp/bench.gguf
LLAMA=/tmp/llama/llama.cpp/build/bin
wait_llama() { [ -d /tmp/llama ] && [ "${LLAMA_WAIT:-1}" = 1 ] || return 0; for i in $(seq 1 90); do [ -f /tmp/llama/build.rc ] && break; sleep 5; done
  echo "llama.cpp build rc: $(cat /tmp/llama/build.rc 2>/dev/null)"; tail -2 /tmp/llama/build.log; }
need_gguf() {  # the bench GGUF, in the page cache as the issue's timings had it
  [ -f $G ] || python3 scripts/make_bench_gguf.py $G 2>&1 | tail -2 | tee "$OUT/make-gguf.log"; cat $G > /dev/null; }
if [[ " $PARTS " == *" checks "* ]]; then
  t0=$(date +%s)
  MUSE_GPU_RECEIPT="$OUT/verification.json" timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/gpu/test_kernels.py \
    ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider -rf --tb=short -v > "$OUT/gpu-tests.log" 2>&1
  echo "GPU tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR" "$OUT/gpu-tests.log" | head; tail -2 "$OUT/gpu-tests.log"
fi
if [[ " $PARTS " == *" probe "* ]]; then
  need_gguf
  timeout 150 python3 scripts/device/probe_prefill.py $G "$OUT/prefill-probe.json" 2>&1 | tee "$OUT/prefill-probe.log"
fi
if [[ " $PARTS " == *" prefill "* ]]; then
  need_gguf
  for lane in ${LANES:-f16 f32}; do
    cfg=""; [ $lane = f32 ] && cfg="prefill_f16=0"; [ $lane = noflash ] && cfg="prefill_flash=0"
    [ $lane = inflight1 ] && cfg="prefill_layers_in_flight=1"
    [ $lane = fused ] && cfg="prefill_flash=2"
    timeout 240 python3 -m muse_mlx.tools.bench --model $G --synthetic --depths "" --prefill ${PREFILL_LENGTHS:-512,2048} \
      --prefill-depths ${PREFILL_DEPTHS:-0,32768} --reps 3 --no-matvecs ${cfg:+--kernel-config "$cfg"} \
      --receipt "$OUT/prefill-$lane.json" 2>&1 | tee "$OUT/prefill-$lane.log"
  done
  wait_llama
  if [ -x $LLAMA/llama-bench ]; then
    $LLAMA/llama-bench -m $G -ngl 99 -fa 1 -r 3 -p ${PREFILL_LENGTHS:-512,2048} -n 0 -d ${PREFILL_DEPTHS:-0,32768} -o json > "$OUT/llama-prefill.json" 2> /tmp/llama-prefill.err
    tail -3 /tmp/llama-prefill.err
    for lane in ${LANES:-f16 f32}; do
      python3 -m muse_mlx.tools.bench --combine "$OUT/prefill-$lane.json" "$OUT/llama-prefill.json" \
        --receipt "$OUT/bench-compare-$lane.json"
    done
  fi
fi
if [[ " $PARTS " == *" unseen "* ]]; then
  need_gguf
  for lane in ${LANES:-f16 fused}; do
    cfg=""; [ $lane = fused ] && cfg="prefill_flash=2"
    timeout 120 python3 -m muse_mlx.tools.bench --model $G --synthetic --depths "" --prefill 700,1300,1900,2600,3300 \
      --reps 1 --warmup 0 --no-matvecs ${cfg:+--kernel-config "$cfg"} --receipt "$OUT/unseen-$lane.json" 2>&1 | grep prefill
    timeout 200 python3 -m muse_mlx.tools.bench --model $G --synthetic --depths "" --prefill 131072 \
      --reps 1 --warmup 0 --no-matvecs ${cfg:+--kernel-config "$cfg"} --receipt "$OUT/unseen-131072-$lane.json" 2>&1 | grep prefill
  done
fi
if [[ " $PARTS " == *" fresh "* ]]; then
  need_gguf
  timeout 300 python3 scripts/device/probe_fresh_memory.py --model $G --receipt "$OUT/probe-fresh-memory.json" 2>&1 \
    | tee "$OUT/probe-fresh-memory.log"
fi
if [[ " $PARTS " == *" cold "* ]]; then
  need_gguf
  rm -rf /tmp/ptx-cold && mkdir -p /tmp/ptx-cold
  GEN="python3 -m muse_mlx.generate --model $G --prompt 'The quick brown fox jumps over the lazy dog, and then' --max-tokens 1"
  specs=("kernel-cache-first|MLX_PTX_CACHE_DIR=/tmp/ptx-cold|$GEN")
  IFS=';' read -ra cold_cfgs <<< "${COLD_CONFIGS:-default:}"
  for i in 1 2; do
    for tc in "${cold_cfgs[@]}"; do
      tag=${tc%%:*}; cfg=${tc#*:}
      specs+=("$tag-$i|MLX_PTX_CACHE_DIR=/tmp/ptx-cold|$GEN${cfg:+ --kernel-config $cfg}")
    done
  done
  specs+=("import-mlx||python3 -c 'import mlx.core as mx; mx.eval(mx.zeros(1))'"
          "import-generate||python3 -c 'import muse_mlx.generate'")
  wait_llama
  if [ -x $LLAMA/llama-completion ]; then
    LC="$LLAMA/llama-completion -m $G -p 'The quick brown fox jumps over the lazy dog, and then' -n 1 -ngl 99 -no-cnv"
    specs+=("llama-completion-1||$LC" "llama-completion-2||$LC")
  fi
  timeout 420 python3 scripts/device/cold_start.py "$OUT/cold-start.json" "${specs[@]}" 2>&1 | tee "$OUT/cold-start.log"
  ls /tmp/ptx-cold | wc -l
fi
bash scripts/device/pack_out.sh
