#!/usr/bin/env bash
# Issue 15's cells in one device call, on a machine where an earlier call unpacked MLX (and, for
# `warm`, wrote the bench GGUF). PARTS (default "probe warm handoff"), in this order:
#   probe    scripts/device/probe_upload.py: the page-locked staging's bytes and GB/s against
#            mx.load; kvpack.restore at 2,048 / 32,768 / 65,536 positions each way ($OUT/probe-upload.json / .log)
#   warm     tools/bench_serving.py's warm cells (WARM, default 2048,32768,65536; the cold prefill
#            up to COLD_MAX, default 2,048, COLD_REPS times, default 2: COLD_MAX=65536 COLD_REPS=1
#            WARM_TIMEOUT=400 times every cold prefill once) with the defaults, then at 65,536
#            with pinned_upload=0 ($OUT/warm.json, warm-mx.load.json / .log)
#   handoff  tools/handoff.py: the book's delta and deep handoff cells at the pinned geometry
#            ($OUT/handoff.json / .log)
#   live     tools/live_handoff.py (issue 16 item 6): the same two cells between two live servers
#            on the bench GGUF over HTTP, the deep one at 130,815 tokens and the delta one at
#            32,768 of 65,536 ($OUT/live-{deep,delta}.json / .log; not in the default PARTS)
#   load     tools/load_test.py (issue 16 item 4): one server with 4 slots on the bench GGUF, 200
#            requests alone and then LOAD_ROUNDS (default 2) rounds 8 at a time through the openai
#            client, every answer against its solo run ($OUT/load-test-MODE.json / .log; not in the
#            default PARTS; needs the client's wheels: stage_server_stack.sh --client); LOAD_MODES
#            (default "default"; "exact": the server with --batch-invariant)
# Carry .device/revision.
set -uo pipefail
cd "$(dirname "$0")/../.."
source ~/.muse-device/env.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" MUSE_GIT_REVISION="$(cat .device/revision)"
PARTS=${PARTS:-"probe warm handoff"}
G=/tmp/bench.gguf
if [[ " $PARTS " == *" probe "* ]]; then
  timeout 200 python3 scripts/device/probe_upload.py --receipt "$OUT/probe-upload.json" 2>&1 | tee "$OUT/probe-upload.log"
fi
if [[ " $PARTS " == *" warm "* ]]; then
  [ -f $G ] || { echo "no $G: run a call that writes it first"; exit 1; }
  timeout ${WARM_TIMEOUT:-240} python3 -m muse_mlx.tools.bench_serving --model $G --synthetic \
    --warm "${WARM:-2048,32768,65536}" --cold-max ${COLD_MAX:-2048} --cold-reps ${COLD_REPS:-2} --batch '' \
    --receipt "$OUT/warm.json" 2>&1 | tee "$OUT/warm.log"
  timeout 120 python3 -m muse_mlx.tools.bench_serving --model $G --synthetic --warm 65536 --cold-max 0 --batch '' \
    --kernel-config pinned_upload=0 --receipt "$OUT/warm-mx.load.json" 2>&1 | tee "$OUT/warm-mx.load.log"
fi
if [[ " $PARTS " == *" handoff "* ]]; then
  timeout 150 python3 -m muse_mlx.tools.handoff --receipt "$OUT/handoff.json" 2>&1 | tee "$OUT/handoff.log"
fi
if [[ " $PARTS " == *" live "* ]]; then
  [ -f $G ] || { echo "no $G: run a call that writes it first"; exit 1; }
  # The device's image has no server stack (uvicorn, starlette, sse-starlette): carry .device/srv,
  # which scripts/device/stage_server_stack.sh fills from the local venv.
  [ -d .device/srv ] && export PYTHONPATH="$PWD/.device/srv:$PYTHONPATH"
  python3 -c "import uvicorn, starlette, sse_starlette" 2>/dev/null \
    || { echo "live: no uvicorn / starlette / sse-starlette here: run scripts/device/stage_server_stack.sh and carry .device/srv"; exit 2; }
  timeout ${LIVE_TIMEOUT:-280} python3 -m muse_mlx.tools.live_handoff --model $G --synthetic --depth 130815 \
    --workdir /tmp/live-deep --receipt "$OUT/live-deep.json" > "$OUT/live-deep.log" 2>&1
  echo "live deep rc $?"; tail -2 "$OUT/live-deep.log"; rm -rf /tmp/live-deep
  timeout ${LIVE_TIMEOUT:-280} python3 -m muse_mlx.tools.live_handoff --model $G --synthetic --depth 65536 --held 32768 \
    --workdir /tmp/live-delta --receipt "$OUT/live-delta.json" > "$OUT/live-delta.log" 2>&1
  echo "live delta rc $?"; tail -2 "$OUT/live-delta.log"; rm -rf /tmp/live-delta
fi
if [[ " $PARTS " == *" load "* ]]; then
  [ -f $G ] || { echo "no $G: run a call that writes it first"; exit 1; }
  if [ -d .device/srv/wheels ] && [ ! -d /tmp/client-site ]; then   # the openai client's cp312 wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/client-site .device/srv/wheels/*.whl
  fi
  export PYTHONPATH="$PWD/.device/srv:/tmp/client-site:$PYTHONPATH"
  python3 -c "import uvicorn, starlette, sse_starlette, openai" 2>/dev/null \
    || { echo "load: no server stack or openai client here: run scripts/device/stage_server_stack.sh --client and carry .device/srv"; exit 2; }
  for mode in ${LOAD_MODES:-default}; do   # default, and/or exact: the server with --batch-invariant
    extra=(); [ "$mode" = exact ] && extra=(--server-arg=--batch-invariant)
    timeout ${LOAD_TIMEOUT:-400} python3 -m muse_mlx.tools.load_test --model $G --synthetic --parallel 4 --requests 200 \
      --concurrency 8 --rounds ${LOAD_ROUNDS:-2} ${extra[@]+"${extra[@]}"} --receipt "$OUT/load-test-$mode.json" > "$OUT/load-test-$mode.log" 2>&1
    echo "load ($mode) rc $?"; tail -6 "$OUT/load-test-$mode.log"
  done
fi
bash scripts/device/pack_out.sh
