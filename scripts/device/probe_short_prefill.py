"""A short prompt's prefill on the bench file: Model.prefill with chunk C for each C of argv[1] in turn
(e.g. "8,512,8,512"), each on a fresh cache, for prompts of 13 and 31 random tokens; prints each
call's time, the last token's argmax and logit[0]. C = 8 puts every forward on the kernel path's
products (float32); C = 512 takes one chunk (each matrix dequantized to f16 for the tensor cores).
Usage (on the device, /tmp/bench.gguf written): python scripts/device/probe_short_prefill.py 8,512,8,512
"""

import sys
import time

import mlx.core as mx
import numpy as np

from muse_mlx.model import load

order = sys.argv[1].split(",")   # e.g. "8,512,8,512": prefill chunk sizes in turn, each on a fresh cache
t = time.perf_counter(); m = load("/tmp/bench.gguf"); print(f"load {time.perf_counter() - t:.2f} s", flush=True)
rng = np.random.default_rng(3)
for n in (13, 31):
    toks = rng.integers(0, 1000, n)
    for c in order:
        cache = m.make_cache(4096)
        t = time.perf_counter(); logits = m.prefill(mx.array(toks), cache, chunk=int(c)); mx.eval(logits)
        s = time.perf_counter() - t
        print(f"n={n} chunk={c}: {s*1000:.1f} ms, argmax {int(mx.argmax(logits))}, logit[0] {float(logits.reshape(-1)[0]):.6f}", flush=True)
