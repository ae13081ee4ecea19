#!/usr/bin/env bash
# The device returns at most 8 files from $OUT (more are dropped: files_left_out ... (count)).
# Run last in a call: with more than 8 files under $OUT, pack them all into $OUT/all.tgz
# (unpack here with `tar xzf`); with 8 or fewer, leave them as they are.
set -uo pipefail
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/muse-out.tgz . && find . -mindepth 1 -delete && mv /tmp/muse-out.tgz all.tgz) \
    && echo "packed $n files into \$OUT/all.tgz"
fi
