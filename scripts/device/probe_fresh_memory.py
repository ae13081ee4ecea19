"""Where a fresh process's weight load loses its time: fresh device memory, by the allocation.

MLX 0.32's CUDA allocator gives a GPU op's output (a custom kernel's included) memory from the
device's default memory pool (cudaMallocAsync), whose release threshold is 0: a fresh process
grows the pool for each new buffer. The weights through the page-locked staging took 1.78 s in a
process whose earlier loads had been freed and 4.3-4.4 s in fresh processes (2026-12-02,
00ace0f). Hypothesis: the ~2.6 s is the pool's growth, paid per allocation, not per byte
(refuted at 63ac5f9: fresh memory cost nothing; docs/ledger.md, 2026-12-03). Each
cell runs in a fresh process (the parent spawns itself with --cell); TOTAL is the bench file's
tensor bytes.

  cumem-one            the driver's cuMemAlloc of TOTAL in one call, then a memset of it
  cumem-pieces         cuMemAlloc of TOTAL in 16 MiB pieces
  pool-grow            the default pool grown by one allocation of TOTAL, freed into it, kept
                       (release threshold raised to the maximum; 4 = CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
  fill[-grown]         MLX arrays of TOTAL in 16 MiB pieces, written by a fill (mx.zeros);
                       -grown: after pool-grow
  staging[-grown]      the file's tensors through kernels/upload.py's staging (pieces of at most
                       128 MiB), the weights' candidate path
  mxload[-grown]       weight_stream.load_raw in 16 MiB pieces (the weights' path now)
  staging@HxTxP        the weights' path (weight_stream.upload_raw) with a staging of two H MiB
                       halves, T reading threads and pieces of at most P MiB (the engine's:
                       staging@128x8x16)
  read@TxP             the reads alone: the file's tensors in P MiB pieces into a page-locked
                       buffer of 256 MiB by T threads, no copies to the GPU
  copy@HxP             the copies alone: as many P MiB copies out of a staging of two H MiB
                       halves as the file has pieces, no reads (host bytes as the GPU reads them)

Usage: python scripts/device/probe_fresh_memory.py --model bench.gguf --receipt probe.json [--cells a,b]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PIECE = 16 * 2**20
CELLS = ["cumem-one", "cumem-pieces", "pool-grow", "fill", "fill-grown", "staging", "staging-grown",
         "mxload", "mxload-grown", "staging", "staging-grown"]


def _driver_context():
    from muse_mlx.kernels.upload import _call, _driver
    lib = _driver()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    _call(lib, "cuInit", 0)
    _call(lib, "cuDeviceGet", ctypes.byref(dev), 0)
    _call(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    _call(lib, "cuCtxPushCurrent_v2", ctx)
    return lib, dev


def _fn(lib, name, *argtypes):
    f = getattr(lib, name)
    f.argtypes, f.restype = list(argtypes), ctypes.c_int
    return f


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with status {status}")


def grow_pool(total: int) -> float:
    """Grow device 0's default memory pool by `total` bytes at once and let it keep what it frees
    (release threshold at its maximum); seconds. (The engine's `pool_reserve` did this at 63ac5f9;
    it gained nothing and was removed.)"""
    lib, dev = _driver_context()
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    pool = vp()
    t = time.perf_counter()
    _check(_fn(lib, "cuDeviceGetDefaultMemPool", ctypes.POINTER(vp), ctypes.c_int)(ctypes.byref(pool), dev), "pool")
    keep = u64(2**64 - 1)
    _check(_fn(lib, "cuMemPoolSetAttribute", vp, ctypes.c_int, vp)(pool, 4, ctypes.byref(keep)), "threshold")
    ptr = u64()
    _check(_fn(lib, "cuMemAllocFromPoolAsync", ctypes.POINTER(u64), ctypes.c_size_t, vp, vp)(
        ctypes.byref(ptr), total, pool, None), "alloc from pool")
    _check(_fn(lib, "cuMemFreeAsync", u64, vp)(ptr, None), "free async")
    _check(_fn(lib, "cuStreamSynchronize", vp)(None), "sync")
    return time.perf_counter() - t


def _tensors(model: str):
    from muse_mlx.artifact import open_artifact
    art = open_artifact(model, check_weights=False)
    return list(art.tensors.values())


def cell(name: str, model: str) -> dict:
    import mlx.core as mx
    raws = _tensors(model)
    total = sum(r.nbytes for r in raws)
    out = {"cell": name, "bytes": total}
    mx.eval(mx.zeros((4,), mx.uint8))   # the runtime's context and streams
    base = name.removesuffix("-grown")
    if name.endswith("-grown"):
        out["grow_s"] = grow_pool(total)
    if base == "pool-grow":
        out["grow_s"] = grow_pool(total)
        return out
    if base.startswith("cumem"):
        lib, _ = _driver_context()
        u64 = ctypes.c_uint64
        alloc = _fn(lib, "cuMemAlloc_v2", ctypes.POINTER(u64), ctypes.c_size_t)
        free = _fn(lib, "cuMemFree_v2", u64)
        sizes = [total] if base == "cumem-one" else [PIECE] * (total // PIECE)
        ptrs = []
        t = time.perf_counter()
        for s in sizes:
            p = u64()
            _check(alloc(ctypes.byref(p), s), "cuMemAlloc")
            ptrs.append(p)
        out["alloc_s"] = time.perf_counter() - t
        if base == "cumem-one":
            t = time.perf_counter()
            _check(_fn(lib, "cuMemsetD8_v2", u64, ctypes.c_ubyte, ctypes.c_size_t)(ptrs[0], 0, total), "memset")
            _check(_fn(lib, "cuCtxSynchronize")(), "sync")
            out["memset_s"] = time.perf_counter() - t
        for p in ptrs:
            free(p)
        return out
    if base == "fill":
        t = time.perf_counter()
        arrays = []
        for _ in range(total // PIECE):
            arrays.append(mx.zeros((PIECE,), mx.uint8))
            mx.async_eval(arrays[-1])
        mx.eval(arrays)
        out["seconds"] = time.perf_counter() - t
        return out
    if base == "staging":
        from muse_mlx.kernels.upload import HALF_BYTES, Piece, pinned_upload
        up = pinned_upload()
        up.upload([Piece(raws[0].path, raws[0].offset, 256)])   # the copy kernel built
        pieces = [Piece(r.path, r.offset + i, min(HALF_BYTES, r.nbytes - i))
                  for r in raws for i in range(0, r.nbytes, HALF_BYTES)]
        t = time.perf_counter()
        arrays = up.upload(pieces)
        out["seconds"] = time.perf_counter() - t
        out["pieces"] = len(pieces)
        del arrays
        return out
    if "@" in base:
        return {**out, **_stage_cell(base, raws)}
    if base == "mxload":
        from muse_mlx.weight_stream import load_raw
        t = time.perf_counter()
        arrays = load_raw(raws, PIECE)
        mx.eval(arrays)
        out["seconds"] = time.perf_counter() - t
        return out
    raise ValueError(f"no cell {name!r}")


def _stage_cell(name: str, raws) -> dict:
    """The staging@, read@ and copy@ cells (module doc): seconds and GB/s over the tensors' bytes."""
    import mlx.core as mx
    from concurrent.futures import ThreadPoolExecutor
    from muse_mlx.kernels.upload import Piece, PinnedUpload, _read
    from muse_mlx.weight_stream import upload_raw

    kind, values = name.split("@")
    mib = [int(v) for v in values.split("x")]
    total = sum(r.nbytes for r in raws)
    if kind == "staging":
        half, threads, piece = mib
        up = PinnedUpload(half * 2**20, threads)
        up.upload([Piece(raws[0].path, raws[0].offset, 256)])   # the staging allocated, the copy kernel built
        mapped = [r for r in raws if len(r.shape) == 2]
        t = time.perf_counter()
        arrays = upload_raw(mapped, up, piece * 2**20)
        mx.eval(arrays)
        seconds = time.perf_counter() - t
        total = sum(r.nbytes for r in mapped)
    elif kind == "read":
        threads, piece = mib
        up = PinnedUpload(128 * 2**20, threads)
        up._staging = up._allocate(256 * 2**20)
        step = piece * 2**20
        spans = [(r.path, r.offset + i, min(step, r.nbytes - i)) for r in raws for i in range(0, r.nbytes, step)]
        slots = 256 * 2**20 // step
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: _read(spans[k][0], spans[k][1],
                                          up._staging.view[(k % slots) * step:(k % slots) * step + spans[k][2]]),
                          range(len(spans))))
        seconds = time.perf_counter() - t
    elif kind == "copy":
        half, piece = mib
        up = PinnedUpload(half * 2**20, 1)
        up._staging = up._allocate(2 * half * 2**20)
        step = piece * 2**20
        slots = 2 * half * 2**20 // step
        count = -(-total // step)
        mx.eval(up._copy(0, 256))
        t = time.perf_counter()
        pending = []
        for k in range(count):
            pending.append(up._copy((k % slots) * step, step))
            mx.async_eval(pending[-1])
            if len(pending) >= 2 * slots:
                mx.eval(pending)
                pending = []
        mx.eval(pending)
        seconds = time.perf_counter() - t
    else:
        raise ValueError(f"no cell kind {kind!r}")
    return {"seconds": seconds, "gb_per_s": total / seconds / 1e9, "bytes": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--receipt")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell:
        print(json.dumps(cell(args.cell, args.model)), flush=True)
        return 0
    from muse_mlx.tools.receipts import make_receipt
    results = []
    for name in args.cells.split(","):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--model", args.model, "--cell", name],
                           capture_output=True, text=True)
        row = {"cell": name, "process_s": time.perf_counter() - t, "exit": p.returncode}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        row.update(json.loads(lines[-1]) if lines else {"stderr": p.stderr[-800:]})
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.receipt:
            Path(args.receipt).write_text(json.dumps(make_receipt(
                "research/probe-fresh-memory", inputs={"model": args.model, "piece_bytes": PIECE},
                metrics={"cells": results}, synthetic=True,
                notes=["each cell a fresh process; the model file in the page cache"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
