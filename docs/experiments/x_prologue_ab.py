"""A/B of the streaming matvec's x prologue on the GPU (fourth session; receipt
receipts/kernels/h200-9efe80c-exp-x-prologue.json): 16-byte loads (custom_kernels/matvec_stream.inc
from 5ac64f5 on) against scalar loads (the text at 6c305c2). Needs the old text beside the new:
    git show 6c305c2:custom_kernels/matvec_stream.inc > custom_kernels/matvec_stream_scalarx.inc
then, on the device: python3 docs/experiments/x_prologue_ab.py OUT.json (from the repository root).
GB/s = bytes of the matrix x launches / wall time, on random bytes (synthetic; NaN-laden f16
scales, so outputs are not compared here: tests/gpu checks the kernel)."""
import json, os, sys
sys.path.insert(0, "scripts")
sys.path.insert(0, ".")
import mlx.core as mx
from gguf import GGMLQuantizationType as QT
from muse_mlx import kernels
from probe_matvec import STREAM_SHAPES, device_bytes, stats, timed, token_shapes

for v in ("q4_k", "q6_k"):
    kernels.KERNELS[f"matvec_old_{v}"] = ("matvec_stream_scalarx", ["prologue", "x_plain", v, "loop_direct", f"{v}_rows", "epilogue"], ["w", "x"], ["y"])
new_name = kernels._stream_name
old_name = lambda loop, v, act="": f"matvec_old_{v}"
qt = {"q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
res = {"per_shape_GBps": {}, "token_ms": {}}
for name, (K, N, variant, bb) in STREAM_SHAPES.items():
    w = device_bytes(N, K // 256 * bb, seed=3)
    x = mx.random.normal((1, K))
    reps = max(4, min(40, int(2e9 // w.nbytes)))
    ref = None
    for tag, fn in (("scalar", old_name), ("vector", new_name), ("scalar", old_name), ("vector", new_name)):
        kernels._stream_name = fn
        out = kernels.matvec(w, qt[variant], x)
        if ref is None:
            ref = out
        assert mx.allclose(out, ref, rtol=1e-5, atol=1e-3).item(), (name, tag)
        t = timed(lambda w=w, q=qt[variant], x=x, n=reps: [kernels.matvec(w, q, x) for _ in range(n)], reps=5)
        res["per_shape_GBps"].setdefault(f"{name}|{tag}", []).append(stats([reps * w.nbytes / s / 1e9 for s in t]))
    print(name, {k.split("|")[1]: [round(c["mean"]) for c in v] for k, v in res["per_shape_GBps"].items() if k.startswith(name + "|")}, flush=True)
    del w
mx.clear_cache()
shapes = token_shapes()
ws = [device_bytes(N, K // 256 * b, seed=i) for i, (K, N, b, _) in enumerate(shapes)]
xs = {K: mx.random.normal((1, K)) for K, *_ in shapes}
mx.eval(list(xs.values()))
for tag, fn in (("scalar", old_name), ("vector", new_name)) * 2:
    kernels._stream_name = fn
    t = timed(lambda: [kernels.matvec(w, qt[v], xs[K]) for w, (K, N, b, v) in zip(ws, shapes)], reps=5, warmup=2)
    res["token_ms"].setdefault(tag, []).append(stats([s * 1e3 for s in t]))
print("token ms", {k: [round(c["mean"], 3) for c in v] for k, v in res["token_ms"].items()}, flush=True)
json.dump({"command": "python3 docs/experiments/x_prologue_ab.py", "revision": os.environ.get("MUSE_GIT_REVISION"), "metrics": res}, open(sys.argv[1], "w"), indent=1)
