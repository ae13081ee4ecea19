"""The Metal instantiation of every kernel, executed on the CPU (tests/metal_emulator.py).

Each kernel is launched through kernels.Kernels exactly as the model launches it on an Apple GPU
(device "metal": its launch plans, grids and template constants), its Metal text compiled
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

from muse_mlx.config import KernelConfig
from muse_mlx.kernels import plan
from muse_mlx.tools.fixtures import random_blocks

from metal_emulator import CXX, emulated_kernels
from reference import attention_ref, log_softmax, prefill_attention_ref

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
NAN = float("nan")


@pytest.fixture
def metal():
    return emulated_kernels()


def dense(blocks: np.ndarray, qtype, n: int, k: int) -> np.ndarray:
    return gguf_dequantize(blocks, qtype).reshape(n, k).astype(np.float64)


def err_over_terms(out, ref, scale) -> float:
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(scale))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(37, 768), (1, 256), (9, 2304)])
def test_streaming_matvec(metal, qtype, n, k):
    """One-token product; 2,304 = 9 blocks, so Q6_K rows start off 4- and 16-byte boundaries."""
    rng = np.random.default_rng([n, k, int(qtype), 6])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.array(metal.matvec(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("b, n, k", [(2, 37, 768), (4, 9, 1280), (3, 5, 256), (6, 21, 512)])
def test_streaming_matvec_rows_in_threadgroup_memory(metal, qtype, b, n, k):
    """Several rows of x through the streaming kernel's x_shared form (a packed step over slots):
    each weight read once for the rows of a launch (on the Metal plan at most 3: 4 and 6 rows
    take two launches; 1,280 = 5 blocks puts Q6_K rows off 4-byte boundaries)."""
    rng = np.random.default_rng([b, n, k, int(qtype), 7])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((b, k)).astype(np.float32)
    assert plan.stream_batch_rows(k, metal.device, metal.config) >= 2
    out = np.array(metal.matvec(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert out.shape == (b, n) and np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rf", [2, 4])
def test_streaming_matvec_rows_decoded_per_pass(metal, qtype, rf):
    """stream_batch_rf: RF rows of weights decoded per pass over the rows of x in threadgroup
    memory. Each row's sums keep their order, so the products equal RF = 1's bit for bit (and
    the float64 terms). Enough rows that each group steps 8 at a time; the last group's end
    off a multiple of RF."""
    many = emulated_kernels(KernelConfig(stream_batch_rf=rf))
    b, n, k = 3, 8 * many.device.cores + 5, 768
    rng = np.random.default_rng([b, n, k, int(qtype), 8])
    w, x = mx.array(random_blocks(n, k, qtype, rng)), mx.array(rng.standard_normal((b, k)).astype(np.float32))
    assert plan.stream_plan(qtype, k, n, many.device, many.config, b).rows_loaded == rf
    out = np.array(many.matvec(w, qtype, x, init_value=NAN))
    assert np.array_equal(out, np.array(metal.matvec(w, qtype, x, init_value=NAN)))
    W = dense(np.array(w), qtype, n, k)
    assert err_over_terms(out, np.array(x) @ W.T, np.abs(np.array(x)) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("b, n, k", [(3, 37, 768), (4, 17, 1280), (1, 5, 256), (2, 40, 512)])
def test_tensor_core_matvec(qtype, b, n, k):
    """The tensor-core form (mma_*: what CUDA runs for 2..4 rows) with the Metal dialect's
    shuffle stand-in for mma.m16n8k16, which follows PTX's fragment layout: rows past a whole
    tile (37, 17), a tile split between two threadgroups' turns, 1,280 = 5 blocks (Q6_K rows
    off 4-byte boundaries), one row of x. x keeps ~22 bits (two f16 halves), so the products sit
    near float32's (the x_shared checks' bound)."""
    kernels = emulated_kernels(KernelConfig(stream_groups=2))
    rng = np.random.default_rng([b, n, k, int(qtype), 21])
    w = random_blocks(n, k, qtype, rng)
    x = (rng.standard_normal((b, k)) * np.exp(rng.uniform(-6, 6, (b, 1)))).astype(np.float32)
    out = np.array(kernels.matvec_mma(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert out.shape == (b, n) and np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_tensor_core_matvec_in_parts(qtype):
    """The tensor-core form with K in parts (grid y: Metal's 32 KB of threadgroup memory holds
    2,048 values' fragments only in four; mma_parts=5 splits 5,120's 80 units in five of 16 on a
    device with room for them whole), their products added, against float64."""
    kernels = emulated_kernels(KernelConfig(stream_groups=2))
    assert plan.mma_plan(qtype, 2048, 21, 3, kernels.device, kernels.config).parts > 1
    check_mma_against_float64(kernels, qtype, 21, 2048, 3)
    from muse_mlx.kernels import Device, Kernels
    from metal_emulator import EmulatedKernel
    six = Kernels(Device("metal", 4, 1 << 20), KernelConfig(stream_groups=2, mma_parts=5),
                  build=lambda name, which, shared: EmulatedKernel(name))
    assert plan.mma_plan(qtype, 5120, 21, 2, six.device, six.config).parts == 5
    check_mma_against_float64(six, qtype, 21, 5120, 2)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_tensor_core_matvec_many_warps(qtype):
    """The whole threadgroup on one tile, on a device with room for the reduction buffers. Both
    forms' warps take whole blocks (Q4_K within 96 registers: 21 warps at most; Q6_K's block form
    within 80: 25), so 13 warps of two blocks at K = 6,656 and 10 of one at 2,560."""
    from muse_mlx.kernels import Device, Kernels
    from metal_emulator import EmulatedKernel
    big = Kernels(Device("metal", 4, 1 << 20), KernelConfig(stream_groups=2, mma_tile_warps=32),
                  build=lambda name, which, shared: EmulatedKernel(name))
    for n, k, warps in ((19, 6656, 13), (16, 2560, 10)):
        assert plan.mma_plan(qtype, k, n, 4, big.device, big.config).warps == warps
        check_mma_against_float64(big, qtype, n, k, 4)


def check_mma_against_float64(kernels, qtype, n, k, rows):
    """The tensor-core form over `rows` rows of x on random blocks: finite, within 1e-6 of the
    terms' magnitudes of the float64 product."""
    rng = np.random.default_rng([n, k, int(qtype), 24])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    out = np.array(kernels.matvec_mma(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tile_warps, warps, b", [(1, 3, 3), (2, 6, 4), (3, 6, 2)])
def test_tensor_core_matvec_tiles_shared_out(qtype, tile_warps, warps, b):
    """Warps split between tiles: KW = 1 (a warp sums its tile alone, hi and lo columns joined
    by a shuffle, no barrier), 2 and 3 (NW / KW tiles a round, each reduced over its own warps);
    the last round with tiles past the matrix (7 tiles, 3 or 2 a round, 2 threadgroups), units
    (Q4_K: whole blocks) that do not split evenly (3 warps over 32 or 20 units, 8 or 5 blocks),
    rows past the last whole tile."""
    from muse_mlx.kernels import Device, Kernels
    from metal_emulator import EmulatedKernel
    config = KernelConfig(stream_groups=2, mma_warps=warps, mma_tile_warps=tile_warps, mma_parts=1)
    big = Kernels(Device("metal", 4, 1 << 20), config, build=lambda name, which, shared: EmulatedKernel(name))
    for n, k in ((103, 2048), (100, 1280)):
        p = plan.mma_plan(qtype, k, n, b, big.device, big.config)
        assert (p.warps, p.tile_warps) == (warps, tile_warps), p
        check_mma_against_float64(big, qtype, n, k, b)


def test_tensor_core_matvec_carries_non_finite_x():
    """An infinite or NaN x gives non-finite products (the engine refuses non-finite logits),
    not finite garbage from the f16 scaling."""
    kernels = emulated_kernels(KernelConfig(stream_groups=1))
    rng = np.random.default_rng(23)
    w = random_blocks(16, 256, QT.Q4_K, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, 7], x[1, 200] = np.inf, np.nan
    out = np.array(kernels.matvec_mma(mx.array(w), QT.Q4_K, mx.array(x), init_value=0.0))
    assert not np.isfinite(out[0]).any() and not np.isfinite(out[1]).any()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_streaming_matvec_silu_rows(metal, qtype):
    """The FFN down projection for 3 token rows of one stacked gate|up output (rows 2k apart)."""
    n, k = 13, 512
    check_silu_rows(lambda w, gu: metal.matvec_silu(w, qtype, gu, gu, up_offset=k, init_value=NAN), qtype, n, k, 3, 11)


def check_silu_rows(run, qtype, n: int, k: int, b: int, seed: int) -> None:
    """run(w, gu) on b rows of one stacked gate|up output against float64 W @ (silu(gate) * up)."""
    rng = np.random.default_rng([n, k, int(qtype), seed])
    w = random_blocks(n, k, qtype, rng)
    gu = (2 * rng.standard_normal((b, 2 * k))).astype(np.float32)
    out = np.array(run(mx.array(w), mx.array(gu)))
    g64, u64 = gu[:, :k].astype(np.float64), gu[:, k:].astype(np.float64)
    act = g64 / (1 + np.exp(-g64)) * u64
    W = dense(w, qtype, n, k)
    assert out.shape == (b, n) and np.isfinite(out).all()
    assert err_over_terms(out, act @ W.T, np.abs(act) @ np.abs(W).T) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_streaming_matvec_silu(metal, qtype):
    n, k = 21, 1024
    rng = np.random.default_rng([n, k, int(qtype), 9])
    w = random_blocks(n, k, qtype, rng)
    gu = (2 * rng.standard_normal((1, 2 * k))).astype(np.float32)   # one stacked gate|up output
    out = np.array(metal.matvec_silu(mx.array(w), qtype, mx.array(gu), mx.array(gu), up_offset=k,
                                       init_value=NAN))
    g64, u64 = gu[0, :k].astype(np.float64), gu[0, k:].astype(np.float64)
    act = g64 / (1 + np.exp(-g64)) * u64
    W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out[0], W @ act, np.abs(W) @ np.abs(act)) < 1e-6


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.NVFP4, QT.F16, QT.F32],
                         ids=lambda t: t.name)
