"""A prompt cache: warm prefix reuse through kvpack (docs/kvpack.md, "Prompt cache").

A folder of packs (`entries/<id>/`) whose blobs are hard links into one store (`blobs/`), so
packs that share a prefix share its plane chunks on disk. A prompt restores the deepest
entry whose tokens are a proper prefix of it and prefills only the rest.

Rings cannot be rewound once wrapped, so an entry is a *checkpoint*: the slot's state after
exactly its tokens. Checkpoints are written at every `every` positions of a prompt and at its
end, always at a multiple of the prefill chunk: `Model.prefill` ends its chunks at multiples of
the chunk in absolute positions, so prefilling from a checkpoint computes exactly the chunks a
cold run computes, and the warm output is the cold output, bit for bit. A checkpoint costs its
rings (at the pinned geometry 39 x 2,048 rows x 1,024 B = 81.8 MB) and the plane chunks no
earlier checkpoint holds. The folder is kept under a byte budget, least recently used first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from . import kvpack
from .geometry import PREFILL_CHUNK, Geometry
from .kvpack import PackError


class PromptCache:
    def __init__(self, root, model_id: dict, geometry: Geometry, budget_bytes: int = 16 * 2**30,
                 every: int = 8 * PREFILL_CHUNK, chunk: int = PREFILL_CHUNK, warn=None):
        if every % chunk:
            raise ValueError(f"checkpoints every {every} positions must fall on multiples of the chunk {chunk}")
        self.root, self.model_id, self.geometry = Path(root), dict(model_id), geometry
        self.budget, self.every, self.chunk = budget_bytes, every, chunk
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "blobs").mkdir(exist_ok=True)
        except OSError as exc:
            raise PackError(f"--prompt-cache {self.root}: cannot use it as a folder ({exc.strerror})") from None

    # ---- lookup ----

    def _entries(self) -> list[Path]:
        return [p for p in (self.root / "entries").iterdir() if (p / "manifest.json").exists()]

    def lookup(self, prompt: list[int], context: int):
        """(cache, tokens reused, seconds) from the deepest usable checkpoint, or (None, 0, 0.0).
        A corrupt entry is dropped with a warning and the next is tried."""
        candidates = []
        for entry in self._entries():
            try:
                pack = kvpack.read_manifest(entry)
            except PackError as exc:
                self.warn(f"prompt cache: dropping a corrupt entry ({exc})")
                shutil.rmtree(entry, ignore_errors=True)
                continue
            m = pack.manifest
            n = m["offset"]
            if (m["model"]["fingerprint"] == self.model_id["fingerprint"] and 0 < n < len(prompt)
                    and m["tokens"] == prompt[:n]):
                candidates.append((n, entry))
        for n, entry in sorted(candidates, reverse=True):
            t = time.perf_counter()
            try:
                cache, _ = kvpack.restore(entry, self.geometry, self.model_id["fingerprint"], context)
            except PackError as exc:
                self.warn(f"prompt cache: dropping a corrupt entry ({exc})")
                shutil.rmtree(entry, ignore_errors=True)
                continue
            os.utime(entry / "manifest.json")   # most recently used
            return cache, n, time.perf_counter() - t
        return None, 0, 0.0

    # ---- prefill with checkpoints ----

    def checkpoints(self, start: int, n_prompt: int) -> list[int]:
        """Positions after `start` where the prompt's state is saved: every `every`, and the last
        multiple of the chunk before the prompt's last token."""
        end = (n_prompt - 1) // self.chunk * self.chunk
        points = list(range((start // self.every + 1) * self.every, end + 1, self.every))
        if end > start and end not in points:
            points.append(end)
        return points

    def prefill(self, model, prompt: list[int], cache, start: int):
        """Prefill prompt[start:] into `cache` (holding prompt[:start]), saving checkpoints on the
        way; the logits of the prompt's last token."""
        known: dict = {}
        at = start
        for point in self.checkpoints(start, len(prompt)):
            model.prefill(prompt[at:point], cache, self.chunk)
            at = point
            known = self.store(cache, prompt[:point], known)
        return model.prefill(prompt[at:], cache, self.chunk)

    # ---- store and evict ----

    def _entry_id(self, tokens: list[int]) -> str:
        h = hashlib.sha256(self.model_id["fingerprint"].encode() + json.dumps(tokens).encode())
        return h.hexdigest()[:32]

    def store(self, cache, tokens: list[int], known: dict) -> dict:
        """Save the cache (holding exactly `tokens`) as an entry; its blobs become links into the
        store. Returns the plane chunks now known, for the next checkpoint of this cache."""
        entry = self.root / "entries" / self._entry_id(tokens)
        if (entry / "manifest.json").exists():
            return known
        shutil.rmtree(entry, ignore_errors=True)
        (entry / "blobs").mkdir(parents=True)
        store = self.root / "blobs"
        for name, _ in known.values():
            if (store / f"{name}.safetensors").exists():
                os.link(store / f"{name}.safetensors", entry / "blobs" / f"{name}.safetensors")
        kvpack.save(cache, tokens, self.model_id, entry, known_chunks=known)
        for blob in (entry / "blobs").iterdir():
            shared = store / blob.name
            if shared.exists():
                if not os.path.samefile(shared, blob):
                    blob.unlink()
                    os.link(shared, blob)
            else:
                os.link(blob, shared)
        m = kvpack.read_manifest(entry).manifest
        self.evict(keep=entry)
        return {(c["first"], c["rows"]): (c["blob"], c["bytes"]) for c in m["plane_chunks"]}

    def bytes_held(self) -> int:
        files = list((self.root / "blobs").iterdir()) + [e / "manifest.json" for e in self._entries()]
        return sum(f.stat().st_size for f in files if f.exists())

    def evict(self, keep: Path | None = None) -> None:
        """Remove least recently used entries (not `keep`) until the store fits the budget, then
        the blobs no entry links to."""
        entries = sorted(self._entries(), key=lambda e: (e / "manifest.json").stat().st_mtime_ns)
        while self.bytes_held() > self.budget and entries:
            victim = entries.pop(0)
            if keep is not None and victim == keep:
                continue
            shutil.rmtree(victim, ignore_errors=True)
            self.prune()
        self.prune()

    def prune(self) -> None:
        for blob in (self.root / "blobs").iterdir():
            if blob.stat().st_nlink <= 1:
                blob.unlink()
