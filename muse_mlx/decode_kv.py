"""One decode token's access to the slot's K/V on the kernel path (Attention.decode_one).

A token writes its K/V row into each layer's storage, then attends over the rows now visible
(kernels.decode_attention). Two ways to do that behind one interface (`write`, `attend`):

- `EagerRows`: into the slot's cache as the token is built: a Python row per layer
  (kv.py `append`, in place), the attention's split count from the rows visible now.
- `TracedRows`: inside a compiled step (MUSE_MLX_COMPILE=1, Model._compiled_layers), where
  every Python number is fixed at trace time. A row is written with `mx.put_along_axis` at a
  row index given as an array (MLX's scatter: on its CUDA backend a slice update at an array
  row launches a thread per element of the whole storage, 31 us a write at depth 32,768,
  against a thread per element written here); the rows visible are an array too
  (kernels.attention_params); only
  the split count is a trace constant, rounded up (kernels.attention_splits) so that one trace
  serves many tokens. The layers whose storage has one kind and capacity (the rings; the
  planes) form a group sharing one row index and one parameter array: `step_plan` makes them
  on the host, once a token.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import kernels
from .kv import SlidingRing, SlotCache


def attention_chunk(layer) -> int:
    """Rows per attention split for a layer's storage (kernels.attention_chunks: ring, plane)."""
    return kernels.settings().attn_chunks[0 if isinstance(layer, SlidingRing) else 1]


class EagerRows:
    """The token's K/V written into the slot's cache at once, a Python row per layer."""

    def __init__(self, cache: SlotCache):
        self.layers = cache.layers
        self.params: dict = {}   # (chunk, n_valid) -> attention_params, shared by the layers of a kind

    def write(self, i: int, k16: mx.array, v16: mx.array) -> None:
        self.layers[i].append(k16, v16)

    def attend(self, i: int, q: mx.array, **kw) -> mx.array:
        layer = self.layers[i]
        n_valid, chunk = min(layer.offset, layer.capacity), attention_chunk(layer)
        if (chunk, n_valid) not in self.params:
            self.params[(chunk, n_valid)] = kernels.attention_params(n_valid, chunk)
        return kernels.decode_attention(q, layer.keys, layer.values, n_valid, chunk,
                                        params=self.params[(chunk, n_valid)], **kw)


class StepPlan(NamedTuple):
    """What a compiled step needs from the host for one token.

    groups: the group of each layer; chunks, splits: per group, the attention's rows per split
    and split count (trace constants); arrays: per group, the row to write (int32, shaped
    (n_kv, 1, head_dim) like a row of K: put_along_axis's indices) then the attention
    parameters (int32[8])."""
    groups: tuple[int, ...]
    chunks: tuple[int, ...]
    splits: tuple[int, ...]
    arrays: list[mx.array]

    @property
    def trace_key(self) -> tuple:
        return self.groups, self.chunks, self.splits


def step_plan(cache: SlotCache) -> StepPlan:
    """The next token's StepPlan: each group's write row, rows then visible and split count."""
    keys: dict[tuple, int] = {}
    groups, chunks, splits, arrays = [], [], [], []
    for layer in cache.layers:
        key = (type(layer), layer.capacity)   # every layer is at the slot's offset
        if key not in keys:
            keys[key] = len(chunks)
            n_valid, chunk = min(layer.offset + 1, layer.capacity), attention_chunk(layer)
            nsplit = kernels.attention_splits(n_valid, chunk, layer.capacity)
            chunks.append(chunk)
            splits.append(nsplit)
            n_kv, _, head_dim = layer.keys.shape
            rows = mx.array(np.full((n_kv, 1, head_dim), layer.next_row, dtype=np.int32))
            arrays += [rows, kernels.attention_params(n_valid, chunk, nsplit)]
        groups.append(keys[key])
    return StepPlan(tuple(groups), tuple(chunks), tuple(splits), arrays)


class TracedRows:
    """The token's K/V as arrays in and out of a compiled step: `state` (SlotCache.state order)
    in, `state` with the rows written out; `arrays` are StepPlan.arrays as the trace sees them."""

    def __init__(self, plan_key: tuple, arrays: list[mx.array], state: list[mx.array]):
        self.groups, self.chunks, self.splits = plan_key
        self.rows, self.params = arrays[0::2], arrays[1::2]
        self.state = list(state)

    def write(self, i: int, k16: mx.array, v16: mx.array) -> None:
        row = self.rows[self.groups[i]]
        self.state[2 * i] = mx.put_along_axis(self.state[2 * i], row, k16, axis=1)
        self.state[2 * i + 1] = mx.put_along_axis(self.state[2 * i + 1], row, v16, axis=1)

    def attend(self, i: int, q: mx.array, **kw) -> mx.array:
        gi = self.groups[i]
        return kernels.decode_attention(q, self.state[2 * i], self.state[2 * i + 1], None, self.chunks[gi],
                                        params=self.params[gi], splits=self.splits[gi], **kw)
