"""Kernel verification on a GPU (run on the lent H200; skipped where MLX has no GPU backend).

Every check draws fresh random inputs, poisons the outputs with NaN (MLX's init_value)
so an unwritten element fails, and compares with a float64 numpy reference computed
from the bit-exact MLX-ops dequantization. A summary of every check is written as a
receipt to $MUSE_GPU_RECEIPT (or receipts/kernels/verification.json).
"""

import os
import time

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from muse_mlx import kernels
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, random_blocks, write_fixture, write_random_blocks
from muse_mlx.model import load
from muse_mlx.quant import dequantize
from reference import ReferenceModel, attention_ref, log_softmax, within_float32_noise

pytestmark = pytest.mark.skipif(kernels.backend() is None, reason="no Metal or CUDA device")

RESULTS = []
SEED = int(time.time()) % 100_000  # fresh inputs every run; the seed is in the receipt

# (rows N, row length K) at the pinned geometry: q/gate (4096 x 6656 in GGUF ne order is K=6656, N=4096),
# ffn gate/up, ffn down, the LM head.
SHAPES = [(4096, 6656), (19968, 6656), (6656, 19968), (202048, 6656)]
TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.NVFP4]


def record(check, **fields):
    """Add a check's values to the receipt, rewritten after every check: a run cut short by a
    time limit keeps the values of the checks it finished."""
    RESULTS.append({"check": check, **fields})
    write_results()


def write_results():
    from muse_mlx.tools.receipts import make_receipt, write_receipt

    path = os.environ.get("MUSE_GPU_RECEIPT", "receipts/kernels/verification.json")
    failed = [r for r in RESULTS if not r.get("pass", True)]
    write_receipt(path, make_receipt("kernels/verification", inputs={"seed": SEED, "backend": kernels.backend()},
                                     metrics={"checks": RESULTS},
                                     verdict="pass" if not failed and RESULTS else "fail"))


