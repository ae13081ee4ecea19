"""The KV cache of one slot: an f16 ring per sliding layer, an f16 plane per full layer.

Both hold K and V in one (2, n_kv_heads, rows, head_dim) float16 array (K, then V), allocated
once at its capacity (DESIGN.md §3, seed 000 ch. 22): one array a layer, so a decode step writes a
token's K and V rows with one scatter a sequence (two arrays took two, docs/ledger.md 2026-12-04).

- `SlidingRing`: capacity min(C, W). Position p lives in row p % capacity, so the
  write pointer is `offset % capacity`, the logical origin (oldest position kept)
  is `max(0, offset - capacity)`, and the rotation is fully determined by `offset`:
  restoring `offset` with the rows restores the ring bit for bit. Rows past the
  capacity overwrite the oldest; the ring never grows.
- `GrowingPlane`: capacity C; position p lives in row p; one row per token.

A multi-token write (a prefill chunk) may be longer than the ring. The model
therefore attends over `view()` (the rows *before* the chunk) concatenated with the
chunk's own K|V, and only then calls `append`, which keeps the last `capacity`
rows of the chunk. This is the case mlx-lm's rotating cache got wrong
(ml-explore/mlx-lm #1914): writing first would overwrite rows that earlier
queries of the same chunk still need.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from .errors import ContextLimitError
from .geometry import Geometry

# The contract's KV type (DESIGN.md §3). float32 exists only for the parity
# harness's exactness lane, which compares against llama.cpp run with F32 KV.
KV_DTYPE = mx.float16


class _Rows:
    """The K|V storage shared by both layer kinds: `kv` (2, n_kv, capacity, head_dim), K then V."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, dtype=KV_DTYPE):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.dtype = dtype
        self.kv = mx.zeros((2, n_kv, capacity, head_dim), dtype=dtype)
        self.offset = 0  # tokens written so far == the next absolute position

    @property
    def keys(self) -> mx.array:
        """K (n_kv, capacity, head_dim): a view of `kv` (held past a step, it costs the step's
        in-place write a copy of the storage)."""
        return self.kv[0]

    @property
    def values(self) -> mx.array:
        return self.kv[1]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def _write(self, row: int, kv: mx.array) -> None:
        n = kv.shape[2]
        self.kv[:, :, row:row + n, :] = kv

    def state(self) -> list[mx.array]:
        return [self.kv]

    @property
    def held(self) -> int:
        """Rows that hold positions: physical rows 0..held-1."""
        return min(self.offset, self.capacity)

    def held_rows(self) -> tuple[mx.array, mx.array]:
        """K and V of the held rows, as stored (a ring's in physical order)."""
        return self.kv[0, :, :self.held, :], self.kv[1, :, :self.held, :]

    def restore_rows(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Take `keys`, `values` (n_kv, rows, head_dim) as the held rows of a storage whose next
        position is `offset` (kvpack's restore): they must be exactly the rows `offset` implies."""
        held = min(offset, self.capacity)
        want = (self.kv.shape[1], held, self.kv.shape[3])
        if keys.shape != want or values.shape != want or keys.dtype != self.dtype or values.dtype != self.dtype:
            raise ValueError(f"restore needs K and V of shape {want} and dtype {self.dtype}, got "
                             f"{keys.shape} {keys.dtype} / {values.shape} {values.dtype}")
        if held:
            self.kv[:, :, :held, :] = mx.stack([keys, values])
        self.offset = offset

    def restore_storage(self, kv: mx.array, offset: int) -> None:
        """Take `kv` (2, n_kv, capacity, head_dim) f16, the whole storage with the held rows `offset`
        implies first (kvpack's restore, which puts them together), next position `offset`."""
        want = self.kv.shape
        if kv.shape != want or kv.dtype != mx.float16 or self.dtype != mx.float16:
            raise ValueError(f"restore needs f16 K|V storage of shape {want}, got {kv.shape} {kv.dtype}")
        self.kv = kv
        self.offset = offset

    def rebind(self, kv: mx.array, n_new: int) -> None:
        """Take `kv` (this storage with the rows of the next n_new positions already written: a
        compiled step's output) as the storage, n_new tokens on."""
        if kv.shape != self.kv.shape:
            raise ValueError(f"rebind needs storage of shape {self.kv.shape}, got {kv.shape}")
        self.kv = kv
        self.offset += n_new


class SlidingRing(_Rows):
    """A sliding-window layer's ring of min(C, W) rows."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, window: int, dtype=KV_DTYPE):
        super().__init__(n_kv, head_dim, capacity, dtype)
        self.window = window

    @property
    def write_pointer(self) -> int:
        return self.offset % self.capacity

    @property
    def origin(self) -> int:
        """Absolute position of the oldest row still held."""
        return max(0, self.offset - self.capacity)

    def row_positions(self) -> np.ndarray:
        """Absolute position held by each physical row of `view()`."""
        n = min(self.offset, self.capacity)
        r = np.arange(n, dtype=np.int64)
        return r + self.capacity * ((self.offset - 1 - r) // self.capacity)

    def view(self) -> tuple[mx.array, np.ndarray]:
        """K|V of the held rows (2, n_kv, rows, hd) and the absolute position of each."""
        return self.kv[:, :, :min(self.offset, self.capacity), :], self.row_positions()

    def append(self, kv: mx.array) -> None:
        """Write K|V (2, n_kv, L, hd) of positions offset..offset+L-1; only the last `capacity`
        of them are kept."""
        n_new = kv.shape[2]
        keep = min(n_new, self.capacity)
        kv = kv[:, :, n_new - keep:, :]
        first = (self.offset + n_new - keep) % self.capacity
        head = min(keep, self.capacity - first)
        self._write(first, kv[:, :, :head])
        if keep > head:  # the chunk wraps past the end of the ring
            self._write(0, kv[:, :, head:])
        self.offset += n_new


class GrowingPlane(_Rows):
    """A full-attention (NoPE) layer's plane: one row per token up to capacity C."""

    def row_positions(self) -> np.ndarray:
        return np.arange(self.offset, dtype=np.int64)

    def view(self) -> tuple[mx.array, np.ndarray]:
        return self.kv[:, :, :self.offset, :], self.row_positions()

    def append(self, kv: mx.array) -> None:
        n_new = kv.shape[2]
        if self.offset + n_new > self.capacity:
            raise ContextLimitError(
                f"context full: {self.offset} + {n_new} tokens exceed the slot's {self.capacity} positions")
        self._write(self.offset, kv)
        self.offset += n_new


def memory_capacity_bytes() -> int | None:
    """What this machine can give MLX: the GPU's recommended working set or memory, else the
    physical RAM (the CPU backend); None when neither can be read."""
    if mx.metal.is_available() or mx.cuda.is_available():
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
            if key in info:
                return int(info[key])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def check_fits(nbytes: int, what: str) -> None:
    """Refuse, before allocating, `nbytes` more than the machine has left beside what MLX holds."""
    capacity = memory_capacity_bytes()
    if capacity is None:
        return
    in_use = mx.get_active_memory()
    if nbytes > capacity - in_use:
        raise ContextLimitError(f"{what} needs {nbytes:,} bytes; this machine has {max(0, capacity - in_use):,} "
                                f"available ({capacity:,} in all, {in_use:,} in use)")


class SlotCache:
    """All layers' KV for one sequence (one slot), sized for `context` positions; refused before
    allocating when the machine cannot hold it (check_fits)."""

    def __init__(self, geometry: Geometry, context: int, dtype=KV_DTYPE):
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        self.geometry = geometry
        self.context = context
        self.dtype = dtype
        g = geometry
        row = 2 * g.n_head_kv * g.head_dim * dtype.size   # K and V of one position
        nbytes = sum(g.ring_rows(context) if g.is_swa(il) else context for il in range(g.n_layer)) * row
        check_fits(nbytes, f"the KV cache for {context:,} positions")
        self.layers: list[SlidingRing | GrowingPlane] = [
            SlidingRing(g.n_head_kv, g.head_dim, g.ring_rows(context), g.sliding_window, dtype)
            if g.is_swa(il) else GrowingPlane(g.n_head_kv, g.head_dim, context, dtype)
            for il in range(g.n_layer)
        ]
        # each layer's (is a ring, capacity): the decode step groups layers by it
        self.layer_kinds = tuple((isinstance(layer, SlidingRing), layer.capacity) for layer in self.layers)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def room(self) -> int:
        return self.context - self.offset

    def check_room(self, n_tokens: int) -> None:
        if n_tokens > self.room:
            raise ContextLimitError(
                f"{n_tokens} more tokens do not fit: {self.offset} of {self.context} positions are used")

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V; with f16 KV this is Geometry.slot_kv_bytes(context)."""
        return sum(layer.nbytes for layer in self.layers)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"sliding": 0, "full": 0}
        for layer in self.layers:
            out["sliding" if isinstance(layer, SlidingRing) else "full"] += layer.nbytes
        return out

    def state(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.state()]

    def reset(self) -> None:
        """Empty: no position held (the storage is kept; rows past the offset are never read)."""
        for layer in self.layers:
            layer.offset = 0

    def copy_from(self, other: "SlotCache") -> None:
        """Hold what `other` holds: each layer's held rows copied into this cache's own storage
        (lazily; `other` may go on writing its own), at its offset. The two must have one shape."""
        if [(type(a), a.kv.shape) for a in self.layers] != [(type(b), b.kv.shape) for b in other.layers]:
            raise ValueError("copy_from needs a cache of the same geometry and context")
        for mine, theirs in zip(self.layers, other.layers):
            mine.restore_rows(*theirs.held_rows(), theirs.offset)

    def fill_random(self, depth: int, seed: int = 0) -> None:
        """Synthetic content for benchmarks: every layer's storage random f16 rows (timing depends on
        the sizes, not the values), `depth` positions as if held. Not a cache of any token sequence."""
        if not 0 <= depth <= self.context:
            raise ContextLimitError(f"depth {depth} is outside the slot's 0..{self.context} positions")
        key = mx.random.key(seed)
        for layer in self.layers:
            key, k1, k2 = mx.random.split(key, 3)
            shape = layer.kv.shape[1:]
            layer.kv = mx.stack([0.5 * mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)]).astype(
                layer.dtype)
            layer.offset = depth
        mx.eval(self.state())

    def rebind(self, state: list[mx.array], n_new: int) -> None:
        """Take `state` (as state() lists it, n_new more positions written) as every layer's storage."""
        if len(state) != len(self.layers):
            raise ValueError(f"rebind needs {len(self.layers)} arrays, got {len(state)}")
        for layer, kv in zip(self.layers, state):
            layer.rebind(kv, n_new)
