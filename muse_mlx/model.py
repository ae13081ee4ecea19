"""The Muse Glimmer forward pass as MLX modules, in the order the data flows.

The forward pass (DESIGN.md §1), computed in float32:

    x = rmsnorm(embed[tok])                                   (no weight)
    per layer:
      h = rmsnorm(x) * attn_norm
      q, k, v, g = Wq h, Wk h, Wv h, Wgate h
      q, k = rmsnorm(q) * attn_q_norm, rmsnorm(k) * attn_k_norm    (per head)
      sliding layers: RoPE (ggml NORM mode: adjacent pairs), base rope.freq_base_swa
      full layers: no position encoding (NoPE)
      K, V rounded to f16 and stored in the slot's ring / plane
      a = softmax(q K^T / sqrt(head_dim) + mask) V     (window on sliding layers)
      x = x + rmsnorm(Wo (a * sigmoid(g)), 1e-8) * post_attention_norm
      h = rmsnorm(x) * ffn_norm
      x = x + rmsnorm(Wdown(silu(Wgate h) * Wup h), 1e-8) * post_ffw_norm
    logits = (Woutput (rmsnorm(x) * output_norm)) * logit_scale, then c*tanh(logits/c)

Two paths share this code (kernels.py chooses): the MLX-ops reference path keeps
every matrix as dense float32, dequantized once at load; the kernel path keeps
the raw GGUF blocks and multiplies them in place (custom_kernels/matvec.inc) for
up to 8 rows at a time, dequantizing a matrix on the fly only for longer prefill
chunks, and runs single-token attention with custom_kernels/attention.inc.
"""

from __future__ import annotations

import math
import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .artifact import Artifact, RawTensor
from .geometry import LAYER_TENSORS, POST_NORM_EPS, PREFILL_CHUNK, Geometry
from . import kernels
from .decode_kv import EagerRows, TracedRows, step_plan
from .kv import KV_DTYPE, SlotCache
from .quant import dequantize

# Bound on one attention score block (heads x queries x keys x 4 bytes) on the
# reference path, so a 512-token chunk at depth 131,072 does not need 8.6 GB at once.
_SCORE_BLOCK_BYTES = 256 * 2**20


class Projection(nn.Module):
    """y = x W^T for a GGUF matrix of any supported type (or several of one type, stacked by rows).

    Reference path: dense float32 weights, dequantized once at load. Kernel path: the raw
    blocks, multiplied in place by the matvec kernels for up to kernels.MAX_BATCH rows;
    a longer chunk (prefill) dequantizes the matrix for that one product. Stacking the
    rows of matrices that read the same input (Q, K and gate; FFN gate and up) makes one
    launch of them; the blocks themselves are not changed.
    """

    def __init__(self, raws: RawTensor | list[RawTensor], use_kernels: bool):
        super().__init__()
        raws = raws if isinstance(raws, list) else [raws]
        self.qtype = raws[0].qtype
        if any(r.qtype != self.qtype or r.shape[0] != raws[0].shape[0] for r in raws):
            raise ValueError("stacked projections need one type and one row length")
        self.shape = (raws[0].shape[0], sum(r.shape[1] for r in raws))  # (in, out) in GGUF order
        self.use_kernels = use_kernels and kernels.supports(self.qtype)
        blocks = mx.concatenate([mx.array(np.ascontiguousarray(r.data)) for r in raws]) if len(raws) > 1 \
            else mx.array(np.ascontiguousarray(raws[0].data))  # (out, row_bytes)
        if self.use_kernels:
            self.blocks = blocks
        else:
            self.weight = dequantize(blocks, self.qtype)  # (out, in)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.use_kernels:
            return x @ self.weight.T
        if x.shape[0] <= kernels.MAX_BATCH:
            return kernels.matvec(self.blocks, self.qtype, x)
        return x @ dequantize(self.blocks, self.qtype).T


    def streams_one_token(self) -> bool:
        """Whether a one-token product takes the streaming kernel (kernels.streams)."""
        return self.use_kernels and kernels.streams(self.qtype, self.shape[0])


