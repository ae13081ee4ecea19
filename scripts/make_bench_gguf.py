"""Write the full-geometry benchmark GGUF: random valid blocks in the Q4_K_M layout (~16.9 GB, synthetic).

Usage: python scripts/make_bench_gguf.py OUT.gguf [--seed N] [--layout q4_k_m|nvfp4]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from muse_mlx.tools.fixtures import gguf_bytes, kquant_mix, uniform_types, write_random_blocks  # noqa: E402
from muse_mlx.geometry import PINNED  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--layout", choices=["q4_k_m", "nvfp4"], default="q4_k_m")
args = p.parse_args()
types = kquant_mix(PINNED) if args.layout == "q4_k_m" else uniform_types(PINNED, QT.NVFP4)
t = time.perf_counter()
path = write_random_blocks(args.out, PINNED, types, seed=args.seed)
print(f"{path}: {path.stat().st_size:,} bytes ({gguf_bytes(PINNED, types):,} of tensor data), "
      f"{time.perf_counter() - t:.1f} s, synthetic random blocks")
