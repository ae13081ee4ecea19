#!/usr/bin/env bash
# Device call (after .device/part1/stash.sh): the diagnostic probe of scripts/probe_matvec.py,
# under MLX's default graph limits, with larger CUDA-graph batches, and without CUDA graphs.
set -uo pipefail
cd "$(dirname "$0")/.."
source .device/part2/env.sh 2>/dev/null || source ~/.muse-device/env.sh || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
[ -f .device/revision ] && export MUSE_GIT_REVISION="$(cat .device/revision)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
timeout 240 python3 scripts/probe_matvec.py ${PROBE_ARGS:---host} --receipt "$OUT/probe-default.json" 2>&1 | tee "$OUT/probe.log"
MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=400 timeout 90 python3 scripts/probe_matvec.py \
  --parts launch,token --tag _bigbuf --receipt "$OUT/probe-bigbuf.json" 2>&1 | tee -a "$OUT/probe.log"
MLX_USE_CUDA_GRAPHS=0 timeout 90 python3 scripts/probe_matvec.py --parts launch,token --tag _nographs \
  --receipt "$OUT/probe-nographs.json" 2>&1 | tee -a "$OUT/probe.log"
