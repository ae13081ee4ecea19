"""Where the decode time goes on the GPU: a diagnostic run for docs/kernels.md (device only).

Questions, each answered by a timed contrast (wall time around mx.eval, which waits):
  1. residency: does a kernel read MLX arrays made from host data (CUDA managed memory)
     as fast as arrays a GPU op made (device memory)?  A read-only kernel and our
     one-token Q4_K matvec on both.
  2. (stream) the streaming one-token matvecs: a float64 check, then a sweep of rows per
     step, rows loaded together and grid size at every layer shape, and a whole token;
     (dispatch) a whole token through kernels.matvec with the engine's defaults, against a
     read-only pass over the same matrices; (loops) the streaming kernel's variants (rows
     from device memory or staged in threadgroup memory, x in registers or in threadgroup
     memory), per shape and per token; (attention) the decode attention with K/V rows loaded
     one at a time against eight together, at a full ring and at plane depths.
  3. launch cost: a chain of tiny custom kernels and of tiny MLX ops, graph build and eval
     timed apart; (kv_write) a token's K/V row writes with a Python row, with an array row
     (what a compiled decode step needs) and compiled.
  4. the whole token: one token's 261 projections at the pinned geometry, weights made on
     the GPU (random bytes: the values do not matter for time) and, if --host, from host data.
Writes a JSON receipt (synthetic random weights) to --receipt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx.core as mx
import numpy as np

from muse_mlx import kernels
from muse_mlx.geometry import PINNED
from muse_mlx.tools.receipts import make_receipt, write_receipt

Q4, Q6 = 144, 210  # bytes per 256-value block


def stats(xs):
    return {"mean": statistics.fmean(xs), "min": min(xs),
            "cv": statistics.stdev(xs) / statistics.fmean(xs) if len(xs) > 1 else 0.0, "samples": xs}


def timed(fn, reps=5, warmup=1):
    for _ in range(warmup):
        mx.eval(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t)
    return out


def device_bytes(rows, row_bytes, seed=0):
    a = mx.random.randint(0, 256, (rows, row_bytes), dtype=mx.uint8, key=mx.random.key(seed))
    mx.eval(a)
    return a


def host_bytes(rows, row_bytes, seed=0):
    a = mx.array(np.random.default_rng(seed).integers(0, 256, (rows, row_bytes), dtype=np.uint8))
    mx.eval(a)
    return a


READ_SRC = """
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
const uint32_t stride = gridDim.x * blockDim.x;
uint32_t acc = 0u;
const uint4* p = (const uint4*)w;
for (uint64_t i = t; i < uint64_t(NV); i += stride) { const uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
y[t] = acc;
"""
_read_kernel = mx.fast.cuda_kernel(name="probe_read", input_names=["w"], output_names=["y"], source=READ_SRC)
TINY_SRC = "y[0] = x[0] + 1.0f;"
_tiny_kernel = mx.fast.cuda_kernel(name="probe_tiny", input_names=["x"], output_names=["y"], source=TINY_SRC)


def read_once(w):
    nv = w.size // 16
    blocks = 132 * 8
    return _read_kernel(inputs=[w], template=[("NV", nv)], grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(blocks * 256,)], output_dtypes=[mx.uint32])[0]


def stream(w, x, variant, K, N, R=8, RF=4, groups="default"):
    """One streaming launch; groups: a number, "default" (kernels.stream_groups) or None (one per row group)."""
    tpg = kernels.stream_threads(K)
    nrg = -(-N // R)
    g = nrg if groups is None else min(nrg, kernels.stream_groups(tpg) if groups == "default" else groups)
    rb = K // 256 * {"q4_k": Q4, "q6_k": Q6}[variant]
    return kernels.kernel(f"matvec_stream_{variant}")(
        inputs=[w, x], template=[("K", K), ("N", N), ("TPG", tpg), ("R", R), ("RF", RF), ("RB", rb), ("NS", 1)],
        grid=(g * tpg, 1, 1), threadgroup=(tpg, 1, 1), output_shapes=[(1, N)], output_dtypes=[mx.float32])[0]


STREAM_SHAPES = {  # name: (K, N, variant, block bytes)
    "qkg_q4k": (6656, 8448, "q4_k", Q4), "o_q4k": (4096, 6656, "q4_k", Q4), "gateup_q4k": (6656, 39936, "q4_k", Q4),
    "down_q4k": (19968, 6656, "q4_k", Q4), "down_q6k": (19968, 6656, "q6_k", Q6), "v_q6k": (6656, 256, "q6_k", Q6),
    "output_q6k": (6656, 202048, "q6_k", Q6)}
STREAM_CONFIGS = [(8, 2), (8, 4), (4, 2), (16, 4)]
STREAM_GROUPS = [264, 528, 1056, "default"]


def section_stream(res):
    """Correctness (float64 numpy on valid random blocks) and a sweep of R, RF and the grid size."""
    from gguf import GGMLQuantizationType as QT

    from muse_mlx.tools.fixtures import random_blocks
    from muse_mlx.quant import dequantize

    qt = {"q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
    rng = np.random.default_rng(7)
    checks = {}
    for K in (4096, 6656, 19968):
        for variant in ("q4_k", "q6_k"):
            for (R, RF) in STREAM_CONFIGS[:2]:
                n = 37
                blocks = mx.array(random_blocks(n, K, qt[variant], rng))
                x = rng.standard_normal(K).astype(np.float32)
                want = np.array(dequantize(blocks, qt[variant])).astype(np.float64) @ x.astype(np.float64)
                got = np.array(stream(blocks, mx.array(x), variant, K, n, R, RF, groups=3)).reshape(-1)
                rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                checks[f"{variant}_K{K}_R{R}_RF{RF}"] = rel
    res["stream_checks_max_rel_err"] = checks
    print("stream checks", {k: f"{v:.1e}" for k, v in checks.items()}, flush=True)
    sweep = {}
    for name, (K, N, variant, bb) in STREAM_SHAPES.items():
        w = device_bytes(N, K // 256 * bb, seed=3)
        x = mx.random.normal((K,))
        reps = max(4, min(40, int(2e9 // w.nbytes)))
        for (R, RF) in STREAM_CONFIGS:
            for G in STREAM_GROUPS:
                t = timed(lambda w=w, x=x, v=variant, k=K, m=N, r=R, f=RF, g=G, n=reps:
                          [stream(w, x, v, k, m, r, f, g) for _ in range(n)], reps=3)
                sweep[f"{name}|R{R}|RF{RF}|G{G}"] = min(reps * w.nbytes / s / 1e9 for s in t)
        best = max((k for k in sweep if k.startswith(name + "|")), key=sweep.get)
        print(name, "best", best, f"{sweep[best]:.0f} GB/s", flush=True)
        del w
    res["stream_sweep_GBps"] = sweep
    mx.clear_cache()
    # the whole token with each shape's best configuration
    best = {}
    for name in STREAM_SHAPES:
        k = max((k for k in sweep if k.startswith(name + "|")), key=sweep.get)
        _, r, rf, g = k.split("|")
        best[name] = (int(r[1:]), int(rf[2:]), g[1:] if g == "Gdefault" else int(g[1:]))
    res["stream_best"] = {k: list(v) for k, v in best.items()}
    g = PINNED
    layer = ["qkg_q4k", "v_q6k", "o_q4k", "gateup_q4k", "down_q6k"]
    names = layer * g.n_layer + ["output_q6k"]
    ws = [device_bytes(STREAM_SHAPES[n][1], STREAM_SHAPES[n][0] // 256 * STREAM_SHAPES[n][3], seed=i)
          for i, n in enumerate(names)]
    xs = {K: mx.random.normal((K,)) for K, *_ in STREAM_SHAPES.values()}
    mx.eval(list(xs.values()))
    total = sum(w.nbytes for w in ws)

    def token(ws=ws):
        out = []
        for w, n in zip(ws, names):
            K, N, v, _ = STREAM_SHAPES[n]
            out.append(stream(w, xs[K], v, K, N, *best[n]))
        return out
    t = timed(token, reps=5, warmup=2)
    res["token_stream"] = {"weight_bytes": total, "ms": stats([s * 1e3 for s in t]),
                           "GBps": stats([total / s / 1e9 for s in t])}
    print("token stream", res["token_stream"]["ms"]["mean"], "ms", res["token_stream"]["GBps"]["mean"], "GB/s",
          flush=True)
    del ws
    mx.clear_cache()


def section_dispatch(res):
    """One token's projections through kernels.matvec (the engine's dispatch and defaults),
    weights made on the GPU (random bytes), and a read-only pass over the same matrices."""
    from gguf import GGMLQuantizationType as QT

    shapes = token_shapes()
    ws = [device_bytes(N, K // 256 * b, seed=i) for i, (K, N, b, _) in enumerate(shapes)]
    xs = {K: mx.random.normal((1, K)) for K, *_ in shapes}
    mx.eval(list(xs.values()))
    total = sum(w.nbytes for w in ws)
    qt = {"q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
    r = {"weight_bytes": total, "launches": len(shapes)}

    def token(ws=ws):
        return [kernels.matvec(w, qt[v], xs[K]) for w, (K, N, b, v) in zip(ws, shapes)]

    def reads(ws=ws):
        return [read_once(w) for w in ws]
    for name, fn in (("matvec", token), ("read_only", reads), ("matvec_again", token)):
        t = timed(fn, reps=5, warmup=2)
        r[f"{name}_ms"] = stats([s * 1e3 for s in t])
        r[f"{name}_GBps"] = stats([total / s / 1e9 for s in t])
    res["token_dispatch"] = r
    print("dispatch", {k: round(v["mean"], 3) for k, v in r.items() if isinstance(v, dict)}, flush=True)
    del ws
    mx.clear_cache()


def section_loops(res):
    """The one-token matvec variants of matvec_stream.inc through kernels.matvec (each with its
    own plan, kernels.stream_plan): rows straight from device memory ("stream"), rows staged in
    threadgroup memory ("staged"), x in threadgroup memory ("sharedx"), per layer shape, then a
    whole token's projections."""
    from gguf import GGMLQuantizationType as QT

    qt = {"q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
    before = os.environ.get("MUSE_MLX_MATVEC")
    per_shape = {}
    for name, (K, N, variant, bb) in STREAM_SHAPES.items():
        w = device_bytes(N, K // 256 * bb, seed=3)
        x = mx.random.normal((1, K))
        reps = max(4, min(40, int(2e9 // w.nbytes)))
        for loop in ("stream", "staged", "sharedx"):
            os.environ["MUSE_MLX_MATVEC"] = loop
            t = timed(lambda w=w, q=qt[variant], x=x, n=reps: [kernels.matvec(w, q, x) for _ in range(n)], reps=5)
            per_shape[f"{name}|{loop}"] = stats([reps * w.nbytes / s / 1e9 for s in t])
        print(name, {lp: round(per_shape[f"{name}|{lp}"]["mean"]) for lp in ("stream", "staged", "sharedx")}, "GB/s",
              flush=True)
        del w
    res["loops_GBps"] = per_shape
    mx.clear_cache()
    shapes = token_shapes()
    ws = [device_bytes(N, K // 256 * b, seed=i) for i, (K, N, b, _) in enumerate(shapes)]
    xs = {K: mx.random.normal((1, K)) for K, *_ in shapes}
    mx.eval(list(xs.values()))
    total = sum(w.nbytes for w in ws)
    token = {"weight_bytes": total, "launches": len(shapes)}
    for loop in ("stream", "staged", "sharedx") * 2:   # interleaved twice
        os.environ["MUSE_MLX_MATVEC"] = loop
        t = timed(lambda ws=ws: [kernels.matvec(w, qt[v], xs[K]) for w, (K, N, b, v) in zip(ws, shapes)],
                  reps=5, warmup=2)
        token.setdefault(f"{loop}_ms", []).append(stats([s * 1e3 for s in t]))
    res["loops_token"] = token
    print("token ms", {k: [round(c["mean"], 3) for c in v] for k, v in token.items() if k.endswith("_ms")},
          flush=True)
    if before is None:
        os.environ.pop("MUSE_MLX_MATVEC", None)
    else:
        os.environ["MUSE_MLX_MATVEC"] = before
    del ws
    mx.clear_cache()


def section_attention(res):
    """The decode attention (partial + combine) at a full 2,048-row ring and at plane depths,
    with K/V rows loaded one at a time and eight together (MUSE_MLX_ATTN_ROWS), interleaved;
    a chain of 39 (ring) or 13 (plane) launches as in one token, random f16 rows."""
    before = os.environ.get("MUSE_MLX_ATTN_ROWS")
    n_head, n_kv, hd = 32, 2, 128
    q = mx.random.normal((n_head, hd))
    out = {}
    for kind, cap, n_valid, layers in (("ring", 2048, 2048, 39), ("plane", 32768, 32768, 13),
                                       ("plane", 131072, 131072, 13)):
        keys = (0.5 * mx.random.normal((n_kv, cap, hd))).astype(mx.float16)
        values = mx.random.normal((n_kv, cap, hd)).astype(mx.float16)
        mx.eval(q, keys, values)
        chunk = kernels.RING_CHUNK if kind == "ring" else kernels.PLANE_CHUNK
        for rows in ("1", "8", "1", "8"):
            os.environ["MUSE_MLX_ATTN_ROWS"] = rows
            t = timed(lambda k=keys, v=values, n=n_valid, c=chunk, m=layers:
                      [kernels.decode_attention(q, k, v, n, c) for _ in range(m)], reps=5)
            out.setdefault(f"{kind}{n_valid}|rows{rows}_us_per_layer", []).append(
                stats([s * 1e6 / layers for s in t]))
        print(kind, n_valid, {k.split("|")[1]: [round(c["mean"], 1) for c in v] for k, v in out.items()
                              if k.startswith(f"{kind}{n_valid}|")}, flush=True)
        del keys, values
        mx.clear_cache()
    res["attention"] = out
    if before is None:
        os.environ.pop("MUSE_MLX_ATTN_ROWS", None)
    else:
        os.environ["MUSE_MLX_ATTN_ROWS"] = before


def section_kv_write(res):
    """One decode token's K/V row writes (26 arrays of a 32,898-row f16 plane, as at depth 32,768)
    three ways: a slice assignment with a Python row (MLX's SliceUpdate), mx.slice_update with
    the row as an array (DynamicSliceUpdate, what a compiled step needs), and the latter compiled.
    A write that copies its array costs ~1,000x one that does not."""
    u = mx.ones((2, 1, 128), dtype=mx.float16)
    compiled = mx.compile(lambda r, *arrs: [mx.slice_update(a, u, start_indices=r, axes=(1,)) for a in arrs])

    def static(arrs, i):
        for a in arrs:
            a[:, i:i + 1, :] = u
        return arrs

    def dynamic(arrs, i):
        r = mx.array([i], dtype=mx.int32)
        return [mx.slice_update(a, u, start_indices=r, axes=(1,)) for a in arrs]

    def dynamic_compiled(arrs, i):
        return compiled(mx.array([i], dtype=mx.int32), *arrs)

    r = {}
    for name, fn in (("static", static), ("dynamic", dynamic), ("dynamic_compiled", dynamic_compiled)):
        arrs = [mx.zeros((2, 32898, 128), dtype=mx.float16) for _ in range(26)]
        mx.eval(arrs)
        samples = []
        for _ in range(4):
            t = time.perf_counter()
            for i in range(20):
                arrs = fn(arrs, i)
                mx.eval(arrs)
            samples.append((time.perf_counter() - t) / 20 * 1e3)
        r[f"{name}_ms_per_token"] = stats(samples[1:])
        del arrs
        mx.clear_cache()
    res["kv_write"] = r
    print("kv write", {k: round(v["mean"], 3) for k, v in r.items()}, flush=True)


def per_launch(fn, launches, reps=5):
    """fn() -> list of `launches` arrays; returns build and eval time per launch (us)."""
    mx.eval(fn())
    build, run = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = fn()
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e6 / launches)
        run.append((t2 - t1) * 1e6 / launches)
    return {"build_us": stats(build), "eval_us": stats(run)}


def section_residency(res, host: bool):
    g = PINNED
    K, N = g.n_embd, 2 * g.n_ff                          # FFN gate|up stacked: 39,936 x 6,656 Q4_K
    row = K // 256 * Q4
    x = mx.random.normal((K,))
    mx.eval(x)
    makers = {"device": device_bytes} | ({"host": host_bytes} if host else {})
    for where, make in makers.items():
        w = make(N, row)
        big = make(2 * 1024, 1024 * 1024, seed=1)        # 2 GiB
        r = {}
        reps_in_graph = 20
        t = timed(lambda big=big: [read_once(big) for _ in range(4)])
        r["read_2GiB_GBps"] = stats([4 * big.nbytes / s / 1e9 for s in t])
        t = timed(lambda w=w, n=reps_in_graph: [read_once(w) for _ in range(n)])
        r["read_gateup_GBps"] = stats([reps_in_graph * w.nbytes / s / 1e9 for s in t])
        for variant in ("q4_k",):
            t = timed(lambda w=w, v=variant, n=reps_in_graph: [stream(w, x, v, K, N) for _ in range(n)])
            r[f"{variant}_gateup_GBps"] = stats([reps_in_graph * w.nbytes / s / 1e9 for s in t])
            r[f"{variant}_gateup_us"] = stats([s / reps_in_graph * 1e6 for s in t])
        # Q6_K ffn_down shape: 6,656 x 19,968
        Kd, Nd = g.n_ff, g.n_embd
        wd = make(Nd, Kd // 256 * Q6, seed=2)
        xd = mx.random.normal((Kd,))
        for variant in ("q6_k",):
            t = timed(lambda w=wd, x=xd, v=variant, n=reps_in_graph, k=Kd, m=Nd:
                      [stream(w, x, v, k, m, RF=2) for _ in range(n)])
            r[f"{variant}_down_GBps"] = stats([reps_in_graph * wd.nbytes / s / 1e9 for s in t])
        res[f"residency_{where}"] = r
        print(where, {k: round(v["mean"], 1) for k, v in r.items()}, flush=True)
        del w, big, wd
        mx.clear_cache()


def section_launch(res):
    x = mx.zeros((1,))
    mx.eval(x)

    def tiny_chain():
        a = x
        for _ in range(500):
            a = _tiny_kernel(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                             output_dtypes=[mx.float32])[0]
        return [a]

    def tiny_independent():
        return [_tiny_kernel(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                             output_dtypes=[mx.float32])[0] for _ in range(500)]

    def op_chain():
        a = x
        for _ in range(500):
            a = a + 1.0
        return [a]

    w = device_bytes(32, Q4)
    xs = mx.random.normal((1, 256))

    def matvec_chain():
        from gguf import GGMLQuantizationType as QT
        return [kernels.matvec(w, QT.Q4_K, xs) for _ in range(500)]

    r = {"tiny_kernel_chain": per_launch(tiny_chain, 500), "tiny_kernel_independent": per_launch(tiny_independent, 500),
         "mlx_add_chain": per_launch(op_chain, 500), "our_matvec_tiny": per_launch(matvec_chain, 500)}
    res["launch"] = r
    print({k: (round(v["build_us"]["mean"], 1), round(v["eval_us"]["mean"], 1)) for k, v in r.items()}, flush=True)


def token_shapes():
    """(K, N, block bytes, variant) of one token's projections, Q4_K_M-like (Q6_K attn_v/ffn_down)."""
    g = PINNED
    layer = [(g.n_embd, 2 * g.q_dim + g.kv_dim, Q4, "q4_k"), (g.n_embd, g.kv_dim, Q6, "q6_k"),
             (g.q_dim, g.n_embd, Q4, "q4_k"), (g.n_embd, 2 * g.n_ff, Q4, "q4_k"), (g.n_ff, g.n_embd, Q6, "q6_k")]
    return layer * g.n_layer + [(g.n_embd, g.n_vocab, Q6, "q6_k")]


def section_token(res, host: bool, tag: str):
    shapes = token_shapes()
    make = host_bytes if host else device_bytes
    ws = [make(N, K // 256 * b, seed=i) for i, (K, N, b, _) in enumerate(shapes)]
    xs = {K: mx.random.normal((K,)) for K, *_ in shapes}
    mx.eval(list(xs.values()))
    total = sum(w.nbytes for w in ws)
    r = {"weight_bytes": total, "launches": len(shapes)}
    def token(ws=ws):
        return [stream(w, xs[K], v, K, N, RF=4 if v == "q4_k" else 2)
                for w, (K, N, b, v) in zip(ws, shapes)]
    t = timed(token, reps=5, warmup=2)
    r["stream_ms"] = stats([s * 1e3 for s in t])
    r["stream_GBps"] = stats([total / s / 1e9 for s in t])

    def reads(ws=ws):
        return [read_once(w) for w in ws]
    t = timed(reads, reps=5, warmup=2)
    r["read_only_ms"] = stats([s * 1e3 for s in t])
    res[f"token_{tag}"] = r
    print(tag, {k: (round(v["mean"], 2) if isinstance(v, dict) else v) for k, v in r.items()}, flush=True)
    del ws
    mx.clear_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--receipt", required=True)
    p.add_argument("--parts", default="residency,launch,token")
    p.add_argument("--host", action="store_true", help="also time weights made from host data (managed memory)")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    res = {"env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "MUSE_"))}}
    parts = a.parts.split(",")
    if "stream" in parts:
        section_stream(res)
    if "dispatch" in parts:
        section_dispatch(res)
    if "loops" in parts:
        section_loops(res)
    if "attention" in parts:
        section_attention(res)
    if "residency" in parts:
        section_residency(res, a.host)
    if "launch" in parts:
        section_launch(res)
    if "kv_write" in parts:
        section_kv_write(res)
    if "token" in parts:
        section_token(res, False, "device" + a.tag)
        if a.host:
            section_token(res, True, "host" + a.tag)
    write_receipt(a.receipt, make_receipt("probe/matvec", inputs=vars(a), metrics=res, synthetic=True))


if __name__ == "__main__":
    main()
