"""The Metal instantiation of every kernel, executed on the CPU (tests/metal_emulator.py).

Each kernel is launched through kernels.py exactly as the model launches it on an Apple GPU
(backend "metal": its launch plans, grids and template constants), its Metal text compiled
with g++ and run one OS thread per GPU thread, and compared with an independent float64
reference: gguf-py's dequantizers for the matrices, numpy for attention, the norms and RoPE.
Outputs start as NaN, so an element no thread writes fails. This is the only execution the
Metal text gets here (no Mac); Metal's own compiler and Apple GPU timing are not checked.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

import mlx.core as mx

from muse_mlx import kernels
from muse_mlx.tools.fixtures import random_blocks

from metal_emulator import CXX, emulate
from reference import attention_ref, log_softmax

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
NAN = float("nan")


@pytest.fixture
def metal(monkeypatch):
    emulate(monkeypatch)
    return monkeypatch


def dense(blocks: np.ndarray, qtype, n: int, k: int) -> np.ndarray:
    return gguf_dequantize(blocks, qtype).reshape(n, k).astype(np.float64)


def err_over_terms(out, ref, scale) -> float:
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(scale))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
@pytest.mark.parametrize("n, k", [(37, 768), (1, 256), (9, 2304)])
def test_streaming_matvec(metal, qtype, loop, n, k):
    """One-token product, every loop (staged: Metal's single synchronous stage; sharedx: x in
    threadgroup memory); 2,304 = 9 blocks, so Q6_K rows start off 4- and 16-byte boundaries."""
    metal.setenv("MUSE_MLX_MATVEC", loop)
    rng = np.random.default_rng([n, k, int(qtype), len(loop)])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.array(kernels.matvec(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
def test_streaming_matvec_silu(metal, qtype, loop):
    metal.setenv("MUSE_MLX_MATVEC", loop)
    n, k = 21, 1024
    rng = np.random.default_rng([n, k, int(qtype), 9])
    w = random_blocks(n, k, qtype, rng)
    gu = (2 * rng.standard_normal((1, 2 * k))).astype(np.float32)   # one stacked gate|up output
    out = np.array(kernels.matvec_silu(mx.array(w), qtype, mx.array(gu), mx.array(gu), up_offset=k,
                                       init_value=NAN))
    g64, u64 = gu[0, :k].astype(np.float64), gu[0, k:].astype(np.float64)
    act = g64 / (1 + np.exp(-g64)) * u64
    W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out[0], W @ act, np.abs(W) @ np.abs(act)) < 1e-6


def resnorm_ref(x, f, w_post, w_next, eps):
    """float64: r = x + rmsnorm(f, eps[0]) * w_post, h = rmsnorm(r, eps[1]) * w_next."""
    x, f, w_post, w_next = (np.asarray(a, np.float64).reshape(-1) for a in (x, f, w_post, w_next))
    r = x + f / np.sqrt((f * f).mean() + eps[0]) * w_post
    return r, r / np.sqrt((r * r).mean() + eps[1]) * w_next


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(37, 768), (9, 2304)])
def test_streaming_matvec_resnorm(metal, qtype, n, k):
    """The residual step made in the product's prologue (x_resnorm): the product against float64
    and the residual written once, whole (outputs start as NaN); 2,304 values leave 28 of 64
    threads without a unit."""
    rng = np.random.default_rng([n, k, int(qtype), 77])
    w = random_blocks(n, k, qtype, rng)
    x, f = rng.standard_normal((1, k)).astype(np.float32), (3 * rng.standard_normal((1, k))).astype(np.float32)
    w_post, w_next = (rng.uniform(0.5, 1.5, k).astype(np.float32) for _ in range(2))
    eps = np.array([1e-8, 1e-6], np.float32)
    y, r_out = kernels.matvec_resnorm(mx.array(w), qtype, mx.array(x), mx.array(f), mx.array(w_post),
                                      mx.array(w_next), mx.array(eps), init_value=NAN)
    r, h = resnorm_ref(x, f, w_post, w_next, eps.astype(np.float64))
    W = dense(w, qtype, n, k)
    y, r_out = np.array(y), np.array(r_out)
    assert np.isfinite(y).all() and np.isfinite(r_out).all()
    assert np.abs(r_out[0] - r).max() < 1e-5 * np.abs(r).max()
    assert err_over_terms(y[0], W @ h, np.abs(W) @ np.abs(h)) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.NVFP4, QT.F16, QT.F32],
                         ids=lambda t: t.name)
def test_batched_matvec(metal, qtype):
    """matvec.inc (batches of 2-8 rows; the simple one-token kernel for types without a
    streaming one) at 3 rows. (BF16 weights are not emulated: the shim has no bfloat type.)"""
    n, k, b = 13, 512, 3
    rng = np.random.default_rng([n, k, int(qtype)])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((b, k)).astype(np.float32)
    out = np.array(kernels.matvec(mx.array(w), qtype, mx.array(x), init_value=NAN))
    if qtype in (QT.F16, QT.F32):
        W = np.array(mx.array(w).view(kernels.FLOAT_DTYPES[qtype]).reshape(n, k).astype(mx.float32), np.float64)
    else:
        W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("n_head, n_kv, hd, cap, n_valid, chunk", [
    (8, 2, 128, 64, 64, 32),     # a full ring: two splits per KV head
    (8, 2, 128, 300, 257, 128),  # a plane, the last split partly filled
    (6, 1, 48, 40, 7, 32),       # other geometry: head_dim 48 (lanes past it idle), GQA 6:1
])
@pytest.mark.parametrize("rows", ["1", "8", "butterfly", "butterfly-cw6"])
def test_decode_attention(metal, n_head, n_kv, hd, cap, n_valid, chunk, rows):
    """Rows of K/V loaded one at a time or eight together (MUSE_MLX_ATTN_ROWS), or the butterfly
    loop (MUSE_MLX_ATTN_LOOP; padding heads when HPW is 1 or 2), including a split shorter than
    eight rows; -cw6: the combine in 6 simdgroups (MUSE_MLX_COMBINE_WARPS), more than some
    cases have splits."""
    if rows.startswith("butterfly"):
        metal.setenv("MUSE_MLX_ATTN_LOOP", "butterfly")
    else:
        metal.setenv("MUSE_MLX_ATTN_LOOP", "rows")
        metal.setenv("MUSE_MLX_ATTN_ROWS", rows)
    metal.setenv("MUSE_MLX_COMBINE_WARPS", "6" if rows.endswith("-cw6") else "4")
    rng = np.random.default_rng([n_head, hd, cap, n_valid])
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    out = np.array(kernels.decode_attention(mx.array(q), mx.array(keys), mx.array(values), n_valid, chunk,
                                            init_value=NAN))
    ref = attention_ref(q, keys, values, n_valid)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("loop", ["rows", "butterfly"])
def test_decode_attention_padded_splits(metal, loop):
    """A compiled step's attention: more splits in the grid than the rows visible need
    (kernels.attention_splits), the rows visible read only from params; the empty splits
    must weigh nothing in the combine."""
    metal.setenv("MUSE_MLX_ATTN_LOOP", loop)
    n_head, n_kv, hd, cap, n_valid, chunk = 8, 2, 64, 320, 70, 32   # 3 splits needed, 10 in the grid
    rng = np.random.default_rng(11)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    params = kernels.attention_params(n_valid, chunk, 10)
    out = np.array(kernels.decode_attention(mx.array(q), mx.array(keys), mx.array(values), None, chunk,
                                            init_value=NAN, params=params, splits=10))
    ref = attention_ref(q, keys, values, n_valid)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_decode_attention_gated(metal):
    n_head, n_kv, hd, cap, n_valid = 4, 2, 64, 96, 70
    rng = np.random.default_rng(3)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    stacked = rng.standard_normal((1, 100 + n_head * hd)).astype(np.float32)   # the gate from offset 100
    out = np.array(kernels.decode_attention(mx.array(q), mx.array(keys), mx.array(values), n_valid, 32,
                                            init_value=NAN, gate=mx.array(stacked), gate_offset=100,
                                            out_shape=(1, n_head * hd)))
    gate = stacked[0, 100:].astype(np.float64).reshape(n_head, hd)
    ref = (attention_ref(q, keys, values, n_valid) / (1 + np.exp(-gate))).reshape(1, -1)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("rope_half", [0, 16])
def test_qk_post(metal, rope_half):
    n_head, n_kv, hd, eps = 4, 2, 48, 1e-6
    rng = np.random.default_rng(rope_half)
    stacked = rng.standard_normal((1, n_head * hd + n_kv * hd + 64)).astype(np.float32)  # Q|K|(gate) output
    v = rng.standard_normal((1, n_kv * hd)).astype(np.float32)
    q_norm, k_norm = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    angles = rng.uniform(0, 6, max(rope_half, 1)).astype(np.float64)
    rope = np.concatenate([np.cos(angles), np.sin(angles)]).astype(np.float32)
    q_out, k_out, v_out = kernels.qk_post(mx.array(stacked), mx.array(stacked), mx.array(v), mx.array(q_norm),
                                          mx.array(k_norm), mx.array(rope), rope_half,
                                          mx.array([eps], dtype=mx.float32), n_head, n_kv, hd,
                                          q_offset=0, k_offset=n_head * hd, init_value=NAN)
    s = stacked[0].astype(np.float64)

    def post(x, w):
        y = rms(x, eps) * w
        if rope_half:
            c, sn = rope[:rope_half].astype(np.float64), rope[rope_half:].astype(np.float64)
            a, b = y[:, 0:2 * rope_half:2].copy(), y[:, 1:2 * rope_half:2].copy()
            y[:, 0:2 * rope_half:2], y[:, 1:2 * rope_half:2] = a * c - b * sn, a * sn + b * c
        return y
    q_ref = post(s[:n_head * hd].reshape(n_head, hd), q_norm)
    k_ref = post(s[n_head * hd:(n_head + n_kv) * hd].reshape(n_kv, hd), k_norm)
    assert np.abs(np.array(q_out) - q_ref).max() < 1e-5
    # K and V are stored as f16: the f32 results rounded once
    assert np.abs(np.array(k_out, np.float64).reshape(n_kv, hd) - k_ref).max() <= 2e-3 * np.abs(k_ref).max()
    assert np.array_equal(np.array(v_out).reshape(-1), v[0].astype(np.float16))


def test_residual_norm(metal):
    n = 1000   # not a multiple of the threads: the last pass is partial
    rng = np.random.default_rng(8)
    x, f = (rng.standard_normal((1, n)).astype(np.float32) for _ in range(2))
    w_post, w_next = (rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(2))
    eps = np.array([1e-8, 1e-6], np.float32)
    x_out, h = kernels.residual_norm(*(mx.array(a) for a in (x, f, w_post, w_next, eps)), init_value=NAN)
    x_ref = x.astype(np.float64) + rms(f.astype(np.float64), 1e-8) * w_post
    h_ref = rms(x_ref, 1e-6) * w_next
    assert np.abs(np.array(x_out) - x_ref).max() < 1e-5
    assert np.abs(np.array(h) - h_ref).max() < 1e-5


def test_whole_model_on_emulated_metal_kernels(metal, tmp_path):
    """The kernel path end to end with every kernel's Metal text emulated: a random-block
    Q4_K_M-layout fixture, 3 prompt tokens (batched matvecs) and 6 decode steps (the streaming
    matvecs with the silu product, qk_post, decode attention with the gate, the fused residual
    steps), against the MLX-ops reference path. Tolerances as on the GPU (tests/gpu: this
    fixture's logits are ill-conditioned). The eager step (MUSE_MLX_COMPILE=0): the emulator
    needs each launch's inputs as numbers, which a compiled step's trace does not have; the
    compiled step's orchestration is tested with MLX-ops stand-ins (test_kernel_path_on_cpu)."""
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_random_blocks
    from muse_mlx.model import load

    metal.setenv("MUSE_MLX_COMPILE", "0")
    g = DEFAULT_GEOMETRY
    path = write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=3)
    tokens = np.random.default_rng(11).integers(0, g.n_vocab, 9)

    def run(use_kernels):
        model = load(path, use_kernels=use_kernels)
        cache = model.make_cache(len(tokens))
        rows = [np.array(model.prefill(mx.array(tokens[:3]), cache, all_logits=True))]
        rows += [np.array(model(mx.array([int(t)]), cache)) for t in tokens[3:]]
        return np.concatenate(rows).astype(np.float64)
    ours = run(True)
    metal.setattr(kernels, "backend", lambda: None)
    ref = run(False)

    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert np.isfinite(ours).all()
    assert d.max() < 1.5e-1 and d.mean() < 5e-3 and (ours.argmax(-1) == ref.argmax(-1)).all(), (d.max(), d.mean())
