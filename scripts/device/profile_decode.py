"""One decode token of a GGUF under Nsight Compute: the profiled range is one warm token.

Run it under `ncu --profile-from-start off ...` (scripts/device/profile_decode.sh): the script
warms the step up, then brackets exactly one synced token with cuProfilerStart / cuProfilerStop
(the CUDA driver API, through ctypes), so ncu sees that token's kernels and no others.
The KV cache is filled to --depth with random f16 rows (synthetic content).

--batch 1,2,3,4 profiles, per variant, one packed step for each count B of sequences in turn (the
server's step over B slots: one forward over B tokens, each sequence with its own cache), each
range after --warm steps of that B outside it; fold them with `ncu_summary.py --parts
b1,b2,... --ends _202048_` (the LM head, a token's last kernel).

--variants "tag:name=value,name=value;tag2:..." profiles one token per kernel configuration in
turn (the bench's --kernel-config syntax, muse_mlx.config.KernelConfig.parse; "tag:" alone is
the defaults), each in a profiled range of its own after --warm tokens outside it. A kernel
configuration is fixed when a model is built, so each variant builds its own model from the one
opened artifact (the previous one freed first). The listing then holds the variants' kernels in
that order; `scripts/ncu_summary.py --parts tag,tag2,...` folds each part on its own.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time

import mlx.core as mx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--depth", type=int, default=512)
    p.add_argument("--warm", type=int, default=4, help="tokens decoded before each profiled one")
    p.add_argument("--batch", default="1", help="sequences per step, comma-separated: one profiled step each")
    p.add_argument("--variants", default="", help="\"tag:name=value,...;tag2:...\" (see above); default: one "
                                                  "unnamed token with the default kernel configuration")
    args = p.parse_args()
    from muse_mlx.artifact import open_artifact
    from muse_mlx.model import Model
    from muse_mlx.ops import select_ops

    variants = parse_variants(args.variants)
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--batch: expected comma-separated counts, got {args.batch!r}") from None
    if not batches or any(b < 1 for b in batches):
        raise SystemExit(f"--batch: expected counts >= 1, got {args.batch!r}")
    artifact = open_artifact(args.model)
    cuda = ctypes.CDLL("libcuda.so.1")
    for tag, config in variants:
        model = Model(artifact, select_ops("gpu", config))
        for batch in batches:
            caches = [model.make_cache(args.depth + args.warm + 2) for _ in range(batch)]
            for cache in caches:
                cache.fill_random(args.depth)
            token = mx.zeros((batch, 1), dtype=mx.int32)

            def step(token):
                token = mx.argmax(model(token, caches)[:, -1], axis=-1).astype(mx.int32).reshape(batch, 1)
                mx.eval(token)
                return token

            for _ in range(args.warm):
                token = step(token)
            mx.synchronize()
            cuda.cuProfilerStart()
            t = time.perf_counter()
            token = step(token)
            mx.synchronize()
            cuda.cuProfilerStop()
            print(f"profiled one step over {batch} sequence(s){' of ' + tag if tag else ''} ({config}) at depth "
                  f"{args.depth + args.warm}: {1e3 * (time.perf_counter() - t):.1f} ms under ncu", flush=True)
            del caches, step, token
            gc.collect()
            mx.clear_cache()
        del model
        gc.collect()
        mx.clear_cache()
    return 0


def parse_variants(text: str) -> list:
    """'tag:name=value,...;tag2:...' -> [(tag, KernelConfig)]; '' -> one unnamed variant with the defaults."""
    from muse_mlx.config import KernelConfig
    from muse_mlx.errors import MuseError

    try:
        return KernelConfig.parse_tagged(text, "--variants") if text else [("", KernelConfig())]
    except MuseError as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    raise SystemExit(main())
