"""The KV cache of one slot: an f16 ring per sliding layer, an f16 plane per full layer.

Both hold K and V in one (2, n_kv_heads, rows, head_dim) float16 array (K, then V), allocated
once at its capacity (DESIGN.md §3, seed 000 ch. 22). The arrays live in a `KVPool`: one array a
layer for all the slots of a server, (2, n_kv, n_slots * capacity, head_dim), slot s's rows at
s * capacity.. , so a decode step over the slots writes a token's K and V rows of every slot with
one scatter a layer (one array a slot took one a slot; two arrays, K and V, took two;
docs/ledger.md 2026-12-04). A cache made alone is the one slot of its own pool: its array is
exactly its storage.

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


class KVPool:
    """The K|V arrays of `n_slots` caches of one geometry and context: `arrays[i]` is layer i's
    (2, n_kv, n_slots * capacity_i, head_dim), slot s's rows at s * capacity_i."""

    def __init__(self, shapes: list[tuple[int, int, int]], n_slots: int, dtype=KV_DTYPE):
        """shapes: each layer's (n_kv, capacity, head_dim)."""
        if n_slots < 1:
            raise ValueError(f"a pool holds at least one slot, got {n_slots}")
        if any(capacity <= 0 for _, capacity, _ in shapes):
            raise ValueError(f"capacities must be positive, got {[c for _, c, _ in shapes]}")
        self.n_slots, self.dtype = n_slots, dtype
        self.arrays = [mx.zeros((2, n_kv, n_slots * capacity, hd), dtype=dtype) for n_kv, capacity, hd in shapes]