class ResidualStep:
    """The normed input h of a sub-layer in a decode token, as the projections that read it need it.

    Either given (the first layer: h and the residual x), or pending: h = rmsnorm(r)·w_next with
    r = x + rmsnorm(f)·w_post, the previous sub-layer's output f joining the residual.
    `project(projections)` returns each projection of h (one token) and sets `residual` to r.
    With kernels.settings().fuse_norm and every projection streaming, each makes h in its own
    prologue (kernels.matvec_resnorm: no residual_norm launch); otherwise h is made once
    (kernels.residual_norm) and multiplied as usual."""

    def __init__(self, x: mx.array, f: mx.array | None = None, w_post: mx.array | None = None,
                 w_next: mx.array | None = None, eps: mx.array | None = None, h: mx.array | None = None):
        self.residual, self.h = (x, h) if h is not None else (None, None)
        self.pending = (x, f, w_post, w_next, eps)

    def project(self, projections: list[Projection]) -> list[mx.array]:
        if self.h is None:
            if kernels.settings().fuse_norm and all(p.streams_one_token() for p in projections):
                outs = [kernels.matvec_resnorm(p.blocks, p.qtype, *self.pending) for p in projections]
                self.residual = outs[0][1]
                return [y for y, _ in outs]
            self.residual, self.h = kernels.residual_norm(*self.pending)
        return [p(self.h) for p in projections]


def _stackable(raws: list[RawTensor]) -> bool:
    return len({r.qtype for r in raws}) == 1


class Embedding(nn.Module):
    """Token rows gathered from the raw table and dequantized on the fly (only the rows used)."""

    def __init__(self, raw: RawTensor):
        super().__init__()
        self.qtype = raw.qtype
        self.rows = mx.array(np.ascontiguousarray(raw.data))  # (n_vocab, row_bytes)

    def __call__(self, tokens: mx.array) -> mx.array:
        return dequantize(self.rows[tokens], self.qtype)


def _vector(raw: RawTensor) -> mx.array:
    return dequantize(mx.array(np.ascontiguousarray(raw.data)), raw.qtype).reshape(-1)