def test_batched_matvec(metal, qtype):
    """matvec.inc (batches of 2-8 rows; the simple one-token kernel for types without a
    streaming one) at 3 rows. (BF16 weights are not emulated: the shim has no bfloat type.)"""
    n, k, b = 13, 512, 3
    rng = np.random.default_rng([n, k, int(qtype)])
    w = random_blocks(n, k, qtype, rng)
    x = rng.standard_normal((b, k)).astype(np.float32)
    out = np.array(metal.matvec(mx.array(w), qtype, mx.array(x), init_value=NAN))
    if qtype in (QT.F16, QT.F32):
        W = np.array(mx.array(w).view(plan.FLOAT_DTYPES[qtype]).reshape(n, k).astype(mx.float32), np.float64)
    else:
        W = dense(w, qtype, n, k)
    assert np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6


def f16_ulps(out: np.ndarray, ref32: np.ndarray) -> np.ndarray:
    """How many float16 steps each output lies from the float32 value rounded to nearest f16."""
    a = np.asarray(out, np.float16).view(np.int16).astype(np.int64)
    b = ref32.astype(np.float16).view(np.int16).astype(np.int64)
    a, b = np.where(a < 0, -(a & 0x7FFF), a), np.where(b < 0, -(b & 0x7FFF), b)   # sign-magnitude -> ordered
    return np.abs(a - b)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.NVFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(7, 256), (3, 2304)])
