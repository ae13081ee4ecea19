"""The forward's steps as MLX ops, in float32, over weights dequantized once at load.

This is the exactness path (held to the float64 oracle in tests/reference.py) and the only
path on the CPU. GpuOps (ops/gpu.py) inherits what it does not replace.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..artifact import RawTensor
from ..geometry import Geometry
from ..kv import SlotCache
from ..quant import dequantize
from ..weight_stream import load_raw, nonfinite_flag

# Bound on one attention score block (heads x queries x keys x 4 bytes), so a 512-token chunk
# at depth 131,072 does not need 8.6 GB at once.
SCORE_BLOCK_BYTES = 256 * 2**20


class Slice(NamedTuple):
    """Columns offset..offset+width of a projection's output rows (several projections of one
    input are stacked into one product; the kernels read their parts in place)."""
    array: mx.array   # (rows, stacked width)
    offset: int
    width: int

    def dense(self) -> mx.array:
        if self.offset == 0 and self.width == self.array.shape[-1]:
            return self.array
        return self.array[:, self.offset:self.offset + self.width]


class Matrix(nn.Module):
    """A loaded weight matrix: `data` dense float32 (out, in), or the GGUF's raw rows (out, row_bytes)."""

    def __init__(self, data: mx.array, qtype: QT, raw: bool, n_in: int, n_out: int):
        super().__init__()
        self.data, self.qtype, self.raw, self.n_in, self.n_out = data, qtype, raw, n_in, n_out


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first rope_dim dims (ggml's NORM mode);
    x (rows, heads, head_dim), cos / sin (rows, rope_dim/2)."""
    rows, n_heads, head_dim = x.shape
    rope_dim = 2 * cos.shape[-1]
    pairs = x[..., :rope_dim].reshape(rows, n_heads, rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = mx.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(rows, n_heads, rope_dim)
    if rope_dim == head_dim:
        return rotated
    return mx.concatenate([rotated, x[..., rope_dim:]], axis=-1)


def attention(q: mx.array, keys: mx.array, values: mx.array, q_pos: np.ndarray, k_pos: np.ndarray,
              window: int | None, scale: float) -> mx.array:
    """Causal GQA attention in float32.

    q: (L, n_head, hd); keys/values: (n_kv, N, hd); q_pos (L,), k_pos (N,) absolute
    positions. A key is visible iff k_pos <= q_pos and, with a window W, q_pos - k_pos < W.
    Returns (L, n_head * hd)."""
    L, n_head, hd = q.shape
    n_kv, N, _ = keys.shape
    group = n_head // n_kv
    k = keys.astype(mx.float32)[:, None]          # (n_kv, 1, N, hd)
    v = values.astype(mx.float32)[:, None]
    qh = q.transpose(1, 0, 2).reshape(n_kv, group, L, hd)
    step = max(1, SCORE_BLOCK_BYTES // max(1, n_head * N * 4))
    qp, kp = mx.array(np.asarray(q_pos, dtype=np.int32)), mx.array(np.asarray(k_pos, dtype=np.int32))
    outs = []
    for a in range(0, L, step):
        b = min(L, a + step)
        rel = qp[a:b, None] - kp[None, :]   # the mask made where it is used (not L x N floats from the host)
        visible = rel >= 0
        if window is not None:
            visible = visible & (rel < window)
        mask = mx.where(visible, mx.array(0.0, dtype=mx.float32), mx.array(-np.inf, dtype=mx.float32))
        scores = (qh[:, :, a:b] @ k.swapaxes(-1, -2)) * scale + mask
        probs = mx.softmax(scores, axis=-1, precise=True)
        outs.append(probs @ v)                    # (n_kv, group, b-a, hd)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.reshape(n_head, L, hd).transpose(1, 0, 2).reshape(L, n_head * hd)


def output_gate(a: mx.array, gate: mx.array) -> mx.array:
    """The attention output gate: a * sigmoid(Wgate h), before the output projection."""
    return a * mx.sigmoid(gate)


@mx.compile
def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class ChunkStep:
    """K/V for a forward over T tokens of each of B sequences, with MLX ops: each sequence's
    queries attend over the rows its layer held before the chunk plus the chunk's own, then the
    chunk is stored (kv.py: right for a chunk longer than the ring)."""

    compiled = False

    def __init__(self, g: Geometry, caches: list[SlotCache], T: int, attend_rows=None):
        """attend_rows(q, keys, values, q_pos, k_pos, window) -> (T, n_head * hd): the causal
        attention of one sequence's chunk (default: `attention` in float32, MLX ops)."""
        self.g, self.caches, self.T = g, caches, T
        self.scale = 1.0 / float(np.sqrt(g.head_dim))
        self.attend_rows = attend_rows or (lambda q, k, v, qp, kp, w: attention(q, k, v, qp, kp, w, self.scale))

    def attend(self, i: int, q: mx.array, kv: mx.array, gate: Slice) -> mx.array:
        """Layer i: q (B*T, n_head, hd) f32, kv (2, n_kv, B*T, hd) K|V in the cache's dtype -> the
        gated attention output softmax(q K^T / sqrt(hd)) V * sigmoid(gate), (B*T, n_head * hd)."""
        T, outs = self.T, []
        window = self.g.sliding_window if self.g.is_swa(i) else None
        for b, cache in enumerate(self.caches):
            layer = cache.layers[i]
            kv_new = kv if len(self.caches) == 1 else kv[:, :, b * T:(b + 1) * T]
            old, old_pos = layer.view()
            positions = np.arange(layer.offset, layer.offset + T, dtype=np.int64)
            rows = mx.concatenate([old, kv_new], axis=2)
            k_pos = np.concatenate([old_pos, positions])
            layer.append(kv_new)
            outs.append(self.attend_rows(q[b * T:(b + 1) * T], rows[0], rows[1], positions, k_pos, window))
        a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return output_gate(a, gate.dense())

    def layer_state(self, i: int) -> list[mx.array]:
        return [a for c in self.caches for a in c.layers[i].state()]


class ReferenceOps:
    name = "reference"
    raw_piece_bytes: int | None = None   # weight_stream.load_raw's piece size (None: whole tensors)
    upload = None                        # how kvpack's restores reach the device (None: mx.load)

    def __init__(self):
        self.weight_flags: list[mx.array] = []   # of the matrices loaded since Model last checked them

    def load_raw(self, raws: list[RawTensor]) -> list[mx.array]:
        """Each raw tensor's (rows, row_bytes) uint8 bytes on the device (weight_stream.load_raw); for
        each matrix, its weight_stream.nonfinite_flag is added to `weight_flags` (Model checks them)."""
        arrays = self._raw_arrays(raws)
        for r, a in zip(raws, arrays):
            flag = nonfinite_flag(r, a) if len(r.shape) == 2 else None
            if flag is not None:
                self.weight_flags.append(flag)
        return arrays

    def _raw_arrays(self, raws: list[RawTensor]) -> list[mx.array]:
        return load_raw(raws, self.raw_piece_bytes)

    def begin_weights(self, raws: list[RawTensor]) -> bool:
        """Called once with every tensor of a model before any loads (GpuOps may load them ahead).
        -> whether its matrices are now in memory (so the model's checks of them need not bound
        what is loaded at once: Model evaluates them without a wait a layer)."""
        return False

    def stack_raw(self, raws: list[RawTensor]) -> mx.array:
        """The raw rows of several matrices of one type and row length, one after another."""
        arrays = self.load_raw(raws)
        return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)

    def matrix(self, raws: list[RawTensor]) -> Matrix:
        """Load one matrix, or several of one type and row length stacked by rows."""
        qtype = raws[0].qtype
        return Matrix(dequantize(self.stack_raw(raws), qtype), qtype, False, raws[0].shape[0],
                      sum(r.shape[1] for r in raws))

    def project(self, w: Matrix, x: mx.array) -> mx.array:
        """x (rows, in) -> x W^T (rows, out), float32."""
        return x @ w.data.T

    def project_out(self, w: Matrix, x: mx.array) -> mx.array:
        """A sub-layer's output projection, whose value only residual_norm reads: project's (GpuOps
        may leave a tensor-core product's parts of K unsummed, for its residual_norm to add)."""
        return self.project(w, x)

    def logits(self, w: Matrix, h: mx.array) -> mx.array:
        """The output projection (the LM head): h (rows, n_embd) -> (rows, n_vocab) float32."""
        return self.project(w, h)

    def down_silu(self, w: Matrix, gate: Slice, up: Slice) -> mx.array:
        """The FFN down projection of silu(gate) * up; only residual_norm reads it (project_out)."""
        return self.project(w, silu_mul(gate.dense(), up.dense()))

    def qk_post(self, q: Slice, k: Slice, v: Slice, q_norm: mx.array, k_norm: mx.array, rope: mx.array,
                rope_half: int, g: Geometry, kv_dtype) -> tuple[mx.array, mx.array]:
        """Per-head RMSNorm of q and k, RoPE on the first 2*rope_half dims (0: NoPE), k and v
        rounded to the cache's dtype. rope (rows, 2*rope_half): cos then sin of each row's angles.
        -> q (rows, n_head, hd) f32, K|V (2, n_kv, rows, hd) in kv_dtype: the cache's layout."""
        rows = q.array.shape[0]
        qh = rms_norm(q.dense().reshape(rows, g.n_head, g.head_dim), q_norm, g.rms_eps)
        kh = rms_norm(k.dense().reshape(rows, g.n_head_kv, g.head_dim), k_norm, g.rms_eps)
        if rope_half:
            cos, sin = rope[:, :rope_half], rope[:, rope_half:2 * rope_half]
            qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
        vh = v.dense().reshape(rows, g.n_head_kv, g.head_dim)
        return qh, mx.stack([kh, vh]).transpose(0, 2, 1, 3).astype(kv_dtype)

    def residual_norm(self, x: mx.array, f: mx.array, w_post: mx.array, w_next: mx.array, eps_post: float,
                      eps_next: float) -> tuple[mx.array, mx.array]:
        """A sub-layer's output f joins the residual: r = x + rmsnorm(f) * w_post; and the next
        sub-layer's input h = rmsnorm(r) * w_next. -> (r, h)."""
        r = x + rms_norm(f, w_post, eps_post)
        return r, rms_norm(r, w_next, eps_next)

    def kv_step(self, g: Geometry, caches: list[SlotCache], T: int, rope):
        """How this forward reaches the caches: a ChunkStep (attend, in place; the forward takes
        the tokens' cos|sin rows), or on the GPU a DecodePlan (`compiled`: the forward runs as the
        compiled decode step, which makes its cos|sin rows from the sequences' positions and
        blocks of the rows of rope, the model's RopeRows)."""
        return ChunkStep(g, caches, T)

    def end_layer(self, kv, i: int, *arrays: mx.array) -> None:
        """After layer i (the GPU backend bounds the dequantized weights alive at once here)."""

    def ready(self) -> None:
        """Before a forward's outputs are evaluated (the GPU backend writes its kernel disk cache here)."""
