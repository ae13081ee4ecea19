"""Write the full-geometry benchmark GGUF: random valid blocks in the Q4_K_M layout (~16.9 GB, synthetic).

Usage: python scripts/make_bench_gguf.py OUT.gguf [--seed N] [--layout q4_k_m|nvfp4]
(with the package installed, `pip install -e .`, or PYTHONPATH at the repository root as on the device)
"""
import argparse
import time

from gguf import GGMLQuantizationType as QT

from muse_mlx.geometry import PINNED
from muse_mlx.tools.fixtures import gguf_bytes, kquant_mix, uniform_types, write_random_blocks

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
