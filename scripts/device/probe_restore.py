"""Ways to restore a kvpack on this machine, timed side by side on one pack (issue 15's 0.3 s goal).

The pack: the pinned geometry's cache at context N + 1 holding N random positions (synthetic rows;
default N = 65,536: 0.947 GB of payload in 254 plane chunks of 256 rows and 3 ring groups).
Each way ends with the layers' K/V storage as MLX arrays, every blob's SHA-256 checked; then one
GPU pass over all of it (what the first decode step would pay to bring the rows to the device):

  current      kvpack.restore as it is
  host         blobs read and hashed in the same pass (threads), the rows viewed in place (the
               safetensors header parsed, no copy), each layer's storage put together on the host
               (threads) and handed to MLX by mx.array (one copy a layer, serial)
  gpu          blobs read and hashed as in `host`; each blob handed to MLX whole (mx.array of its
               bytes); each layer's storage put together on the device (slices viewed as f16,
               concatenated: device memory)
  load         blobs hashed on threads; each loaded by mx.load on the GPU stream (MLX reads it
               into host memory and copies it to device memory); storage concatenated on the device
  load_cpu     as `load`, the loads spread over 8 CPU streams (read in parallel, into managed
               memory), then concatenated on the device

Each way: one run after mx.clear_cache() (fresh memory, as in a new process) and two more (MLX's
buffer cache warm), in two rounds. Usage:
  python scripts/device/probe_restore.py --out probe.json [--positions 65536] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from muse_mlx import kvpack  # noqa: E402
from muse_mlx.geometry import PINNED  # noqa: E402
from muse_mlx.kv import SlotCache  # noqa: E402

PIECE = 8 * 2**20
THREADS = 8
MODEL = {"fingerprint": "sha256:" + "0" * 64, "architecture": "muse-glimmer (synthetic rows)"}


def read_hashed(path: Path) -> tuple[np.ndarray, str]:
    """The file's bytes in a new buffer and their SHA-256, in one pass (each piece hashed while hot)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, np.uint8)
        mv, h, at = memoryview(buf), hashlib.sha256(), 0
        while at < size:
            n = f.readinto(mv[at:at + PIECE])
            h.update(mv[at:at + n])
            at += n
    return buf, h.hexdigest()


def hash_only(path: Path) -> str:
    buf = bytearray(PIECE)
    mv, h = memoryview(buf), hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(mv):
            h.update(mv[:n])
    return h.hexdigest()


