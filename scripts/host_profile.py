"""Where the host's time goes in pipelined decode: cProfile of the engine's decode loop on the kernel path.

python scripts/host_profile.py --model M.gguf [--tokens 32] [--depth 0] [--kernel-config ring_chunk=16];
prints the top functions by own time and the seconds a token (the profiler's overhead included).
--kernel-config takes the bench's syntax (muse_mlx.config.KernelConfig.parse). Runs wherever MLX
has a GPU (the lent H200, a Mac); needs the package installed (pip install -e .) or on PYTHONPATH."""

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
    p.add_argument("--kernel-config", default="", help="kernel tuning values, 'name=value,...' (default: the defaults)")
    args = p.parse_args()
    from muse_mlx.artifact import open_artifact
    from muse_mlx.config import KernelConfig
    from muse_mlx.generate import decode_tokens
    from muse_mlx.model import Model
    from muse_mlx.ops import select_ops
    from muse_mlx.sampling import Sampler, SamplerSettings

    model = Model(open_artifact(args.model), select_ops("gpu", KernelConfig.parse(args.kernel_config)))
    cache = model.make_cache(args.depth + 2 * args.tokens + 16)
    cache.fill_random(args.depth)
    greedy = Sampler(SamplerSettings())
    token = mx.array(1)

    def run(n, token):
        """n decode steps through the engine's pipelined loop (generate.decode_tokens), from `token`;
        the last token, not yet fed back."""
        for value in decode_tokens(model, cache, token, greedy, n + 1):
            pass
        return mx.array(value)

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
