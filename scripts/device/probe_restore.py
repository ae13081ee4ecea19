"""kvpack.restore timed on this machine at the pinned geometry, with nothing else in the process.

For each N in --positions: the pinned geometry's cache at context N + 1 holding N random positions
(synthetic rows), saved as a pack, then restored 1 + --reps times: once after mx.clear_cache()
(fresh memory, as in a new process), then with MLX's buffer cache warm. Each restore is followed
by one GPU pass over the whole storage (what the first decode step pays to bring the rows to the
device, if they are not there yet). The rows are compared with the saved cache's.

With --ways restore,overlap, each N is also restored by `restore_overlapped` (below), a variant
measured here before the engine would take it.

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


def restore_overlapped(path: Path, context: int):
    """A variant kept here, not in the engine, to be measured: kvpack.restore with each blob loaded
    (mx.load) as soon as it is read and hashed, while later blobs are still being read and hashed
    on the threads. A bad blob is then found after earlier blobs reached MLX (a new cache that is
    dropped, no other cache changed): what kvpack's rule "every blob checked before any storage
    is made" forbids today, and what the 0.3 s goal at 65,536 may need."""
    from concurrent.futures import ThreadPoolExecutor

    g = PINNED
    pack = kvpack.read_manifest(path)
    kvpack.check_for_model(pack, g, MODEL["fingerprint"])
    m = pack.manifest
    n_full = g.n_layer - g.n_swa
    wanted = [(c["blob"], (n_full, 2, g.n_head_kv, c["rows"], g.head_dim)) for c in m["plane_chunks"]]
    wanted += [(r["blob"], (len(r["layers"]), 2, g.n_head_kv, m["ring_rows_held"], g.head_dim))
               for r in m["ring_groups"]]
    with ThreadPoolExecutor(kvpack.READ_THREADS) as pool:
        futures = [pool.submit(kvpack._read_blob, pack, name, "kv", shape) for name, shape in wanted]
        loaded = [f.result().device() for f in futures]
    cache = SlotCache(g, context)
    chunks, rings = loaded[:len(m["plane_chunks"])], loaded[len(m["plane_chunks"]):]
    full = [i for i in range(g.n_layer) if not g.is_swa(i)]
    plane = chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=3)
    for j, i in enumerate(full):
        layer = cache.layers[i]
        layer.restore_storage(kvpack._storage(plane[j, 0], layer.capacity),
                              kvpack._storage(plane[j, 1], layer.capacity), m["offset"])
    for grp, ring in zip(m["ring_groups"], rings):
        for j, i in enumerate(grp["layers"]):
            layer = cache.layers[i]
            layer.restore_storage(kvpack._storage(ring[j, 0], layer.capacity),
                                  kvpack._storage(ring[j, 1], layer.capacity), m["offset"])
    del loaded, chunks, rings, plane
    mx.eval(cache.state())
    return cache


WAYS = {"restore": lambda pack, n: kvpack.restore(pack, PINNED, MODEL["fingerprint"], n + 1)[0],
        "overlap": lambda pack, n: restore_overlapped(pack, n + 1)}


def cell(n: int, reps: int, work: Path, way: str = "restore") -> dict:
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
        restored = WAYS[way](pack, n)
        mx.eval(restored.state())
        t1 = time.perf_counter()
        mx.eval([mx.sum(a.astype(mx.float32)) for a in restored.state()])
        t2 = time.perf_counter()
        runs.append({"fresh_memory": rep == 0, "restore_s": t1 - t0, "first_gpu_pass_s": t2 - t1})
        if rep == 0:
            same = all(np.array_equal(np.array(a)[:, :min(n, a.shape[1])], w[:, :min(n, a.shape[1])])
                       for a, w in zip(restored.state(), want))
        del restored
        print(f"{way:>8} {n:>6}: restore {t1 - t0:.3f} s ({payload / (t1 - t0) / 1e9:.2f} GB/s"
              f"{', fresh memory' if rep == 0 else ''}), first GPU pass {t2 - t1:.3f} s", flush=True)
    shutil.rmtree(pack)
    warm = [r["restore_s"] for r in runs[1:]]
    return {"way": way, "positions": n, "payload_bytes": payload, "save_s": save_s, "rows_equal": bool(same), "runs": runs,
            "restore_s_fresh": runs[0]["restore_s"], "restore_s_warm_mean": float(np.mean(warm)) if warm else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", default="2048,32768,65536")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ways", default="restore,overlap", help="restore: kvpack.restore; overlap: restore_overlapped")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--receipt", required=True)
    args = p.parse_args()
    work = Path(args.dir) / "probe-restore"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cells = [cell(int(n), args.reps, work, way) for n in args.positions.split(",") for way in args.ways.split(",")]
    receipt = make_receipt("research/probe-restore", inputs=vars(args) | {"cpu_count": os.cpu_count(),
                           "read_threads": kvpack.READ_THREADS}, metrics={"cells": cells}, synthetic=True,
                           notes=["K/V rows random f16 (SlotCache.fill_random); each pack in the page cache "
                                  "(written just before it is restored)"])
    Path(args.receipt).write_text(json.dumps(receipt, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
