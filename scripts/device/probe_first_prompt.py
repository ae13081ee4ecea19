"""What a fresh process's first prompt pays over a warm one (issue 17's cold start).

`generate --max-tokens 1` on the bench file: the 31-token prompt took 0.80 s in a fresh process
and ~0.08 s warm (1c486bb; docs/ledger.md, 2026-12-03). This loads the model as generate does,
then times, each to its end on the device (mx.eval), the steps named by --steps in order:

  cache      a slot cache of the model's context (make_cache), its zeros written
  product    one matrix product over the prompt's rows (layer 0's o_proj: dequantized to f16,
             its L1 bound, the f16 GEMM), twice: first and again
  prompt     the prompt's prefill on a new cache, twice (first and again, same shapes)
  other      a prefill of prompt + 9 tokens (shapes not seen before)
  step       two decode steps (the compiled step's first trace, then a replay)

Run it once with every step and once with `prompt` alone (generate's case), and with
MLX_USE_CUDA_GRAPHS=0 in the environment to see MLX's CUDA graphs' share.

Usage: python scripts/device/probe_first_prompt.py --model bench.gguf [--steps cache,product,prompt,other,step]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", default="cache,product,prompt,other,step")
    ap.add_argument("--prompt-tokens", type=int, default=31)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import mlx.core as mx
    import numpy as np
    from muse_mlx.model import load

    out = {"steps": args.steps, "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "default")}
    out["import_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    model = load(args.model)
    out["load_s"] = time.perf_counter() - t
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.geometry.n_vocab, args.prompt_tokens + 9)
    prompt = tokens[:args.prompt_tokens]

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t

    for step in args.steps.split(","):
        if step == "cache":
            timed("cache_s", lambda: mx.eval(model.make_cache().state()))
        elif step == "product":
            w = model.blocks[0].attention.wo
            x = mx.array(rng.standard_normal((args.prompt_tokens, w.n_in)).astype(np.float32))
            timed("product_first_s", lambda: mx.eval(model.ops.project(w, x)))
            timed("product_again_s", lambda: mx.eval(model.ops.project(w, x)))
        elif step == "prompt":
            timed("prompt_first_s", lambda: mx.eval(model.prefill(prompt, model.make_cache())))
            timed("prompt_again_s", lambda: mx.eval(model.prefill(prompt, model.make_cache())))
        elif step == "other":
            timed("prompt_new_shape_s", lambda: mx.eval(model.prefill(tokens, model.make_cache())))
        elif step == "step":
            cache = model.make_cache()
            mx.eval(model.prefill(prompt, cache))
            timed("step_first_s", lambda: mx.eval(model.step(1, cache)))
            timed("step_again_s", lambda: mx.eval(model.step(2, cache)))
        else:
            raise SystemExit(f"no step {step!r}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
