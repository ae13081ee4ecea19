"""What the engine's decode loop costs over a bare one, on this machine (issue 14's 1.3 %).

At eb3da4d the bench's pipelined decode (the engine's loop, generate.decode_tokens) ran 1.3 %
behind 0e4a0ae's at depths 0 and 32,768 in four interleaved passes, while synced decode did not
(ledger, 2026-12-02). 0e4a0ae's bench timed its own loop: argmax of the step's logits, no finite
check. This times, in one process and interleaved, on one cache filled to --depth:

  engine  generate.decode_tokens (greedy; every step's logits checked finite)
  bare    the same pipelined loop without the finite check (this probe's copy, for attribution)

Usage: python scripts/device/probe_decode_loop.py MODEL.gguf OUT.json [--depths 0,32768]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from muse_mlx.generate import decode_tokens  # noqa: E402
from muse_mlx.model import load  # noqa: E402
from muse_mlx.sampling import Sampler, SamplerSettings  # noqa: E402
from muse_mlx.tools.receipts import make_receipt  # noqa: E402


def bare(model, cache, logits, n: int) -> int:
    token = mx.argmax(logits.reshape(-1))
    for i in range(n):
        following = None
        if i + 1 < n:
            following = mx.argmax(model.step(token, cache).reshape(-1))
            mx.async_eval(following)
        int(token.item())
        if following is None:
            return n
        token = following
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--depths", default="0,32768")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=4)
    args = p.parse_args()
    model = load(args.model)
    greedy = Sampler(SamplerSettings())
    cells = []
    for depth in (int(d) for d in args.depths.split(",")):
        cache = model.make_cache(depth + 2 * args.tokens + 2)
        cache.fill_random(depth)
        ways = {"engine": lambda: sum(1 for _ in decode_tokens(model, cache, model.step(1, cache), greedy, args.tokens)),
                "bare": lambda: bare(model, cache, model.step(1, cache), args.tokens)}
        samples = {w: [] for w in ways}
        for rep in range(args.passes + 1):
            for name, fn in ways.items():
                for layer in cache.layers:
                    layer.offset = depth
                t = time.perf_counter()
                n = fn()
                rate = n / (time.perf_counter() - t)
                if rep:              # the first pass warms the traces
                    samples[name].append(rate)
        cell = {"depth": depth, **{f"{w}_tok_s": s for w, s in samples.items()},
                **{f"{w}_mean": float(np.mean(s)) for w, s in samples.items()}}
        print(f"depth {depth}: engine {cell['engine_mean']:.2f}, bare {cell['bare_mean']:.2f} tok/s", flush=True)
        cells.append(cell)
        del cache
    Path(args.out).write_text(json.dumps(make_receipt("research/probe-decode-loop", inputs=vars(args),
                                                      metrics={"cells": cells}, synthetic=True), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
