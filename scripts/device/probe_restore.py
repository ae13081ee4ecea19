"""kvpack.restore timed on this machine at the pinned geometry, with nothing else in the process.

For each N in --positions: the pinned geometry's cache at context N + 1 holding N random positions
(synthetic rows), saved as a pack, then restored 1 + --reps times: once after mx.clear_cache()
(fresh memory, as in a new process), then with MLX's buffer cache warm. Each restore is followed
by one GPU pass over the whole storage (what the first decode step pays to bring the rows to the
device, if they are not there yet). The rows are compared with the saved cache's.

The variants this replaced (kvpack/1's host assembly, mx.array of the bytes, mx.load from the
file, loads on CPU streams) were timed at 3dcc931: receipts/research/h200-3dcc931-probe-restore.json.

Usage: python scripts/device/probe_restore.py --receipt probe.json [--positions 2048,32768,65536]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from muse_mlx import kvpack  # noqa: E402
from muse_mlx.geometry import PINNED  # noqa: E402
from muse_mlx.kv import SlotCache  # noqa: E402
from muse_mlx.tools.receipts import make_receipt  # noqa: E402

MODEL = {"fingerprint": "sha256:" + "0" * 64, "architecture": "muse-glimmer (synthetic rows)"}


def cell(n: int, reps: int, work: Path) -> dict:
    g = PINNED
    cache = SlotCache(g, n + 1)
    cache.fill_random(n)
    pack = work / f"pack-{n}"
    t = time.perf_counter()
    kvpack.save(cache, np.random.default_rng(n).integers(0, g.n_vocab, n).tolist(), MODEL, pack)
    save_s = time.perf_counter() - t
    want = [np.array(a) for a in cache.state()]
    del cache
    payload = kvpack.payload_bytes(kvpack.read_manifest(pack).manifest)
    runs = []
    for rep in range(1 + reps):
        if rep == 0:
            mx.clear_cache()
        t0 = time.perf_counter()
        restored, _ = kvpack.restore(pack, g, MODEL["fingerprint"], n + 1)
        mx.eval(restored.state())
        t1 = time.perf_counter()
        mx.eval([mx.sum(a.astype(mx.float32)) for a in restored.state()])
        t2 = time.perf_counter()
        runs.append({"fresh_memory": rep == 0, "restore_s": t1 - t0, "first_gpu_pass_s": t2 - t1})
        if rep == 0:
            same = all(np.array_equal(np.array(a)[:, :min(n, a.shape[1])], w[:, :min(n, a.shape[1])])
                       for a, w in zip(restored.state(), want))
        del restored
        print(f"{n:>6}: restore {t1 - t0:.3f} s ({payload / (t1 - t0) / 1e9:.2f} GB/s"
              f"{', fresh memory' if rep == 0 else ''}), first GPU pass {t2 - t1:.3f} s", flush=True)
    shutil.rmtree(pack)
    warm = [r["restore_s"] for r in runs[1:]]
    return {"positions": n, "payload_bytes": payload, "save_s": save_s, "rows_equal": bool(same), "runs": runs,
            "restore_s_fresh": runs[0]["restore_s"], "restore_s_warm_mean": float(np.mean(warm)) if warm else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", default="2048,32768,65536")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--receipt", required=True)
    args = p.parse_args()
    work = Path(args.dir) / "probe-restore"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cells = [cell(int(n), args.reps, work) for n in args.positions.split(",")]
    receipt = make_receipt("research/probe-restore", inputs=vars(args) | {"cpu_count": os.cpu_count(),
                           "read_threads": kvpack.READ_THREADS}, metrics={"cells": cells}, synthetic=True,
                           notes=["K/V rows random f16 (SlotCache.fill_random); each pack in the page cache "
                                  "(written just before it is restored)"])
    Path(args.receipt).write_text(json.dumps(receipt, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