def test_dequantize_to_f16(metal, qtype, n, k):
    """dequant.inc: every value gguf-py's dequantizer gives, rounded to nearest f16 (a value whose
    float32 product was formed with one rounding fewer, an FMA, may land one f16 step away);
    2,304 = 9 blocks puts Q6_K and Q8_0 rows off 4-byte boundaries."""
    rng = np.random.default_rng([n, k, int(qtype), 16])
    w = random_blocks(n, k, qtype, rng)
    out = np.array(metal.dequantize(mx.array(w), qtype, k, init_value=NAN))
    ref = gguf_dequantize(w, qtype).reshape(n, k).astype(np.float32)
    assert out.dtype == np.float16 and out.shape == (n, k)
    assert np.isfinite(out).all()
    ulps = f16_ulps(out, ref)
    assert ulps.max() <= 1 and (ulps == 0).mean() >= 0.999


@pytest.mark.parametrize("n_head, n_kv, hd, cap, n_valid, chunk", [
    (8, 2, 128, 64, 64, 32),     # a full ring: two splits per KV head
    (8, 2, 128, 300, 257, 128),  # a plane, the last split partly filled
    (6, 1, 48, 40, 7, 32),       # other geometry: head_dim 48 (lanes past it idle), GQA 6:1
])
@pytest.mark.parametrize("combine_warps", [0, 6])
def test_decode_attention(n_head, n_kv, hd, cap, n_valid, chunk, combine_warps):
    """The butterfly partial (padding heads when HPW is 1 or 2), including a split shorter than
    eight rows; the combine scaled with the splits (0) or in 6 simdgroups, more than some cases
    have splits."""
    k = emulated_kernels(KernelConfig(combine_warps=combine_warps))
    rng = np.random.default_rng([n_head, hd, cap, n_valid])
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    splits = -(-n_valid // chunk)
    out = np.array(k.decode_attention(mx.array(q), mx.array(np.stack([keys, values])),
                                      plan.attention_params(n_valid, chunk, splits), chunk, splits, init_value=NAN))
    ref = attention_ref(q, keys, values, n_valid)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_decode_attention_padded_splits(metal):
    """A compiled step's attention: more splits in the grid than the rows visible need
    (plan.attention_splits), the rows visible read only from params; the empty splits must
    weigh nothing in the combine."""
    n_head, n_kv, hd, cap, n_valid, chunk = 8, 2, 64, 320, 70, 32   # 3 splits needed, 10 in the grid
    rng = np.random.default_rng(11)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    params = plan.attention_params(n_valid, chunk, 10)
    out = np.array(metal.decode_attention(mx.array(q), mx.array(np.stack([keys, values])), params, chunk, 10,
                                          init_value=NAN))
    ref = attention_ref(q, keys, values, n_valid)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_decode_attention_gated(metal):
    n_head, n_kv, hd, cap, n_valid = 4, 2, 64, 96, 70
    rng = np.random.default_rng(3)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    keys = (0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16)
    values = rng.standard_normal((n_kv, cap, hd)).astype(np.float16)
    stacked = rng.standard_normal((2, 100 + n_head * hd)).astype(np.float32)   # row 1's gate from offset 100
    width = stacked.shape[1]
    out = np.array(metal.decode_attention(mx.array(q), mx.array(np.stack([keys, values])),
                                          plan.attention_params(n_valid, 32, 3), 32, 3, gate=mx.array(stacked),
                                          gate_offset=width + 100, out_shape=(1, n_head * hd), init_value=NAN))
    gate = stacked[1, 100:].astype(np.float64).reshape(n_head, hd)
    ref = (attention_ref(q, keys, values, n_valid) / (1 + np.exp(-gate))).reshape(1, -1)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("seqs, gated", [(2, False), (3, True), (4, True)])
def test_decode_attention_over_sequences_in_one_launch(metal, seqs, gated):
    """decode_attention_seqs: S sequences, each with its own storage, rows visible (one past a
    chunk, one short of a split) and gate row, in one launch of each kernel, against the same
    kernels launched per sequence: bitwise, since each sequence's sums are the same sums in the
    same order; and against float64."""
    n_head, n_kv, hd, cap, chunk, splits = 8, 2, 64, 160, 32, 5
    rng = np.random.default_rng([seqs, 17])
    q = rng.standard_normal((seqs, n_head, hd)).astype(np.float32)
    keys = [(0.5 * rng.standard_normal((n_kv, cap, hd))).astype(np.float16) for _ in range(seqs)]
    values = [rng.standard_normal((n_kv, cap, hd)).astype(np.float16) for _ in range(seqs)]
    n_valid = [33, 160, 1, 127][:seqs]
    params = [plan.attention_params(n, chunk, splits) for n in n_valid]
    gate = rng.standard_normal((seqs, 40 + n_head * hd)).astype(np.float32) if gated else None
    out = np.array(metal.decode_attention_seqs(
        mx.array(q), [mx.array(np.stack(kv)) for kv in zip(keys, values)], mx.stack(params), chunk, splits,
        gate=None if gate is None else mx.array(gate), gate_offset=40, init_value=NAN))
    assert out.shape == (seqs, n_head * hd) and np.isfinite(out).all()
    for s in range(seqs):
        alone = np.array(metal.decode_attention(
            mx.array(q[s]), mx.array(np.stack([keys[s], values[s]])), params[s], chunk, splits,
            gate=None if gate is None else mx.array(gate), gate_offset=s * gate.shape[1] + 40 if gated else 0,
            out_shape=(1, n_head * hd), init_value=NAN))
        assert np.array_equal(out[s:s + 1], alone), s
        ref = attention_ref(q[s], keys[s], values[s], n_valid[s])
        if gated:
            ref = ref / (1 + np.exp(-gate[s, 40:].astype(np.float64).reshape(n_head, hd)))
        assert np.linalg.norm(out[s] - ref.reshape(-1)) / np.linalg.norm(ref) < 1e-5, s


def rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("rope_half, rows", [(0, 1), (16, 1), (16, 3)])
def test_qk_post(metal, rope_half, rows):
    """One token row (a decode step) or several (B slots), each with its own RoPE angles; K and V
    come out in the cache's layout, K|V (2, n_kv, rows, hd)."""
    n_head, n_kv, hd, eps = 4, 2, 48, 1e-6
    rng = np.random.default_rng([rope_half, rows])
    stacked = rng.standard_normal((rows, n_head * hd + n_kv * hd + 64)).astype(np.float32)  # Q|K|(gate) output
    v = rng.standard_normal((rows, n_kv * hd)).astype(np.float32)
    q_norm, k_norm = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    angles = rng.uniform(0, 6, (rows, max(rope_half, 1))).astype(np.float64)
    rope = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    q_out, kv_out = metal.qk_post(mx.array(stacked), mx.array(stacked), mx.array(v), mx.array(q_norm),
                                  mx.array(k_norm), mx.array(rope), rope_half, eps, n_head, n_kv, hd,
                                  offsets=(0, n_head * hd, 0), init_value=NAN)
    assert kv_out.shape == (2, n_kv, rows, hd)
    k_out, v_out = kv_out[0], kv_out[1]
    for r in range(rows):
        s = stacked[r].astype(np.float64)

        def post(x, w):
            y = rms(x, eps) * w
            if rope_half:
                c, sn = rope[r, :rope_half].astype(np.float64), rope[r, rope_half:].astype(np.float64)
                a, b = y[:, 0:2 * rope_half:2].copy(), y[:, 1:2 * rope_half:2].copy()
                y[:, 0:2 * rope_half:2], y[:, 1:2 * rope_half:2] = a * c - b * sn, a * sn + b * c
            return y
        q_ref = post(s[:n_head * hd].reshape(n_head, hd), q_norm)
        k_ref = post(s[n_head * hd:(n_head + n_kv) * hd].reshape(n_kv, hd), k_norm)
        assert np.abs(np.array(q_out[r]) - q_ref).max() < 1e-5
        # K and V are stored as f16: the f32 results rounded once
        assert np.abs(np.array(k_out[:, r], np.float64) - k_ref).max() <= 2e-3 * np.abs(k_ref).max()
        assert np.array_equal(np.array(v_out[:, r]).reshape(-1), v[r].astype(np.float16))


@pytest.mark.parametrize("rows", [1, 3])
def test_residual_norm(metal, rows):
    n = 1000   # not a multiple of the threads: the last pass is partial
    rng = np.random.default_rng([8, rows])
    x, f = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    w_post, w_next = (rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(2))
    x_out, h = metal.residual_norm(*(mx.array(a) for a in (x, f, w_post, w_next)), 1e-8, 1e-6, init_value=NAN)
    x_ref = x.astype(np.float64) + rms(f.astype(np.float64), 1e-8) * w_post
    h_ref = rms(x_ref, 1e-6) * w_next
    assert np.abs(np.array(x_out) - x_ref).max() < 1e-5
    assert np.abs(np.array(h) - h_ref).max() < 1e-5


@pytest.mark.parametrize("parts, rows", [(3, 3), (8, 1), (2, 4)])
def test_residual_norm_adds_parts_of_k(metal, parts, rows):
    """f as (P, rows, n), a tensor-core product's parts of K (matvec's `parts`): against float64
    with the parts summed, and bit for bit the kernel given the parts already added in order
    p = 0, 1, ... (the order the kernel adds them in)."""
    n = 1000
    rng = np.random.default_rng([9, parts, rows])
    x = rng.standard_normal((rows, n)).astype(np.float32)
    f = (rng.standard_normal((parts, rows, n)) * rng.uniform(0.1, 10, (parts, 1, 1))).astype(np.float32)
    w_post, w_next = (rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(2))
    x_out, h = metal.residual_norm(*(mx.array(a) for a in (x, f, w_post, w_next)), 1e-8, 1e-6, init_value=NAN)
    x_ref = x.astype(np.float64) + rms(f.astype(np.float64).sum(axis=0), 1e-8) * w_post
    assert np.abs(np.array(x_out) - x_ref).max() < 1e-5
    assert np.abs(np.array(h) - rms(x_ref, 1e-6) * w_next).max() < 1e-5
    summed = f[0].copy()
    for p in range(1, parts):
        summed = summed + f[p]   # float32, in order
    x_one, h_one = metal.residual_norm(*(mx.array(a) for a in (x, summed, w_post, w_next)), 1e-8, 1e-6)
    assert np.array_equal(np.array(x_out), np.array(x_one)) and np.array_equal(np.array(h), np.array(h_one))


def test_whole_model_on_emulated_metal_kernels(metal, tmp_path):
    """The kernel path end to end with every kernel's Metal text emulated: a random-block
    Q4_K_M-layout fixture, 3 prompt tokens (batched matvecs) and 6 decode steps (the streaming
    matvecs with the silu product, qk_post, decode attention with the gate, the fused residual
    steps), against the MLX-ops reference path. Tolerances as on the GPU (tests/gpu: this
    fixture's logits are ill-conditioned). The decode step runs with MLX's compilation off
    (mx.disable_compile: the same function, executed): the emulator needs each launch's inputs
    as numbers, which a trace does not have; the compiled step's orchestration is tested with
    MLX-ops stand-ins (test_kernel_path_on_cpu)."""
    from muse_mlx.artifact import open_artifact
    from muse_mlx.model import Model
    from muse_mlx.ops import ReferenceOps
    from muse_mlx.ops.gpu import GpuOps
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_random_blocks

    g = DEFAULT_GEOMETRY
    path = write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=3)
    tokens = np.random.default_rng(11).integers(0, g.n_vocab, 9)

    def run(ops):
        model = Model(open_artifact(path), ops)
        cache = model.make_cache(len(tokens))
        rows = [np.array(model.prefill(mx.array(tokens[:3]), cache, all_logits=True))]
        rows += [np.array(model.step(int(t), cache))[None] for t in tokens[3:]]
        return np.concatenate(rows).astype(np.float64)
    mx.disable_compile()
    try:
        ours = run(GpuOps(metal))
    finally:
        mx.enable_compile()
    ref = run(ReferenceOps())

    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert np.isfinite(ours).all()
    assert d.max() < 1.5e-1 and d.mean() < 5e-3 and (ours.argmax(-1) == ref.argmax(-1)).all(), (d.max(), d.mean())


