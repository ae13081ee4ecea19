"""Host bytes to the GPU on this machine: kernels/upload.py's page-locked staging against mx.load.

1. bytes: a file of random bytes (in the page cache) uploaded in pieces at odd offsets and spans
   (every alignment the copy kernel branches on), compared byte for byte; then --gib GiB of it
   in 16 MiB pieces through the staging (8 to a half, so every reading thread has one) and
   through mx.load of a safetensors stream (weight_stream.load_raw, the weights' way): GB/s each.
2. restore: for each N in --positions, the pinned geometry's cache at context N + 1 holding N
   random positions (synthetic rows), saved as a pack, restored 1 + --reps times each way
   (kvpack.restore with upload = the staging, and with None: mx.load of each checked blob), the
   first after mx.clear_cache(); the rows compared with the saved cache's, bit for bit.

A failing byte comparison exits 1 at once, so a device round can fall back before timing more.

Usage: python scripts/device/probe_upload.py --receipt probe.json [--positions 2048,32768,65536]
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
from muse_mlx.artifact import RawTensor  # noqa: E402
from muse_mlx.geometry import PINNED  # noqa: E402
from muse_mlx.kernels.upload import Piece, PinnedUpload, pinned_upload  # noqa: E402
from muse_mlx.kv import SlotCache  # noqa: E402
from muse_mlx.tools.receipts import make_receipt  # noqa: E402
from muse_mlx.weight_stream import load_raw  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

MODEL = {"fingerprint": "sha256:" + "0" * 64, "architecture": "muse-glimmer (synthetic rows)"}


def bytes_cell(work: Path, gib: float) -> dict:
    rng = np.random.default_rng(11)
    size = int(gib * 2**30)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    f = work / "bytes.bin"
    data.tofile(f)
    up = PinnedUpload(half_bytes=2**20)
    pieces = [Piece(f, off, n) for off in (0, 1, 3, 8, 16, 4097) for n in (1, 7, 8, 15, 16, 17, 4096, 2**20 - 5)]
    spans = [(min(s, p.size), max(0, p.size - s - e)) for p, (s, e) in zip(pieces, [(0, 0), (3, 1), (8, 0), (16, 5)] * 100)]
    got = up.upload(pieces, lambda i, v: spans[i])
    bad = [i for i, (p, a, (s, n)) in enumerate(zip(pieces, got, spans))
           if not np.array_equal(np.array(a), data[p.offset + s:p.offset + s + n])]
    print(f"bytes: {len(pieces)} pieces at every alignment, {len(bad)} differ", flush=True)
    out = {"pieces_checked": len(pieces), "pieces_differing": len(bad)}
    if bad:
        return out
    rows = 2**20
    raw = RawTensor("bytes", QT.I8, (rows, size // rows), data[:size // rows * rows].reshape(size // rows, rows),
                    f, 0)   # the file's bytes as a (size / 2^20, 2^20) tensor at offset 0
    piece = 16 * 2**20      # 8 pieces to a half of the staging: all 8 threads read
    pieces = [Piece(f, at, min(piece, raw.data.nbytes - at)) for at in range(0, raw.data.nbytes, piece)]
    for way in ("pinned", "mx.load", "pinned", "mx.load"):
        mx.clear_cache()
        t = time.perf_counter()
        if way == "pinned":
            a = mx.concatenate(pinned_upload().upload(pieces)).reshape(raw.data.shape)
        else:
            a = load_raw([raw], piece)[0]
        mx.eval(a)
        dt = time.perf_counter() - t
        same = bool(mx.array_equal(a, mx.array(raw.data)).item()) if way == "pinned" else None
        out.setdefault(way, []).append({"seconds": dt, "gbps": raw.data.nbytes / dt / 1e9, "equal": same})
        print(f"bytes: {raw.data.nbytes / 1e9:.2f} GB by {way}: {dt:.3f} s, {raw.data.nbytes / dt / 1e9:.2f} GB/s"
              + ("" if same is None else f", equal {same}"), flush=True)
        del a
    f.unlink()
    return out


def restore_cell(n: int, reps: int, work: Path) -> dict:
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
    out = {"positions": n, "payload_bytes": payload, "save_s": save_s}
    for way, upload in (("pinned", pinned_upload()), ("mx.load", None)):
        runs = []
        for rep in range(1 + reps):
            if rep == 0:
                mx.clear_cache()
            t0 = time.perf_counter()
            restored, _ = kvpack.restore(pack, g, MODEL["fingerprint"], n + 1, upload=upload)
            mx.eval(restored.state())
            dt = time.perf_counter() - t0
            runs.append({"fresh_memory": rep == 0, "restore_s": dt})
            if rep == 0:
                same = all(np.array_equal(np.array(a)[:, :min(n, a.shape[1])], w[:, :min(n, a.shape[1])])
                           for a, w in zip(restored.state(), want))
            del restored
            print(f"restore {n:>6} by {way}: {dt:.3f} s ({payload / dt / 1e9:.2f} GB/s"
                  f"{', fresh memory' if rep == 0 else ''})", flush=True)
        warm = [r["restore_s"] for r in runs[1:]]
        out[way] = {"rows_equal": bool(same), "runs": runs, "restore_s_warm_mean": float(np.mean(warm)) if warm else None}
    shutil.rmtree(pack)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", default="2048,32768,65536")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gib", type=float, default=1.0)   # under 2 GiB: MLX shapes are 32-bit
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--receipt", required=True)
    args = p.parse_args()
    work = Path(args.dir) / "probe-upload"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    metrics = {"bytes": bytes_cell(work, args.gib)}

    def write() -> None:
        receipt = make_receipt("research/probe-upload", inputs=vars(args) | {"cpu_count": os.cpu_count(),
                               "read_threads": kvpack.READ_THREADS}, metrics=metrics, synthetic=True,
                               notes=["random bytes and random f16 K/V rows (SlotCache.fill_random), each file "
                                      "in the page cache (written just before it is read)"])
        Path(args.receipt).write_text(json.dumps(receipt, indent=1))
    write()
    if metrics["bytes"]["pieces_differing"]:
        return 1
    metrics["restore"] = []
    for n in args.positions.split(","):
        metrics["restore"].append(restore_cell(int(n), args.reps, work))
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
