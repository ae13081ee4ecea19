"""The MLX model against an independent float64 numpy reference (tests/reference.py).

Tolerances, and why (max |Δ log-probability| over the whole vocabulary, every position):
- f32 KV against the reference without KV rounding: 1e-4. Both compute the same
  function; the engine does it in float32 (measured 1.7e-5 on the default fixture,
  212 tokens: float32 matmuls, RoPE angles by ggml's float32 recurrence;
  receipts/reference/float64.json, tests/measure_reference_tolerances.py).
- f16 KV (the contract) against the reference that rounds K/V to f16 too: 5e-3 max,
  5e-4 mean, top-1 agreement >= 0.98. Rounding to f16 amplifies the float32 noise:
  an element that lands near an f16 rounding boundary flips by one f16 ulp (4.9e-4
  relative), so a few positions move by up to ~1e-3 (measured 1.0e-3 max, 1.4e-4 mean,
  top-1 1.0; same receipt).
Sequences are longer than the window, so every sliding layer's ring wraps.
"""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, write_fixture
from muse_mlx.geometry import Geometry
from muse_mlx.model import load
from reference import ReferenceModel, log_softmax

F32_KV_TOL = 1e-4
F16_KV_MAX, F16_KV_MEAN, F16_KV_TOP1 = 5e-3, 5e-4, 0.98

# Geometries the engine has never been tuned on: other layer counts, windows, head
# counts and dims, partial RoPE, custom sliding patterns, logit scales, softcaps, bases.
OTHER_GEOMETRIES = {
    "gqa4-hd64-nocap": Geometry(n_layer=5, n_embd=128, n_head=4, n_head_kv=1, head_dim=64, n_ff=256, n_vocab=300,
                                sliding_window=16, context_length=512, rms_eps=1e-5, rope_base=1e6,
                                rope_base_swa=500.0, logit_scale=0.5, final_logit_softcap=None),
    "partial-rope-pattern": Geometry(n_layer=6, n_embd=96, n_head=6, n_head_kv=3, head_dim=16, n_ff=160,
                                     n_vocab=400, sliding_window=40, context_length=256, rms_eps=1e-2,
                                     rope_base=10_000.0, rope_base_swa=2_000.0, logit_scale=3.0,
                                     final_logit_softcap=5.0, rope_dim=8,
                                     swa_layers=(True, False, True, True, False, True)),
    "mha-window1": Geometry(n_layer=4, n_embd=64, n_head=2, n_head_kv=2, head_dim=48, n_ff=128, n_vocab=270,
                            sliding_window=1, context_length=128, rms_eps=1e-4, rope_base=10_000.0,
                            rope_base_swa=10_000.0, logit_scale=1.0, final_logit_softcap=50.0),
}


def tokens_for(g: Geometry, n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, g.n_vocab, n)


def engine_logits(path, tokens, *, kv_dtype=mx.float16, chunk=512, context=None):
    model = load(path)
    cache = model.make_cache(context or len(tokens) + 8, dtype=kv_dtype)
    return np.array(model.prefill(mx.array(tokens), cache, chunk=chunk, all_logits=True))


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    return {"max": float(d.max()), "mean": float(d.mean()),
            "top1": float((ours.argmax(-1) == ref.argmax(-1)).mean())}


def assert_f16_close(m):
    assert m["max"] < F16_KV_MAX and m["mean"] < F16_KV_MEAN and m["top1"] >= F16_KV_TOP1, m


@pytest.fixture(scope="module")
def default_tokens():
    return tokens_for(DEFAULT_GEOMETRY, 3 * DEFAULT_GEOMETRY.sliding_window + 20)  # 212 positions: 3 wraps


@pytest.fixture(scope="module")
def reference_logits(f32_fixture, default_tokens):
    return {kv16: ReferenceModel(f32_fixture, kv_f16=kv16).logits(default_tokens) for kv16 in (False, True)}


def test_f32_kv_matches_float64(f32_fixture, default_tokens, reference_logits):
    m = compare(engine_logits(f32_fixture, default_tokens, kv_dtype=mx.float32), reference_logits[False])
    assert m["max"] < F32_KV_TOL, m
    assert m["top1"] == 1.0


