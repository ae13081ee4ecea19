"""The kernel path's orchestration on the CPU, with MLX-ops stand-ins for the GPU kernels.

The kernels themselves are verified on a GPU (tests/gpu). What runs here is everything around
them on the kernel path: raw blocks kept and stacked (Q|K|gate, FFN gate|up), the offsets the
decode step passes into stacked outputs, the K/V row writes and attention scalars, the fused
residual steps, the batched and dequantizing prefill paths. Each stand-in implements its
kernel's contract (kernels.py docstrings) with MLX ops, so a wrong offset, a misplaced row or
a wrong norm weight in model.py shows up as a difference from the reference path here.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from muse_mlx import kernels
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_random_blocks
from muse_mlx.model import load
from muse_mlx.quant import dequantize
from reference import log_softmax


def matvec(w, qtype, x, init_value=None):
    assert 1 <= x.shape[0] <= kernels.MAX_BATCH
    return x.astype(mx.float32) @ dequantize(w, qtype).T


def matvec_silu(w, qtype, gate, up, up_offset=0, init_value=None):
    dense = dequantize(w, qtype)
    k = dense.shape[1]
    act = nn.silu(gate.reshape(-1)[:k]) * up.reshape(-1)[up_offset:up_offset + k]
    return (act @ dense.T).reshape(1, -1)


def qk_post(q, k, v, q_norm, k_norm, rope, rope_half, eps, n_head, n_kv, head_dim, q_offset=0, k_offset=0,
            init_value=None, v_offset=0):
    def part(a, offset, heads):
        return a.reshape(-1)[offset:offset + heads * head_dim].reshape(heads, head_dim)

    def rotate(x):
        if not rope_half:
            return x
        c, s = rope[:rope_half], rope[rope_half:2 * rope_half]
        x0, x1 = x[:, 0:2 * rope_half:2], x[:, 1:2 * rope_half:2]
        pairs = mx.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape[0], 2 * rope_half)
        return mx.concatenate([pairs, x[:, 2 * rope_half:]], axis=-1)
    qn = rotate(rms_norm(part(q, q_offset, n_head), q_norm, eps[0]))
    kn = rotate(rms_norm(part(k, k_offset, n_kv), k_norm, eps[0]))
    return qn, kn.astype(mx.float16)[:, None], part(v, v_offset, n_kv).astype(mx.float16)[:, None]


def rms_norm(x, w, eps):
    """RMSNorm with eps an array element: traceable by mx.compile (no .item())."""
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


ATTENTION_SPLITS = []   # the `splits` each traced decode_attention was given (a compiled step)


def decode_attention(q, keys, values, n_valid, chunk, init_value=None, gate=None, gate_offset=0, params=None,
                     out_shape=None, splits=None):
    n_head, hd = q.shape
    n_kv, cap = keys.shape[:2]
    if splits is None:   # eager: the rows visible are a Python number, params must agree
        assert params is None or params[0].item() == n_valid
        visible = mx.arange(cap) < n_valid
    else:                # compiled: only params knows them; the grid's splits must cover them
        assert n_valid is None and params is not None
        ATTENTION_SPLITS.append(splits)
        visible = mx.arange(cap) < mx.minimum(params[0], params[1] * chunk)
    k = keys.astype(mx.float32)
    v = values.astype(mx.float32)
    qh = q.reshape(n_kv, n_head // n_kv, hd)
    scores = (qh @ k.swapaxes(-1, -2)) / math.sqrt(hd)
    probs = mx.softmax(mx.where(visible, scores, -mx.inf), axis=-1, precise=True)
    out = (probs @ v).reshape(n_head, hd)
    if gate is not None:
        out = out * mx.sigmoid(gate.reshape(-1)[gate_offset:gate_offset + n_head * hd].reshape(n_head, hd))
    return out.reshape(out_shape or (n_head, hd))


def residual_norm(x, f, w_post, w_next, eps, init_value=None):
    x_out = x + rms_norm(f, w_post, eps[0])
    return x_out, rms_norm(x_out, w_next, eps[1])


RESNORM_CALLS = []


def matvec_resnorm(w, qtype, x, f, w_post, w_next, eps, init_value=None):
    assert kernels.streams(qtype, x.shape[-1])
    RESNORM_CALLS.append(w.shape[0])
    x_out, h = residual_norm(x, f, w_post, w_next, eps)
    return matvec(w, qtype, h), x_out


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    for fn in (matvec, matvec_silu, qk_post, decode_attention, residual_norm, matvec_resnorm):
        monkeypatch.setattr(kernels, fn.__name__, fn)
    RESNORM_CALLS.clear()
    ATTENTION_SPLITS.clear()


def run(path, tokens, prefill, use_kernels):
    model = load(path, use_kernels=use_kernels)
    assert (model.backend is not None) == use_kernels
    cache = model.make_cache(len(tokens))
    rows = [np.array(model.prefill(mx.array(tokens[:prefill]), cache, chunk=100, all_logits=True))]
    for t in tokens[prefill:]:
        rows.append(np.array(model(mx.array([int(t)]), cache)))
    return np.concatenate(rows), cache


@pytest.mark.parametrize("layout, fuse, compiled", [("f32", "0", "0"), ("q4_k_m", "0", "0"), ("q4_k_m", "1", "0"),
                                                     ("f32", "0", "1"), ("q4_k_m", "1", "1")])
def test_kernel_path_orchestration_matches_reference_path(standins, f32_fixture, tmp_path, layout, fuse, compiled,
                                                          monkeypatch):
    """Prefill 100 (dequantizing path) + 3 (batched matvecs), then decode steps past the ring
    wrap; the stand-ins compute in float32 like the kernels, so the two paths agree closely.
    fuse=1 (MUSE_MLX_FUSE_NORM): the residual steps inside the streaming products that consume
    them (matvec_resnorm), in every layer of the Q4_K_M layout and before the LM head.
    compiled=1 (MUSE_MLX_COMPILE): the decode step's layers as one mx.compile'd function, rows
    written by scatters at array rows, attention over rounded-up split counts."""
    monkeypatch.setenv("MUSE_MLX_FUSE_NORM", fuse)
    monkeypatch.setenv("MUSE_MLX_COMPILE", compiled)
    g = DEFAULT_GEOMETRY
    path = f32_fixture if layout == "f32" else write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=3)
    tokens = np.random.default_rng(5).integers(0, g.n_vocab, 103 + 2 * g.sliding_window)
    ours, cache = run(path, tokens, 103, use_kernels=True)
    model = load(path, use_kernels=False)
    ref_cache = model.make_cache(len(tokens))
    ref = [np.array(model.prefill(mx.array(tokens[:103]), ref_cache, chunk=100, all_logits=True))]
    for t in tokens[103:]:
        ref.append(np.array(model(mx.array([int(t)]), ref_cache)))
    ref = np.concatenate(ref)
    decode_steps = len(tokens) - 103
    # per decode token: each layer's FFN gate|up and its next input's Q|K|gate(|V) and V, the LM head
    if compiled == "1":   # traced once per split count, not once per token
        traces = len(ATTENTION_SPLITS) // g.n_layer
        assert 1 < traces < decode_steps // 2 and len(ATTENTION_SPLITS) == traces * g.n_layer, traces
        per_trace, rest = divmod(len(RESNORM_CALLS), traces)
        assert rest == 0 and (per_trace > 2 * g.n_layer) == (fuse == "1"), len(RESNORM_CALLS)
    else:
        assert not ATTENTION_SPLITS
        assert (len(RESNORM_CALLS) > decode_steps * 2 * g.n_layer) == (fuse == "1"), len(RESNORM_CALLS)
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert d.max() < 2e-3 and (ours.argmax(-1) == ref.argmax(-1)).all(), d.max()
    for a, b in zip(cache.state(), ref_cache.state()):  # the same rows written where they belong
        assert np.array_equal(np.array(a) != 0, np.array(b) != 0)
        assert np.abs(np.array(a, dtype=np.float32) - np.array(b, dtype=np.float32)).max() < 2e-2


@pytest.mark.parametrize("compiled", ["0", "1"])
@pytest.mark.parametrize("name", ["gqa4-hd64-nocap", "partial-rope-pattern", "mha-window1"])
def test_kernel_path_orchestration_on_other_geometries(standins, tmp_path, name, compiled, monkeypatch):
    """The decode step (eager and compiled) on geometries it was never tuned on: GQA 4:1 with
    head_dim 64, partial RoPE with a custom sliding pattern, a window of one row (a ring of
    one row per sliding layer): prefill 5, then decode past two ring wraps, against the
    reference path."""
    from test_model import OTHER_GEOMETRIES

    from muse_mlx.tools.fixtures import write_fixture

    monkeypatch.setenv("MUSE_MLX_COMPILE", compiled)
    g = OTHER_GEOMETRIES[name]
    path = write_fixture(tmp_path / f"{name}.gguf", geometry=g, seed=5)
    tokens = np.random.default_rng(9).integers(0, g.n_vocab, 5 + 2 * g.sliding_window + 6)

    def logits(use_kernels):
        model = load(path, use_kernels=use_kernels)
        cache = model.make_cache(len(tokens))
        rows = [np.array(model.prefill(mx.array(tokens[:5]), cache, all_logits=True))]
        rows += [np.array(model(mx.array([int(t)]), cache)) for t in tokens[5:]]
        return np.concatenate(rows), cache
    ours, cache = logits(True)
    assert bool(ATTENTION_SPLITS) == (compiled == "1")
    ref, ref_cache = logits(False)
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert d.max() < 2e-3 and (ours.argmax(-1) == ref.argmax(-1)).all(), d.max()
    for a, b in zip(cache.state(), ref_cache.state()):
        assert np.abs(np.array(a, dtype=np.float32) - np.array(b, dtype=np.float32)).max() < 2e-2


def test_compiled_steps_are_freed_with_the_model(standins, f32_fixture, monkeypatch):
    """A model's compiled steps do not keep it alive (no reference cycle through them): a full
    model is ~17 GB, freed at `del`, not at the next garbage collection."""
    import gc
    import weakref

    monkeypatch.setenv("MUSE_MLX_COMPILE", "1")
    model = load(f32_fixture, use_kernels=True)
    cache = model.make_cache(8)
    mx.eval(model(mx.array([1]), cache))
    assert model._compiled_steps
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()
