"""One decode token of a GGUF under Nsight Compute: the profiled range is one warm token.

Run it under `ncu --profile-from-start off ...` (scripts/profile_decode.sh): the script warms
the step up, then brackets exactly one synced token with cuProfilerStart / cuProfilerStop
(the CUDA driver API, through ctypes), so ncu sees that token's kernels and no others.
The KV cache is filled to --depth with random f16 rows (synthetic content).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import mlx.core as mx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--depth", type=int, default=512)
    p.add_argument("--warm", type=int, default=4, help="tokens decoded before the profiled one")
    args = p.parse_args()
    from muse_mlx.artifact import open_artifact
    from muse_mlx.bench import fill_kv
    from muse_mlx.model import Model

    model = Model(open_artifact(args.model))
    cache = model.make_cache(args.depth + args.warm + 4)
    fill_kv(cache, args.depth)
    token = mx.array([1])
    for _ in range(args.warm):
        token = mx.argmax(model(token, cache, all_logits=False)[-1]).reshape(1)
        mx.eval(token)
    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    cuda.cuProfilerStart()
    t = time.perf_counter()
    token = mx.argmax(model(token, cache, all_logits=False)[-1]).reshape(1)
    mx.eval(token)
    mx.synchronize()
    cuda.cuProfilerStop()
    print(f"profiled one token at depth {cache.offset - 1}: {1e3 * (time.perf_counter() - t):.1f} ms under ncu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