def test_f16_kv_matches_float64(f32_fixture, default_tokens, reference_logits):
    assert_f16_close(compare(engine_logits(f32_fixture, default_tokens), reference_logits[True]))


@pytest.mark.parametrize("chunk", [1, 7, 64, 65, 150])
def test_chunked_prefill_across_the_wrap(f32_fixture, default_tokens, reference_logits, chunk):
    """Chunks shorter than, equal to and longer than the ring, split anywhere across a wrap."""
    m = compare(engine_logits(f32_fixture, default_tokens, kv_dtype=mx.float32, chunk=chunk),
                reference_logits[False])
    assert m["max"] < F32_KV_TOL, m


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16], ids=["f32kv", "f16kv"])
def test_incremental_decode_matches_full_forward(f32_fixture, default_tokens, reference_logits, kv_dtype):
    """Prefill 37 tokens, then one token at a time through the rings and planes."""
    model = load(f32_fixture)
    cache = model.make_cache(len(default_tokens), dtype=kv_dtype)
    steps = [np.array(model.prefill(mx.array(default_tokens[:37]), cache, all_logits=True))]
    for t in default_tokens[37:]:
        steps.append(np.array(model.step(int(t), cache))[None])
    incremental = np.concatenate(steps)
    full = engine_logits(f32_fixture, default_tokens, kv_dtype=kv_dtype)
    if kv_dtype == mx.float32:
        assert np.abs(incremental - full).max() < 1e-4
        assert compare(incremental, reference_logits[False])["max"] < F32_KV_TOL
    else:
        assert_f16_close(compare(incremental, full))
        assert_f16_close(compare(incremental, reference_logits[True]))
    assert cache.offset == len(default_tokens)


@pytest.mark.parametrize("weight_type", [QT.F16, QT.BF16, QT.Q8_0], ids=lambda t: t.name)
def test_quantized_weights_match_float64_on_the_same_weights(fixture_dir, weight_type):
    """The reference dequantizes with gguf-py, the engine with its own code: same weights, same tolerance."""
    path = write_fixture(fixture_dir / f"default-{weight_type.name}.gguf", weight_type=weight_type)
    tokens = tokens_for(DEFAULT_GEOMETRY, 150, seed=2)
    m = compare(engine_logits(path, tokens, kv_dtype=mx.float32), ReferenceModel(path, kv_f16=False).logits(tokens))
    assert m["max"] < F32_KV_TOL, m