@pytest.mark.parametrize("n_head, n_kv, hd, held, L, window", [
    (32, 2, 32, 37, 5, 0),       # the pinned GQA (16 heads a tile = one query), a plane with rows held
    (12, 2, 48, 16, 40, 16),     # GQA 6:1 (tiles across queries), a ring in rotation, the chunk longer than it
    (2, 2, 16, 69, 1, 0),        # one query (a one-row chunk), keys not a multiple of the tile
    (8, 1, 64, 150, 7, 24),      # a window far shorter than the rows held: whole tiles of keys unseen
])
def test_prefill_attention(metal, n_head, n_kv, hd, held, L, window):
    """attention_prefill (flash-style, tensor-core stand-in) against the float64 oracle: each
    query's softmax over the keys its position and the window let it see, q and the weights
    rounded to f16 by the kernel (so ~1e-3, not float32's 1e-6)."""
    rng = np.random.default_rng([n_head, hd, held, L])
    held_pos = np.arange(held)
    if window:   # a ring holds the last `window` positions, rotated by its write pointer
        held_pos = np.roll(np.arange(held - min(held, window), held), 5)
    k_pos = np.concatenate([held_pos, np.arange(held, held + L)]).astype(np.int32)
    q_pos = np.arange(held, held + L, dtype=np.int32)
    N = len(k_pos)
    q = (rng.standard_normal((L, n_head, hd)) * 2).astype(np.float32)
    keys = rng.standard_normal((n_kv, N, hd)).astype(np.float16)
    values = rng.standard_normal((n_kv, N, hd)).astype(np.float16)
    out = np.array(metal.prefill_attention(mx.array(q), mx.array(keys), mx.array(values), mx.array(q_pos),
                                           mx.array(k_pos), window, init_value=NAN))
    ref = prefill_attention_ref(q, keys, values, q_pos, k_pos, window)
    assert out.shape == ref.shape and np.isfinite(out).all()
    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 3e-3, err.max()


