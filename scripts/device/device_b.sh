#!/usr/bin/env bash
# Device call B, on the machine call A (or device_checks.sh / device_ab.sh with LLAMA_BUILD=1)
# left warm, with llama-bench built and /tmp/bench.gguf written: llama-bench on that file, our
# bench again (interleaved in the same session), and the combined receipt with the ratios.
# Carry .device/revision. Writes $OUT/llama-prefill.json, llama-decode.json, llama-bench.json
# (the two joined), bench-ours-after-llama.json, bench-2.log, bench-compare.json and, with
# CANDIDATE, bench-candidate.json / .log.
#   CANDIDATE  a kernel configuration (the bench's --kernel-config, e.g. "ring_chunk=16") to time
#              end to end (decode only) after the defaults, when the GPU checks an earlier call
#              ran on this machine all passed (device_a.sh, device_checks.sh and device_ab.sh keep
#              their log in /tmp/gpu-tests.log)
set -uo pipefail
cd "$(dirname "$0")/../.."
source ~/.muse-device/env.sh || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# The device gets the working tree without .git: carry .device/revision, written before the
# call with `git rev-parse HEAD > .device/revision`, so receipts name the revision.
[ -f .device/revision ] && export MUSE_GIT_REVISION="$(cat .device/revision)"
for i in $(seq 1 60); do [ -f /tmp/llama/build.rc ] && break; sleep 5; done
echo "llama.cpp build rc: $(cat /tmp/llama/build.rc 2>/dev/null)"; tail -3 /tmp/llama/build.log
LB=/tmp/llama/llama.cpp/build/bin/llama-bench
(cd /tmp/llama/llama.cpp && git rev-parse HEAD 2>/dev/null); $LB --version 2>&1 | head -3
$LB -m /tmp/bench.gguf -ngl 99 -fa 1 -r 5 -p 512,2048 -n 0 -o json > "$OUT/llama-prefill.json" 2> /tmp/llama-prefill.err
$LB -m /tmp/bench.gguf -ngl 99 -fa 1 -r 5 -p 0 -n 128 -d 0,32768 -o json > "$OUT/llama-decode.json" 2> /tmp/llama-decode.err
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
for name in ("llama-prefill.json", "llama-decode.json"):
    try:
        rows += json.loads((out / name).read_text())
    except Exception as exc:
        print(name, "unreadable:", exc)
(out / "llama-bench.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"llama.cpp p={r.get('n_prompt')} n={r.get('n_gen')} d={r.get('n_depth')}: {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} tok/s")
PY
timeout 200 python3 -m muse_mlx.tools.bench --model /tmp/bench.gguf --synthetic --no-matvecs \
  --receipt "$OUT/bench-ours-after-llama.json" 2>&1 | tee "$OUT/bench-2.log"
python3 -m muse_mlx.tools.bench --combine "$OUT/bench-ours-after-llama.json" "$OUT/llama-bench.json" \
  --receipt "$OUT/bench-compare.json"
if [ -n "${CANDIDATE:-}" ]; then
  if [ -s /tmp/gpu-tests.log ] && ! grep -qE "FAILED|ERROR" /tmp/gpu-tests.log; then
    timeout 150 python3 -m muse_mlx.tools.bench --model /tmp/bench.gguf --synthetic --no-matvecs --prefill "" \
      --kernel-config "$CANDIDATE" --receipt "$OUT/bench-candidate.json" 2>&1 | tee "$OUT/bench-candidate.log"
  else
    echo "candidate not benchmarked: the GPU checks did not all pass (or did not run on this machine)"
  fi
fi
bash scripts/device/pack_out.sh
