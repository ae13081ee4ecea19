"""Diagnose a tensor-core plan on the GPU: Q4_K / Q6_K products at a few (N, K, B) under several
KernelConfigs, against float64: the plan, the error over the terms, and which tiles and rows of x
are wrong. "uncapped" lifts plan.MMA_CHECKED_TILE_WARPS, giving Q4_K at 256 x 6,656 the 21-warp
plan that summed wrong on an H100 (98cd826). Usage: diag_mma_warps.py [TREE_LABEL [N [TAGS]]]: with N,
only the Q4_K case of N rows; with TAGS (comma-separated names of `configs`), only those, in that
order. MLX caches a CUDA graph by its shape alone and updates it with the next launch's kernel and
arguments (cudaGraphExecUpdate): the 21-warp plan failed right after a Q6_K plan of the same graph
shape, so `fresh 256 uncapped` runs it first in its process, and MLX_USE_CUDA_GRAPHS=0 without
graphs."""
import sys

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from muse_mlx.config import KernelConfig
from muse_mlx.kernels import Kernels, gpu_device, plan
from muse_mlx.quant import dequantize
from muse_mlx.tools.fixtures import random_blocks

label = sys.argv[1] if len(sys.argv) > 1 else "head"
dev = gpu_device()
cases = [(QT.Q4_K, 256, 6656), (QT.Q4_K, 1024, 6656), (QT.Q4_K, 1536, 4096), (QT.Q6_K, 256, 6656)]
if len(sys.argv) > 2:
    cases = [c for c in cases if c[0] == QT.Q4_K and c[1] == int(sys.argv[2])]
# "uncapped" twice: MLX updates a cached CUDA graph of the same shape with the new kernel, so the
# second runs after a graph that already held the same kernel
# "after-q6k": the uncapped plan right after a Q6_K product of 8,448 x 6,656 (the GPU checks' order
# when it failed)
configs = {"default": {}, "uncapped": {}, "uncapped-again": {}, "after-q6k": {}, "whole13": {"mma_tile_warps": 32}, "alone": {"mma_tile_warps": 1},
           "warps16": {"mma_warps": 16}, "w21k7": {"mma_warps": 21, "mma_tile_warps": 7}}
runs = [(tag, configs[tag]) for tag in sys.argv[3].split(",")] if len(sys.argv) > 3 else list(configs.items())
checked = dict(getattr(plan, "MMA_CHECKED_TILE_WARPS", {}))
for qtype, n, k in cases:
    rng = np.random.default_rng([n, k, int(qtype)])
    wn = random_blocks(n, k, qtype, rng)
    w = mx.array(wn)
    dense = np.array(dequantize(w, qtype)).astype(np.float64)
    for b in (2, 4):
        x = rng.standard_normal((b, k)).astype(np.float32)
        ref = x.astype(np.float64) @ dense.T
        scale = np.abs(x.astype(np.float64)) @ np.abs(dense).T
        for tag, extra in runs:
            if hasattr(plan, "MMA_CHECKED_TILE_WARPS"):
                plan.MMA_CHECKED_TILE_WARPS.clear()
                plan.MMA_CHECKED_TILE_WARPS.update({} if tag.startswith("uncapped") or tag == "after-q6k" else checked)
                plan.mma_plan.cache_clear()
                plan.mma_launch.cache_clear()
            cfg = KernelConfig(stream_mma=2, mma_pair_min_rows=0, mma_min_rows=0, **extra)
            kern = Kernels(dev, cfg)
            try:
                if tag == "after-q6k":
                    w6 = mx.array(random_blocks(8448, k, QT.Q6_K, np.random.default_rng(6)))
                    mx.eval(kern.matvec(w6, QT.Q6_K, mx.array(x), init_value=float("nan")))
                p = plan.mma_plan(qtype, k, n, b, kern.device, kern.config)
                out = np.array(kern.matvec(w, qtype, mx.array(x), init_value=float("nan"))).astype(np.float64)
            except Exception as e:  # noqa: BLE001 (a diagnostic: report and go on)
                print(label, qtype.name, n, k, b, tag, "ERROR", str(e)[:160], flush=True)
                continue
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(scale))
            bad = ~(np.abs(out - ref) <= 1e-4 * scale + 1e-6)   # NaN (an element never written) counts
            tiles = sorted(set((np.nonzero(bad.any(0))[0] // 16).tolist()))
            rows16 = sorted(set((np.nonzero(bad.any(0))[0] % 16).tolist()))
            print(label, qtype.name, n, k, b, tag, p, f"err {err:.3g} bad {int(bad.sum())}/{bad.size} unwritten {int(np.isnan(out).sum())}",
                  "xrows", bad.any(1).nonzero()[0].tolist(), "tiles", tiles[:12], "rows%16", rows16, flush=True)
