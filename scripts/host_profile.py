"""Where the host's time goes in pipelined decode: cProfile of N tokens on the kernel path.

python scripts/host_profile.py --model M.gguf [--tokens 32] [--depth 0]; prints the top
functions by own time and the seconds a token (the profiler's overhead included)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import mlx.core as mx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    from muse_mlx.artifact import open_artifact
    from muse_mlx.tools.bench import fill_kv
    from muse_mlx.model import Model

    model = Model(open_artifact(args.model))
    cache = model.make_cache(args.depth + 2 * args.tokens + 16)
    fill_kv(cache, args.depth)
    token = mx.array([1])

    def run(n, token):
        for _ in range(n):
            token = mx.argmax(model(token, cache, all_logits=False)[-1]).reshape(1)
            mx.async_eval(token)
        mx.eval(token)
        return token

    token = run(8, token)
    t = time.perf_counter()
    token = run(args.tokens, token)
    plain = (time.perf_counter() - t) / args.tokens
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    token = run(args.tokens, token)
    prof.disable()
    print(f"{1e3 * plain:.2f} ms a token without the profiler, {1e3 * (time.perf_counter() - t) / args.tokens:.2f} with")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
