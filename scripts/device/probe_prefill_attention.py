"""A chunk's attention alone: the flash kernel against MLX's fused attention (cuDNN on CUDA).

    python3 scripts/device/probe_prefill_attention.py OUT.json

At the pinned heads (32 query heads over 2 KV heads, head dim 128), for a full layer (keys in
position order, no window: causal, aligned bottom-right) at several (queries, keys), and a
sliding layer's ring (window 2,048): Kernels.prefill_attention, and for the full layer
ops/gpu.fused_attention (MLX's fused attention; on the ring with the positions' mask), each with its TFLOP/s over
the visible pairs. Then both against the float64 oracle (tools/oracle.prefill_attention_ref)
at 512 queries over 4,096 keys: max |error| over each row's norm. One warm-up, median of 5.
Random q/K/V (synthetic).
"""

from __future__ import annotations

import statistics
import sys

import mlx.core as mx
import numpy as np


def timed(fn, reps: int = 5) -> dict:
    from muse_mlx.tools.bench import eval_ms

    samples = eval_ms(fn, reps, 1)
    return {"median_ms": statistics.median(samples), "samples_ms": samples}


def main() -> int:
    from muse_mlx.kernels import Kernels, gpu_device
    from muse_mlx.ops.gpu import causal_in_order, fused_attention
    from muse_mlx.tools.oracle import prefill_attention_ref
    from muse_mlx.tools.receipts import make_receipt, write_receipt

    out = sys.argv[1]
    kernels = Kernels(gpu_device())
    H, KV, HD = 32, 2, 128
    cells = []
    for L, N, window in ((512, 512, 0), (512, 33280, 0), (2048, 34816, 0), (512, 131072, 0), (512, 2560, 2048),
                             (2048, 4096, 2048)):
        q = mx.random.normal((L, H, HD))
        keys = mx.random.normal((KV, N, HD)).astype(mx.float16)
        values = mx.random.normal((KV, N, HD)).astype(mx.float16)
        q_pos = mx.arange(N - L, N, dtype=mx.int32)
        k_pos = mx.arange(N, dtype=mx.int32)
        rel = np.arange(N - L, N)[:, None] - np.arange(N)[None, :]
        pairs = float(((rel >= 0) & ((rel < window) if window else True)).sum()) * H
        flop = 4.0 * pairs * HD
        cell = {"L": L, "N": N, "window": window, "flash": timed(lambda: kernels.prefill_attention(q, keys, values, q_pos, k_pos, window or None))}
        cell["flash_tflops"] = flop / cell["flash"]["median_ms"] / 1e9
        line = f"L {L:5d} N {N:6d} W {window:4d}: flash {cell['flash']['median_ms']:.3f} ms ({cell['flash_tflops']:.0f} TFLOP/s)"
        qp, kp = np.asarray(q_pos), np.asarray(k_pos)
        if window:   # a ring in rotation, as the cache holds it: the positions' mask
            kp = np.concatenate([np.roll(kp[:N - L], 17), kp[N - L:]])
            k_pos = mx.array(kp)
        cell["fused"] = timed(lambda: fused_attention(q, keys, values, qp, kp, window or None))
        cell["fused_mask"] = "causal" if causal_in_order(qp, kp, window or None) else "positions"
        cell["fused_tflops"] = flop / cell["fused"]["median_ms"] / 1e9
        line += f", fused ({cell['fused_mask']}) {cell['fused']['median_ms']:.3f} ms ({cell['fused_tflops']:.0f} TFLOP/s)"
        print(line, flush=True)
        cells.append(cell)
        del q, keys, values
        mx.clear_cache()
    # numerics at 512 queries over 4,096 keys, against float64
    L, N = 512, 4096
    rng = np.random.default_rng(5)
    q = rng.standard_normal((L, H, HD)).astype(np.float32) * 2
    keys = rng.standard_normal((KV, N, HD)).astype(np.float16)
    values = rng.standard_normal((KV, N, HD)).astype(np.float16)
    q_pos, k_pos = np.arange(N - L, N, dtype=np.int32), np.arange(N, dtype=np.int32)
    ref = prefill_attention_ref(q, keys, values, q_pos, k_pos, 0)
    norm = np.linalg.norm(ref.reshape(L, H, HD), axis=-1)[..., None]
    flash = np.array(kernels.prefill_attention(mx.array(q), mx.array(keys), mx.array(values), mx.array(q_pos),
                                               mx.array(k_pos), None))
    fused = np.array(fused_attention(mx.array(q), mx.array(keys), mx.array(values), q_pos, k_pos, None))
    errors = {name: float((np.abs(a.reshape(L, H, HD) - ref.reshape(L, H, HD)) / norm).max())
              for name, a in (("flash", flash), ("fused", fused))}
    print(f"against float64 (512 x 4096): {errors}", flush=True)
    write_receipt(out, make_receipt("research/prefill-attention-probe", inputs={"heads": [H, KV, HD]},
                                    metrics={"cells": cells, "error_over_row_norm": errors}, synthetic=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
