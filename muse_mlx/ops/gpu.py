"""The forward's steps on the GPU: the custom kernels over the GGUF's raw blocks.

Two regimes, by the number of token rows in the forward (B sequences x T tokens):

- at most kernels.MAX_BATCH rows (decode over 1..4 slots, a speculative verify step): every
  product reads the raw blocks in place (the streaming kernel for Q4_K / Q6_K, its rows of x in
  registers or threadgroup memory; matvec.inc for the rest; each weight read once for the rows
  of a launch), the glue steps are fused
  kernels (qk_post, residual_norm), and with T = 1 over f16 caches the attention is the split
  decode kernel (DecodeStep), inside one compiled step (model.Model compiles the forward
  for the DecodePlan's key);
- longer chunks (prefill): each matrix dequantized for its product, one layer's at a time, to
  float16 by dequant.inc and multiplied on the tensor cores with x rounded to f16 (f16_product,
  KernelConfig.prefill_f16 = 1, the default), or to float32 and multiplied in float32 (0: the
  exactness lane); on the f16 lane on CUDA the attention is the flash kernel
  (prefill_attention.inc) or MLX's fused attention (KernelConfig.prefill_flash); the
  reference's MLX ops for everything else.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..artifact import RawTensor
from ..geometry import Geometry
from ..kernels import Kernels
from ..kernels import plan as kplan
from ..kv import SlotCache
from ..quant import dequantize
from ..weight_stream import upload_raw
from .reference import ChunkStep, Matrix, ReferenceOps, Slice


class DecodePlan(NamedTuple):
    """What the compiled decode step over B sequences needs from the host for one token.

    key: the trace key (B; per sequence, the group of each layer; per group, the attention's
    rows per split and split count; the groups' kinds: ring or plane, and capacity); positions:
    the sequences' positions (B,) int32 on the device; arrays: the rope rows of each position's
    block of RopeRows.BLOCK (B, BLOCK, rope width), then every cache's storage (SlotCache.state
    order: one K|V array a layer). The step makes the rows it writes, the attention's parameters
    and the cos|sin rows from the positions and returns them plus one, which `after` keeps for
    the next token (DevicePositions)."""
    key: tuple
    positions: mx.array
    arrays: list
    after: object
    compiled: bool = True


class DevicePositions:
    """The decode step's positions kept on the device from one token to the next: a token whose
    sequences stand where the last step left them takes the step's own output, so the step reads
    nothing the host wrote that token; other offsets (a slot joined, left, or was restored) are
    uploaded once. The rope rows go up a block of RopeRows.BLOCK positions at a time. (Host-made
    rows, parameters and cos|sin every token cost ~0.3-0.55 ms a step on the H200, each array a
    managed-memory migration at the GPU's first read; docs/ledger.md 2026-12-04.)"""

    def __init__(self):
        self.offsets, self.positions = None, None     # offsets the device array holds, and it
        self.blocks, self.tables = None, None

    def plan(self, caches: list[SlotCache], rope) -> tuple[mx.array, mx.array]:
        offsets = tuple(c.offset for c in caches)
        if offsets != self.offsets:
            self.offsets, self.positions = offsets, mx.array(np.array(offsets, dtype=np.int32))
        blocks = tuple(o // rope.BLOCK for o in offsets)
        if blocks != self.blocks:
            self.blocks = blocks
            self.tables = mx.array(np.stack([rope.block_rows(b) for b in blocks]).astype(np.float32, copy=False))
        return self.positions, self.tables

    def after(self, positions: mx.array) -> None:
        """The step's next positions (lazy, on the device) for offsets one past these."""
        self.offsets, self.positions = tuple(o + 1 for o in self.offsets), positions


def decode_plan(caches: list[SlotCache], kernels: Kernels, device_positions: DevicePositions, rope) -> DecodePlan:
    """The next token's DecodePlan (rope: the model's RopeRows). Layers whose storage has one kind
    and capacity (the rings; the planes) form a group that shares a row index and a parameter
    array; a group's split count is the largest any sequence needs (the others' extra splits
    weigh zero), rounded up (plan.attention_splits) so that one trace serves many tokens; a plane
    group's rows per split from the deepest sequence's rows (plan.plane_chunk). The layers of one
    cache are at one offset, so each group's first layer speaks for the group (this runs once a
    token: a loop over groups, not over the layers). The context limit: Model checks each
    cache's room first."""
    config = kernels.config
    groups: dict[tuple, int] = {}
    layer_groups, firsts = [], []   # per cache: the group of each layer; group -> its first layer
    for cache in caches:
        ids = tuple(groups.setdefault(kind, len(groups)) for kind in cache.layer_kinds)
        layer_groups.append(ids)
        firsts.append({gi: cache.layers[ids.index(gi)] for gi in set(ids)})
    kinds = list(groups)
    n_valid = [{gi: min(layer.offset + 1, layer.capacity) for gi, layer in first.items()} for first in firsts]
    chunks = tuple(config.ring_chunk if ring else
                   kplan.plane_chunk(max(valid[gi] for valid in n_valid if gi in valid), config)
                   for gi, (ring, _) in enumerate(kinds))
    splits = tuple(max(kplan.attention_splits(valid[gi], chunks[gi], kinds[gi][1]) for valid in n_valid if gi in valid)
                   for gi in range(len(kinds)))
    positions, tables = device_positions.plan(caches, rope)
    arrays = [tables]
    for cache in caches:
        arrays += cache.state()
    return DecodePlan((len(caches), tuple(layer_groups), chunks, splits, tuple(kinds)), positions, arrays,
                      device_positions.after)


class DecodeStep:
    """One decode token of B sequences inside the compiled step: writes each layer's new K|V row
    into each sequence's storage array with put_along_axis at the rows made from the positions
    (MLX's scatter: a thread per element written, where a slice update at an array row launches
    one per element stored; one scatter a sequence a layer, K and V being one array) and attends
    with the split decode kernel: the B sequences in one launch where a layer's storage has one
    group for all of them, else one launch each. `state` is the storage with the rows written.

    From the positions (B,) int32: a ring's row is position % its capacity, a plane's the
    position; n_valid min(position + 1, capacity) (the attention's parameters,
    plan.attention_params's layout); the cos|sin row the position's row of its block; a
    group a sequence lacks writes row 0 with n_valid 1 (its extra splits weigh zero)."""

    def __init__(self, key: tuple, positions: mx.array, arrays: list, kernels: Kernels):
        self.kernels = kernels
        self.B, self.layer_groups, self.chunks, self.splits, kinds = key
        self.n_layer = len(self.layer_groups[0])
        tables, self.state = arrays[0], list(arrays[1:])
        block = tables.shape[1]
        self.rope = mx.take_along_axis(tables, (positions % block).reshape(self.B, 1, 1), axis=1).reshape(self.B, -1)
        self.positions_next = positions + 1
        kv = self.state[0]
        n_kv, hd = kv.shape[1], kv.shape[3]
        self.rows = [[None] * len(kinds) for _ in range(self.B)]
        self.params = []
        for gi, (ring, capacity) in enumerate(kinds):
            present = [gi in groups for groups in self.layer_groups]
            row = positions % capacity if ring else positions
            n_valid = mx.minimum(positions + 1, capacity)
            if not all(present):
                mask = mx.array(np.array(present))
                row, n_valid = mx.where(mask, row, 0), mx.where(mask, n_valid, 1)
            self.params.append(mx.concatenate([n_valid.reshape(self.B, 1), mx.full((self.B, 1), self.splits[gi], mx.int32),
                                               mx.zeros((self.B, 6), mx.int32)], axis=1))
            for b in range(self.B):
                self.rows[b][gi] = mx.broadcast_to(row[b:b + 1].reshape(1, 1, 1, 1), (2, n_kv, 1, hd))

    @property
    def outputs(self) -> list:
        """What the compiled step returns after the logits: the next positions, then the storage."""
        return [self.positions_next] + self.state

    def attend(self, i: int, q: mx.array, kv: mx.array, gate: Slice) -> mx.array:
        """Layer i: q (B, n_head, hd) f32, kv (2, n_kv, B, hd) f16 K|V -> the gated attention (B, n_head*hd).

        With B = 1 the arrays go to the scatter and the kernel as they are: each slice, reshape or
        integer index would be a node per layer that the compiled step rebuilds every token, and
        an integer index is a gather launch (revision ebd927c had ~8 such nodes a layer, 2 of them
        gathers, and decoded 2-5 % slower than 0e4a0ae on the H200, docs/ledger.md). With B > 1 kv
        is split into its B rows by one node (mx.split: one primitive, B outputs) for the B
        writes, and q goes whole to one launch over the B sequences' storage."""
        n_head, hd = q.shape[1:]
        kvs = [kv] if self.B == 1 else mx.split(kv, self.B, axis=2)
        groups = [self.layer_groups[b][i] for b in range(self.B)]
        for b, gi in enumerate(groups):
            s = b * self.n_layer + i
            self.state[s] = mx.put_along_axis(self.state[s], self.rows[b][gi], kvs[b], axis=2)
        storage = self.state[i::self.n_layer]
        if self.B == 1:
            gi = groups[0]
            return self.kernels.decode_attention(q, storage[0], self.params[gi], self.chunks[gi], self.splits[gi],
                                                 gate=gate.array, gate_offset=gate.offset, out_shape=(1, n_head * hd))
        if len(set(groups)) == 1:
            gi = groups[0]
            return self.kernels.decode_attention_seqs(q, storage, self.params[gi], self.chunks[gi], self.splits[gi],
                                                      gate=gate.array, gate_offset=gate.offset)
        qs = mx.split(q, self.B, axis=0)
        return mx.concatenate([self.kernels.decode_attention(
            qs[b], storage[b], self.params[gi][b], self.chunks[gi], self.splits[gi], gate=gate.array,
            gate_offset=b * gate.array.shape[-1] + gate.offset, out_shape=(1, n_head * hd))
            for b, gi in enumerate(groups)], axis=0)

    def layer_state(self, i: int) -> list[mx.array]:
        return self.state[i::self.n_layer]


# The f16 products cannot overflow: |y_n| = |sum_k w_nk x_k| <= max|x| * sum_k |w_nk|, so each row of
# x is scaled by the power of two that puts max|x| * (the matrix's largest row L1 norm) at or below
# 2^F16_PRODUCT_TOP (f16's largest value is 65,504, just under 2^16), then rounded to f16: exact to
# undo. (2026-12-01, 921bc6c: scaling max|x| alone to [2^6, 2^7) overflowed on the synthetic
# full-geometry file, non-finite logits at a 31-token prompt.)
F16_PRODUCT_TOP = 15


@mx.compile
def _scaled_f16(x: mx.array, l1_max: mx.array) -> tuple[mx.array, mx.array]:
    """(x scaled per row and rounded to f16, the inverse scale per row): one compiled graph."""
    bound = mx.max(mx.abs(x), axis=-1, keepdims=True) * l1_max
    exponent = mx.ceil(mx.log2(mx.maximum(bound, 2.0 ** -100))).astype(mx.int32)
    k = mx.clip(F16_PRODUCT_TOP - exponent, -126, 127)
    scale = ((k + 127) << 23).view(mx.float32)          # 2^k, built from its bits: exact
    inverse = ((127 - k) << 23).view(mx.float32)
    return (x * scale).astype(mx.float16), inverse


@mx.compile
def _unscaled(y: mx.array, inverse: mx.array) -> mx.array:
    return y.astype(mx.float32) * inverse


def f16_product(x: mx.array, w16: mx.array, l1_max: mx.array) -> mx.array:
    """x (rows, in) float32 times w16^T (in, out) on the tensor cores; l1_max: the largest row L1
    norm of w16 (a 1-element float32 array). x is rounded to f16 after a per-row power-of-two
    scaling, MLX's f16 GEMM accumulates in float32, its f16 result is scaled back. -> (rows, out)
    float32. The prefill lane of KernelConfig.prefill_f16."""
    x16, inverse = _scaled_f16(x, l1_max)
    return _unscaled(x16 @ w16.T, inverse)


def causal_in_order(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> bool:
    """Whether a chunk's visibility is plain causal, aligned at the end: the keys are consecutive
    positions ending with the queries' own, and no window cuts a pair that causality lets through
    (what MLX's fused attention takes as mask="causal")."""
    N, L = len(k_pos), len(q_pos)
    if N < L or L == 0 or k_pos[-1] - k_pos[0] != N - 1 or not np.array_equal(q_pos, k_pos[N - L:]):
        return False
    return bool(np.all(np.diff(k_pos) == 1)) and (window is None or q_pos[-1] - k_pos[0] < window)


def fused_attention(q: mx.array, keys: mx.array, values: mx.array, q_pos: np.ndarray, k_pos: np.ndarray,
                    window: int | None) -> mx.array:
    """A chunk's causal GQA attention by MLX's fused attention (mx.fast.scaled_dot_product_attention;
    cuDNN's flash attention on CUDA for head dims up to 128): q (L, n_head, HD) float32 rounded to
    f16, keys / values (n_kv, N, HD) f16, positions as ChunkStep gives them -> (L, n_head * HD)
    float32 (the f16 result widened). Keys in position order take mask="causal"; a ring's rotated
    rows or a window that cuts take an additive mask made on the device from the positions."""
    L, n_head, hd = q.shape
    if causal_in_order(q_pos, k_pos, window):
        mask = "causal"
    else:
        rel = mx.array(q_pos.astype(np.int32))[:, None] - mx.array(k_pos.astype(np.int32))[None, :]
        seen = (rel >= 0) & (rel < window) if window else rel >= 0
        mask = mx.where(seen, mx.array(0.0, mx.float16), mx.array(-np.inf, mx.float16))
    o = mx.fast.scaled_dot_product_attention(q.astype(mx.float16).transpose(1, 0, 2)[None], keys[None], values[None],
                                             scale=float(hd) ** -0.5, mask=mask)
    return o[0].transpose(1, 0, 2).reshape(L, n_head * hd).astype(mx.float32)


class GpuOps(ReferenceOps):
    name = "gpu"

    def __init__(self, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self._dequantized = False   # a product of this layer dequantized its matrix (a long chunk)
        self._in_flight: list[list[mx.array]] = []   # the long chunk's layers submitted, not yet waited for
        self._ahead: dict[tuple, mx.array] = {}   # tensors begin_weights loaded, until the model takes them
        self._l1_max: dict[int, mx.array] = {}   # id of a raw matrix's data -> its f16 values' largest row L1 norm
        self._positions = DevicePositions()   # the decode step's, from token to token

    @property
    def backend(self) -> str:
        return self.kernels.device.backend

    @property
    def raw_piece_bytes(self) -> int | None:
        """CUDA: raw tensors loaded in 16 MiB row ranges (weight_stream.load_raw says why)."""
        return 16 * 2**20 if self.backend == "cuda" else None

    @property
    def upload(self):
        """CUDA with KernelConfig.pinned_upload = 1: the process's page-locked staging
        (kernels/upload.py) for kvpack's restores and, with weights_staged = 1, the weights
        (begin_weights); else None (mx.load)."""
        if self.backend != "cuda" or not self.kernels.config.pinned_upload:
            return None
        from ..kernels.upload import pinned_upload
        return pinned_upload()

    def _raw_arrays(self, raws: list[RawTensor]) -> list[mx.array]:
        """The tensors begin_weights loaded ahead, taken (each once); others by mx.load in 16 MiB
        pieces (the base class)."""
        keys = [(r.path, r.offset, r.nbytes) for r in raws]
        if keys and all(k in self._ahead for k in keys):
            return [self._ahead.pop(k) for k in keys]
        return super()._raw_arrays(raws)

    def begin_weights(self, raws: list[RawTensor]) -> bool:
        """KernelConfig.weights_staged = 1 on CUDA: every tensor mapped from a file loaded now, in one
        pass through the page-locked staging (weight_stream.upload_raw: its reading threads keep
        the staging's two halves full across tensors, which a pass a matrix would drain), kept
        until the model takes it."""
        up = self.upload if self.kernels.config.weights_staged else None
        mapped = [r for r in raws if r.path is not None and r.offset is not None and len(r.shape) == 2]
        if up is not None and mapped:
            if self.kernels.disk_cache is not None:
                from ..kernels.upload import note_copy_kernel
                note_copy_kernel(self.kernels.disk_cache)
            arrays = upload_raw(mapped, up, self.raw_piece_bytes)
            self._ahead = {(r.path, r.offset, r.nbytes): a for r, a in zip(mapped, arrays)}
        return bool(self._ahead)

    def matrix(self, raws: list[RawTensor]) -> Matrix:
        qtype = raws[0].qtype
        if not kplan.supports(qtype):
            return super().matrix(raws)
        return Matrix(self.stack_raw(raws), qtype, True, raws[0].shape[0], sum(r.shape[1] for r in raws))

    def project(self, w: Matrix, x: mx.array) -> mx.array:
        if not w.raw:
            return super().project(w, x)
        if x.shape[0] <= kplan.MAX_BATCH:
            return self.kernels.matvec(w.data, w.qtype, x)
        self._dequantized = True
        config = self.kernels.config
        if not config.prefill_f16:
            return x @ dequantize(w.data, w.qtype).T
        key = id(w.data)
        w16 = None
        if key not in self._l1_max:   # once per matrix: its largest row L1 norm (f16_product's bound)
            w16 = self.weights_f16(w)
            self._l1_max[key] = mx.max(mx.sum(mx.abs(w16.astype(mx.float32)), axis=-1)).reshape(1)
        return f16_product(x, self.weights_f16(w) if w16 is None else w16, self._l1_max[key])

    def project_out(self, w: Matrix, x: mx.array) -> mx.array:
        """Where the tensor cores split K (o_proj's 4,096 in parts at two to four rows), the parts
        unsummed: residual_norm adds them as it loads them, so their sum is no node of its own."""
        if w.raw and x.shape[0] <= kplan.MAX_BATCH:
            return self.kernels.matvec(w.data, w.qtype, x, parts=True)
        return self.project(w, x)

    def logits(self, w: Matrix, h: mx.array) -> mx.array:
        """The LM head keeps float32 products for long chunks (every position's logits, as parity
        and perplexity ask): an f16 result would carry ~2^-12 of each logit into the log-probs."""
        if w.raw and h.shape[0] > kplan.MAX_BATCH:
            self._dequantized = True
            return h @ dequantize(w.data, w.qtype).T
        return self.project(w, h)

    def weights_f16(self, w: Matrix) -> mx.array:
        """A raw matrix's values as (n_out, n_in) float16 (dequant.inc), for one chunk's product."""
        if w.qtype in kplan.FLOAT_DTYPES:
            return w.data.view(kplan.FLOAT_DTYPES[w.qtype]).reshape(w.n_out, w.n_in).astype(mx.float16)
        return self.kernels.dequantize(w.data, w.qtype, w.n_in)

    def down_silu(self, w: Matrix, gate: Slice, up: Slice) -> mx.array:
        rows = gate.array.shape[0]
        kernels = self.kernels
        one_row = rows == 1 and not kernels.config.batch_invariant   # one row's form only where several share it
        if (w.raw and gate.offset == 0 and gate.array.shape == up.array.shape and kplan.streams(w.qtype, w.n_in)
                and (one_row or 2 <= kplan.stream_batch_rows(w.n_in, kernels.device, kernels.config))
                and rows <= kplan.MAX_BATCH):
            return kernels.matvec_silu(w.data, w.qtype, gate.array, up.array, up_offset=up.offset, parts=True)
        return super().down_silu(w, gate, up)

    def qk_post(self, q, k, v, q_norm, k_norm, rope, rope_half, g: Geometry, kv_dtype):
        rows = q.array.shape[0]
        if rows > kplan.MAX_BATCH or kv_dtype != mx.float16:
            return super().qk_post(q, k, v, q_norm, k_norm, rope, rope_half, g, kv_dtype)
        return self.kernels.qk_post(q.array, k.array, v.array, q_norm, k_norm, rope, rope_half,
                                    g.rms_eps, g.n_head, g.n_head_kv, g.head_dim,
                                    offsets=(q.offset, k.offset, v.offset))

    def residual_norm(self, x, f, w_post, w_next, eps_post, eps_next):
        """f may hold a tensor-core product's parts of K (project_out, down_silu): (P, rows, n)."""
        if x.shape[0] > kplan.MAX_BATCH:
            return super().residual_norm(x, f, w_post, w_next, eps_post, eps_next)
        return self.kernels.residual_norm(x, f, w_post, w_next, eps_post, eps_next)

    def ready(self) -> None:
        self.kernels.ready()
        self._in_flight.clear()   # the forward's outputs are evaluated next, which waits for them all

    def kv_step(self, g: Geometry, caches: list[SlotCache], T: int, rope):
        f16 = all(c.dtype == mx.float16 for c in caches)
        if T == 1 and f16:
            return decode_plan(caches, self.kernels, self._positions, rope)
        if f16 and len(caches) * T > kplan.MAX_BATCH and self.flash_prefill(g):
            return ChunkStep(g, caches, T, self._flash_rows)
        return super().kv_step(g, caches, T, rope)

    def flash_prefill(self, g: Geometry) -> bool:
        """Whether a long chunk's attention takes _flash_rows (MLX's fused attention or the flash
        kernel): the f16 lane with prefill_flash on CUDA (on Metal the kernel's tensor-core products
        are a stand-in, correct but slow, and the fused attention is unmeasured) and a geometry the
        kernel's plan takes."""
        config, device = self.kernels.config, self.kernels.device
        return bool(config.prefill_f16 and config.prefill_flash and device.backend == "cuda"
                    and kplan.prefill_attention_launch(1, g.n_head, g.n_head_kv, g.head_dim, device) is not None)

    def _flash_rows(self, q, keys, values, q_pos, k_pos, window):
        how = self.kernels.config.prefill_flash
        if q.shape[-1] <= 128 and how == 2:   # cuDNN's limit
            return fused_attention(q, keys, values, q_pos, k_pos, window)
        return self.kernels.prefill_attention(q, keys, values, mx.array(q_pos.astype(np.int32)),
                                              mx.array(k_pos.astype(np.int32)), window)

    def end_layer(self, kv, i: int, *arrays: mx.array) -> None:
        """A long chunk's layer is submitted here, and the host waits for the layer before it when
        more than KernelConfig.prefill_layers_in_flight would be queued: so at most that many
        layers' dequantized weights exist at once, and with 2 the host builds the next layer
        while the GPU runs this one."""
        if self._dequantized:
            self.kernels.ready()
            layer = [*arrays, *kv.layer_state(i)]
            mx.async_eval(*layer)
            self._in_flight.append(layer)
            while len(self._in_flight) >= self.kernels.config.prefill_layers_in_flight:
                mx.eval(*self._in_flight.pop(0))
            self._dequantized = False
