"""Dequantization is bit-exact against gguf-py's reference dequantizers (gguf.quants.dequantize)."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_mlx.quant import SUPPORTED, dequantize

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.NVFP4]

# Where each block format keeps its f16 scale(s), as byte offsets (ggml-common.h).
F16_SCALE_OFFSETS = {QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
EXTREME_F16 = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x3C00, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00],
                       dtype=np.uint16)  # max, -max, min subnormal, -min subnormal, min normal, 1, ±0, ±inf, NaN


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, except that any NaN equals any NaN (payloads are not part of the contract)."""
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return np.array_equal(nan_a, nan_b) and np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b])


def ours(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return np.array(dequantize(mx.array(raw), qtype))


def test_every_contract_type_has_a_dequantizer():
    assert set(TYPES) == set(SUPPORTED)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bytes(qtype, seed):
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(5, 24 * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw, qtype)
    got = ours(raw, qtype)
    assert got.shape == (5, 24 * block)
    assert same_bits(got, ref)


@pytest.mark.parametrize("qtype", list(F16_SCALE_OFFSETS), ids=lambda t: t.name)
def test_extreme_scales(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    n = len(EXTREME_F16) ** 2
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    offsets = F16_SCALE_OFFSETS[qtype]
    a, b = np.meshgrid(EXTREME_F16, EXTREME_F16)
    for off, values in zip(offsets, (a.reshape(-1), b.reshape(-1))):
        raw[:, off:off + 2] = values.view(np.uint8).reshape(-1, 2)
    if qtype in (QT.Q4_K, QT.Q5_K):  # the largest 6-bit scales and mins too
        raw[: n // 2, 4:16] = 0xFF
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw, qtype)
    assert same_bits(ours(raw, qtype), ref)


def test_nvfp4_every_scale_byte():
    """All 256 UE4M3 bytes, including 0x7F (ggml maps it to 0) and the ignored top bit."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(64, 36), dtype=np.uint8)
    raw[:, 0:4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    assert same_bits(ours(raw, QT.NVFP4), gguf_dequantize(raw, QT.NVFP4))


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), data=st.data())
def test_arbitrary_blocks(qtype, data):
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = data.draw(st.integers(1, 3))
    payload = data.draw(st.binary(min_size=n_blocks * size, max_size=n_blocks * size))
    raw = np.frombuffer(payload, dtype=np.uint8).reshape(1, -1)
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw, qtype)
    assert same_bits(ours(raw, qtype), ref)


def test_rejects_partial_blocks():
    with pytest.raises(ValueError, match="whole number"):
        dequantize(mx.zeros((2, 35), dtype=mx.uint8), QT.Q8_0)
