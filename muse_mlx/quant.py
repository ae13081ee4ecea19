"""GGUF block formats and their dequantization, in MLX ops.

One function per format turns raw blocks (uint8, one block per row of the last
axis) into float32 values. Each follows the arithmetic of gguf-py's reference
dequantizer operation by operation (same products, same order, no fused
multiply-add), so the results are bit-identical to `gguf.quants.dequantize`
(tests/test_quant.py checks that on random blocks, extreme scales included).

Block layouts (ggml-common.h), bytes per block / values per block:
  Q8_0   34 / 32   d:f16, qs:int8[32]
  Q4_K  144 / 256  d:f16, dmin:f16, scales:u8[12] (6-bit sc/m pairs), qs:u8[128] (nibbles)
  Q5_K  176 / 256  d, dmin, scales[12], qh:u8[32] (5th bits), qs[128]
  Q6_K  210 / 256  ql:u8[128], qh:u8[64], scales:int8[16], d:f16
  NVFP4  36 / 64   d:ue4m3[4] (one per 16 values), qs:u8[32] (E2M1 nibbles)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

QK_K = 256


def block_size(qtype: QT) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def block_bytes(qtype: QT) -> int:
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: QT, row_length: int) -> int:
    return row_length // block_size(qtype) * block_bytes(qtype)


def _f16(b: mx.array) -> mx.array:
    """Two little-endian bytes per value (last axis) -> float32."""
    shape = b.shape[:-1]
    return mx.contiguous(b).view(mx.float16).reshape(shape).astype(mx.float32)


def _u8(values) -> mx.array:
    return mx.array(np.array(values, dtype=np.uint8))


def _ue4m3_table() -> mx.array:
    """ggml_ue4m3_to_fp32 for every byte, with its 0.5 factor: the top bit is ignored
    (exp = (x >> 3) & 0xF) and 0x00 and 0x7F map to 0. Every entry is exact in float32."""
    out = np.zeros(256, dtype=np.float32)
    for x in range(256):
        if x in (0, 0x7F):
            continue
        exp, man = (x >> 3) & 0xF, x & 0x7
        raw = man * 2.0**-9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        out[x] = raw * 0.5
    return mx.array(out)


# E2M1 values, doubled (ggml's kvalues_mxfp4 convention; the 0.5 lives in the scale).
_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequant_f32(raw: mx.array) -> mx.array:
    return mx.contiguous(raw).view(mx.float32)


def dequant_f16(raw: mx.array) -> mx.array:
    return mx.contiguous(raw).view(mx.float16).astype(mx.float32)


def dequant_bf16(raw: mx.array) -> mx.array:
    # bf16 -> f32 is a 16-bit shift; do it on the integers so NaN payloads survive as in gguf-py.
    bits = mx.contiguous(raw).view(mx.uint16).astype(mx.uint32) << 16
    return bits.view(mx.float32)


def dequant_q8_0(blocks: mx.array) -> mx.array:
    d = _f16(blocks[:, 0:2])[:, None]
    x = mx.contiguous(blocks[:, 2:]).view(mx.int8).astype(mx.float32)
    return x * d


def _k_scale_min(scales: mx.array) -> tuple[mx.array, mx.array]:
    """Unpack Q4_K/Q5_K's 12 scale bytes into eight 6-bit scales and eight 6-bit mins."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = mx.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(mx.float32), mn.astype(mx.float32)


def _k_affine(blocks: mx.array) -> tuple[mx.array, mx.array]:
    """Per 32-value group of a Q4_K/Q5_K block: scale = d*sc and offset = dmin*m, each one f32 product."""
    d = _f16(blocks[:, 0:2])[:, None]
    dmin = _f16(blocks[:, 2:4])[:, None]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return (d * sc)[:, :, None], (dmin * mn)[:, :, None]


def _nibbles_by_32(qs: mx.array) -> mx.array:
    """128 bytes -> (8, 32) nibbles: group 2j is the low nibbles of bytes 32j..32j+31, 2j+1 the high."""
    q = qs.reshape(-1, 4, 1, 32) >> _u8([0, 4]).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def dequant_q4_k(blocks: mx.array) -> mx.array:
    scale, offset = _k_affine(blocks)
    q = _nibbles_by_32(blocks[:, 16:144]).astype(mx.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def dequant_q5_k(blocks: mx.array) -> mx.array:
    scale, offset = _k_affine(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 1, 32) >> _u8(range(8)).reshape(1, 1, 8, 1)
    qh = (qh & 0x01).reshape(-1, 8, 32)
    q = (_nibbles_by_32(blocks[:, 48:176]) | (qh << 4)).astype(mx.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def dequant_q6_k(blocks: mx.array) -> mx.array:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 64) >> _u8([0, 4]).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _u8([0, 2, 4, 6]).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).astype(mx.int8) - 32
    scales = mx.contiguous(blocks[:, 192:208]).view(mx.int8).astype(mx.float32)
    d = _f16(blocks[:, 208:210])[:, None]
    scale = (d * scales).reshape(-1, 16, 1)
    return (scale * q.reshape(-1, 16, 16).astype(mx.float32)).reshape(-1, QK_K)


