"""The kernel path's launches: each kernel of custom_kernels/ behind a function of MLX arrays.

A `Kernels` is made once per model, for one backend, device and KernelConfig; `build` makes a
kernel object from its name (source.build; the tests pass an emulator's). Every launch is
planned by kernels/plan.py from its shapes and is memoised there.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

from ..config import KernelConfig
from . import plan, source
from .device import Device


class Kernels:
    def __init__(self, device: Device, config: KernelConfig = KernelConfig(),
                 build: Callable | None = None):
        self.device, self.config = device, config
        self._build = build or source.build

    def kernel(self, name: str):
        return self._build(name, self.device.backend, 0)

    # ---- matrix products over raw GGUF blocks ----

    def matvec(self, w: mx.array, qtype: QT, x: mx.array, init_value: float | None = None) -> mx.array:
        """x (B, K) float32, 1 <= B <= MAX_BATCH; w the raw GGUF rows (N, row_bytes) uint8 -> (B, N) float32.

        One row on a type with a streaming kernel takes it (matvec_stream.inc); otherwise
        matvec.inc, which reads each weight once for all B rows. `init_value` pre-fills the
        output (tests poison it with NaN to catch unwritten elements)."""
        B, K = x.shape
        if not 1 <= B <= plan.MAX_BATCH:
            raise ValueError(f"matvec takes 1..{plan.MAX_BATCH} rows, got {B}")
        x = x.astype(mx.float32)
        N = w.shape[0]
        if B == 1 and plan.streams(qtype, K):
            name, launch = plan.stream_launch(qtype, K, N, "", 0, self.device, self.config)
            return self.kernel(name)(inputs=[w, x], init_value=init_value, **launch)[0]
        name, launch = plan.batch_launch(qtype, K, N, B)
        if qtype in plan.QUANT_VARIANTS:
            xs = x.reshape(B, K // 16, 16).sum(axis=-1)
            return self.kernel(name)(inputs=[w, x, xs], init_value=init_value, **launch)[0]
        weights = w.view(plan.FLOAT_DTYPES[qtype]).reshape(N, K)
        return self.kernel(name)(inputs=[weights, x], init_value=init_value, **launch)[0]

    def matvec_silu(self, w: mx.array, qtype: QT, gate: mx.array, up: mx.array, up_offset: int = 0,
                    init_value: float | None = None) -> mx.array:
        """W @ (silu(gate) * up) for one token, the activation made inside the streaming kernel
        (plan.streams(qtype, K) must hold). gate: K float32 values from its start; up: K from
        `up_offset` (pass one stacked gate|up output as both, up_offset = K). -> (1, N) float32."""
        K = w.shape[1] // plan.ROW_BYTES_PER_256[qtype] * 256
        name, launch = plan.stream_launch(qtype, K, w.shape[0], "_silu", up_offset, self.device, self.config)
        return self.kernel(name)(inputs=[w, gate, up], init_value=init_value, **launch)[0]

    # ---- decode attention ----

    def decode_attention(self, q: mx.array, keys: mx.array, values: mx.array, params: mx.array, chunk: int,
                         splits: int, gate: mx.array | None = None, gate_offset: int = 0,
                         out_shape: tuple | None = None, init_value: float | None = None) -> mx.array:
        """One query token over the first params[0] rows of (n_kv, CAP, HD) f16 K/V, in `splits`
        splits of `chunk` rows (plan.attention_params(n_valid, chunk, splits) -> params; splits
        past the rows weigh zero). q (n_head, HD) or (1, n_head, HD) f32 -> (n_head, HD) f32, or
        `out_shape`.
        With `gate` (n_head * HD values from `gate_offset`) the output is multiplied by
        sigmoid(gate), the attention output gate, in the combine."""
        partial, combine = plan.attention_launch(q.shape[-2:], keys.shape, chunk, splits, gate is not None, gate_offset,
                                                 out_shape, self.config)
        part_o, part_ml = self.kernel("attention_partial")(inputs=[q, keys, values, params], **partial)
        if gate is None:
            return self.kernel("attention_combine")(inputs=[part_o, part_ml, params], init_value=init_value,
                                                    **combine)[0]
        return self.kernel("attention_combine_gated")(inputs=[part_o, part_ml, params, gate],
                                                      init_value=init_value, **combine)[0]

    # ---- the steps between the products (decode_glue.inc) ----

    def qk_post(self, q: mx.array, k: mx.array, v: mx.array, q_norm: mx.array, k_norm: mx.array, rope: mx.array,
                rope_half: int, eps: mx.array, n_head: int, n_kv: int, head_dim: int, offsets: tuple = (0, 0, 0),
                init_value: float | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """R token rows of q, k, v (f32, each (R, row width)) -> q normed and rotated (R, n_head, hd)
        f32, k and v (n_kv, R, hd) f16 (the cache's layout).

        q, k and v are read from `offsets` within each row of their arrays (pass one stacked
        Q|K|gate|V output as each). `rope`: (R, 2*rope_half) cos then sin of each row's angles,
        unused when rope_half is 0 (NoPE); `eps` a 1-element f32 array (the RMSNorm epsilon)."""
        rows = q.shape[0]
        tpg = -(-head_dim // 32) * 32
        q_off, k_off, v_off = offsets
        return tuple(self.kernel("qk_post")(
            inputs=[q, k, v, q_norm, k_norm, rope, eps],
            template=[("HD", head_dim), ("NH", n_head), ("NKV", n_kv), ("ROPE_HALF", rope_half), ("TPG", tpg),
                      ("Q_OFF", q_off), ("K_OFF", k_off), ("V_OFF", v_off),
                      ("QS", q.shape[-1]), ("KS", k.shape[-1]), ("VS", v.shape[-1]), ("ROWS", rows)],
            grid=((n_head + 2 * n_kv) * tpg, rows, 1), threadgroup=(tpg, 1, 1),
            output_shapes=[(rows, n_head, head_dim), (n_kv, rows, head_dim), (n_kv, rows, head_dim)],
            output_dtypes=[mx.float32, mx.float16, mx.float16], init_value=init_value, stream=mx.gpu))

    def residual_norm(self, x: mx.array, f: mx.array, w_post: mx.array, w_next: mx.array, eps: mx.array,
                      init_value: float | None = None) -> tuple[mx.array, mx.array]:
        """Per row of x, f (R, N) f32: r = x + rmsnorm(f, eps[0]) * w_post, h = rmsnorm(r, eps[1]) * w_next
        -> (r, h)."""
        rows, n = x.shape
        tpg = min(1024, -(-n // 32) * 32)
        x_out, h = self.kernel("residual_norm")(
            inputs=[x, f, w_post, w_next, eps], template=[("N", n), ("TPG", tpg)],
            grid=(tpg, rows, 1), threadgroup=(tpg, 1, 1), output_shapes=[(rows, n), (rows, n)],
            output_dtypes=[mx.float32, mx.float32], init_value=init_value, stream=mx.gpu)
        return x_out, h
