"""Where a prefill chunk's time goes on the GPU: each step of one layer, timed alone.

    python3 scripts/device/probe_prefill.py BENCH.gguf OUT.json [ROWS]

For layer 0's matrices of the file (Q|K|gate|V are timed one by one, as stored): dequant.inc to
f16, MLX's f16 GEMM on the f16 weights, f16_product (the lane as the model runs it), and the
float32 lane's MLX-ops dequantization and float32 GEMM; the reference attention over ROWS
queries at depth 0 and 32,768; MLX's f16 GEMM at 8192^3 for the device's reach. Each: one
warm-up, then the median of 5 timed evaluations (ms). Synthetic weights (the bench file's).
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
    from muse_mlx.artifact import open_artifact
    from muse_mlx.kernels import Kernels, gpu_device
    from muse_mlx.ops.gpu import f16_product
    from muse_mlx.ops.reference import attention
    from muse_mlx.quant import dequantize
    from muse_mlx.tools.receipts import make_receipt, write_receipt

    path, out = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    art = open_artifact(path, check_weights=False)
    kernels = Kernels(gpu_device())
    cells = []
    for name in ("attn_q", "attn_k", "attn_gate", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        raw = art.tensors[f"blk.0.{name}.weight"]
        K, N = raw.shape[0], raw.shape[1]
        w = mx.array(np.ascontiguousarray(raw.data))
        x = mx.random.normal((rows, K))
        w16 = kernels.dequantize(w, raw.qtype, K)
        l1 = mx.max(mx.sum(mx.abs(w16.astype(mx.float32)), axis=-1)).reshape(1)
        x16 = x.astype(mx.float16)
        mx.eval(w16, l1, x16)
        flop = 2.0 * rows * N * K
        cell = {"tensor": name, "qtype": raw.qtype.name, "N": N, "K": K,
                "dequant_f16": timed(lambda: kernels.dequantize(w, raw.qtype, K)),
                "gemm_f16": timed(lambda: x16 @ w16.T),
                "f16_product": timed(lambda: f16_product(x, w16, l1)),
                "dequant_f32_mlx_ops": timed(lambda: dequantize(w, raw.qtype))}
        w32 = dequantize(w, raw.qtype)
        mx.eval(w32)
        cell["gemm_f32"] = timed(lambda: x @ w32.T)
        cell["gemm_f16_tflops"] = flop / cell["gemm_f16"]["median_ms"] / 1e9
        cell["gemm_f32_tflops"] = flop / cell["gemm_f32"]["median_ms"] / 1e9
        cell["dequant_f16_gbps"] = (raw.data.nbytes + 2 * N * K) / cell["dequant_f16"]["median_ms"] / 1e6
        cells.append(cell)
        print(f"{name:12s} {raw.qtype.name:5s} {N:6d}x{K:6d}: dequant f16 {cell['dequant_f16']['median_ms']:.3f} ms "
              f"({cell['dequant_f16_gbps']:.0f} GB/s), gemm f16 {cell['gemm_f16']['median_ms']:.3f} ms "
              f"({cell['gemm_f16_tflops']:.0f} TFLOP/s), f16_product {cell['f16_product']['median_ms']:.3f} ms | "
              f"f32: dequant {cell['dequant_f32_mlx_ops']['median_ms']:.3f} ms, gemm {cell['gemm_f32']['median_ms']:.3f} ms "
              f"({cell['gemm_f32_tflops']:.0f} TFLOP/s)", flush=True)
        del w32, w16
        mx.clear_cache()
    g = art.geometry
    att = []
    for depth in (0, 32768):
        n = depth + rows
        q = mx.random.normal((rows, g.n_head, g.head_dim))
        keys = mx.random.normal((g.n_head_kv, n, g.head_dim)).astype(mx.float16)
        values = mx.random.normal((g.n_head_kv, n, g.head_dim)).astype(mx.float16)
        q_pos, k_pos = np.arange(depth, n), np.arange(n)
        for window in (None, g.sliding_window):
            cell = {"depth": depth, "window": window,
                    **timed(lambda: attention(q, keys, values, q_pos, k_pos, window, 1 / np.sqrt(g.head_dim)))}
            att.append(cell)
            print(f"attention {rows} queries at depth {depth} window {window}: {cell['median_ms']:.3f} ms", flush=True)
    a = mx.random.normal((8192, 8192)).astype(mx.float16)
    square = timed(lambda: a @ a)
    square["tflops"] = 2 * 8192**3 / square["median_ms"] / 1e9
    print(f"f16 GEMM 8192^3: {square['median_ms']:.3f} ms, {square['tflops']:.0f} TFLOP/s", flush=True)
    write_receipt(out, make_receipt("research/prefill-probe", inputs={"model": path, "rows": rows},
                                    metrics={"matrices": cells, "attention": att, "square_f16_gemm": square},
                                    synthetic=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