def tensor_spans(buf: np.ndarray) -> dict[str, tuple[tuple, int, int]]:
    """name -> (shape, first byte, end byte) of a safetensors file's tensors (F16 only here)."""
    n = int.from_bytes(buf[:8].tobytes(), "little")
    header = json.loads(buf[8:8 + n].tobytes())
    base = 8 + n
    return {k: (tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def layout(pack):
    """[(blob name, {tensor name: layer})] in the order rows go into storage, and per layer its blobs."""
    m = pack.manifest
    return [c["blob"] for c in m["plane_chunks"]], [g["blob"] for g in m["ring_groups"]]


def blob_path(pack, name):
    return pack.path / "blobs" / f"{name}.safetensors"


def way_current(pack, geometry, context):
    cache, _ = kvpack.restore(pack.path, geometry, MODEL["fingerprint"], context)
    return cache.state()


def _read_all(pack, names, pool):
    got = list(pool.map(lambda n: read_hashed(blob_path(pack, n)), names))
    for n, (_, h) in zip(names, got):
        assert h == n, "hash mismatch"
    return [b for b, _ in got]


def way_host(pack, geometry, context, pool):
    chunks, rings = layout(pack)
    bufs = _read_all(pack, chunks + rings, pool)
    spans = [tensor_spans(b) for b in bufs]
    g = geometry
    out = {}

    def build(i):
        for kv in "kv":
            key = f"{kv}.{i}"
            if g.is_swa(i):
                j = next(j for j in range(len(chunks), len(bufs)) if key in spans[j])
                shape, a, b = spans[j][key]
                out[key] = bufs[j][a:b].view(np.float16).reshape(shape)
            else:
                parts = []
                for j in range(len(chunks)):
                    shape, a, b = spans[j][key]
                    parts.append(bufs[j][a:b].view(np.float16).reshape(shape))
                out[key] = np.concatenate(parts, axis=1)
    list(pool.map(build, range(g.n_layer)))
    return [mx.array(out[f"{kv}.{i}"]) for i in range(g.n_layer) for kv in "kv"]


def way_gpu(pack, geometry, context, pool):
    chunks, rings = layout(pack)
    bufs = _read_all(pack, chunks + rings, pool)
    spans = [tensor_spans(b) for b in bufs]
    arrays = [mx.array(b) for b in bufs]
    g = geometry
    state = []
    for i in range(g.n_layer):
        for kv in "kv":
            key = f"{kv}.{i}"
            js = [j for j in range(len(bufs)) if key in spans[j]]
            parts = [arrays[j][spans[j][key][1]:spans[j][key][2]].view(mx.float16).reshape(spans[j][key][0])
                     for j in js]
            state.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
    return state


def _way_load(pack, geometry, context, pool, streams):
    chunks, rings = layout(pack)
    names = chunks + rings
    hashes = list(pool.map(lambda n: hash_only(blob_path(pack, n)), names))
    assert hashes == names, "hash mismatch"
    loaded = [mx.load(str(blob_path(pack, n)), stream=streams[j % len(streams)] if streams else None)
              for j, n in enumerate(names)]
    if streams:
        mx.eval([a for d in loaded for a in d.values()])
    g = geometry
    state = []
    for i in range(g.n_layer):
        for kv in "kv":
            key = f"{kv}.{i}"
            parts = [d[key] for d in loaded if key in d]
            state.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
    return state


def timed_way(fn) -> dict:
    t0 = time.perf_counter()
    state = fn()
    mx.eval(state)
    t1 = time.perf_counter()
    mx.eval([mx.sum(a.astype(mx.float32)) for a in state])   # every row read by the device once
    t2 = time.perf_counter()
    sig = [float(mx.sum(a[:, :7, :5].astype(mx.float32)).item()) for a in state[::9]]
    del state
    return {"restore_s": t1 - t0, "first_gpu_pass_s": t2 - t1, "signature": sig}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=65536)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    g, n = PINNED, args.positions
    work = Path(args.dir) / "probe-restore"
    shutil.rmtree(work, ignore_errors=True)
    cache = SlotCache(g, n + 1)
    cache.fill_random(n)
    t = time.perf_counter()
    kvpack.save(cache, np.random.default_rng(0).integers(0, g.n_vocab, n).tolist(), MODEL, work)
    save_s = time.perf_counter() - t
    del cache
    mx.clear_cache()
    pack = kvpack.read_manifest(work)
    payload = kvpack.payload_bytes(pack.manifest)
    pool = ThreadPoolExecutor(THREADS)
    cpu_streams = [mx.new_stream(mx.cpu) for _ in range(8)]
    ways = {
        "current": lambda: way_current(pack, g, n + 1),
        "host": lambda: way_host(pack, g, n + 1, pool),
        "gpu": lambda: way_gpu(pack, g, n + 1, pool),
        "load": lambda: _way_load(pack, g, n + 1, pool, None),
        "load_cpu": lambda: _way_load(pack, g, n + 1, pool, cpu_streams),
    }
    results = {k: [] for k in ways}
    for r in range(args.rounds):
        for name, fn in ways.items():
            for rep in range(3):
                if rep == 0:
                    mx.clear_cache()
                try:
                    cell = timed_way(fn)
                except Exception as exc:   # a way MLX cannot run here is reported, not fatal
                    cell = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                cell.update(round=r, rep=rep, fresh_memory=rep == 0)
                results[name].append(cell)
                print(f"{name:>9} round {r} rep {rep}: " + (cell.get("error") or
                      f"restore {cell['restore_s']:.3f} s ({payload / cell['restore_s'] / 1e9:.2f} GB/s), "
                      f"first GPU pass {cell['first_gpu_pass_s']:.3f} s"), flush=True)
    sigs = {k: next((c["signature"] for c in v if "signature" in c), None) for k, v in results.items()}
    ref = sigs["current"]
    agree = {k: s == ref for k, s in sigs.items()}
    for v in results.values():
        for c in v:
            c.pop("signature", None)
    out = {"positions": n, "payload_bytes": payload, "blobs": len(pack.blob_names()), "save_s": save_s,
           "threads": THREADS, "piece_bytes": PIECE, "device": str(mx.default_device()), "mlx": mx.__version__,
           "cpu_count": os.cpu_count(), "same_rows_as_current": agree, "ways": results,
           "notes": ["synthetic rows (SlotCache.fill_random); pack in the page cache (written just before)"]}
    print("same rows as current:", agree)
    Path(args.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
