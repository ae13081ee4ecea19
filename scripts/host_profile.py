"""Where the host's time goes in pipelined decode: cProfile of the engine's decode loop on the kernel path.

python scripts/host_profile.py --model M.gguf [--tokens 32] [--depth 0] [--kernel-config ring_chunk=16];
prints the top functions by own time and the seconds a token (the profiler's overhead included).
--slots N profiles the server's engine loop instead (slots.Scheduler.step on this thread, no HTTP):
N greedy requests of --prompt random token ids and --tokens tokens at once, timed and profiled
over the decode steps once every slot decodes (the packed step measured alone ran 8-13 % faster
than the engine loop on the H200, ledger 2026-12-03, f6f0b36). --backend reference runs it on the
CPU (a smoke test of the tool; its times are not the GPU's).
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
    p.add_argument("--slots", type=int, default=0, help="profile the engine loop with this many slots (0: the CLI's loop)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of each request with --slots")
    p.add_argument("--backend", default="gpu", choices=("gpu", "reference"))
    args = p.parse_args()
    if args.slots:
        return profile_slots(args)
    from muse_mlx.artifact import open_artifact
    from muse_mlx.config import KernelConfig
    from muse_mlx.generate import decode_tokens
    from muse_mlx.model import Model
    from muse_mlx.ops import select_ops
    from muse_mlx.sampling import Sampler, SamplerSettings

    model = Model(open_artifact(args.model), select_ops(args.backend, KernelConfig.parse(args.kernel_config)))
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


def profile_slots(args) -> int:
    import numpy as np

    from muse_mlx.artifact import open_artifact
    from muse_mlx.config import KernelConfig
    from muse_mlx.model import Model
    from muse_mlx.ops import select_ops
    from muse_mlx.sampling import SamplerSettings
    from muse_mlx.slots import Request, Scheduler
    from muse_mlx.tokenizer import MuseTokenizer

    artifact = open_artifact(args.model)
    model = Model(artifact, select_ops(args.backend, KernelConfig.parse(args.kernel_config)))
    sched = Scheduler(model, MuseTokenizer(artifact.vocabulary), args.slots, args.prompt + args.tokens + 16)
    rng = np.random.default_rng(0)

    def run(tokens: int, prof: cProfile.Profile | None = None) -> tuple[float, int]:
        """The engine loop over `slots` requests of `tokens` tokens: (seconds, steps) once every slot decodes."""
        for _ in range(args.slots):
            ids = rng.integers(0, model.geometry.n_vocab, args.prompt).tolist()
            sched.submit(Request(ids, tokens, SamplerSettings(), lambda e: None))
        while sched.waiting or any(s.state != "decode" for s in sched.slots):
            sched.step()
        steps, t = 0, time.perf_counter()
        if prof is not None:
            prof.enable()
        while any(s.state != "idle" for s in sched.slots):
            sched.step()
            steps += 1
        if prof is not None:
            prof.disable()
        return time.perf_counter() - t, steps

    run(8)
    seconds, steps = run(args.tokens)
    prof = cProfile.Profile()
    seconds_p, steps_p = run(args.tokens, prof)
    print(f"engine loop, {args.slots} slot(s): {1e3 * seconds / steps:.2f} ms a step without the profiler "
          f"({args.slots * steps / seconds:.1f} tok/s aggregate), {1e3 * seconds_p / steps_p:.2f} with")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
