"""Parity with the pinned llama.cpp: every lane passes its thresholds, and each planted fault fails them.

Needs the parity extra (llama-cpp-python==0.3.36). Numbers come from synthetic fixtures.
"""

import ctypes
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import muse_mlx.model as model_module
import muse_mlx.ops.reference as reference_ops
from muse_mlx.tools import parity
from muse_mlx.artifact import open_artifact
from muse_mlx.tools.llamacpp import LlamaCpp, lib
from muse_mlx.tools.receipts import write_new_receipt
from muse_mlx.model import Model, load
from muse_mlx.quant import quantize_nvfp4
from muse_mlx.tokenizer import MuseTokenizer
from reference import ReferenceModel, log_softmax

pytestmark = pytest.mark.parity

PREFILL, DECODE, GREEDY = 100, 120, 16   # 220 positions: the 64-position window wraps three times


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 512, PREFILL + DECODE)


@pytest.fixture(scope="module")
def lane_files(f32_fixture, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lanes")
    return {name: parity.lane_file(lane, f32_fixture, workdir) for name, lane in parity.LANES.items()}


def run(name, path, tokens, model=None, lane=None):
    return parity.run_lane(lane or parity.LANES[name], path, tokens, PREFILL, GREEDY, model=model)


@pytest.mark.parametrize("name", list(parity.LANES))
def test_lane_passes(name, lane_files, tokens):
    result = run(name, lane_files[name], tokens)
    assert result.passed, parity.table([result])


def test_lane_files_have_the_lane_types(lane_files):
    def matrix_types(path):
        return {t.qtype for t in open_artifact(path).tensors.values() if len(t.shape) == 2}

    assert matrix_types(lane_files["q4_k_m"]) == {QT.Q4_K, QT.Q6_K}
    assert matrix_types(lane_files["q5_k_m"]) == {QT.Q5_K, QT.Q6_K}
    assert matrix_types(lane_files["q6_k"]) == {QT.Q6_K}
    assert matrix_types(lane_files["nvfp4"]) == {QT.NVFP4}
    for name in parity.LANES:
        assert name in parity.infer_lanes(lane_files[name])


# ---- planted faults: the harness must catch each ---------------------------------------


def neox_rope(x, cos, sin):
    """The other RoPE mode (GPT-NeoX: rotate the two halves), the classic porting bug."""
    half = cos.shape[-1]
    x0, x1 = x[..., :half], x[..., half:2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = mx.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return rotated if 2 * half == x.shape[-1] else mx.concatenate([rotated, x[..., 2 * half:]], axis=-1)


def with_geometry(path, **changes):
    artifact = open_artifact(path)
    artifact.geometry = artifact.geometry.with_(**changes)
    return Model(artifact)


FAULTS = {
    "rope-neox-mode": lambda mp, path: (mp.setattr(reference_ops, "apply_rope", neox_rope), load(path))[1],
    "rope-full-base": lambda mp, path: with_geometry(path, rope_base_swa=1_000_000.0),
    "norm-eps-default": lambda mp, path: with_geometry(path, rms_eps=1e-6),
    "post-norm-eps-from-file": lambda mp, path: (mp.setattr(model_module, "POST_NORM_EPS", 1e-3), load(path))[1],
    "window-plus-one": lambda mp, path: with_geometry(path, sliding_window=65),
    "window-minus-one": lambda mp, path: with_geometry(path, sliding_window=63),
    "gate-missing": lambda mp, path: (mp.setattr(reference_ops, "output_gate", lambda a, g: a), load(path))[1],
    "softcap-missing": lambda mp, path: with_geometry(path, final_logit_softcap=None),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_exactness_lane_catches_fault(fault, f32_fixture, tokens, monkeypatch):
    faulty = FAULTS[fault](monkeypatch, f32_fixture)
    result = run("f32", f32_fixture, tokens, model=faulty)
    assert not result.passed
    assert not result.checks["closer_to_oracle"]["pass"], parity.table([result])


def test_f16kv_lane_catches_unrounded_kv(f32_fixture, tokens):
    unrounded = dataclasses.replace(parity.LANES["f16kv"], engine_kv="f32")
    result = run("f16kv", f32_fixture, tokens, lane=unrounded)
    assert not result.passed
    assert not result.checks["kv_layer0_identical"]["pass"]
    assert result.metrics["kv_layer0_identical"] < 0.01


# ---- the referee on geometries the fixtures were not tuned on ---------------------------------


@pytest.fixture(scope="module")
def wide_q4_k_m(tmp_path_factory):
    """llama.cpp's own Q4_K_M of a geometry unlike the default fixture's: hidden 512, 8:2 heads of
    64, window 16, 12 layers (its CPU path drifts from the float64 oracle here: top-1 ~0.87)."""
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, write_fixture
    from muse_mlx.tools.llamacpp import quantize

    d = tmp_path_factory.mktemp("wide")
    g = DEFAULT_GEOMETRY.with_(n_layer=12, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, rope_dim=64,
                               sliding_window=16)
    return quantize(write_fixture(d / "wide-f32.gguf", g), d / "wide-q4_k_m.gguf", "Q4_K_M")


def test_the_referee_passes_a_correct_engine_where_llama_cpp_drifts(wide_q4_k_m, tokens):
    result = run("q4_k_m", wide_q4_k_m, tokens)
    assert result.passed, parity.table([result])
    x = result.metrics["referee"]
    assert x["vs_oracle"]["top1"] >= x["llama_vs_oracle"]["top1"] and x["vs_oracle"]["max_abs_dlogprob"] < 0.01


def test_the_referee_still_fails_a_planted_fault_there(wide_q4_k_m, tokens):
    result = run("q4_k_m", wide_q4_k_m, tokens, model=with_geometry(wide_q4_k_m, sliding_window=17))
    assert not result.passed and not result.checks["closer_to_oracle"]["pass"], parity.table([result])


def test_a_width_llama_cpp_quantizes_to_q5_0_is_refused_in_one_line(tmp_path):
    """At hidden 384 llama.cpp's Q4_K_M falls back to Q5_0 for rows K-quants cannot take; the engine
    does not read Q5_0 and says so, naming the tensor and the type (exit 2, one line)."""
    from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, write_fixture
    from muse_mlx.tools.llamacpp import quantize

    g = DEFAULT_GEOMETRY.with_(n_embd=384, n_head=6, n_head_kv=2, head_dim=64, rope_dim=64)
    q = quantize(write_fixture(tmp_path / "w384.gguf", g), tmp_path / "w384-q4_k_m.gguf", "Q4_K_M")
    r = subprocess.run([sys.executable, "-m", "muse_mlx.tools.parity", "--model", str(q), "--receipt-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "found Q5_0" in r.stderr and "tensor '" in r.stderr


# ---- NVFP4: written by the project, proven by gguf-py and by llama.cpp -------------------


def ggml_quantize(values: np.ndarray, ggml_type: int, row_bytes: int) -> np.ndarray:
    """ggml's own quantizer (ggml_quantize_chunk in the pinned build's libggml-base)."""
    libdir = Path(lib().__file__).parent / "lib"
    ggml = ctypes.CDLL(str(next(libdir.glob("libggml-base.so*"))))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros((values.shape[0], row_bytes), dtype=np.uint8)
    ggml.ggml_quantize_chunk(ggml_type, values.ctypes.data, out.ctypes.data, 0, values.shape[0], values.shape[1], None)
    return out


@pytest.mark.parametrize("scale", [1e-7, 1e-3, 1.0, 300.0, 1e5])
def test_nvfp4_quantizer_matches_ggml_bit_for_bit(scale):
    rng = np.random.default_rng(int(np.log10(scale) + 10))
    x = (rng.standard_normal((16, 512)) * scale).astype(np.float32)
    x[0, :64] = 0.0
    x[1, ::7] *= 1000.0
    assert np.array_equal(quantize_nvfp4(x), ggml_quantize(x, 40, 512 // 64 * 36))  # GGML_TYPE_NVFP4 = 40


def test_nvfp4_file_dequantizes_with_gguf_py(lane_files, f32_fixture):
    nv = {t.name: t for t in GGUFReader(lane_files["nvfp4"]).tensors}
    base = {t.name: t for t in GGUFReader(f32_fixture).tensors}
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "output.weight"):
        assert nv[name].tensor_type == QT.NVFP4
        values = gguf_dequantize(np.asarray(nv[name].data), QT.NVFP4)
        original = np.asarray(base[name].data)
        assert values.shape == original.shape
        err = np.abs(values - original).reshape(-1, 16)
        amax = np.abs(original).reshape(-1, 16).max(axis=1, keepdims=True)
        # E2M1's widest gap (4 -> 6) costs at most one scale (~amax/6); the E4M3 scale adds its rounding.
        assert np.all(err <= amax / 4)
        assert np.sqrt((err ** 2).mean() / (original ** 2).mean()) < 0.1


# ---- the engine on llama.cpp's quantized files, against float64 on the same weights ------


@pytest.mark.parametrize("name", ["q4_k_m", "q5_k_m", "q6_k", "nvfp4"])
def test_quantized_lane_matches_float64_on_the_same_weights(name, lane_files):
    path = lane_files[name]
    toks = np.random.default_rng(4).integers(0, 512, 150)
    m = load(path)
    cache = m.make_cache(150, dtype=mx.float32)
    ours = np.array(m.prefill(mx.array(toks), cache, all_logits=True))
    ref = ReferenceModel(path, kv_f16=False).logits(toks)
    assert np.abs(log_softmax(ours) - log_softmax(ref)).max() < 1e-4


# ---- text: tokenization and greedy generation against llama.cpp --------------------------

TEXTS = ["The weights are a river.", "  two  spaces\nand a newline", "naïve 東京 🚀",
         "<|start|>user<|message|>Hello<|eot|><|start|>assistant"]


def test_tokenization_matches_llama(f32_fixture):
    tok = MuseTokenizer(open_artifact(f32_fixture).vocabulary)
    with LlamaCpp(f32_fixture, n_ctx=256) as llama:
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids == llama.tokenize(text), text
            assert tok.decode(ids).encode() == llama.detokenize(ids)


def test_greedy_text_matches_llama(f32_fixture):
    prompt, n = "The cache keeps what attention has already computed.", 40
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(f32_fixture), "--temp", "0",
                        "--prompt", prompt, "--max-tokens", str(n)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with LlamaCpp(f32_fixture, n_ctx=256) as llama:
        ids = llama.greedy(llama.tokenize(prompt), n)
        stop = next((i for i, t in enumerate(ids) if llama.is_eog(t)), n)
        text = llama.detokenize(ids[:stop]).decode("utf-8", errors="replace")
    assert r.stdout == text + "\n"


# ---- the CLI ---------------------------------------------------------------------------


def test_cli_writes_receipts(f32_fixture, tmp_path):
    r = subprocess.run([sys.executable, "-m", "muse_mlx.tools.parity", "--model", str(f32_fixture), "--lanes", "f32",
                        "--prefill", "70", "--decode-steps", "10", "--greedy", "4", "--receipt-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "f32" in r.stdout and "pass" in r.stdout
    # one new file per lane and run, named by the run's date and revision, never overwritten
    (path,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-([0-9a-f]{7}(-dirty)?|norev)-f32\.json", path.name), path.name
    assert str(path) in r.stdout
    receipt = path.read_text()
    for key in ('"llama-cpp-python": "0.3.36"', '"model_sha256"', '"verdict": "pass"', '"synthetic": true'):
        assert key in receipt
    again = [write_new_receipt(tmp_path, "f32", json.loads(receipt)) for _ in range(2)]
    assert [a.name for a in again] == [path.name.replace(".json", f"-{n}.json") for n in (2, 3)]
    assert path.read_text() == receipt


@pytest.mark.parametrize("args", [["--lanes", "q3_k"], ["--prefill", "0"], ["--prefill", "5000"]])
def test_cli_user_errors(f32_fixture, args):
    r = subprocess.run([sys.executable, "-m", "muse_mlx.tools.parity", "--model", str(f32_fixture), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_end_of_generation_and_special_kinds_match_llama(f32_fixture, tmp_path):
    """The tokens llama.cpp's vocabulary decides by their text (llama-vocab.cpp's load): a normal
    "<|endoftext|>" made a control end-of-generation token, "<|end|>" left out of the set beside
    "<|return|>" and "<|call|>" (and printed), a FIM pad token ending generation, "</s>" made normal
    beside "<|tool_response>", an unknown-type token printed as nothing, "<|channel|>" printed. For
    every id: in the stop set exactly when llama.cpp's llama_vocab_is_eog says so, and the same bytes
    as its token_to_piece; a text holding them tokenizes the same."""
    from gguf import GGUFValueType as VT
    from ggufedit import rewrite

    vocab = open_artifact(f32_fixture).vocabulary
    plant = [("<|endoftext|>", 1), ("<|end|>", 3), ("<|return|>", 3), ("<|call|>", 3), ("<|fim_pad|>", 4),
             ("<|fim_prefix|>", 1), ("</s>", 3), ("<|tool_response>", 3), ("<unk>", 2), ("<|channel|>", 3),
             ("[EOS]", 4)]
    tokens, types = list(vocab.tokens), list(vocab.token_types)
    ids = list(range(490, 490 + len(plant)))
    gone = {tokens[i] for i in ids}
    for i, (text, kind) in zip(ids, plant):
        tokens[i], types[i] = text, kind
    merges = [m for m in vocab.merges if not ({*m.split(" "), m.replace(" ", "")} & gone)]
    path = rewrite(f32_fixture, tmp_path / "specials.gguf", set_keys={
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": (types, VT.ARRAY, VT.INT32),
        "tokenizer.ggml.merges": (merges, VT.ARRAY, VT.STRING)})
    tok = MuseTokenizer(open_artifact(path).vocabulary)
    with LlamaCpp(path, n_ctx=64) as llama:
        eog = {i for i in range(llama.n_vocab) if llama.is_eog(i)}
        assert tok.stop_ids == eog
        assert {tokens[i] for i in eog} >= {"<|endoftext|>", "<|fim_pad|>", "<|tool_response>", "[EOS]", "<|eot|>"}
        assert not {tokens[i] for i in eog} & {"<|end|>", "</s>", "<|fim_prefix|>"}
        for i in range(llama.n_vocab):
            assert tok.token_bytes(i) == llama.detokenize([i]), (i, tokens[i])
        text = "a<|end|>b<|endoftext|> c</s><unk><|channel|>[EOS]<|fim_prefix|>"
        assert tok.encode(text) == llama.tokenize(text)


def test_suppressed_tokens_are_never_picked_as_llama_cpp_s_sampler_does(f32_fixture, tmp_path):
    """A GGUF's tokenizer.ggml.suppress_tokens (INT32 ids; out-of-range ones dropped): the list llama.cpp
    reads (llama_vocab_get_suppress_tokens), and greedy generation that never takes them, as llama.cpp's
    common sampler does (minus infinity added to their logits): the CLI's text equals a greedy loop
    over llama.cpp's own logits with those tokens masked, and differs from the unsuppressed run. The
    key of another type is refused, by both."""
    from gguf import GGUFValueType as VT
    from ggufedit import rewrite

    prompt, n = "The cache keeps what", 12
    with LlamaCpp(f32_fixture, n_ctx=128) as llama:
        ids = llama.tokenize(prompt)
        plain = llama.greedy(ids, 3)
    suppress = [plain[0], plain[2], 10**6]
    path = rewrite(f32_fixture, tmp_path / "suppress.gguf",
                   set_keys={"tokenizer.ggml.suppress_tokens": (suppress, VT.ARRAY, VT.INT32)})
    assert open_artifact(path).vocabulary.suppress_ids == tuple(sorted(suppress[:2]))
    with LlamaCpp(path, n_ctx=128) as llama:
        count = ctypes.c_int32(0)
        got = llama.L.llama_vocab_get_suppress_tokens(llama.vocab, ctypes.byref(count))
        assert sorted(got[i] for i in range(count.value)) == sorted(suppress[:2])
        out, logits = [], llama._decode(ids, 0, True)[-1]
        for i in range(n):
            masked = logits.copy()
            masked[suppress[:2]] = -np.inf
            token = int(np.argmax(masked))
            if llama.is_eog(token):
                break
            out.append(token)
            logits = llama._decode([token], len(ids) + i, True)[0]
        want = llama.detokenize(out).decode("utf-8", errors="replace")
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(path), "--temp", "0",
                        "--prompt", prompt, "--max-tokens", str(n)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n" and plain[0] not in out
    bad = rewrite(f32_fixture, tmp_path / "bad.gguf",
                  set_keys={"tokenizer.ggml.suppress_tokens": ([1, 2], VT.ARRAY, VT.UINT32)})
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(bad), "-m", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "tokenizer.ggml.suppress_tokens" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(Exception):
        LlamaCpp(bad, n_ctx=64)
