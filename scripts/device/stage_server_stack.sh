#!/usr/bin/env bash
# Host side: copy the server stack's pure-Python packages (uvicorn, starlette, sse-starlette and
# sniffio, which the device's image lacks; h11, anyio, click are there) from the local venv into
# .device/srv, for device calls that start a server (device_kvpack.sh PARTS=live): carry .device/srv.
set -euo pipefail
cd "$(dirname "$0")/../.."
SP=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .device/srv && mkdir -p .device/srv
for m in uvicorn starlette sse_starlette sniffio; do
  [ -d "$SP/$m" ] || { echo "stage_server_stack: $m is not in $SP (pip install -e '.[test]' first)" >&2; exit 2; }
  cp -r "$SP/$m" .device/srv/
done
find .device/srv -name __pycache__ -prune -exec rm -rf {} +
echo "staged $(du -sh .device/srv | cut -f1) in .device/srv: carry it"
