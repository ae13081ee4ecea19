"""The Muse Glimmer forward pass, once, in the order the data flows.

    x = rmsnorm(embed[tok])                                   (no weight)
    h = rmsnorm(x) * attn_norm[0]
    per layer:
      q, k, v, g = Wq h, Wk h, Wv h, Wgate h
      q, k = rmsnorm(q) * attn_q_norm, rmsnorm(k) * attn_k_norm    (per head)
      sliding layers: RoPE (ggml NORM mode: adjacent pairs), base rope.freq_base_swa
      full layers: no position encoding (NoPE)
      K, V rounded to the cache's dtype (f16) and stored in the slot's ring / plane
      a = softmax(q K^T / sqrt(head_dim) + mask) V * sigmoid(g)    (window on sliding layers)
      x = x + rmsnorm(Wo a, 1e-8) * post_attention_norm;   h = rmsnorm(x) * ffn_norm
      x = x + rmsnorm(Wdown(silu(Wgate h) * Wup h), 1e-8) * post_ffw_norm;   h = rmsnorm(x) * (next norm)
    logits = (Woutput h) * logit_scale, then c*tanh(logits/c)   (h normed by output_norm)

Each sub-layer's residual add is written together with the next sub-layer's input norm
(ops.residual_norm), the form the GPU fuses; the arithmetic is DESIGN.md §1's. The forward
takes tokens (B, T) for B sequences with one SlotCache each: B = 1..4 for slots, T = 1 for a
decode step, T = k + 1 for a speculative verify, T = a chunk for prefill. How each step is
computed is the ops backend's (ops/): MLX ops, or the custom kernels over raw blocks. A decode
step on the GPU (T = 1, f16 caches) runs as one mx.compile'd function of this same forward.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .artifact import Artifact, RawTensor, check_matrix_weights
from .errors import ArtifactError
from .config import KernelConfig
from .geometry import LAYER_TENSORS, POST_NORM_EPS, PREFILL_CHUNK, Geometry
from .kv import KV_DTYPE, SlotCache
from .ops import ReferenceOps, Slice, select_ops
from .quant import dequantize
from .weight_stream import load_raw


class Projections(nn.Module):
    """The products of one input: named matrices, those of one type and row length stacked into
    one product (one launch; the blocks themselves unchanged). Returns a Slice per name."""

    def __init__(self, ops: ReferenceOps, named: dict[str, RawTensor]):
        super().__init__()
        self._ops = ops
        groups: dict[tuple, list[str]] = {}
        for name, raw in named.items():
            groups.setdefault((raw.qtype, raw.shape[0]), []).append(name)
        self.products = [ops.matrix([named[n] for n in names]) for names in groups.values()]
        self._layout = []   # (product index, name, offset, width)
        for p, names in enumerate(groups.values()):
            offset = 0
            for n in names:
                self._layout.append((p, n, offset, named[n].shape[1]))
                offset += named[n].shape[1]

    def __call__(self, h: mx.array) -> dict[str, Slice]:
        outs = [self._ops.project(w, h) for w in self.products]
        return {n: Slice(outs[p], offset, width) for p, n, offset, width in self._layout}


def _vector(raw: RawTensor) -> mx.array:
    return dequantize(load_raw([raw])[0], raw.qtype).reshape(-1)


class Embedding(nn.Module):
    """Token rows gathered from the raw table and dequantized on the fly (only the rows used)."""

    def __init__(self, raw: RawTensor, ops: ReferenceOps):
        super().__init__()
        self.qtype = raw.qtype
        self.rows = ops.load_raw([raw])[0]  # (n_vocab, row_bytes)

    def __call__(self, tokens: mx.array) -> mx.array:
        return dequantize(self.rows[tokens], self.qtype)


class Attention(nn.Module):
    def __init__(self, ops: ReferenceOps, g: Geometry, layer: int, t: dict[str, RawTensor]):
        super().__init__()
        self._ops, self.g, self.layer = ops, g, layer
        self.rope_half = g.rope_dim // 2 if g.is_swa(layer) else 0
        self.attn_norm = _vector(t["attn_norm"])
        self.wqkgv = Projections(ops, {"q": t["attn_q"], "k": t["attn_k"], "gate": t["attn_gate"], "v": t["attn_v"]})
        self.q_norm, self.k_norm = _vector(t["attn_q_norm"]), _vector(t["attn_k_norm"])
        self.wo = ops.matrix([t["attn_output"]])
        self.post_norm = _vector(t["post_attention_norm"])

    def __call__(self, h: mx.array, rope: mx.array, kv, kv_dtype) -> mx.array:
        """h (rows, n_embd), the normed input -> Wo of the gated attention (rows, n_embd)."""
        p = self.wqkgv(h)
        q, kv_new = self._ops.qk_post(p["q"], p["k"], p["v"], self.q_norm, self.k_norm, rope, self.rope_half, self.g,
                                      kv_dtype)
        return self._ops.project_out(self.wo, kv.attend(self.layer, q, kv_new, p["gate"]))


class FeedForward(nn.Module):
    def __init__(self, ops: ReferenceOps, t: dict[str, RawTensor]):
        super().__init__()
        self._ops = ops
        self.ffn_norm = _vector(t["ffn_norm"])
        self.wgate_up = Projections(ops, {"gate": t["ffn_gate"], "up": t["ffn_up"]})
        self.wdown = ops.matrix([t["ffn_down"]])
        self.post_norm = _vector(t["post_ffw_norm"])

    def __call__(self, h: mx.array) -> mx.array:
        """h (rows, n_embd), the normed input -> Wdown(silu(Wgate h) * Wup h) (rows, n_embd)."""
        p = self.wgate_up(h)
        return self._ops.down_silu(self.wdown, p["gate"], p["up"])


class Block(nn.Module):
    def __init__(self, ops: ReferenceOps, g: Geometry, layer: int, t: dict[str, RawTensor]):
        super().__init__()
        self.attention = Attention(ops, g, layer, t)
        self.feed_forward = FeedForward(ops, t)


def rope_cos_sin(positions: np.ndarray, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of ggml's RoPE angles, (L, rope_dim/2), float32 numpy.

    ggml (ggml_rope_cache_init) starts from theta = p and multiplies by
    theta_scale = base^(-2/rope_dim) once per pair, in float32; this reproduces that
    recurrence so the angles round the way the reference's do."""
    theta_scale = np.float32(np.float32(base) ** np.float32(-2.0 / rope_dim))
    theta = positions.astype(np.float32)
    angles = np.empty((len(positions), rope_dim // 2), dtype=np.float32)
    for i in range(rope_dim // 2):
        angles[:, i] = theta
        theta = (theta * theta_scale).astype(np.float32)
    a64 = angles.astype(np.float64)
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


class RopeRows:
    """cos then sin of the RoPE angles of given positions, (rows, rope_dim), worked out a block of
    256 positions at a time (one position alone costs ~30 us of numpy, every decode step)."""

    BLOCK = 256

    def __init__(self, rope_dim: int, base: float):
        self.rope_dim, self.base = rope_dim, base
        self.block, self.table = -1, None

    def rows(self, positions: np.ndarray) -> np.ndarray:
        block = int(positions[0]) // self.BLOCK
        if int(positions.max()) // self.BLOCK == block and int(positions.min()) >= block * self.BLOCK:
            if block != self.block:
                self.block, self.table = block, self.block_rows(block)
            return self.table[positions - block * self.BLOCK]
        return np.concatenate(rope_cos_sin(positions, self.rope_dim, self.base), axis=1)

    def block_rows(self, block: int) -> np.ndarray:
        """The rows of positions block * BLOCK .. (block + 1) * BLOCK - 1, (BLOCK, rope_dim)."""
        cos, sin = rope_cos_sin(np.arange(block * self.BLOCK, (block + 1) * self.BLOCK), self.rope_dim, self.base)
        return np.concatenate([cos, sin], axis=1)


class Model(nn.Module):
    """Muse Glimmer from a validated artifact, its steps computed by one ops backend (ops/; default:
    select_ops('auto'), the GPU kernels when MLX has a GPU, else MLX ops)."""

    def __init__(self, artifact: Artifact, ops: ReferenceOps | None = None, progress=None):
        """progress: called with (layers loaded, layers) as the blocks load (a CLI's progress bar)."""
        super().__init__()
        self.artifact = artifact
        self._ops = ops = ops if ops is not None else select_ops("auto")
        g = self.geometry = artifact.geometry
        t = artifact.tensors
        self._flags: list[mx.array] | None = [] if ops.begin_weights(list(t.values())) else None
        self.embed = Embedding(t["token_embd.weight"], ops)
        self._loaded(self.embed.parameters())
        artifact.release([t["token_embd.weight"]])   # its bytes are copied: the mapping need not hold them
        self.blocks = []
        for il in range(g.n_layer):
            raws = {name: t[f"blk.{il}.{name}.weight"] for name in LAYER_TENSORS}
            self.blocks.append(Block(ops, g, il, raws))
            self._loaded(self.blocks[-1].parameters())
            artifact.release(raws.values())
            if progress is not None:
                progress(il + 1, g.n_layer)
        self.output_norm = _vector(t["output_norm.weight"])
        self.output = ops.matrix([t["output.weight"]])
        self._loaded(self.output.parameters())
        artifact.release([t["output.weight"]])
        self._rope = RopeRows(g.rope_dim, g.rope_base_swa)
        self._compiled: dict = {}   # DecodePlan key -> the compiled decode step
        mx.eval(self.parameters())
        if self._flags is not None:
            self._check_flags(self._flags)
            self._flags = None

    def _loaded(self, parameters) -> None:
        """Evaluate newly loaded parameters with the non-finite flags of their matrices (ops.load_raw,
        weight_stream.nonfinite_flag: the weight scan's rule, run where the bytes are). Matrices
        loaded ahead (ops.begin_weights) are evaluated without a wait and their flags read once,
        after the last layer; others a layer at a time, which bounds what is loaded at once."""
        flags, self._ops.weight_flags = self._ops.weight_flags, []
        if self._flags is not None:
            mx.async_eval(parameters, flags)
            self._flags += flags
            return
        mx.eval(parameters, flags)
        self._check_flags(flags)

    def _check_flags(self, flags: list[mx.array]) -> None:
        """A set flag means a bad matrix: the artifact's host scan then names the first, in the
        file's order."""
        if flags and bool(mx.any(mx.stack([f.reshape(()) for f in flags])).item()):
            a = self.artifact
            check_matrix_weights(a.path, a.tensors, {name: r.offset for name, r in a.tensors.items()})
            raise ArtifactError(a.path, "a matrix", "finite weights and block scales",
                                "a non-finite value the host scan did not locate")

    @property
    def ops(self) -> ReferenceOps:
        return self._ops

    @property
    def path(self) -> str:
        return f"kernels ({self._ops.backend})" if self._ops.name == "gpu" else "MLX ops (reference)"

    def matrices(self) -> list:
        """Every matrix product of one step, as launched (stacked ones count once)."""
        out = []
        for block in self.blocks:
            out += block.attention.wqkgv.products + [block.attention.wo]
            out += block.feed_forward.wgate_up.products + [block.feed_forward.wdown]
        return out + [self.output]

    @property
    def weight_bytes(self) -> int:
        """Bytes the loaded weights occupy (raw blocks or dense float32, as the ops backend keeps them)."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def make_cache(self, context: int | None = None, dtype=KV_DTYPE) -> SlotCache:
        return SlotCache(self.geometry, context or self.geometry.context_length, dtype)

    def __call__(self, tokens: mx.array, caches: list[SlotCache], last_only: bool = False) -> mx.array:
        """tokens (B, T) at positions cache.offset.. of each sequence's cache -> logits (B, T, n_vocab),
        or (B, 1, n_vocab) of each sequence's last token with `last_only`. The caches take the
        tokens' K/V."""
        if tokens.ndim != 2 or tokens.shape[0] != len(caches):
            raise ValueError(f"tokens must be (B, T) with one cache per row; got {tokens.shape} and {len(caches)} caches")
        B, T = tokens.shape
        if len({c.dtype for c in caches}) != 1:
            raise ValueError("the caches of one forward must share their dtype")
        for cache in caches:
            cache.check_room(T)
        kv = self._ops.kv_step(self.geometry, caches, T, self._rope)
        if kv.compiled:   # a DecodePlan: the forward compiled for its key
            logits, positions, *state = self._compiled_step(kv.key)(tokens, kv.positions, *kv.arrays)
            kv.after(positions)
            for b, cache in enumerate(caches):
                n = len(cache.layers)
                cache.rebind(state[b * n:(b + 1) * n], T)
        else:
            positions = np.concatenate([np.arange(c.offset, c.offset + T, dtype=np.int64) for c in caches])
            logits = self.forward(tokens, mx.array(self._rope.rows(positions)), kv, caches[0].dtype, last_only)
        self._ops.ready()
        return logits

    def forward(self, tokens: mx.array, rope: mx.array, kv, kv_dtype, last_only: bool = False) -> mx.array:
        """The forward over tokens (B, T); rope: cos|sin of each token row's angles; kv: the caches'
        access for this step (ops: ChunkStep, or a DecodeStep inside the compiled step)."""
        g, ops = self.geometry, self._ops
        B, T = tokens.shape
        x = mx.fast.rms_norm(self.embed(tokens.reshape(-1)), None, g.rms_eps)
        h = mx.fast.rms_norm(x, self.blocks[0].attention.attn_norm, g.rms_eps)
        for i, block in enumerate(self.blocks):
            att, ffn = block.attention, block.feed_forward
            x, h = ops.residual_norm(x, att(h, rope, kv, kv_dtype), att.post_norm, ffn.ffn_norm, POST_NORM_EPS,
                                     g.rms_eps)
            w_next = self.blocks[i + 1].attention.attn_norm if i + 1 < len(self.blocks) else self.output_norm
            x, h = ops.residual_norm(x, ffn(h), ffn.post_norm, w_next, POST_NORM_EPS, g.rms_eps)
            ops.end_layer(kv, i, x, h)
        if last_only and T > 1:
            h = h.reshape(B, T, -1)[:, -1]
            T = 1
        logits = ops.logits(self.output, h) * g.logit_scale
        if g.final_logit_softcap:
            logits = mx.tanh(logits / g.final_logit_softcap) * g.final_logit_softcap
        return logits.reshape(B, T, -1)

    def _compiled_step(self, key: tuple):
        """The forward as an mx.compile'd function of (tokens, positions, the DecodePlan's arrays) ->
        (logits, the positions plus one, the storage with the token's rows written), traced once per key (a new split
        count: ~4 per doubling of the depth) and replayed by MLX for every other token. It holds
        the model weakly, so a model (whose weights the graph captures) is freed at `del`."""
        fn = self._compiled.get(key)
        if fn is None:
            from .ops.gpu import DecodeStep

            model, kernels = weakref.ref(self), self._ops.kernels

            def step(tokens, positions, *arrays):
                kv = DecodeStep(key, positions, list(arrays), kernels)
                return [model().forward(tokens, kv.rope, kv, mx.float16), *kv.outputs]
            fn = self._compiled[key] = mx.compile(step)
        return fn

    def prefill(self, tokens, cache: SlotCache, chunk: int = PREFILL_CHUNK, all_logits: bool = False,
                progress=None) -> mx.array:
        """Feed one sequence's tokens at positions cache.offset.. -> logits of the last (1, V), or of
        every token (L, V). progress: called with (tokens done, tokens) after each chunk.

        Chunks end at multiples of `chunk` in absolute positions, so a prompt fed in several calls
        that stop at such multiples (a cache restored from a pack saved there, kvpack) computes
        every chunk with the same rows as one call from position 0: the same bits."""
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(np.asarray(tokens))
        n = tokens.shape[0]
        cache.check_room(n)
        outs, a = [], 0
        while a < n:
            b = min(n, a + chunk - (cache.offset % chunk))
            logits = self(tokens[None, a:b], [cache], last_only=not all_logits)[0]
            mx.eval(logits, cache.state())
            outs.append(logits)
            a = b
            if progress is not None:
                progress(a, n)
        return mx.concatenate(outs, axis=0) if all_logits else outs[-1]

    def step(self, token: int | mx.array, cache: SlotCache) -> mx.array:
        """One token of one sequence -> its logits (n_vocab,) (a lazy array: nothing waits on it)."""
        token = token if isinstance(token, mx.array) else mx.array(token)
        return self(token.reshape(1, 1), [cache])[0, 0]


def load(path, backend: str = "auto", kernel_config: KernelConfig = KernelConfig(), progress=None,
         kernel_cache: bool = True, on_open=None) -> Model:
    """Open, validate and load a GGUF; backend 'auto', 'gpu' or 'reference', kernel_cache as
    ops.select_ops takes them. on_open: called with the opened Artifact before the weights load
    (generate builds the tokenizer from its vocabulary meanwhile)."""
    import time

    from .artifact import open_artifact

    t = time.perf_counter()
    artifact = open_artifact(path, check_weights=False)   # the matrices are checked as they load (Model._loaded)
    opened = time.perf_counter() - t
    if on_open is not None:
        on_open(artifact)
    model = Model(artifact, select_ops(backend, kernel_config, kernel_cache), progress)
    model.open_seconds = opened   # the file opened and checked (generate's load line)
    return model


__all__ = ["Model", "load", "rope_cos_sin"]
