"""The kernel path's launches: each kernel of custom_kernels/ behind a function of MLX arrays.

A `Kernels` is made once per model, for one backend, device and KernelConfig; `build` makes a
kernel object from its name (source.build; the tests pass an emulator's). Every launch is
planned by kernels/plan.py from its shapes and is memoised there.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..config import KernelConfig
from . import plan, source
from .device import Device


def float_bits(value: float) -> int:
    """The bits of a non-negative float32 as a template constant (a kernel reads them back with
    BITS_TO_FLOAT): constants such as an epsilon cost no memory read."""
    bits = int(np.float32(value).view(np.uint32))
    if not 0 <= bits < 0x7F800000:
        raise ValueError(f"{value!r} is not a finite non-negative float32")
    return bits


class Kernels:
    def __init__(self, device: Device, config: KernelConfig = KernelConfig(),
                 build: Callable | None = None, disk_cache=None):
        """disk_cache: a disk_cache.KernelCache that compiles our CUDA kernels into MLX's disk
        cache before MLX would (None: MLX compiles each in every process)."""
        self.device, self.config = device, config
        self._build = build or source.build
        self.disk_cache = disk_cache

    def kernel(self, name: str, group_memory: int = 0):
        k = self._build(name, self.device.backend, group_memory)
        if self.disk_cache is None:
            return k
        cache = self.disk_cache

        def launch(*, inputs, output_dtypes, template=(), **kw):
            _, _, input_names, output_names = source.KERNELS[name]
            cache.note(f"muse_{name}", *source.texts(name, self.device.backend), input_names, inputs, output_names,
                       output_dtypes, list(template))
            return k(inputs=inputs, output_dtypes=output_dtypes, template=list(template), **kw)
        return launch

    def ready(self) -> None:
        """Before the launches made so far are evaluated: compile the new ones into the disk cache."""
        if self.disk_cache is not None:
            self.disk_cache.ready()

    # ---- matrix products over raw GGUF blocks ----

    def matvec(self, w: mx.array, qtype: QT, x: mx.array, init_value: float | None = None,
               parts: bool = False) -> mx.array:
        """x (B, K) float32, 1 <= B <= MAX_BATCH; w the raw GGUF rows (N, row_bytes) uint8 -> (B, N) float32.

        A type with a streaming kernel takes it (matvec_stream.inc): one row with x in
        registers, several with x in threadgroup memory, as many rows a launch as
        plan.stream_batch_rows allows; otherwise matvec.inc. Each reads each weight once for
        all the rows of its launch. On CUDA several rows take the tensor cores (_takes_mma, which
        also says what KernelConfig.batch_invariant changes). `init_value` pre-fills the output
        (tests poison it with NaN to catch unwritten elements). `parts`: where one tensor-core
        launch splits K into parts, its (P, B, N) products unsummed, for residual_norm to add as it
        loads them (no node of their own)."""
        B, K = x.shape
        if not 1 <= B <= plan.MAX_BATCH:
            raise ValueError(f"matvec takes 1..{plan.MAX_BATCH} rows, got {B}")
        x = x.astype(mx.float32)
        N = w.shape[0]
        if self._takes_mma(qtype, K, N, B):
            if B <= plan.MMA_MAX_ROWS:
                return self.matvec_mma(w, qtype, x, init_value=init_value, parts=parts)
            return mx.concatenate([self.matvec_mma(w, qtype, x[b:b + plan.MMA_MAX_ROWS], init_value=init_value)
                                   for b in range(0, B, plan.MMA_MAX_ROWS)], axis=0)
        if plan.streams(qtype, K) and (B == 1 and not self.config.batch_invariant
                                       or plan.stream_batch_rows(K, self.device, self.config)):
            return self._stream(w, qtype, K, N, "", [x], 0, init_value)
        return self._rows(w, qtype, x, init_value)

    def _rows(self, w: mx.array, qtype: QT, x: mx.array, init_value: float | None) -> mx.array:
        """matvec.inc over the B rows of x (B, K) float32."""
        B, K = x.shape
        N = w.shape[0]
        name, launch = plan.batch_launch(qtype, K, N, B)
        if qtype in plan.QUANT_VARIANTS:
            xs = x.reshape(B, K // 16, 16).sum(axis=-1)
            return self.kernel(name)(inputs=[w, x, xs], init_value=init_value, **launch)[0]
        weights = w.view(plan.FLOAT_DTYPES[qtype]).reshape(N, K)
        return self.kernel(name)(inputs=[weights, x], init_value=init_value, **launch)[0]

    def _takes_mma(self, qtype: QT, K: int, N: int, B: int) -> bool:
        """Whether B rows take the tensor-core form: on CUDA, from config.stream_mma rows on, where it
        applies (over matrices of config.mma_pair_min_rows rows or more with two rows of x, of
        config.mma_min_rows or more with three or four).

        With config.batch_invariant every row count takes one form, so that a row's sums never
        depend on the rows beside it: on CUDA the tensor-core form wherever its plan applies (the
        plan does not depend on the rows, and each row of x has its own scale, halves and mma
        column), in launches of at most MMA_MAX_ROWS rows; elsewhere the streaming pair where
        several rows may stream (x_shared sums each output in one row's order), else matvec.inc
        (a warp a row)."""
        config = self.config
        if config.batch_invariant:
            return (self.device.backend == "cuda"
                    and plan.mma_plan(qtype, K, N, min(B, plan.MMA_MAX_ROWS), self.device, config) is not None)
        return (self.device.backend == "cuda" and 2 <= config.stream_mma <= B
                and N >= (config.mma_pair_min_rows if B == 2 else config.mma_min_rows)
                and plan.mma_plan(qtype, K, N, B, self.device, self.config) is not None)

    def matvec_mma(self, w: mx.array, qtype: QT, x: mx.array, init_value: float | None = None,
                   parts: bool = False) -> mx.array:
        """The tensor-core form (matvec_stream.inc, mma_*) over 1..4 rows of x (B, S), each row's K
        values from its start, on any backend (Metal runs it through a slow stand-in for the mma;
        its plans choose x_shared). -> (B, N) float32, or with `parts` (P, B, N) where the plan
        splits K into P > 1 parts."""
        K = w.shape[1] // plan.ROW_BYTES_PER_256[qtype] * 256
        B, stride = x.shape
        if plan.mma_plan(qtype, K, w.shape[0], B, self.device, self.config) is None:
            raise ValueError(f"the tensor-core matvec does not take {qtype.name} with K = {K} and {B} rows")
        name, memory, launch = plan.mma_launch(qtype, K, w.shape[0], self.device, self.config, B, stride)
        y = self.kernel(name, memory)(inputs=[w, x.astype(mx.float32)], init_value=init_value, **launch)[0]
        if y.ndim == 2 or parts:
            return y
        if not self.config.batch_invariant:
            return y.sum(axis=0)
        parts = mx.split(y, y.shape[0], axis=0)   # added in order, an order that does not depend on B
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total.reshape(y.shape[1:])

    def dequantize(self, w: mx.array, qtype: QT, K: int, init_value: float | None = None) -> mx.array:
        """The raw GGUF rows (N, row_bytes) uint8 of a quantized type -> (N, K) float16: gguf-py's
        values (float32, the same products) rounded to nearest (dequant.inc)."""
        name, launch = plan.dequant_launch(qtype, K, w.shape[0])
        return self.kernel(name)(inputs=[w], init_value=init_value, **launch)[0]

    def matvec_silu(self, w: mx.array, qtype: QT, gate: mx.array, up: mx.array, up_offset: int = 0,
                    init_value: float | None = None, parts: bool = False) -> mx.array:
        """W @ (silu(gate) * up) for B token rows (plan.streams(qtype, K) must hold, and for B > 1
        stream_batch_rows(K) >= 2). gate, up: (B, S) float32 of one row stride S; per row, gate's
        K values from its start and up's from `up_offset` (pass one stacked gate|up output as
        both, up_offset = K). -> (B, N).
        The streaming kernels make the activation in their prologue. Rows that take the tensor
        cores get it from MLX ops first (one fused launch in a compiled step) and the plain form:
        made inside that kernel, every threadgroup made it twice and the form's registers held it
        to fewer warps (at B = 4 FFN down Q4_K 111 against 62 µs; H200, c202a3c, ledger).
        Under KernelConfig.batch_invariant one row takes the tensor cores too where several do
        (_takes_mma), and the ops stream a single row only where several rows may (GpuOps.down_silu).
        `parts` as matvec's."""
        K = w.shape[1] // plan.ROW_BYTES_PER_256[qtype] * 256
        if gate.shape != up.shape:
            raise ValueError(f"matvec_silu: gate {gate.shape} and up {up.shape} must have one shape")
        if (gate.shape[0] > 1 or self.config.batch_invariant) and self._takes_mma(qtype, K, w.shape[0], gate.shape[0]):
            g, u = gate[:, :K], up[:, up_offset:up_offset + K]
            return self.matvec(w, qtype, nn.silu(g) * u, init_value, parts=parts)
        return self._stream(w, qtype, K, w.shape[0], "_silu", [gate, up], up_offset, init_value)

    def _stream(self, w: mx.array, qtype: QT, K: int, N: int, act: str, xs: list[mx.array], up_offset: int,
                init_value: float | None) -> mx.array:
        """The streaming launches over the rows of xs (each (B, S)), stream_batch_rows at a time."""
        B, stride = xs[0].shape
        step = 1 if B == 1 else plan.stream_batch_rows(K, self.device, self.config)
        outs = []
        for b0 in range(0, B, step):
            rows = min(step, B - b0)
            part = [a if rows == B else a[b0:b0 + rows] for a in xs]
            name, memory, launch = plan.stream_launch(qtype, K, N, act, up_offset, self.device, self.config,
                                                      rows, stride)
            outs.append(self.kernel(name, memory)(inputs=[w, *part], init_value=init_value, **launch)[0])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    # ---- decode attention ----

    def decode_attention(self, q: mx.array, kv: mx.array, params: mx.array, chunk: int,
                         splits: int, gate: mx.array | None = None, gate_offset: int = 0,
                         out_shape: tuple | None = None, init_value: float | None = None) -> mx.array:
        """One query token over the first params[0] rows of kv (2, n_kv, CAP, HD) f16, K then V, in `splits`
        splits of `chunk` rows (plan.attention_params(n_valid, chunk, splits) -> params; splits
        past the rows weigh zero). q (n_head, HD) or (1, n_head, HD) f32 -> (n_head, HD) f32, or
        `out_shape`.
        With `gate` (n_head * HD values from `gate_offset`) the output is multiplied by
        sigmoid(gate), the attention output gate, in the combine."""
        partial, combine = plan.attention_launch(q.shape[-2:], kv.shape[1:], chunk, splits, gate is not None,
                                                 gate_offset, out_shape, self.config)
        part_o, part_ml = self.kernel("attention_partial")(inputs=[q, kv, params], **partial)
        if gate is None:
            return self.kernel("attention_combine")(inputs=[part_o, part_ml, params], init_value=init_value,
                                                    **combine)[0]
        return self.kernel("attention_combine_gated")(inputs=[part_o, part_ml, params, gate],
                                                      init_value=init_value, **combine)[0]

    def decode_attention_seqs(self, q: mx.array, kvs: list[mx.array], params: mx.array,
                              chunk: int, splits: int, gate: mx.array | None = None, gate_offset: int = 0,
                              init_value: float | None = None) -> mx.array:
        """decode_attention for S = len(kvs) sequences (at most source.ATTENTION_SEQS) in one
        launch of each kernel: q (S, n_head, HD) f32, kvs[s] sequence s's (2, n_kv, CAP, HD) f16
        K|V storage (one shape for all), params (S, 8) int32 (plan.attention_params rows; one
        split count), the gate's row s from gate_offset for sequence s. -> (S, n_head * HD) f32."""
        seqs = len(kvs)
        if not 1 <= seqs <= source.ATTENTION_SEQS or q.shape[0] != seqs:
            raise ValueError(f"decode_attention_seqs takes 1..{source.ATTENTION_SEQS} sequences, got {seqs}")
        gate_row = 0 if gate is None else gate.shape[-1]
        partial, combine = plan.attention_launch(q.shape[-2:], kvs[0].shape[1:], chunk, splits, gate is not None,
                                                 gate_offset, None, self.config, seqs, gate_row)
        spare = source.ATTENTION_SEQS - seqs   # unused storage inputs: sequence 0's again (never read)
        part_o, part_ml = self.kernel("attention_partial_seqs")(
            inputs=[q, *kvs, *kvs[:1] * spare, params], **partial)
        if gate is None:
            return self.kernel("attention_combine_seqs")(inputs=[part_o, part_ml, params], init_value=init_value,
                                                         **combine)[0]
        return self.kernel("attention_combine_seqs_gated")(inputs=[part_o, part_ml, params, gate],
                                                           init_value=init_value, **combine)[0]

    # ---- prefill attention (prefill_attention.inc) ----

    def prefill_attention(self, q: mx.array, keys: mx.array, values: mx.array, q_pos: mx.array, k_pos: mx.array,
                          window: int | None, init_value: float | None = None) -> mx.array:
        """Causal GQA attention of a chunk, flash-style on the tensor cores: q (L, n_head, HD) float32;
        keys, values (n_kv, N, HD) float16; q_pos (L,), k_pos (N,) int32 absolute positions (key j
        visible to query i iff k_pos[j] <= q_pos[i] and, with a window W, q_pos[i] - k_pos[j] < W).
        -> (L, n_head * HD) float32. q and the softmax weights are rounded to f16 for the products."""
        L, n_head, hd = q.shape
        n_kv, N, _ = keys.shape
        launch = plan.prefill_attention_launch(L, n_head, n_kv, hd, self.device)
        if launch is None:
            raise ValueError(f"prefill attention does not take head dim {hd} with {n_head} / {n_kv} heads here")
        memory, kw = launch
        params = mx.array([L, N, window or 0, 0, 0, 0, 0, 0], dtype=mx.int32)
        return self.kernel("attention_prefill", memory)(
            inputs=[q.astype(mx.float32), keys, values, q_pos.astype(mx.int32), k_pos.astype(mx.int32), params],
            init_value=init_value, **kw)[0]

    # ---- the steps between the products (decode_glue.inc) ----

    def qk_post(self, q: mx.array, k: mx.array, v: mx.array, q_norm: mx.array, k_norm: mx.array, rope: mx.array,
                rope_half: int, eps: float, n_head: int, n_kv: int, head_dim: int, offsets: tuple = (0, 0, 0),
                init_value: float | None = None) -> tuple[mx.array, mx.array]:
        """R token rows of q, k, v (f32, each (R, row width)) -> q normed and rotated (R, n_head, hd)
        f32, K|V (2, n_kv, R, hd) f16 (the cache's layout).

        q, k and v are read from `offsets` within each row of their arrays (pass one stacked
        Q|K|gate|V output as each). `rope`: (R, 2*rope_half) cos then sin of each row's angles,
        unused when rope_half is 0 (NoPE); `eps` the RMSNorm epsilon, compiled into the kernel as its
        float32 bits (a 1-element array here was a read of small host-made memory by every threadgroup)."""
        rows = q.shape[0]
        tpg = -(-head_dim // 32) * 32
        q_off, k_off, v_off = offsets
        return tuple(self.kernel("qk_post")(
            inputs=[q, k, v, q_norm, k_norm, rope],
            template=[("HD", head_dim), ("NH", n_head), ("NKV", n_kv), ("ROPE_HALF", rope_half), ("TPG", tpg),
                      ("Q_OFF", q_off), ("K_OFF", k_off), ("V_OFF", v_off),
                      ("QS", q.shape[-1]), ("KS", k.shape[-1]), ("VS", v.shape[-1]), ("ROWS", rows),
                      ("EPS", float_bits(eps))],
            grid=((n_head + 2 * n_kv) * tpg, rows, 1), threadgroup=(tpg, 1, 1),
            output_shapes=[(rows, n_head, head_dim), (2, n_kv, rows, head_dim)],
            output_dtypes=[mx.float32, mx.float16], init_value=init_value, stream=mx.gpu))

    def residual_norm(self, x: mx.array, f: mx.array, w_post: mx.array, w_next: mx.array, eps_post: float,
                      eps_next: float, init_value: float | None = None) -> tuple[mx.array, mx.array]:
        """Per row of x, f (R, N) f32: r = x + rmsnorm(f, eps_post) * w_post, h = rmsnorm(r, eps_next) * w_next
        -> (r, h). f may come as (P, R, N), the parts of K of a tensor-core product (matvec's
        `parts`): added in order p = 0, 1, ... as the kernel loads them. The epsilons are compiled
        into the kernel (as qk_post's)."""
        rows, n = x.shape
        parts = f.shape[0] if f.ndim == 3 else 1
        if f.shape[-2:] != (rows, n):
            raise ValueError(f"residual_norm: f {f.shape} does not hold x's {x.shape}")
        tpg = min(1024, -(-n // 32) * 32)
        x_out, h = self.kernel("residual_norm")(
            inputs=[x, f, w_post, w_next],
            template=[("N", n), ("TPG", tpg), ("EPS_POST", float_bits(eps_post)), ("EPS_NEXT", float_bits(eps_next)),
                      ("FP", parts), ("R", rows if parts > 1 else 0)],
            grid=(tpg, rows, 1), threadgroup=(tpg, 1, 1), output_shapes=[(rows, n), (rows, n)],
            output_dtypes=[mx.float32, mx.float32], init_value=init_value, stream=mx.gpu)
        return x_out, h
