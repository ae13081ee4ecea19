#!/usr/bin/env bash
# Reproduce chapter 1's and chapter 22's numbers from the engine's geometry and allocator,
# writing the receipts and Figure 22.1 under receipts/research/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=receipts/research
mkdir -p "$out"
python -m muse_mlx.tools.footprint --plot "$out/figure-22-1.png" --receipt "$out/footprint-pinned.json"
python -m muse_mlx.tools.envelope --tok-s 35.4395 --receipt "$out/envelope-book-inputs.json"
