"""A prompt cache: warm prefix reuse through kvpack (docs/kvpack.md, "Prompt cache").

A folder of packs (`entries/<id>/`) whose blobs are hard links into one store (`blobs/`), so
packs that share a prefix share its plane chunks on disk. A prompt restores the deepest
entry whose tokens are a proper prefix of it and prefills only the rest.

Rings cannot be rewound once wrapped, so an entry is a *checkpoint*: the slot's state after
exactly its tokens. Checkpoints are written at every `every` positions of a prompt and at the
last multiple of the prefill chunk before its last token: `Model.prefill` ends its chunks at
multiples of the chunk in absolute positions, so prefilling from such a checkpoint computes
exactly the chunks a cold run computes, and the warm output is the cold output, bit for bit.
The prompt's exact end is stored too, with the logits of its last token (`last_logits`): the
same prompt again restores it and samples its first token from those logits, with no prefill at
all (the same bits: they are the logits the first run sampled from). An end that is not on a
chunk multiple is used only for that prompt exactly, never as a prefix of a longer one. A checkpoint costs its
rings (at the pinned geometry 39 x 2,048 rows x 1,024 B = 81.8 MB) and the plane chunks no
earlier checkpoint holds. The folder is kept under a byte budget, least recently used first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import kvpack
from .geometry import PREFILL_CHUNK, Geometry
from .kvpack import PackError


class Hit(NamedTuple):
    """What a lookup found: the restored cache (None: nothing usable), the prompt tokens it holds,
    the restore's seconds, and, for the prompt's exact end, the logits of its last token."""
    cache: object
    reused: int
    seconds: float
    logits: np.ndarray | None = None


class PromptCache:
    def __init__(self, root, model_id: dict, geometry: Geometry, budget_bytes: int = 16 * 2**30,
                 every: int = 8 * PREFILL_CHUNK, chunk: int = PREFILL_CHUNK, warn=None, upload=None):
        """upload: how a restore's rows reach the device (kvpack.restore's; the ops backend's)."""
        if every % chunk:
            raise ValueError(f"checkpoints every {every} positions must fall on multiples of the chunk {chunk}")
        self.root, self.model_id, self.geometry = Path(root), dict(model_id), geometry
        self.budget, self.every, self.chunk, self.upload = budget_bytes, every, chunk, upload
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "blobs").mkdir(exist_ok=True)
        except OSError as exc:
            raise PackError(f"--prompt-cache {self.root}: cannot use it as a folder ({exc.strerror})") from None

    # ---- lookup ----

    def _entries(self) -> list[Path]:
        return [p for p in (self.root / "entries").iterdir() if (p / "manifest.json").exists()]

    def _prefix_ids(self, tokens: list[int], ends: list[int]) -> dict[int, str]:
        """The entry id of tokens[:n] for each n of `ends` (ascending), in one pass over the tokens:
        SHA-256 of the model's fingerprint then the ids as 4-byte integers, copied at each end."""
        h = hashlib.sha256(self.model_id["fingerprint"].encode())
        ids, at = {}, 0
        data = np.asarray(tokens, dtype="<u4")
        for n in ends:
            h.update(data[at:n].tobytes())
            ids[n], at = h.copy().hexdigest()[:32], n
        return ids

    def _entry_id(self, tokens: list[int]) -> str:
        return self._prefix_ids(tokens, [len(tokens)])[len(tokens)]

    def lookup(self, prompt: list[int], context: int) -> Hit:
        """The prompt's exact end with its logits if stored, else the deepest checkpoint on a chunk
        multiple that is a proper prefix of it, restored; Hit(None, 0, 0.0) when none is. Entries
        are found by the ids of the prompt's prefixes (no other entry's manifest is read). A
        corrupt entry is dropped with a warning and the next is tried."""
        if not prompt:
            return Hit(None, 0, 0.0)
        ends = list(range(self.chunk, len(prompt), self.chunk)) + [len(prompt)]
        ids = self._prefix_ids(prompt, ends)
        for n in reversed(ends):     # the exact end first, then the deepest checkpoint
            entry = self.root / "entries" / ids[n]
            t = time.perf_counter()
            try:
                if not (entry / "manifest.json").exists():
                    continue
                pack = kvpack.read_manifest(entry)
                m = pack.manifest
                exact = n == len(prompt)
                if (m["model"]["fingerprint"] != self.model_id["fingerprint"] or m["offset"] != n
                        or m["tokens"] != prompt[:n] or (exact and "last_logits" not in m)):
                    continue
                logits = kvpack.read_last_logits(pack) if exact else None
                cache, _ = kvpack.restore(pack, self.geometry, self.model_id["fingerprint"], context,
                                          upload=self.upload)
            except PackError as exc:
                self.warn(f"prompt cache: dropping a corrupt entry ({exc})")
                shutil.rmtree(entry, ignore_errors=True)
                continue
            except OSError as exc:   # the folder unreadable or gone: the prompt is computed
                self.warn(f"prompt cache: cannot read {entry} ({exc.strerror or exc}); computing the prompt")
                return Hit(None, 0, 0.0)
            try:
                os.utime(entry / "manifest.json")   # most recently used
            except OSError:
                pass
            return Hit(cache, n, time.perf_counter() - t, logits)
        return Hit(None, 0, 0.0)

    # ---- prefill with checkpoints ----

    def checkpoints(self, start: int, n_prompt: int) -> list[int]:
        """Positions after `start` where the prompt's state is saved: every `every`, and the last
        multiple of the chunk before the prompt's last token."""
        end = (n_prompt - 1) // self.chunk * self.chunk
        points = list(range((start // self.every + 1) * self.every, end + 1, self.every))
        if end > start and end not in points:
            points.append(end)
        return points

    def prefill(self, model, prompt: list[int], cache, start: int, progress=None):
        """Prefill prompt[start:] into `cache` (holding prompt[:start]), saving checkpoints on the
        way and the prompt's end with its last logits; the logits of the prompt's last token.
        progress: called with (tokens done after start, tokens to do)."""
        known: dict = {}
        at = start

        def piece(a: int, b: int):
            report = None if progress is None else (lambda d, n: progress(a - start + d, len(prompt) - start))
            return model.prefill(prompt[a:b], cache, self.chunk, progress=report)
        for point in self.checkpoints(start, len(prompt)):
            piece(at, point)
            at = point
            known = self.store(cache, prompt[:point], known)
        logits = piece(at, len(prompt))
        self.store_end(cache, prompt, logits, known)
        return logits

    def store_end(self, cache, prompt: list[int], logits, known: dict | None = None) -> None:
        """Store the cache holding exactly `prompt` with `logits`, those of its last token."""
        self.store(cache, prompt, known or {}, last_logits=np.array(logits.astype(mx.float32)))

    # ---- store and evict ----

    def store(self, cache, tokens: list[int], known: dict, last_logits=None) -> dict:
        """Save the cache (holding exactly `tokens`) as an entry; its blobs become links into the
        store. Returns the plane chunks now known, for the next checkpoint of this cache. A store
        the disk refuses (full, read-only, the folder gone) is warned about and left out, its
        partial entry removed: the prompt cache is an optimisation, never a reason a request fails."""
        entry = self.root / "entries" / self._entry_id(tokens)
        try:
            return self._store(entry, cache, tokens, known, last_logits)
        except OSError as exc:
            self.warn(f"prompt cache: could not store {len(tokens)} tokens' entry ({exc.strerror or exc}); "
                      f"going on without it")
            shutil.rmtree(entry, ignore_errors=True)
            return {}

    def _store(self, entry: Path, cache, tokens: list[int], known: dict, last_logits) -> dict:
        if (entry / "manifest.json").exists():
            try:
                has_logits = "last_logits" in kvpack.read_manifest(entry).manifest
            except PackError:
                has_logits = False   # corrupt: written again below
            else:
                if last_logits is None or has_logits:
                    return known
        shutil.rmtree(entry, ignore_errors=True)
        (entry / "blobs").mkdir(parents=True)
        store = self.root / "blobs"
        for name, _ in known.values():
            if (store / f"{name}.safetensors").exists():
                os.link(store / f"{name}.safetensors", entry / "blobs" / f"{name}.safetensors")
        kvpack.save(cache, tokens, self.model_id, entry, known_chunks=known, last_logits=last_logits)
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
