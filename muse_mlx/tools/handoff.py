"""`python -m muse_mlx.tools.handoff`: the book's two handoff cells, by real packs at the pinned geometry.

Seed 000 §22.7-22.9: a delta handoff at the 32,768-of-65,536 cell shipped 54.2851 % of the full
bytes (which is the share with the boundary token held back: 32,767 of 65,535 NoPE rows plus the
rings; without the hold-back it would be 54.2857 %); a deep handoff at 130,815 tokens carried 1,823,184,896 B (130,814 NoPE rows, the boundary
token decoded by the receiver, plus 3 groups x 13 layers x 2,048 ring rows). Here the caches are
allocated at the pinned geometry and filled with random f16 rows (synthetic: the bytes, not the
values, are measured), packed with kvpack, and the delta is made against what the receiver
holds; the numbers are the packs' own accounting (payload: K/V row bytes; on disk: with the
safetensors headers and the manifest). About 3.5 GB of memory and 3.5 GB of disk.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import cli, kvpack
from ..cli import Parser
from ..geometry import PINNED, Geometry
from ..kv import SlotCache
from .anchors import BOOK_HANDOFF_DEPTH

SYNTHETIC_MODEL = {"fingerprint": "sha256:" + "0" * 64, "architecture": "muse-glimmer (synthetic rows)"}


def _tokens(n: int, g: Geometry, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, g.n_vocab, n)]


def _disk_bytes(path: Path, names=None) -> int:
    blobs = [f for f in (path / "blobs").iterdir() if names is None or f.name.removesuffix(".safetensors") in names]
    return sum(f.stat().st_size for f in blobs) + (path / "manifest.json").stat().st_size


def delta_cell(g: Geometry, held: int, total: int, work: Path) -> dict:
    """The receiver holds the pack of the first `held` tokens; the sender, at `total` tokens, ships
    the delta of its pack of all but the last (the boundary token the receiver decodes, as in the
    deep cell) against it."""
    ids = _tokens(total, g, 1)
    sender = SlotCache(g, total)
    sender.fill_random(total - 1, seed=1)
    receiver = SlotCache(g, total)
    receiver.fill_random(held, seed=2)   # its own rings; its plane rows are the sender's first `held`
    for i, (a, b) in enumerate(zip(sender.layers, receiver.layers)):
        if not g.is_swa(i):
            b.restore_rows(a.keys[:, :held, :], a.values[:, :held, :], held)
    t = time.perf_counter()
    old = kvpack.save(receiver, ids[:held], SYNTHETIC_MODEL, work / "held")
    full = kvpack.save(sender, ids[:-1], SYNTHETIC_MODEL, work / "full")
    save_s = time.perf_counter() - t
    del sender, receiver
    stats = kvpack.delta(full, kvpack.read_manifest(old).blob_names(), work / "delta")
    applied = kvpack.apply(work / "delta", [old], work / "applied")
    same = all((applied.path / "blobs" / f"{n}.safetensors").read_bytes() ==
               (full / "blobs" / f"{n}.safetensors").read_bytes() for n in applied.blob_names())
    return {"held": held, "total": total, "payload_full": stats["payload_bytes_full"],
            "payload_shipped": stats["payload_bytes_shipped"],
            "share": stats["payload_bytes_shipped"] / stats["payload_bytes_full"],
            "disk_full": _disk_bytes(full), "disk_shipped": _disk_bytes(work / "delta"),
            "blobs_shipped": stats["blobs_shipped"], "blobs_in_pack": stats["blobs_in_pack"],
            "applied_equals_full": same, "save_seconds_both": save_s}


def deep_cell(g: Geometry, depth: int, work: Path) -> dict:
    """The sender holds `depth` tokens and ships all but the last (the receiver decodes it)."""
    ids = _tokens(depth, g, 3)
    sender = SlotCache(g, g.context_length)
    sender.fill_random(depth - 1, seed=3)
    t = time.perf_counter()
    pack = kvpack.save(sender, ids[:-1], SYNTHETIC_MODEL, work / "deep")
    save_s = time.perf_counter() - t
    m = kvpack.read_manifest(pack).manifest
    t = time.perf_counter()
    receiver, tokens = kvpack.restore(pack, g, SYNTHETIC_MODEL["fingerprint"], g.context_length, upload=_upload())
    restore_s = time.perf_counter() - t
    same = tokens == ids[:-1] and receiver.offset == sender.offset and all(
        bool(mx.array_equal(a, b).item()) for la, lb in zip(sender.layers, receiver.layers)
        for a, b in zip(la.held_rows(), lb.held_rows()))
    return {"depth": depth, "rows_shipped": m["offset"], "payload": kvpack.payload_bytes(m),
            "disk": _disk_bytes(pack), "save_seconds": save_s,
            "payload_bytes_per_second_saved": kvpack.payload_bytes(m) / save_s,
            "restore_seconds": restore_s, "receiver_rows_equal_sender": bool(same)}


def _upload():
    """The page-locked staging on CUDA (as a model's ops backend would pass), else mx.load's way."""
    from ..kernels import gpu_backend

    if gpu_backend() != "cuda":
        return None
    from ..kernels.upload import pinned_upload
    return pinned_upload()


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.handoff", description=__doc__.splitlines()[0])
    p.add_argument("--receipt", help="write a receipt JSON here")
    p.add_argument("--workdir", help="where the packs go (default: a temporary folder, removed after)")
    args = p.parse_args(argv)
    from .receipts import check_output, make_receipt, write_receipt

    if args.receipt:
        check_output(args.receipt, "--receipt", suffix=".json")
    g = PINNED
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="muse-handoff-"))
    try:
        cell = delta_cell(g, 32_768, 65_536, work / "delta-cell")
        print(f"delta handoff, {cell['held']:,} of {cell['total']:,} tokens held: shipped {cell['payload_shipped']:,} "
              f"of {cell['payload_full']:,} B = {cell['share']:.4%} (book: 54.2851 %); on disk "
              f"{cell['disk_shipped']:,} of {cell['disk_full']:,} B; applied = full: {cell['applied_equals_full']}")
        shutil.rmtree(work / "delta-cell", ignore_errors=True)
        mx.clear_cache()
        deep = deep_cell(g, BOOK_HANDOFF_DEPTH, work / "deep-cell")
        print(f"deep handoff at {deep['depth']:,} tokens: {deep['rows_shipped']:,} positions, payload "
              f"{deep['payload']:,} B (book: 1,823,184,896 B); on disk {deep['disk']:,} B; saved in "
              f"{deep['save_seconds']:.1f} s, restored by the receiver in {deep['restore_seconds']:.2f} s, its rows "
              f"the sender's: {deep['receiver_rows_equal_sender']}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.receipt:
        r = make_receipt("research/handoff", inputs={"geometry": "pinned", "rows": "random f16 (synthetic)"},
                         metrics={"delta_cell": cell, "deep_cell": deep,
                                  "book": {"delta_share": 0.542851, "deep_payload": 1_823_184_896}},
                         synthetic=True, verdict="agrees" if round(cell["share"], 6) == 0.542851
                         and deep["payload"] == 1_823_184_896 and deep["receiver_rows_equal_sender"] else "disagrees")
        print(f"receipt: {write_receipt(args.receipt, r)}")
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
