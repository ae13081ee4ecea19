"""The step's small kernels alone at 1..4 token rows (decode_glue.inc: qk_post, residual_norm) at
the pinned geometry, on random inputs: each launched ITERS times after a warm-up, ms a launch.
Under ncu the packed step's qk_post took 7.2 us at one row and 17-39 us at four (c63e03a); this
says whether the kernel alone grows with the rows.
Usage (on the device): python scripts/device/probe_qk_post.py OUT.json [ITERS]
"""

import sys

import mlx.core as mx
import numpy as np

from muse_mlx.config import KernelConfig
from muse_mlx.kernels import Kernels, gpu_device
from muse_mlx.tools.bench import eval_ms
from muse_mlx.tools.receipts import make_receipt, write_receipt

ITERS = int(sys.argv[2]) if len(sys.argv) > 2 else 50
NH, NKV, HD, EMBD = 32, 2, 128, 6656
kernels = Kernels(gpu_device(), KernelConfig())
rng = np.random.default_rng(3)
eps = 1e-6
norm = mx.array(rng.standard_normal(HD).astype(np.float32))
cells = []


def timed(run) -> list[float]:
    """ms a launch: ITERS launches evaluated together, three times after one such warm-up."""
    return [ms / ITERS for ms in eval_ms(lambda: [run() for _ in range(ITERS)], reps=3, warmup=1)]


for rows in (1, 2, 3, 4):
    # Q|K|gate stacked (8,448 wide) with V apart (256), and Q|K|gate|V (8,704), as the layers have them
    qkg = mx.array(rng.standard_normal((rows, 8448)).astype(np.float32))
    v = mx.array(rng.standard_normal((rows, 256)).astype(np.float32))
    qkgv = mx.array(rng.standard_normal((rows, 8704)).astype(np.float32))
    for rope_half in (64, 0):
        rope = mx.array(rng.standard_normal((rows, 2 * max(rope_half, 1))).astype(np.float32))
        for layout, (qa, va, offs) in {"v-apart": (qkg, v, (0, 4096, 0)), "v-stacked": (qkgv, qkgv, (0, 4096, 8448))}.items():
            samples = timed(lambda: kernels.qk_post(qa, qa, va, norm, norm, rope, rope_half, eps, NH, NKV, HD, offsets=offs))
            print(f"qk_post rows={rows} rope_half={rope_half} {layout}: {min(samples):.4f} ms a launch", flush=True)
            cells.append(dict(kernel="qk_post", rows=rows, rope_half=rope_half, layout=layout, ms=samples))
    x = mx.array(rng.standard_normal((rows, EMBD)).astype(np.float32))
    w = mx.array(rng.standard_normal(EMBD).astype(np.float32))
    samples = timed(lambda: kernels.residual_norm(x, x, w, w, eps, eps))
    print(f"residual_norm rows={rows}: {min(samples):.4f} ms a launch", flush=True)
    cells.append(dict(kernel="residual_norm", rows=rows, ms=samples))
write_receipt(sys.argv[1], make_receipt("probe_qk_post", inputs=dict(iters=ITERS), metrics=dict(cells=cells),
                                        synthetic=True, notes="random inputs at the pinned geometry"))
