"""One decode token of a GGUF under Nsight Compute: the profiled range is one warm token.

Run it under `ncu --profile-from-start off ...` (scripts/profile_decode.sh): the script warms
the step up, then brackets exactly one synced token with cuProfilerStart / cuProfilerStop
(the CUDA driver API, through ctypes), so ncu sees that token's kernels and no others.
The KV cache is filled to --depth with random f16 rows (synthetic content).

--variants "tag:VAR=value VAR=value;tag2:..." profiles one token per variant in turn (after
two warm tokens under its settings, so its kernels are compiled outside the profiled range),
each in a profiled range of its own, the variables of one variant unset before the next:
one model load for several settings. The listing then holds the variants' kernels in that
order; `ncu_summary.py --parts tag,tag2,...` folds each part on its own.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import mlx.core as mx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--depth", type=int, default=512)
    p.add_argument("--warm", type=int, default=4, help="tokens decoded before the profiled one")
    p.add_argument("--variants", default="", help="\"tag:VAR=value VAR=value;tag2:...\" (see above)")
    args = p.parse_args()
    variants = parse_variants(args.variants)
    from muse_mlx.artifact import open_artifact
    from muse_mlx.tools.bench import fill_kv
    from muse_mlx.model import Model

    model = Model(open_artifact(args.model))
    cache = model.make_cache(args.depth + args.warm + 4 + 3 * len(variants))
    fill_kv(cache, args.depth)
    token = mx.array([1])

    def step(token):
        token = mx.argmax(model(token, cache, all_logits=False)[-1]).reshape(1)
        mx.eval(token)
        return token

    for _ in range(args.warm):
        token = step(token)
    cuda = ctypes.CDLL("libcuda.so.1")
    for tag, env in variants:
        os.environ.update(env)
        for _ in range(2 if tag else 0):
            token = step(token)
        mx.synchronize()
        cuda.cuProfilerStart()
        t = time.perf_counter()
        token = step(token)
        mx.synchronize()
        cuda.cuProfilerStop()
        print(f"profiled one token{' of ' + tag if tag else ''} at depth {cache.offset - 1}: "
              f"{1e3 * (time.perf_counter() - t):.1f} ms under ncu")
        for var in env:
            del os.environ[var]
    return 0


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'tag:VAR=value VAR=value;tag2:...' -> [(tag, {VAR: value})]; '' -> one unnamed variant
    with the environment as it is."""
    if not text:
        return [("", {})]
    out = []
    for item in filter(None, text.split(";")):
        tag, _, assigns = item.partition(":")
        env = dict(a.split("=", 1) for a in filter(None, assigns.split()))
        clash = [v for v in env if v in os.environ]
        if not tag or clash:
            raise SystemExit(f"--variants: {item!r} needs a tag, and may not set what the environment sets ({clash})")
        out.append((tag, env))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
