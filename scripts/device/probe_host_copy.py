"""Where a kvpack restore's time goes on this host: the steps of one restore of N bytes, apart.

A restore (kvpack.restore) reads each blob from the page cache, hashes it (SHA-256, READ_THREADS
at once), copies its rows into the storage arrays, and hands those to MLX (mx.array: a copy into
MLX's memory, on CUDA managed memory). Each of those, timed alone here on N random bytes
(default 0.95 GB, the pack of a 65,536-token prompt at the pinned geometry), 3 samples each:

  np_copy          a host copy (numpy), the floor for any one pass over the bytes
  sha256_1, _8     SHA-256 of the bytes on 1 thread and in 8 pieces on 8 threads
  read_cached      reading a file of the bytes back from the page cache (np.fromfile)
  mx_array         mx.array(numpy) then eval: the copy into MLX's memory (fresh pages)
  mx_array_reused  the same after the previous array was freed (MLX's buffer cache may hand back
                   pages the device already touched)
  mx_to_gpu_op     mx.array(numpy) and one GPU op reading it (the pages then used by the device)

Usage: python scripts/device/probe_host_copy.py [--bytes N] [--dir /tmp] --out probe.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np


def timed(fn, reps: int = 3) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=950_000_000)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    n = args.bytes // 2 * 2
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    half = data.view(np.float16)
    path = os.path.join(args.dir, "probe-host-copy.bin")
    data.tofile(path)
    samples = {}
    samples["np_copy"] = timed(lambda: data.copy())
    samples["sha256_1"] = timed(lambda: hashlib.sha256(memoryview(data)).digest())
    pieces = np.array_split(data, 8)
    with ThreadPoolExecutor(8) as pool:
        samples["sha256_8"] = timed(lambda: list(pool.map(lambda a: hashlib.sha256(memoryview(a)).digest(), pieces)))
    samples["read_cached"] = timed(lambda: np.fromfile(path, dtype=np.uint8))
    os.unlink(path)

    def to_mlx():
        a = mx.array(half)
        mx.eval(a)
        return a

    samples["mx_array"] = []
    for _ in range(3):
        mx.clear_cache()
        t = time.perf_counter()
        a = to_mlx()
        samples["mx_array"].append(time.perf_counter() - t)
        del a
    samples["mx_array_reused"] = timed(lambda: to_mlx())

    def to_gpu_op():
        a = mx.array(half)
        mx.eval(mx.sum(a[::4096].astype(mx.float32)))

    samples["mx_to_gpu_op"] = timed(to_gpu_op)
    out = {"bytes": n, "device": str(mx.default_device()), "mlx": mx.__version__,
           "seconds": samples, "gbps_best": {k: n / min(v) / 1e9 for k, v in samples.items()}}
    for k, v in out["gbps_best"].items():
        print(f"{k:>16}: {v:6.2f} GB/s (best of {len(samples[k])}; {', '.join(f'{s:.3f}' for s in samples[k])} s)")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