def dequant_nvfp4(blocks: mx.array) -> mx.array:
    d = _ue4m3_table()[blocks[:, 0:4]].reshape(-1, 4, 1)
    qs = blocks[:, 4:36].reshape(-1, 4, 8)
    codes = mx.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (n, 4, 16): low nibbles first
    values = mx.array(np.array(_E2M1_DOUBLED, dtype=np.float32))[codes]
    return (d * values).reshape(-1, 64)


_ELEMENTWISE = {QT.F32: dequant_f32, QT.F16: dequant_f16, QT.BF16: dequant_bf16}
_BLOCKWISE = {
    QT.Q8_0: dequant_q8_0,
    QT.Q4_K: dequant_q4_k,
    QT.Q5_K: dequant_q5_k,
    QT.Q6_K: dequant_q6_k,
    QT.NVFP4: dequant_nvfp4,
}
SUPPORTED = tuple(_ELEMENTWISE) + tuple(_BLOCKWISE)


def dequantize(raw: mx.array, qtype: QT) -> mx.array:
    """Raw rows (..., row_bytes) of uint8 -> float32 values (..., row_length)."""
    if raw.dtype != mx.uint8:
        raise TypeError(f"dequantize expects uint8 rows, got {raw.dtype}")
    lead = raw.shape[:-1]
    if qtype in _ELEMENTWISE:
        return _ELEMENTWISE[qtype](raw)
    if qtype not in _BLOCKWISE:
        raise NotImplementedError(f"no dequantizer for {qtype.name}")
    nb = block_bytes(qtype)
    if raw.shape[-1] % nb:
        raise ValueError(f"{qtype.name} rows must be a whole number of {nb}-byte blocks, got {raw.shape[-1]}")
    values = _BLOCKWISE[qtype](raw.reshape(-1, nb))
    return values.reshape(*lead, raw.shape[-1] // nb * block_size(qtype))


def dequantize_numpy(tensor) -> np.ndarray:
    """A RawTensor -> float32 numpy array in GGUF row-major order (rows, row_length)."""
    return np.array(dequantize(mx.array(np.ascontiguousarray(tensor.data)), tensor.qtype))


# ---- NVFP4 quantization (the project writes NVFP4 itself: llama.cpp's quantizer refuses the ftype) ----


def _fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3 (ggml-impl.h), vectorised: 0 for x <= 0; saturate at 448 (0x7E);
    subnormal (biased exponent <= 0) as round(x * 512) clamped to 0..7; otherwise round
    half up on the fourth mantissa bit, carrying into the exponent."""
    x = np.minimum(np.where(x > 0, x, 0).astype(np.float32), np.float32(448.0))
    bits = x.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    man = ((bits >> 20) & 0x7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carried_exp = np.where(man > 7, exp + 1, exp)
    normal = np.where(carried_exp >= 15, 0x7E, (carried_exp << 3) | np.where(man > 7, 0, man))
    subnormal = np.clip((x * np.float32(512.0) + np.float32(0.5)).astype(np.int32), 0, 7)
    out = np.where(exp <= 0, subnormal, normal)
    return np.where(x > 0, out, 0).astype(np.uint8)


def quantize_nvfp4(values: np.ndarray) -> np.ndarray:
    """float32 rows (n, k), k % 64 == 0 -> block_nvfp4 bytes (n, k/64*36), as quantize_row_nvfp4_ref:
    per 16 values, scale = UE4M3(amax / 6); each value takes the nearest E2M1 code (first on ties)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    n, k = values.shape
    if k % 64:
        raise ValueError(f"NVFP4 rows must be a multiple of 64 values, got {k}")
    sub = values.reshape(n, k // 64, 4, 16)
    amax = np.abs(sub).max(axis=-1)
    ue = _fp32_to_ue4m3((amax / np.float32(6.0)).astype(np.float32))
    d = np.array(_ue4m3_table())[ue][..., None]                      # (n, nb, 4, 1), includes the 0.5
    codes = np.array(_E2M1_DOUBLED, dtype=np.float32)
    err = np.abs(codes[None, None, None, None, :] * d[..., None] - sub[..., None])
    idx = np.argmin(err, axis=-1).astype(np.uint8)                  # (n, nb, 4, 16), first minimum wins
    qs = idx[..., :8] | (idx[..., 8:] << 4)                          # low nibble j, high nibble 8 + j
    blocks = np.concatenate([ue, qs.reshape(n, k // 64, 32)], axis=-1)
    return blocks.reshape(n, -1)