@pytest.fixture(scope="session", autouse=True)
def receipt():
    yield
    write_results()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def product_err(out: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    """|out - ref| over the size of the terms summed, |W| @ |x| (float64), not over |ref|: a
    single output row can cancel to near zero, and float32 rounding error scales with the
    terms, not with their sum (one 256-value Q6_K row gave 6.5e-5 relative to |ref|, the
    same in both matvec loops)."""
    return float(np.linalg.norm(out - ref) / np.linalg.norm(scale))


# ---- the kernel path against the reference path, whole model ---------------------------


def run(path, tokens, prefill, use_kernels):
    device = mx.gpu if use_kernels else mx.cpu
    with mx.stream(device):
        model = load(path, use_kernels=use_kernels)
        cache = model.make_cache(len(tokens))
        # chunks of 100 then 3: the dequantize-and-matmul path, then the batched matvec path
        rows = [np.array(model.prefill(mx.array(tokens[:prefill]), cache, chunk=100, all_logits=True))]
        for t in tokens[prefill:]:
            rows.append(np.array(model(mx.array([int(t)]), cache)))
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-fixtures")
    g = DEFAULT_GEOMETRY
    files = {t.name: write_fixture(d / f"{t.name}.gguf", weight_type=t) for t in (QT.F32, QT.F16, QT.Q8_0)}
    files["Q4_K_M-random"] = write_random_blocks(d / "q4km.gguf", g, kquant_mix(g), seed=3)
    nv = {name: (QT.NVFP4 if len(shape) == 2 else QT.F32) for name, shape in g.tensor_shapes().items()}
    files["NVFP4-random"] = write_random_blocks(d / "nvfp4.gguf", g, nv, seed=4)
    return files


# Max / mean |Δ log-prob| allowed against the reference path, for the well-conditioned fixtures.
LOGIT_TOLERANCE = {"F32": (5e-3, 5e-4), "F16": (5e-3, 5e-4), "Q8_0": (5e-3, 5e-4)}
# The random-block fixtures are ill-conditioned (logits of standard deviation 10-19): in one
# position of a few hundred, tiny activations rescaled by the post-norms and f16 roundings of
# K/V flipped by float32 noise move the whole log-prob row by 0.1 to several units under any
# change of summation order, and which position depends on the tokens drawn (fifth session:
# over 100 draws, max < 0.15 against the reference path failed 12 % of the time for the
# reference path itself, perturbed by 1e-7). They are judged position by position against the
# float64 oracle with each position's own allowance (reference.within_float32_noise).
RANDOM_FIXTURES = ("Q4_K_M-random", "NVFP4-random")


@pytest.mark.parametrize("name", [*LOGIT_TOLERANCE, *RANDOM_FIXTURES])
def test_kernel_path_logits_match_reference_path(fixture_files, name):
    """Prefill 100 (chunked path, dequantized weights) + 3 (batched matvec path), then 57 decode
    steps (one-token matvecs + kernel attention) over wrapped 64-row rings."""
    check_logits(fixture_files, name)


# Attention settings other than the defaults (the former default, candidates measured in
# docs/kernels.md "Sixth session"), each checked end to end.
CANDIDATE_SETTINGS = {"rows": {"MUSE_MLX_ATTN_LOOP": "rows", "MUSE_MLX_COMBINE_WARPS": "4"},   # the default to 3d07fff
                      "butterfly": {"MUSE_MLX_ATTN_LOOP": "butterfly", "MUSE_MLX_COMBINE_WARPS": "4"},
                      "butterfly-small-auto": {"MUSE_MLX_ATTN_LOOP": "butterfly", "MUSE_MLX_ATTN_CHUNK": "16,64",
                                               "MUSE_MLX_COMBINE_WARPS": "auto"},
                      "fuse-norm": {"MUSE_MLX_FUSE_NORM": "1"},   # exercised where the products stream (Q4_K_M)
                      "compile": {"MUSE_MLX_COMPILE": "1"},   # the default since the seventh session
                      "eager": {"MUSE_MLX_COMPILE": "0"},     # the step built in Python each token (before)
                      "compile-fuse-norm": {"MUSE_MLX_COMPILE": "1", "MUSE_MLX_FUSE_NORM": "1"}}


@pytest.mark.parametrize("name", ["F32", "Q4_K_M-random"])
@pytest.mark.parametrize("candidate", CANDIDATE_SETTINGS)
def test_kernel_path_logits_under_candidate_settings(fixture_files, name, candidate, monkeypatch):
    """The whole-model check of one well- and one ill-conditioned fixture with a candidate's settings."""
    for var, value in CANDIDATE_SETTINGS[candidate].items():
        monkeypatch.setenv(var, value)
    check_logits(fixture_files, name, candidate=candidate)


def check_logits(fixture_files, name, **extra):
    tokens = np.random.default_rng([SEED, 7]).integers(0, DEFAULT_GEOMETRY.n_vocab, 160)
    ours = run(fixture_files[name], tokens, 103, use_kernels=True)
    ref = run(fixture_files[name], tokens, 103, use_kernels=False)
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    fields = dict(fixture=name, **extra, max_abs_dlogprob=float(d.max()), mean_abs_dlogprob=float(d.mean()), top1=top1)
    if name in RANDOM_FIXTURES:
        verdict = within_float32_noise(ours, ref, ReferenceModel(fixture_files[name]), tokens)
        ok = verdict.pop("ok")
        fields.update(verdict)
    else:
        max_tol, mean_tol = LOGIT_TOLERANCE[name]
        ok = bool(np.isfinite(ours).all() and d.max() < max_tol and d.mean() < mean_tol and top1 >= 0.98)
    record("model_logits", **fields, **{"pass": ok})
    assert ok, fields


# ---- single kernels against float64 ----------------------------------------------------


def check_matvec(check: str, qtype, n: int, k: int, batch: int, rng, **fields) -> None:
    """kernels.matvec on random valid blocks against float64 numpy (the bit-exact MLX-ops
    dequantization); records the check and asserts a finite result within 1e-5 of the size of
    the terms (product_err)."""
    w = mx.array(random_blocks(n, k, qtype, rng))
    x = mx.array(rng.standard_normal((batch, k)).astype(np.float32))
    out = np.array(kernels.matvec(w, qtype, x, init_value=float("nan"))).astype(np.float64)
    dense = np.array(dequantize(w, qtype)).astype(np.float64)
    x64 = np.array(x).astype(np.float64)
    ref = x64 @ dense.T
    err = product_err(out, ref, np.abs(x64) @ np.abs(dense).T)
    finite = bool(np.isfinite(out).all())
    ok = finite and err < 1e-5
    record(check, qtype=qtype.name, n=n, k=k, batch=batch, err_over_terms=err, finite=finite, **fields, **{"pass": ok})
    assert ok, err


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_matvec(qtype, shape, batch):
    """Batch 1 is the streaming one-token kernel (matvec_stream.inc, its default loop) for Q4_K and Q6_K,
    the simple one otherwise."""
    if shape[0] == 202048 and (batch != 1 or qtype not in (QT.Q6_K, QT.Q4_K)):
        pytest.skip("LM head: Q6_K (its type in Q4_K_M) and Q4_K, one token")
    if batch > 1 and shape != (4096, 6656):
        pytest.skip("batches 5 and 8 at one shape (the same code path at every shape)")
    n, k = shape
    check_matvec("matvec", qtype, n, k, batch, np.random.default_rng([SEED, n, k, batch, int(qtype)]))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (37, 256), (100, 768), (256, 6656), (9, 32768), (9, 33024)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("groups", ["default", "3"])
@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
def test_matvec_stream_other_shapes(qtype, shape, groups, loop, monkeypatch):
    """Row counts that leave a row group partly empty, an odd number of blocks per row (Q6_K
    blocks at 2-byte alignment; staged rows that start off a 16-byte boundary), the widest
    streaming K (32,768: 512 threads), a K past it (33,024: matvec.inc takes it), a grid
    smaller than the row groups (a staged threadgroup then refills each stage several times),
    and few rows (V's 256): the default plan then takes fewer rows per group (R = 4, 2)."""
    monkeypatch.setenv("MUSE_MLX_MATVEC", loop)
    if groups != "default":
        monkeypatch.setenv("MUSE_MLX_STREAM_GROUPS", groups)
    n, k = shape
    check_matvec(f"matvec_{loop}", qtype, n, k, 1,
                 np.random.default_rng([SEED, n, k, int(qtype), len(groups), len(loop)]), groups=groups)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [4096, 6656, 19968])