class _Rows:
    """The K|V storage shared by both layer kinds: `kv` (2, n_kv, capacity, head_dim), K then V:
    layer `index`'s rows of slot `slot` in `pool` (a pool of its own, made here, when none is given)."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, dtype=KV_DTYPE, pool: KVPool | None = None,
                 index: int = 0, slot: int = 0):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.dtype = dtype
        self.pool = pool if pool is not None else KVPool([(n_kv, capacity, head_dim)], 1, dtype)
        self.index, self.slot = index, slot
        self.base = slot * capacity   # this slot's first row in the pool's array
        self.offset = 0  # tokens written so far == the next absolute position

    @property
    def kv(self) -> mx.array:
        """This slot's storage (2, n_kv, capacity, head_dim): the pool's array itself when the pool
        has one slot, else a view of its rows (held past a step, either costs the step's in-place
        write a copy of the array)."""
        a = self.pool.arrays[self.index]
        return a if self.pool.n_slots == 1 else a[:, :, self.base:self.base + self.capacity, :]

    @kv.setter
    def kv(self, value: mx.array) -> None:
        if self.pool.n_slots == 1:
            self.pool.arrays[self.index] = value
        else:
            self._write(0, value)

    @property
    def keys(self) -> mx.array:
        """K (n_kv, capacity, head_dim): a view of `kv`."""
        return self.kv[0]

    @property
    def values(self) -> mx.array:
        return self.kv[1]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def _write(self, row: int, kv: mx.array) -> None:
        n = kv.shape[2]
        self.pool.arrays[self.index][:, :, self.base + row:self.base + row + n, :] = kv

    def state(self) -> list[mx.array]:
        return [self.kv]

    @property
    def held(self) -> int:
        """Rows that hold positions: physical rows 0..held-1."""
        return min(self.offset, self.capacity)

    def held_rows(self) -> tuple[mx.array, mx.array]:
        """K and V of the held rows, as stored (a ring's in physical order)."""
        kv = self.kv
        return kv[0, :, :self.held, :], kv[1, :, :self.held, :]

    def restore_rows(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Take `keys`, `values` (n_kv, rows, head_dim) as the held rows of a storage whose next
        position is `offset` (kvpack's restore): they must be exactly the rows `offset` implies."""
        held = min(offset, self.capacity)
        shape = self.kv.shape
        want = (shape[1], held, shape[3])
        if keys.shape != want or values.shape != want or keys.dtype != self.dtype or values.dtype != self.dtype:
            raise ValueError(f"restore needs K and V of shape {want} and dtype {self.dtype}, got "
                             f"{keys.shape} {keys.dtype} / {values.shape} {values.dtype}")
        if held:
            self._write(0, mx.stack([keys, values]))
        self.offset = offset

    def restore_storage(self, kv: mx.array, offset: int) -> None:
        """Take `kv` (2, n_kv, capacity, head_dim) f16, the whole storage with the held rows `offset`
        implies first (kvpack's restore, which puts them together), next position `offset`."""
        want = self.kv.shape
        if kv.shape != want or kv.dtype != mx.float16 or self.dtype != mx.float16:
            raise ValueError(f"restore needs f16 K|V storage of shape {want}, got {kv.shape} {kv.dtype}")
        self.kv = kv
        self.offset = offset


class SlidingRing(_Rows):
    """A sliding-window layer's ring of min(C, W) rows."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, window: int, dtype=KV_DTYPE, **home):
        super().__init__(n_kv, head_dim, capacity, dtype, **home)
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
        return self.kv[:, :, :self.held, :], self.row_positions()

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


def layer_shapes(geometry: Geometry, context: int) -> list[tuple[int, int, int]]:
    """Each layer's (n_kv, capacity, head_dim) for `context` positions: a ring min(C, W) rows, a plane C."""
    g = geometry
    return [(g.n_head_kv, g.ring_rows(context) if g.is_swa(il) else context, g.head_dim) for il in range(g.n_layer)]


def pool_for(geometry: Geometry, context: int, n_slots: int, dtype=KV_DTYPE) -> KVPool:
    """The arrays of `n_slots` caches of `context` positions; refused before allocating when the
    machine cannot hold them (check_fits)."""
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    shapes = layer_shapes(geometry, context)
    nbytes = n_slots * sum(2 * n_kv * capacity * hd for n_kv, capacity, hd in shapes) * dtype.size
    what = f"the KV cache for {context:,} positions" + (f" in each of {n_slots} slots" if n_slots > 1 else "")
    check_fits(nbytes, what)
    return KVPool(shapes, n_slots, dtype)


def slot_caches(geometry: Geometry, context: int, n_slots: int, dtype=KV_DTYPE) -> list["SlotCache"]:
    """`n_slots` caches of `context` positions in one pool (a server's slots)."""
    pool = pool_for(geometry, context, n_slots, dtype)
    return [SlotCache(geometry, context, dtype, pool=pool, slot=s) for s in range(n_slots)]


class SlotCache:
    """All layers' KV for one sequence (one slot), sized for `context` positions: slot `slot` of
    `pool` (slot_caches), or alone in a pool of its own, refused before allocating when the
    machine cannot hold it (check_fits)."""

    def __init__(self, geometry: Geometry, context: int, dtype=KV_DTYPE, pool: KVPool | None = None, slot: int = 0):
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        self.geometry = geometry
        self.context = context
        self.dtype = dtype
        g = geometry
        self.pool = pool if pool is not None else pool_for(geometry, context, 1, dtype)
        if not 0 <= slot < self.pool.n_slots or len(self.pool.arrays) != g.n_layer:
            raise ValueError(f"slot {slot} is not one of the pool's {self.pool.n_slots} slots of {g.n_layer} layers")
        self.slot = slot
        self.layers: list[SlidingRing | GrowingPlane] = [
            SlidingRing(g.n_head_kv, g.head_dim, g.ring_rows(context), g.sliding_window, dtype, pool=self.pool,
                        index=il, slot=slot)
            if g.is_swa(il) else GrowingPlane(g.n_head_kv, g.head_dim, context, dtype, pool=self.pool, index=il,
                                              slot=slot)
            for il in range(g.n_layer)
        ]
        # each layer's (is a ring, capacity, slots of its pool): the decode step groups layers by it
        self.layer_kinds = tuple((isinstance(layer, SlidingRing), layer.capacity, self.pool.n_slots)
                                 for layer in self.layers)

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

    def take(self, other: "SlotCache") -> None:
        """Hold what `other` (a cache of the same geometry, context and dtype: kvpack's restore, a
        prompt-cache hit) holds: its storage copied into this cache's rows, its offset."""
        if [k[:2] for k in other.layer_kinds] != [k[:2] for k in self.layer_kinds] or other.dtype != self.dtype:
            raise ValueError("take needs a cache of the same geometry, context and dtype")
        for layer, theirs in zip(self.layers, other.layers):
            layer.kv, layer.offset = theirs.kv, theirs.offset

    def advance(self, n_new: int) -> None:
        """n_new more positions written into the storage (by a compiled step, whose outputs the pool took)."""
        for layer in self.layers:
            layer.offset += n_new
