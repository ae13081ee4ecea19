"""Fresh MLX device memory on this machine: what writing bytes into it costs, and whether
prefetching it to the GPU first (the driver's cuMemPrefetchAsync) removes that cost.

MLX 0.32's CUDA allocator hands out cudaMallocManaged memory and keeps freed buffers in a cache
that later allocations of about the same size reuse. The page-locked staging copied 16 MiB
pieces at 22.2 GB/s into reused buffers and 5.6 GB/s into fresh ones (2026-12-02, 7889bf1), and
the weights through it took 7.13 s against mx.load's 4.84 (e955f3d): the hypothesis is that the
first touch of each managed page costs what is missing. Cells, each on --gib GiB of a file in the
page cache, a cell's buffers fresh (mx.clear_cache() before it) unless said:

  load          weight_stream.load_raw in 16 MiB row ranges, put together (the weights' way)
  load-warm     the same again, its buffers reused from MLX's cache
  load-reserved the same after `reserve`: buffers of the sizes it will ask for allocated
                untouched, prefetched to the GPU, and freed into MLX's cache
  staging       kernels/upload.py's staging in 16 MiB pieces; staging-reserved after `reserve`

Usage: python scripts/device/probe_managed.py --receipt probe.json [--gib 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gguf import GGMLQuantizationType as QT  # noqa: E402

from muse_mlx.artifact import RawTensor  # noqa: E402
from muse_mlx.kernels.upload import Piece, PinnedUpload, _call, _driver  # noqa: E402
from muse_mlx.tools.receipts import make_receipt  # noqa: E402
from muse_mlx.weight_stream import _pieces, load_raw  # noqa: E402

PIECE = 16 * 2**20
ROW = 3744   # a Q4_K row at K = 6,656


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _untouched(nbytes: int) -> mx.array:
    """An evaluated uint8 array whose memory no one wrote (a kernel that writes nothing)."""
    k = mx.fast.cuda_kernel(name="muse_probe_nothing", input_names=["x"], output_names=["out"], source="")
    out = k(inputs=[mx.zeros((1,), mx.uint8)], output_shapes=[(nbytes,)], output_dtypes=[mx.uint8],
            grid=(1, 1, 1), threadgroup=(1, 1, 1), stream=mx.gpu)[0]
    mx.eval(out)
    return out


def _address(a: mx.array) -> int:
    """The data pointer of an evaluated MLX array (its DLPack capsule's DLTensor.data)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = a.__dlpack__()
    return ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(ctypes.c_void_p))[0]


def reserve(sizes: list[int]) -> float:
    """Allocate a buffer of each size untouched, prefetch it to device 0, free it into MLX's
    cache; seconds taken."""
    lib = _driver()
    fn = lib.cuMemPrefetchAsync_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, MemLocation, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    ctx, old = ctypes.c_void_p(), ctypes.c_void_p()
    _call(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    _call(lib, "cuCtxPushCurrent_v2", ctx)
    t = time.perf_counter()
    try:
        arrays = [_untouched(n) for n in sizes]
        for a in arrays:
            status = fn(_address(a), a.nbytes, MemLocation(1, 0), 0, None)
            if status != 0:
                raise RuntimeError(f"cuMemPrefetchAsync_v2 failed with status {status}")
        del a
        status = lib.cuCtxSynchronize()
        if status != 0:
            raise RuntimeError(f"cuCtxSynchronize failed with status {status}")
    finally:
        _call(lib, "cuCtxPopCurrent_v2", ctypes.byref(old))
    del arrays
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--receipt", required=True)
    ap.add_argument("--work", default="/tmp/probe-managed")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = int(args.gib * 2**30) // ROW // 4
    f = work / "weights.bin"
    np.random.default_rng(5).integers(0, 256, 4 * rows * ROW, dtype=np.uint8).tofile(f)
    f.read_bytes()   # into the page cache
    raws = [RawTensor(f"t{i}", QT.Q4_K, (6656, rows), np.zeros((rows, ROW), np.uint8), f, i * rows * ROW)
            for i in range(4)]
    nbytes = 4 * rows * ROW
    pieces = [p for r in raws for p in _pieces(r, PIECE)]
    load_sizes = [p.data.nbytes for p in pieces] + [r.data.nbytes for r in raws]
    reference = np.fromfile(f, dtype=np.uint8)
    cells = []

    def write() -> None:
        Path(args.receipt).write_text(json.dumps(make_receipt(
            "research/probe-managed", inputs={"gib": nbytes / 2**30, "piece_bytes": PIECE}, metrics={"cells": cells},
            synthetic=True, notes=["random bytes in a file in the page cache"]), indent=1))

    def timed(name, fn, fresh=True, before=None):
        try:
            run(name, fn, fresh, before)
        except Exception as exc:   # a probe: record the failure, go on to the next cell
            cells.append({"cell": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            write()
            print(f"{name}: failed: {exc}", flush=True)

    def run(name, fn, fresh, before):
        if fresh:
            mx.clear_cache()
        prep = before() if before else 0.0
        t = time.perf_counter()
        out = fn()
        mx.eval(out)
        s = time.perf_counter() - t
        same = bool(np.array_equal(np.concatenate([np.array(a).reshape(-1) for a in out]), reference))
        cells.append({"cell": name, "seconds": s, "gb_s": nbytes / s / 1e9, "prepare_s": prep, "bytes_equal": same})
        write()
        print(f"{name}: {s:.3f} s, {nbytes / s / 1e9:.2f} GB/s (prepare {prep:.3f} s), bytes equal {same}", flush=True)
        del out

    timed("load", lambda: load_raw(raws, PIECE))
    timed("load-warm", lambda: load_raw(raws, PIECE), fresh=False)
    timed("load-reserved", lambda: load_raw(raws, PIECE), before=lambda: reserve(load_sizes))
    up = PinnedUpload()
    up._staging = up._allocate(2 * up.half_bytes)
    staged = [Piece(f, p.offset, p.data.nbytes) for p in pieces]
    timed("staging", lambda: up.upload(staged))
    timed("staging-reserved", lambda: up.upload(staged), before=lambda: reserve([p.size for p in staged]))
    timed("staging-warm", lambda: up.upload(staged), fresh=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