@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
def test_matvec_loops_at_pinned_row_lengths(qtype, k, loop, monkeypatch):
    """Every one-token variant at the pinned row lengths (their thread counts, idle threads
    past the units, shared-memory sizes), 100 rows: quick enough to run before a benchmark."""
    monkeypatch.setenv("MUSE_MLX_MATVEC", loop)
    check_matvec(f"matvec_{loop}", qtype, 100, k, 1, np.random.default_rng([SEED, k, int(qtype), len(loop), 3]))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6656, 19968), (37, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("loop", ["stream", "staged", "sharedx"])
def test_matvec_silu(qtype, shape, loop, monkeypatch):
    """The FFN down product with silu(gate) * up made inside the kernel."""
    monkeypatch.setenv("MUSE_MLX_MATVEC", loop)
    n, k = shape
    rng = np.random.default_rng([SEED, n, k, int(qtype), 5])
    w = mx.array(random_blocks(n, k, qtype, rng))
    gate, up = (rng.standard_normal((1, k)).astype(np.float32) * 2 for _ in range(2))
    gu = mx.array(np.concatenate([gate, up], axis=1))  # one stacked gate|up output, as the model passes it
    out = np.array(kernels.matvec_silu(w, qtype, gu, gu, up_offset=k, init_value=float("nan")))
    g64 = gate.astype(np.float64)
    act = g64 / (1 + np.exp(-g64)) * up.astype(np.float64)
    dense = np.array(dequantize(w, qtype)).astype(np.float64)
    ref = act @ dense.T
    err = product_err(out.astype(np.float64), ref, np.abs(act) @ np.abs(dense).T)
    ok = bool(np.isfinite(out).all() and err < 1e-5)
    record("matvec_silu", qtype=qtype.name, n=n, k=k, loop=loop, err_over_terms=err, **{"pass": ok})
    assert ok, err


@pytest.mark.parametrize("qtype, n", [(QT.Q4_K, 39936), (QT.Q4_K, 8704), (QT.Q6_K, 256), (QT.Q6_K, 8704),
                                      (QT.Q4_K, 37)], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_resnorm(qtype, n):
    """The residual step made in the product's prologue (MUSE_MLX_FUSE_NORM): FFN gate|up,
    Q|K|gate|V, V, and a matrix of fewer rows than threadgroups, at the pinned row length
    6,656, against float64; the residual output written whole (outputs start as NaN)."""
    k = 6656
    rng = np.random.default_rng([SEED, n, int(qtype), 11])
    w = mx.array(random_blocks(n, k, qtype, rng))
    x, f = rng.standard_normal((1, k)).astype(np.float32), (3 * rng.standard_normal((1, k))).astype(np.float32)
    w_post, w_next = (rng.uniform(0.5, 1.5, k).astype(np.float32) for _ in range(2))
    eps = np.array([1e-8, 1e-6], np.float32)
    y, r_out = kernels.matvec_resnorm(w, qtype, mx.array(x), mx.array(f), mx.array(w_post), mx.array(w_next),
                                      mx.array(eps), init_value=float("nan"))
    x64, f64 = x[0].astype(np.float64), f[0].astype(np.float64)
    r = x64 + f64 / np.sqrt((f64 * f64).mean() + 1e-8) * w_post
    h = r / np.sqrt((r * r).mean() + float(eps[1])) * w_next
    dense = np.array(dequantize(w, qtype)).astype(np.float64)
    y, r_out = np.array(y).astype(np.float64)[0], np.array(r_out).astype(np.float64)[0]
    err = product_err(y, dense @ h, np.abs(dense) @ np.abs(h))
    r_err = float(np.abs(r_out - r).max() / np.abs(r).max())
    ok = bool(np.isfinite(y).all() and np.isfinite(r_out).all() and err < 1e-5 and r_err < 1e-5)
    record("matvec_resnorm", qtype=qtype.name, n=n, k=k, err_over_terms=err, residual_rel_err=r_err, **{"pass": ok})
    assert ok, (err, r_err)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_matvec_float(qtype):
    check_matvec("matvec", qtype, 4096, 6656, 2, np.random.default_rng([SEED, int(qtype)]))


@pytest.mark.parametrize("kind, cap, n_valid", [
    ("ring-before-wrap", 2048, 1), ("ring-before-wrap", 2048, 700), ("ring-full", 2048, 2048),
    ("plane", 131072, 5), ("plane", 131072, 32768), ("plane", 131072, 100_003), ("plane", 131072, 131072),
])
@pytest.mark.parametrize("rows", ["default", "1", "8", "butterfly", "butterfly-small-auto"])
def test_decode_attention(kind, cap, n_valid, rows, monkeypatch):
    """The defaults (no MUSE_MLX_* set); rows of K/V loaded one at a time or eight together
    (MUSE_MLX_ATTN_ROWS) in the rows loop, or the butterfly loop (MUSE_MLX_ATTN_LOOP), each with
    the combine in 4 simdgroups; -small-auto: splits of 16 / 64 rows (ring / plane) and the
    combine's simdgroups scaled with the splits (MUSE_MLX_COMBINE_WARPS=auto: up to 32)."""
    for var in ("MUSE_MLX_ATTN_LOOP", "MUSE_MLX_ATTN_ROWS", "MUSE_MLX_COMBINE_WARPS", "MUSE_MLX_ATTN_CHUNK"):
        monkeypatch.delenv(var, raising=False)
    if rows == "default":
        pass
    elif rows.startswith("butterfly"):
        monkeypatch.setenv("MUSE_MLX_ATTN_LOOP", "butterfly")
    else:
        monkeypatch.setenv("MUSE_MLX_ATTN_LOOP", "rows")
        monkeypatch.setenv("MUSE_MLX_ATTN_ROWS", rows)
    small = rows.endswith("-small-auto")
    if rows != "default":
        monkeypatch.setenv("MUSE_MLX_COMBINE_WARPS", "auto" if small else "4")
    rng = np.random.default_rng([SEED, cap, n_valid])
    n_head, n_kv, hd = 32, 2, 128
    q = mx.array(rng.standard_normal((n_head, hd)).astype(np.float32))
    keys = mx.array((rng.standard_normal((n_kv, cap, hd)) * 0.5).astype(np.float16))
    values = mx.array(rng.standard_normal((n_kv, cap, hd)).astype(np.float16))
    chunk = (16 if small else kernels.RING_CHUNK) if kind.startswith("ring") else (64 if small else kernels.PLANE_CHUNK)
    out = np.array(kernels.decode_attention(q, keys, values, n_valid, chunk, init_value=float("nan")))
    ref = attention_ref(q, keys, values, n_valid)
    err = rel_err(out.astype(np.float64), ref)
    ok = bool(np.isfinite(out).all() and err < 1e-5)
    record("decode_attention", kind=kind, cap=cap, n_valid=n_valid, rows=rows, rel_err=err, **{"pass": ok})
    assert ok, (err, int(np.isnan(out).sum()), out[0, :4], ref[0, :4])


@pytest.mark.parametrize("kind, cap, n_valid", [("ring-before-wrap", 2048, 700), ("ring-full", 2048, 2048),
                                                ("plane", 131072, 5), ("plane", 131072, 32768),
                                                ("plane", 131072, 100_003)])
def test_decode_attention_padded_splits(kind, cap, n_valid):
    """A compiled step's attention (defaults): the grid's splits rounded up (kernels.attention_splits),
    the rows visible read only from params, the empty splits weighed at zero by the combine."""
    rng = np.random.default_rng([SEED, cap, n_valid, 3])
    n_head, n_kv, hd = 32, 2, 128
    q = mx.array(rng.standard_normal((n_head, hd)).astype(np.float32))
    keys = mx.array((rng.standard_normal((n_kv, cap, hd)) * 0.5).astype(np.float16))
    values = mx.array(rng.standard_normal((n_kv, cap, hd)).astype(np.float16))
    chunk = kernels.RING_CHUNK if kind.startswith("ring") else kernels.PLANE_CHUNK
    splits = kernels.attention_splits(n_valid, chunk, cap) + (1 if kind == "ring-full" else 0)  # one past the storage
    out = np.array(kernels.decode_attention(q, keys, values, None, chunk, init_value=float("nan"),
                                            params=kernels.attention_params(n_valid, chunk, splits), splits=splits))
    err = rel_err(out.astype(np.float64), attention_ref(q, keys, values, n_valid))
    ok = bool(np.isfinite(out).all() and err < 1e-5)
    record("decode_attention_padded", kind=kind, cap=cap, n_valid=n_valid, splits=splits, rel_err=err, **{"pass": ok})
    assert ok, err


def test_decode_attention_other_geometry():
    """Head dim 48 (not a multiple of 32), GQA 6:1 (3 simdgroups of 2 heads)."""
    rng = np.random.default_rng([SEED, 48])
    q = mx.array(rng.standard_normal((12, 48)).astype(np.float32))
    keys = mx.array(rng.standard_normal((2, 300, 48)).astype(np.float16))
    values = mx.array(rng.standard_normal((2, 300, 48)).astype(np.float16))
    out = np.array(kernels.decode_attention(q, keys, values, 257, kernels.RING_CHUNK, init_value=float("nan")))
    err = rel_err(out.astype(np.float64), attention_ref(q, keys, values, 257))
    record("decode_attention", kind="hd48-gqa6", cap=300, n_valid=257, rel_err=err, **{"pass": err < 1e-5})
    assert err < 1e-5


def test_decode_attention_gated():
    """The output gate fused into the combine step: out = attention * sigmoid(gate)."""
    rng = np.random.default_rng([SEED, 99])
    q = mx.array(rng.standard_normal((32, 128)).astype(np.float32))
    keys = mx.array((rng.standard_normal((2, 500, 128)) * 0.5).astype(np.float16))
    values = mx.array(rng.standard_normal((2, 500, 128)).astype(np.float16))
    gate = rng.standard_normal(32 * 128).astype(np.float32) * 3
    stacked = mx.array(np.concatenate([rng.standard_normal(300).astype(np.float32), gate]))
    out = np.array(kernels.decode_attention(q, keys, values, 433, kernels.PLANE_CHUNK, init_value=float("nan"),
                                            gate=stacked, gate_offset=300))
    ref = attention_ref(q, keys, values, 433) / (1 + np.exp(-gate.astype(np.float64).reshape(32, 128)))
    err = rel_err(out.astype(np.float64), ref)
    record("decode_attention_gated", n_valid=433, rel_err=err, **{"pass": err < 1e-5})
    assert err < 1e-5


def rmsnorm64(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("n_head, n_kv, hd, rope_half", [(32, 2, 128, 64), (32, 2, 128, 0), (12, 2, 48, 16),
                                                          (8, 8, 32, 16)])
def test_qk_post(n_head, n_kv, hd, rope_half):
    """Per-head RMSNorm of q and k, RoPE in ggml's NORM mode (adjacent pairs), K/V rounded to f16."""
    rng = np.random.default_rng([SEED, n_head, hd, rope_half])
    q, k, v = (rng.standard_normal(n * hd).astype(np.float32) * 3 for n in (n_head, n_kv, n_kv))
    qn, kn = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    ang = rng.uniform(-50, 50, max(rope_half, 1)).astype(np.float32)
    rope = np.concatenate([np.cos(ang), np.sin(ang)]).astype(np.float32)
    eps = 1e-3
    qk = mx.array(np.concatenate([q, k, rng.standard_normal(7).astype(np.float32)]))  # stacked, as the model passes it
    qo, ko, vo = kernels.qk_post(qk, qk, mx.array(v), mx.array(qn), mx.array(kn), mx.array(rope),
                                 rope_half, mx.array([eps], dtype=mx.float32), n_head, n_kv, hd,
                                 q_offset=0, k_offset=n_head * hd, init_value=float("nan"))

    def rotate(x):  # (heads, hd), the reference's apply_rope on adjacent pairs
        x = x.copy()
        c, s_ = rope[:rope_half].astype(np.float64), rope[rope_half:2 * rope_half].astype(np.float64)
        x0, x1 = x[:, 0:2 * rope_half:2].copy(), x[:, 1:2 * rope_half:2].copy()
        x[:, 0:2 * rope_half:2], x[:, 1:2 * rope_half:2] = x0 * c - x1 * s_, x0 * s_ + x1 * c
        return x

    q_ref = rotate(rmsnorm64(q.reshape(n_head, hd), qn, eps))
    k_ref = rotate(rmsnorm64(k.reshape(n_kv, hd), kn, eps))
    eq = rel_err(np.array(qo).astype(np.float64), q_ref)
    # K and V: the f16 rounding of the float64 value, allowing one f16 ulp where float32 noise straddles a tie
    ek = np.abs(np.array(ko).reshape(n_kv, hd).astype(np.float64) - k_ref.astype(np.float16).astype(np.float64))
    ev = np.abs(np.array(vo).reshape(n_kv, hd) - v.reshape(n_kv, hd).astype(np.float16))
    ulp = np.abs(k_ref) * 2.0 ** -10
    ok = bool(eq < 1e-6 and (ek <= ulp).all() and (ev == 0).all() and np.isfinite(np.array(qo)).all())
    record("qk_post", n_head=n_head, n_kv=n_kv, hd=hd, rope_half=rope_half, q_rel_err=eq,
           k_max_err_ulps=float((ek / np.maximum(ulp, 1e-30)).max()), v_exact=bool((ev == 0).all()), **{"pass": ok})
    assert ok, (eq, float(ek.max()), float(ev.max()))


@pytest.mark.parametrize("n", [6656, 256, 1000, 4097])
def test_residual_norm(n):
    """x + rmsnorm(f) * w_post (eps 1e-8), then rmsnorm of that (eps 1e-3) * w_next."""
    rng = np.random.default_rng([SEED, n])
    x, f = (rng.standard_normal(n).astype(np.float32) * 4 for _ in range(2))
    wp, wn = (rng.uniform(0.2, 2.0, n).astype(np.float32) for _ in range(2))
    eps = mx.array([1e-8, 1e-3], dtype=mx.float32)
    xo, h = kernels.residual_norm(mx.array(x)[None], mx.array(f)[None], mx.array(wp), mx.array(wn), eps,
                                  init_value=float("nan"))
    x_ref = x.astype(np.float64) + rmsnorm64(f, wp, 1e-8)
    h_ref = rmsnorm64(x_ref, wn, 1e-3)
    ex, eh = rel_err(np.array(xo).reshape(-1).astype(np.float64), x_ref), \
        rel_err(np.array(h).reshape(-1).astype(np.float64), h_ref)
    ok = bool(ex < 1e-6 and eh < 1e-6)
    record("residual_norm", n=n, x_rel_err=ex, h_rel_err=eh, **{"pass": ok})
    assert ok, (ex, eh)


