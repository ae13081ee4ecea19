"""The tensor-core matvec (matvec_stream.inc, mma_*) against x_shared on synthetic random blocks at the
pinned shapes (no GGUF needed): each product launched ITERS times after a warm-up, for each kernel
configuration of argv[2] ("tag:name=value,...;tag2:..."), at the rows of x of argv[1] (e.g. "2,4").
Prints ms a launch and writes a receipt to argv[3]. Synthetic weights: gguf-py-valid random blocks.
Under `ncu -k regex:matvec` the same launches give the kernels' counters.
Usage (on the device): python scripts/device/probe_mma.py 2,4 "m16:stream_mma=2;m32:stream_mma=2,mma_warps=32" out.json [ITERS [SHAPES]]
(SHAPES: names of SHAPES, ";"-separated, e.g. "down Q6_K;LM head part"; all when absent)
The FFN down shapes ("_silu") are timed as the step calls them (Kernels.matvec_silu: where the
tensor cores take the rows, silu(gate) * up by MLX ops, then the plain form; the times include
that launch).
"""

import json
import os
import sys

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from muse_mlx.config import KernelConfig
from muse_mlx.kernels import Kernels, gpu_device, plan
from muse_mlx.tools.bench import eval_ms
from muse_mlx.tools.fixtures import random_blocks
from muse_mlx.tools.receipts import make_receipt

ITERS = int(sys.argv[4]) if len(sys.argv) > 4 else 20   # launches a sample
SHAPES = [("gate|up", QT.Q4_K, 39936, 6656, ""), ("Q|K|gate", QT.Q4_K, 8704, 6656, ""),
          ("o_proj", QT.Q4_K, 6656, 4096, ""), ("down Q6_K", QT.Q6_K, 6656, 19968, "_silu"),
          ("down Q4_K", QT.Q4_K, 6656, 19968, "_silu"), ("LM head part", QT.Q6_K, 50000, 6656, ""),
          ("V", QT.Q6_K, 256, 6656, "")]

rows = [int(r) for r in sys.argv[1].split(",")]
# MUSE_PROBE_MAX_PARTS: a research bound on the parts of K in place of plan.MMA_MAX_PARTS (e.g. 26,
# so that mma_parts=13 splits K = 6,656 in 13); set before any plan is made
if os.environ.get("MUSE_PROBE_MAX_PARTS"):
    plan.MMA_MAX_PARTS = int(os.environ["MUSE_PROBE_MAX_PARTS"])
if len(sys.argv) > 5:
    SHAPES = [s for s in SHAPES if s[0] in sys.argv[5].split(";")]
configs = KernelConfig.parse_tagged(sys.argv[2], "configs")
rng = np.random.default_rng(7)
cells = []
for name, qtype, n, k, act in SHAPES:
    w = mx.array(random_blocks(n, k, qtype, rng))
    for b in rows:
        xs = [mx.array(rng.standard_normal((b, 2 * k if act else k)).astype(np.float32))]
        for tag, config in configs:
            kernels = Kernels(gpu_device(), config)
            if act:
                run = lambda: kernels.matvec_silu(w, qtype, xs[0], xs[0], up_offset=k)
            else:
                run = lambda: kernels.matvec(w, qtype, xs[0])
            try:
                samples = [ms / ITERS for ms in eval_ms(lambda: [run() for _ in range(ITERS)], reps=3, warmup=1)]
            except Exception as exc:   # a launch the device refuses (registers) is a result too
                print(f"{name} B={b} [{tag}]: failed: {exc}", flush=True)
                cells.append(dict(product=name, rows=b, config=tag, error=str(exc)))
                continue
            print(f"{name} B={b} [{tag}]: {min(samples):.4f} ms a launch ({', '.join(f'{s:.4f}' for s in samples)})",
                  flush=True)
            p = plan.mma_plan(qtype, k, n, b, kernels.device, config) if kernels._takes_mma(qtype, k, n, b) else None
            cells.append(dict(product=name, qtype=qtype.name, n=n, k=k, act=act, rows=b, config=tag,
                              plan=p._asdict() if p else "x_shared", ms=samples))
receipt = make_receipt("probe_mma", inputs=dict(rows=rows, configs=sys.argv[2], iters=ITERS, synthetic=True),
                       metrics=dict(cells=cells), synthetic=True,
                       notes="synthetic random blocks (gguf-py-valid), not a model file")
with open(sys.argv[3], "w") as f:
    json.dump(receipt, f, indent=1)