def test_prefill_attention_is_planned_within_memory():
    """The key tile shrinks until the threadgroup memory fits (Metal: 32 KB); a head dim that is
    not a multiple of 16 gets no plan (the model keeps the float32 attention)."""
    from muse_mlx.kernels import Device
    metal32 = Device("metal", 64)
    for hd in (16, 48, 128, 256):
        memory, kw = plan.prefill_attention_launch(9, 32, 2, hd, metal32)
        assert memory <= 32768 and memory == plan.prefill_attention_memory(hd, dict(kw["template"])["KB"])
    assert dict(plan.prefill_attention_launch(9, 32, 2, 128, metal32)[1]["template"])["KB"] == 32
    assert dict(plan.prefill_attention_launch(9, 32, 2, 256, metal32)[1]["template"])["KB"] == 16
    h200 = Device("cuda", 132, 232448, (9, 0))   # 36 KB at 64 keys: within 48 KB
    assert dict(plan.prefill_attention_launch(9, 32, 2, 128, h200)[1]["template"])["KB"] == 64
    assert plan.prefill_attention_launch(9, 32, 2, 40, metal32) is None
    assert plan.prefill_attention_launch(9, 30, 4, 128, metal32) is None


@pytest.mark.parametrize("b, n, k, config", [
    (3, 37, 768, {}), (4, 17, 1280, {}), (1, 5, 256, {}), (2, 40, 512, {}),
    (3, 21, 2048, {}),                                      # K in parts (Metal's 32 KB)
    (2, 103, 2048, {"mma_warps": 6, "mma_tile_warps": 2, "mma_parts": 1}),  # two warps a tile, a last round past it
    (4, 100, 1280, {"mma_warps": 6, "mma_tile_warps": 3}),  # 5 blocks over 3 warps: one idle
    (4, 19, 6656, {"mma_tile_warps": 32}),                  # the whole threadgroup on one tile
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{a}={c}" for a, c in v.items()) or "-")
@pytest.mark.parametrize("qtype, kernel", [(QT.Q4_K, "matvec_mma_q4_k"), (QT.Q6_K, "matvec_mma_q6_k")],
                         ids=["Q4_K", "Q6_K"])
def test_tensor_core_matvec_block_plans(qtype, kernel, b, n, k, config):
    """The block forms take whole blocks, so their warps split K by blocks: Q4_K's (each lane on its
    own two groups, the mins as one more mma) and Q6_K's (a block's scales and d loaded once; 1,280 = 5 blocks puts every other row, and every other block, off 4-byte
    boundaries), against float64 on plans of every kind (parts of K, tiles split between warps
    with a block count that does not divide, one tile a threadgroup)."""
    from muse_mlx.kernels import Device, Kernels
    from metal_emulator import EmulatedKernel
    device = Device("metal", 4, 1 << 20) if k == 6656 or "mma_warps" in config else None
    cfg = KernelConfig(stream_groups=2, **config)
    kernels = (Kernels(device, cfg, build=lambda name, which, shared: EmulatedKernel(name)) if device
               else emulated_kernels(cfg))
    p = plan.mma_plan(qtype, k, n, b, kernels.device, kernels.config)
    assert p is not None and plan.mma_launch(qtype, k, n, kernels.device, kernels.config, b)[0] == kernel
    if k == 2048 and "mma_parts" not in config:
        assert p.parts > 1
    if "mma_tile_warps" in config and config["mma_tile_warps"] < 32:
        assert p.tile_warps == config["mma_tile_warps"] and p.warps > p.tile_warps, p
    rng = np.random.default_rng([b, n, k, int(qtype), 31])
    w = random_blocks(n, k, qtype, rng)
    x = (rng.standard_normal((b, k)) * np.exp(rng.uniform(-6, 6, (b, 1)))).astype(np.float32)
    out = np.array(kernels.matvec_mma(mx.array(w), qtype, mx.array(x), init_value=NAN))
    W = dense(w, qtype, n, k)
    assert out.shape == (b, n) and np.isfinite(out).all()
    assert err_over_terms(out, x @ W.T, np.abs(x) @ np.abs(W).T) < 1e-6