@pytest.mark.parametrize("name", list(OTHER_GEOMETRIES))
def test_other_geometries(fixture_dir, name):
    g = OTHER_GEOMETRIES[name]
    path = write_fixture(fixture_dir / f"{name}.gguf", geometry=g, seed=5)
    tokens = tokens_for(g, 2 * g.sliding_window + 30, seed=3)
    ours = engine_logits(path, tokens, kv_dtype=mx.float32, chunk=max(1, g.sliding_window // 2 + 3))
    m = compare(ours, ReferenceModel(path, kv_f16=False).logits(tokens))
    assert m["max"] < F32_KV_TOL, m
    assert_f16_close(compare(engine_logits(path, tokens), ReferenceModel(path, kv_f16=True).logits(tokens)))


def _protocol_logits(path, tokens, kv_dtype=mx.float16):
    """tests/gpu's protocol on the reference path: prefill 103 in chunks of 100, then one token at a time."""
    model = load(path, backend="reference")
    cache = model.make_cache(len(tokens), dtype=kv_dtype)
    rows = [np.array(model.prefill(mx.array(tokens[:103]), cache, chunk=100, all_logits=True))]
    for t in tokens[103:]:
        rows.append(np.array(model.step(int(t), cache))[None])
    return np.concatenate(rows)


def test_float32_noise_rule_on_the_random_fixture(tmp_path):
    """The rule tests/gpu judges the ill-conditioned random-block fixtures by
    (reference.within_float32_noise), on the CPU: the perturbed oracle at eps = 0 is the oracle
    bit for bit; a float32 path with another summation order (the reference path with its
    products jittered by 1e-7) passes on the token draw of seed 94356, where the kernel path
    at 8029aec was 0.46 from the reference path in one position (H200); the same path with
    K/V stored in bfloat16 instead of float16 fails (by 82x its allowance when written; the
    jittered path used 0.08 of it)."""
    from muse_mlx.tools.fixtures import kquant_mix, write_random_blocks
    from muse_mlx.ops import ReferenceOps
    from reference import within_float32_noise

    g = DEFAULT_GEOMETRY
    path = write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=3)
    tokens = np.random.default_rng([94356, 7]).integers(0, g.n_vocab, 160)
    oracle_model = ReferenceModel(path)
    assert np.array_equal(oracle_model.logits(tokens, eps=0.0, seed=5), oracle_model.logits(tokens))
    ref = _protocol_logits(path, tokens)
    plain = ReferenceOps.project
    rng = np.random.default_rng(11)

    def jittered(self, w, x):
        y = plain(self, w, x)
        return y * mx.array((1 + 1e-7 * rng.standard_normal(y.shape)).astype(np.float32))

    ReferenceOps.project = jittered
    try:
        other_order = _protocol_logits(path, tokens)
    finally:
        ReferenceOps.project = plain
    assert not np.array_equal(other_order, ref)
    verdict = within_float32_noise(other_order, ref, oracle_model, tokens)
    assert verdict["ok"], verdict
    bf16_kv = _protocol_logits(path, tokens, kv_dtype=mx.bfloat16)
    verdict = within_float32_noise(bf16_kv, ref, oracle_model, tokens)
    assert not verdict["ok"] and verdict["worst_error_over_allowance"] > 10, verdict


def test_f16_precision_rule_on_the_random_fixture(tmp_path):
    """The rule tests/gpu judges the f16 prefill lane by on the random-block fixture
    (reference.within_precision_noise at F16_EPS), on the CPU, over three token draws: the
    oracle perturbed at f16 precision (a correct f16 path's kind of error) passes; the same
    with the sliding window one row short, or with RoPE's base 1.5x, fails every draw. And a
    top-1 rule could not judge such a path: perturbed at f16 precision, the oracle changes its
    own top-1 at positions where its two log-probs were apart by more than 1 nat."""
    import copy

    from muse_mlx.tools.fixtures import kquant_mix, write_random_blocks
    from reference import F16_EPS, within_precision_noise

    g = DEFAULT_GEOMETRY
    oracle_model = ReferenceModel(write_random_blocks(tmp_path / "q4km.gguf", g, kquant_mix(g), seed=3))
    short_window, rope_base = copy.copy(oracle_model), copy.copy(oracle_model)
    short_window.window -= 1
    rope_base.rope_base *= 1.5
    for draw in range(3):
        tokens = np.random.default_rng([40 + draw, 13]).integers(0, g.n_vocab, 103)
        float32_path = oracle_model.logits(tokens, eps=1e-6, seed=100)
        for model, good in ((oracle_model, True), (short_window, False), (rope_base, False)):
            ours = model.logits(tokens, eps=F16_EPS, seed=200)
            verdict = within_precision_noise(ours, float32_path, oracle_model, tokens, F16_EPS)
            assert verdict["ok"] == good, (draw, good, verdict)
    # the token draw [4, 13] of the 2026-12-02 measurement: perturbed at f16 precision, the oracle
    # moves its own top-1 at a position where its two log-probs were more than 1 nat apart
    tokens = np.random.default_rng([4, 13]).integers(0, g.n_vocab, 103)
    exact = log_softmax(oracle_model.logits(tokens))
    gaps = []
    for seed in range(3):
        moved = oracle_model.logits(tokens, eps=F16_EPS, seed=seed).argmax(-1)
        at = np.nonzero(moved != exact.argmax(-1))[0]
        gaps += list(exact[at, exact.argmax(-1)[at]] - exact[at, moved[at]])
    assert max(gaps) > 1.0, gaps
