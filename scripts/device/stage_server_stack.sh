#!/usr/bin/env bash
# Host side: copy the server stack's pure-Python packages (uvicorn, starlette, sse-starlette and
# sniffio, which the device's image lacks; h11, anyio, click are there) from the local venv into
# .device/srv, for device calls that start a server (device_kvpack.sh PARTS=live): carry .device/srv.
# --client: also the official openai client and its dependencies as cp312 wheels for the device
# (.device/srv/wheels, ~6 MB, installed there by device_kvpack.sh PARTS=load).
set -euo pipefail
cd "$(dirname "$0")/../.."
SP=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .device/srv && mkdir -p .device/srv
for m in uvicorn starlette sse_starlette sniffio; do
  [ -d "$SP/$m" ] || { echo "stage_server_stack: $m is not in $SP (pip install -e '.[test]' first)" >&2; exit 2; }
  cp -r "$SP/$m" .device/srv/
done
find .device/srv -name __pycache__ -prune -exec rm -rf {} +
if [ "${1:-}" = "--client" ]; then
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .device/srv/wheels openai
fi
echo "staged $(du -sh .device/srv | cut -f1) in .device/srv: carry it"