def rope_cos_sin(positions: np.ndarray, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of ggml's RoPE angles, (L, rope_dim/2), float32 numpy.

    ggml (ggml_rope_cache_init) starts from theta = p and multiplies by
    theta_scale = base^(-2/rope_dim) once per pair, in float32; this reproduces that
    recurrence so the angles round the way the reference's do.
    """
    theta_scale = np.float32(np.float32(base) ** np.float32(-2.0 / rope_dim))
    theta = positions.astype(np.float32)
    angles = np.empty((len(positions), rope_dim // 2), dtype=np.float32)
    for i in range(rope_dim // 2):
        angles[:, i] = theta
        theta = (theta * theta_scale).astype(np.float32)
    a64 = angles.astype(np.float64)
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


def rope_tables(positions: np.ndarray, rope_dim: int, base: float) -> tuple[mx.array, mx.array]:
    """rope_cos_sin as MLX arrays."""
    cos, sin = rope_cos_sin(positions, rope_dim, base)
    return mx.array(cos), mx.array(sin)


class RopeRows:
    """cos then sin of one position's RoPE angles (rope_cos_sin) for the decode step, worked out
    for a block of positions at a time: one position alone costs ~30 us of numpy a token."""

    BLOCK = 256

    def __init__(self, rope_dim: int, base: float):
        self.rope_dim, self.base = rope_dim, base
        self.block, self.table = -1, None

    def row(self, position: int) -> np.ndarray:
        block = position // self.BLOCK
        if block != self.block:
            cos, sin = rope_cos_sin(np.arange(block * self.BLOCK, (block + 1) * self.BLOCK), self.rope_dim, self.base)
            self.block, self.table = block, np.concatenate([cos, sin], axis=1)
        return self.table[position - block * self.BLOCK]


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first rope_dim dims; x is (L, heads, head_dim)."""
    L, n_heads, head_dim = x.shape
    rope_dim = 2 * cos.shape[-1]
    pairs = x[..., :rope_dim].reshape(L, n_heads, rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = mx.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(L, n_heads, rope_dim)
    if rope_dim == head_dim:
        return rotated
    return mx.concatenate([rotated, x[..., rope_dim:]], axis=-1)


def attention(q: mx.array, keys: mx.array, values: mx.array, q_pos: np.ndarray, k_pos: np.ndarray,
              window: int | None, scale: float) -> mx.array:
    """Causal GQA attention in float32.

    q: (L, n_head, hd); keys/values: (n_kv, N, hd) f16; q_pos (L,), k_pos (N,) absolute
    positions. A key is visible iff k_pos <= q_pos and, with a window W,
    q_pos - k_pos < W. Returns (L, n_head * hd).
    """
    L, n_head, hd = q.shape
    n_kv, N, _ = keys.shape
    group = n_head // n_kv
    k = keys.astype(mx.float32)[:, None]          # (n_kv, 1, N, hd)
    v = values.astype(mx.float32)[:, None]
    qh = q.transpose(1, 0, 2).reshape(n_kv, group, L, hd)
    step = max(1, _SCORE_BLOCK_BYTES // max(1, n_head * N * 4))
    outs = []
    for a in range(0, L, step):
        b = min(L, a + step)
        rel = q_pos[a:b, None] - k_pos[None, :]
        visible = rel >= 0
        if window is not None:
            visible &= rel < window
        mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
        scores = (qh[:, :, a:b] @ k.swapaxes(-1, -2)) * scale + mask
        probs = mx.softmax(scores, axis=-1, precise=True)
        outs.append(probs @ v)                    # (n_kv, group, b-a, hd)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.reshape(n_head, L, hd).transpose(1, 0, 2).reshape(L, n_head * hd)


def output_gate(a: mx.array, gate: mx.array) -> mx.array:
    """The attention output gate: a * sigmoid(Wgate h), before the output projection."""
    return a * mx.sigmoid(gate)


@mx.compile
def _silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, g: Geometry, layer: int, t: dict[str, RawTensor], use_kernels: bool):
        super().__init__()
        self.g, self.sliding, self.use_kernels = g, g.is_swa(layer), use_kernels
        self.attn_norm = _vector(t["attn_norm"])
        qkg = [t["attn_q"], t["attn_k"], t["attn_gate"]]
        # One launch for the projections of h: Q|K|gate, and V after them where its type is
        # theirs (in Q4_K_M, the layers without "more bits" for V).
        self.v_stacked = bool(use_kernels and _stackable(qkg + [t["attn_v"]]))
        if use_kernels and _stackable(qkg):
            self.wqkg = Projection(qkg + [t["attn_v"]] if self.v_stacked else qkg, use_kernels)
        else:
            self.wq, self.wk, self.wgate = (Projection(r, use_kernels) for r in qkg)
        if not self.v_stacked:
            self.wv = Projection(t["attn_v"], use_kernels)
        self.q_norm, self.k_norm = _vector(t["attn_q_norm"]), _vector(t["attn_k_norm"])
        self.wo = Projection(t["attn_output"], use_kernels)
        self.post_norm = _vector(t["post_attention_norm"])
        self.scale = 1.0 / math.sqrt(g.head_dim)
        self.eps = mx.array([g.rms_eps], dtype=mx.float32)

    def decode_one(self, step: ResidualStep, rope: mx.array, kv, layer: int) -> mx.array:
        """The kernel path's attention for one token: its normed input (a ResidualStep) -> Wo output (1, n_embd).

        The same math as __call__, in fewer launches: q/k RMSNorm, RoPE and the f16 rounding
        of K and V in one kernel (kernels.qk_post), the output gate inside the attention's
        combine step. `kv` (decode_kv: EagerRows or TracedRows) writes layer `layer`'s row and
        attends over its rows."""
        g = self.g
        if "wqkg" in self:  # one stacked product; the kernels read q, k, the gate (and v) at their offsets
            outs = step.project([self.wqkg] if self.v_stacked else [self.wqkg, self.wv])
            q = k = gate = outs[0]
            offsets = (0, g.q_dim, g.q_dim + g.kv_dim)
            v, v_offset = (q, 2 * g.q_dim + g.kv_dim) if self.v_stacked else (outs[1], 0)
        else:
            q, k, gate, v = step.project([self.wq, self.wk, self.wgate, self.wv])
            offsets, v_offset = (0, 0, 0), 0
        rope_half = g.rope_dim // 2 if self.sliding else 0
        q, k16, v16 = kernels.qk_post(q, k, v, self.q_norm, self.k_norm, rope, rope_half, self.eps,
                                      g.n_head, g.n_head_kv, g.head_dim, offsets[0], offsets[1], v_offset=v_offset)
        kv.write(layer, k16, v16)
        a = kv.attend(layer, q, gate=gate, gate_offset=offsets[2], out_shape=(1, g.q_dim))
        return self.wo(a)

    def __call__(self, x: mx.array, positions: np.ndarray, rope, cache) -> mx.array:
        g, L = self.g, x.shape[0]
        h = mx.fast.rms_norm(x, self.attn_norm, g.rms_eps)
        if "wqkg" in self:
            qkg = self.wqkg(h)
            gate_end = 2 * g.q_dim + g.kv_dim
            q, k, gate = qkg[:, :g.q_dim], qkg[:, g.q_dim:g.q_dim + g.kv_dim], qkg[:, g.q_dim + g.kv_dim:gate_end]
        else:
            q, k, gate = self.wq(h), self.wk(h), self.wgate(h)
        v = qkg[:, gate_end:] if self.v_stacked else self.wv(h)
        q = q.reshape(L, g.n_head, g.head_dim)
        k = k.reshape(L, g.n_head_kv, g.head_dim)
        v = v.reshape(L, g.n_head_kv, g.head_dim)
        q = mx.fast.rms_norm(q, self.q_norm, g.rms_eps)
        k = mx.fast.rms_norm(k, self.k_norm, g.rms_eps)
        if self.sliding:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k16 = k.astype(cache.dtype).transpose(1, 0, 2)   # (n_kv, L, hd): the cache's layout
        v16 = v.astype(cache.dtype).transpose(1, 0, 2)
        # Attend over the rows held before this chunk plus the chunk's own, then store the
        # chunk: correct for a chunk longer than the ring (kv.py). (One token on the kernel
        # path with f16 KV takes decode_one instead.)
        old_k, old_v, old_pos = cache.view()
        keys = mx.concatenate([old_k, k16], axis=1)
        values = mx.concatenate([old_v, v16], axis=1)
        k_pos = np.concatenate([old_pos, positions])
        cache.append(k16, v16)
        window = g.sliding_window if self.sliding else None
        a = attention(q, keys, values, positions, k_pos, window, self.scale)
        return mx.fast.rms_norm(self.wo(output_gate(a, gate)), self.post_norm, POST_NORM_EPS)


class FeedForward(nn.Module):
    def __init__(self, g: Geometry, t: dict[str, RawTensor], use_kernels: bool):
        super().__init__()
        self.eps = g.rms_eps
        self.ffn_norm = _vector(t["ffn_norm"])
        self.n_ff = g.n_ff
        if use_kernels and _stackable([t["ffn_gate"], t["ffn_up"]]):  # one launch for gate and up
            self.wgate_up = Projection([t["ffn_gate"], t["ffn_up"]], use_kernels)
        else:
            self.wgate, self.wup = Projection(t["ffn_gate"], use_kernels), Projection(t["ffn_up"], use_kernels)
        self.wdown = Projection(t["ffn_down"], use_kernels)
        self.post_norm = _vector(t["post_ffw_norm"])

    def decode_one(self, step: ResidualStep) -> mx.array:
        """The kernel path for one token: its normed input (a ResidualStep) -> Wdown output (1, n_embd)."""
        down = self.wdown
        fused = down.use_kernels and kernels.streams(down.qtype, self.n_ff)  # the activation made inside the product
        if "wgate_up" in self:
            (gu,) = step.project([self.wgate_up])
            if fused:
                return kernels.matvec_silu(down.blocks, down.qtype, gu, gu, up_offset=self.n_ff)
            gate, up = gu[:, :self.n_ff], gu[:, self.n_ff:]
        else:
            gate, up = step.project([self.wgate, self.wup])
            if fused:
                return kernels.matvec_silu(down.blocks, down.qtype, gate, up)
        return down(_silu_mul(gate, up))

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.fast.rms_norm(x, self.ffn_norm, self.eps)
        if "wgate_up" in self:
            gu = self.wgate_up(h)
            gate, up = gu[:, :self.n_ff], gu[:, self.n_ff:]
        else:
            gate, up = self.wgate(h), self.wup(h)
        f = self.wdown(nn.silu(gate) * up)
        return mx.fast.rms_norm(f, self.post_norm, POST_NORM_EPS)


class Block(nn.Module):
    def __init__(self, g: Geometry, layer: int, t: dict[str, RawTensor], use_kernels: bool):
        super().__init__()
        self.attention = Attention(g, layer, t, use_kernels)
        self.feed_forward = FeedForward(g, t, use_kernels)

    def __call__(self, x, positions, rope, cache):
        x = x + self.attention(x, positions, rope, cache)
        return x + self.feed_forward(x)


class Model(nn.Module):
    """Muse Glimmer from a validated artifact, on the kernel path when a GPU backend is present."""

    def __init__(self, artifact: Artifact, use_kernels: bool | None = None):
        super().__init__()
        self.artifact = artifact
        self.backend = kernels.backend() if use_kernels is not False else None
        if use_kernels and self.backend is None:
            raise RuntimeError("the kernel path needs a Metal or CUDA device")
        on_gpu = self.backend is not None
        g = self.geometry = artifact.geometry
        t = artifact.tensors
        self.embed = Embedding(t["token_embd.weight"])
        self.blocks = [
            Block(g, il, {name: t[f"blk.{il}.{name}.weight"] for name in LAYER_TENSORS}, on_gpu)
            for il in range(g.n_layer)
        ]
        self.output_norm = _vector(t["output_norm.weight"])
        self.output = Projection(t["output.weight"], on_gpu)
        # RMSNorm epsilons of the fused residual step (kernels.residual_norm): post-norm, then the next norm.
        self.eps_post_rms = mx.array([POST_NORM_EPS, g.rms_eps], dtype=mx.float32)
        self._rope_rows = RopeRows(g.rope_dim, g.rope_base_swa)
        self._compiled_steps: dict = {}   # (settings, StepPlan.trace_key) -> the compiled layers of a token
        mx.eval(self.parameters())

    @property
    def path(self) -> str:
        return f"kernels ({self.backend})" if self.backend else "MLX ops (reference)"

    def projections(self) -> list[Projection]:
        """Every matrix product of one step, as launched (stacked ones count once)."""
        return [m for m in self.modules() if isinstance(m, Projection)]

    @property
    def weight_bytes(self) -> int:
        """Bytes the loaded weights occupy (raw blocks on the kernel path, dense f32 on the reference path)."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def make_cache(self, context: int | None = None, dtype=KV_DTYPE) -> SlotCache:
        return SlotCache(self.geometry, context or self.geometry.context_length, dtype)

    def __call__(self, tokens: mx.array, cache: SlotCache, all_logits: bool = True) -> mx.array:
        """Run `tokens` (L,) at positions cache.offset.. and return logits (L or 1, n_vocab)."""
        g = self.geometry
        L = tokens.shape[0]
        cache.check_room(L)
        if L == 1 and self.backend is not None and cache.dtype == mx.float16:
            return self.decode_one(tokens, cache)
        positions = np.arange(cache.offset, cache.offset + L, dtype=np.int64)
        rope = rope_tables(positions, g.rope_dim, g.rope_base_swa)
        x = mx.fast.rms_norm(self.embed(tokens), None, g.rms_eps)
        dequantizing = self.backend is not None and L > kernels.MAX_BATCH
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, positions, rope, layer_cache)
            if dequantizing:  # bound the dequantized weights alive at once to one layer's
                mx.eval(x, layer_cache.state())
        if not all_logits:
            x = x[-1:]
        return _final_logits(self.output(mx.fast.rms_norm(x, self.output_norm, g.rms_eps)), g.logit_scale,
                             g.final_logit_softcap)

    def decode_one(self, tokens: mx.array, cache: SlotCache) -> mx.array:
        """One token on the kernel path, in about 13 launches per layer (docs/kernels.md, "decode step").

        The same forward pass as __call__, regrouped: each sub-layer's post-norm and residual
        add are fused with the next sub-layer's input norm (kernels.residual_norm). With
        MUSE_MLX_COMPILE=1 the layers run as one compiled function (_compiled_layers)."""
        with kernels.frozen_settings() as s:  # the MUSE_MLX_* knobs read once for the token's ~600 launches
            g = self.geometry
            rope = mx.array(self._rope_rows.row(cache.offset))
            x = mx.fast.rms_norm(self.embed(tokens), None, g.rms_eps)
            if s.compile_step:
                logits = self._compiled_layers(x, rope, cache, s)
            else:
                logits = self._decode_layers(x, rope, EagerRows(cache))
            return _final_logits(logits, g.logit_scale, g.final_logit_softcap)

    def _decode_layers(self, x: mx.array, rope: mx.array, kv) -> mx.array:
        """The layers and the LM head of one token (before the logit scale): x (1, n_embd) normed
        embedding -> (1, n_vocab); `kv` writes and reads the K/V (decode_kv)."""
        g = self.geometry
        h = mx.fast.rms_norm(x, self.blocks[0].attention.attn_norm, g.rms_eps)
        step = ResidualStep(x, h=h)
        for i, block in enumerate(self.blocks):
            att, ffn = block.attention, block.feed_forward
            o = att.decode_one(step, rope, kv, i)
            step = ResidualStep(step.residual, o, att.post_norm, ffn.ffn_norm, self.eps_post_rms)
            f = ffn.decode_one(step)
            w_next = self.blocks[i + 1].attention.attn_norm if i + 1 < len(self.blocks) else self.output_norm
            step = ResidualStep(step.residual, f, ffn.post_norm, w_next, self.eps_post_rms)
        (logits,) = step.project([self.output])
        return logits

    def _compiled_layers(self, x: mx.array, rope: mx.array, cache: SlotCache, s: kernels.Settings) -> mx.array:
        """_decode_layers as an mx.compile'd function of (x, rope, the StepPlan's arrays, the K/V
        storage) -> (logits, the storage with the token's rows written), traced once per settings
        and StepPlan.trace_key (a new split count: ~4 per doubling of the depth), replayed by MLX
        for every other token. The slot's storage is rebound to the outputs at once, so the old
        arrays' only holders are the row writes (which may then write in place)."""
        plan = step_plan(cache)
        key = (s, plan.trace_key)
        fn = self._compiled_steps.get(key)
        if fn is None:
            model = weakref.ref(self)   # no cycle model -> compiled step -> model: freed with the model

            def layers(x, rope, *arrays, plan_key=plan.trace_key, n_plan=len(plan.arrays)):
                kv = TracedRows(plan_key, list(arrays[:n_plan]), list(arrays[n_plan:]))
                return [model()._decode_layers(x, rope, kv), *kv.state]
            fn = self._compiled_steps[key] = mx.compile(layers)
        logits, *state = fn(x, rope, *plan.arrays, *cache.state())
        cache.rebind(state, 1)
        return logits

    def prefill(self, tokens, cache: SlotCache, chunk: int = PREFILL_CHUNK,
                all_logits: bool = False) -> mx.array:
        """Feed a prompt in chunks of `chunk` positions; logits of the last token (or of all)."""
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
        cache.check_room(tokens.shape[0])
        outs = []
        for a in range(0, tokens.shape[0], chunk):
            logits = self(tokens[a:a + chunk], cache, all_logits=all_logits)
            mx.eval(logits, cache.state())
            outs.append(logits)
        return mx.concatenate(outs, axis=0) if all_logits else outs[-1]


def _final_logits(logits: mx.array, scale: float, softcap: float) -> mx.array:
    """logits * scale, then c * tanh(logits / c) when the file sets a softcap c."""
    logits = logits * scale
    if softcap:
        logits = mx.tanh(logits / softcap) * softcap
    return logits


def load(path, use_kernels: bool | None = None) -> Model:
    """Open, validate and load a GGUF; `use_kernels=False` forces the reference path."""
    from .artifact import open_artifact

    return Model(open_artifact(path), use_kernels)


__all__ = ["Model", "Projection", "load", "attention", "apply_rope", "rope_cos_sin", "rope_tables", "output_gate"]
