"""Hostile GGUFs (issue 19): every mutant is refused with one line naming what was wrong, or loads.

Each case the issue reproduced is a named test below; then a seeded fuzz run over
mutants of three fixtures (byte flips by region, truncations, count / offset / type /
value edits, tokenizer and template payloads) through `open_artifact` and the tokenizer.
A mutant that loads is also run for one token (generate_tokens on the reference backend): its
logits must be finite, or the engine must refuse with its own error. MUSE_FUZZ_MUTANTS sets the fuzz size
(default 100 per fixture; e.g. MUSE_FUZZ_MUTANTS=700 for a 2,100-mutant run).
"""

from __future__ import annotations

import collections
import os
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from mutate import (Layout, enc_array, enc_scalar, enc_string_value, mutants, put, set_tensor_values,
                    splice_kv)
from muse_mlx.artifact import MAX_VOCAB, open_artifact
from muse_mlx.errors import ArtifactError, MuseError
from muse_mlx.geometry import Geometry, norm_weight_limit
from muse_mlx.tokenizer import MuseTokenizer
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_fixture, write_random_blocks

# A small geometry (same shape rules as the pinned model) so F32/F16/BF16 mutants stay tiny.
SMALL = Geometry(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_vocab=300,
                 sliding_window=16, context_length=256, rms_eps=1e-5, rope_base=1e6, rope_base_swa=1e4,
                 logit_scale=1.0, final_logit_softcap=30.0)
K = "muse-glimmer."


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return {
        "f32": write_fixture(d / "small-f32.gguf", SMALL),
        "f16": write_fixture(d / "small-f16.gguf", SMALL, weight_type=QT.F16),
        "bf16": write_fixture(d / "small-bf16.gguf", SMALL, weight_type=QT.BF16),
        "q8_0": write_fixture(d / "q8_0.gguf", DEFAULT_GEOMETRY, weight_type=QT.Q8_0),
        "q4_k": write_random_blocks(d / "q4_k_m.gguf", DEFAULT_GEOMETRY, kquant_mix(DEFAULT_GEOMETRY)),
    }


def load(path):
    a = open_artifact(path)
    MuseTokenizer(a.vocabulary)
    return a


def refused(tmp_path, data: bytes, *fragments, seconds: float = 5.0) -> str:
    p = tmp_path / "mutant.gguf"
    p.write_bytes(data)
    t = time.perf_counter()
    with pytest.raises(ArtifactError) as info:
        load(p)
    assert time.perf_counter() - t < seconds, "refused, but too slowly"
    msg = str(info.value)
    assert "\n" not in msg and str(p) in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def kv_value_at(data, key):
    return Layout.of(data).kv[key].value_at


# ---- the hangs: counts gguf-py would trust ----------------------------------------------


@pytest.mark.parametrize("count,fragment", [(2**32 - 1, "found 4,294,967,295"),  # over the array bound
                                            (10_000_000, "10,000,000 BOOL elements")])  # past the file's end
def test_bool_array_count_is_refused_at_once(fixtures, tmp_path, count, fragment):
    """gguf-py looped on a BOOL array of 2^32-1 elements (9.5 GB RSS after 120 s)."""
    data = fixtures["f32"].read_bytes()
    e = Layout.of(data).kv[K + "attention.sliding_window_pattern"]
    refused(tmp_path, put(data, e.count_at, "<Q", count), "sliding_window_pattern", fragment, seconds=1.0)


def test_array_of_arrays_is_refused(fixtures, tmp_path):
    data = fixtures["f32"].read_bytes()
    e = Layout.of(data).kv[K + "attention.sliding_window_pattern"]
    refused(tmp_path, put(data, e.value_at, "<I", VT.ARRAY), "an array of arrays", seconds=1.0)


@pytest.mark.parametrize("field,value", [("tensor count", 2**64 - 1), ("kv count", 2**32 - 1),
                                         ("kv count", 5000)])
def test_header_counts(fixtures, tmp_path, field, value):
    data = fixtures["f32"].read_bytes()
    refused(tmp_path, put(data, 8 if field == "tensor count" else 16, "<Q", value), seconds=1.0)


def test_string_length_past_the_file(fixtures, tmp_path):
    data = fixtures["f32"].read_bytes()
    at = kv_value_at(data, "tokenizer.chat_template")
    refused(tmp_path, put(data, at, "<Q", 2**63), "tokenizer.chat_template", seconds=1.0)


def test_two_million_tokens_are_refused_fast(fixtures, tmp_path):
    """The issue's 33 MB file of 2,000,000 tokens took 39 s in gguf-py before it was refused."""
    data = fixtures["f32"].read_bytes()
    tokens = [b"t%07d" % i for i in range(2_000_000)]
    mutant = splice_kv(data, "tokenizer.ggml.tokens", enc_array(VT.STRING, tokens))
    assert len(mutant) > 30e6
    refused(tmp_path, mutant, "tokenizer.ggml.tokens", f"at most {MAX_VOCAB:,}", seconds=1.0)


def test_token_count_against_the_embedding_before_gguf_py(fixtures, tmp_path):
    """Under the vocabulary bound, the token list must still match the embedding's rows: checked
    by the pre-scan, before gguf-py builds a view per string."""
    data = fixtures["f32"].read_bytes()
    tokens = [b"t%07d" % i for i in range(600_000)]
    mutant = splice_kv(data, "tokenizer.ggml.tokens", enc_array(VT.STRING, tokens))
    refused(tmp_path, mutant, "'token_embd.weight' shape", "600000", seconds=3.0)


@pytest.mark.parametrize("what", ["key", "tensor name"])
def test_invalid_utf8_names(fixtures, tmp_path, what):
    data = fixtures["f32"].read_bytes()
    if what == "key":
        mutant = splice_kv(data, "general.name", enc_string_value("x"), new_key=b"general.n\xffme")
    else:
        t = Layout.of(data).tensors[3]
        mutant = put(data, t.start + 8, "<B", 0xFF)
    refused(tmp_path, mutant, "valid UTF-8")


def test_invalid_utf8_architecture(fixtures, tmp_path):
    data = fixtures["f32"].read_bytes()
    refused(tmp_path, splice_kv(data, "general.architecture", enc_string_value(b"muse-gl\xffimmer")),
            "'general.architecture'", "valid UTF-8", "0xff")


def test_duplicate_key(fixtures, tmp_path):
    data = fixtures["f32"].read_bytes()
    lay = Layout.of(data)
    e = lay.kv[K + "block_count"]
    mutant = put(data[:lay.kv_end] + data[e.start:e.end] + data[lay.kv_end:], 16, "<Q", len(lay.kv) + 1)
    refused(tmp_path, mutant, "duplicate key 'muse-glimmer.block_count'")


@pytest.mark.parametrize("version,fragment", [(1, "GGUF version"), (4, "GGUF version"),
                                              (3 << 24, "big-endian")])
def test_versions(fixtures, tmp_path, version, fragment):
    refused(tmp_path, put(fixtures["f32"].read_bytes(), 4, "<I", version), fragment)


@pytest.mark.parametrize("value,fragment", [(0, "power of two"), (48, "power of two"),
                                            (2**31, "data section")])
def test_alignment(fixtures, tmp_path, value, fragment):
    data = splice_kv(fixtures["f32"].read_bytes(), "general.alignment", enc_scalar(VT.UINT32, value))
    refused(tmp_path, data, fragment)


def test_alignment_of_wrong_type(fixtures, tmp_path):
    data = splice_kv(fixtures["f32"].read_bytes(), "general.alignment", enc_scalar(VT.UINT64, 32))
    refused(tmp_path, data, "general.alignment", "UINT32")


# ---- the tensor table: offsets, types, shapes ---------------------------------------------


def test_offset_2_64_minus_1_does_not_wrap(fixtures, tmp_path):
    data = fixtures["q8_0"].read_bytes()
    t = Layout.of(data).tensor("blk.3.attn_q.weight")
    refused(tmp_path, put(data, t.offset_at, "<Q", 2**64 - 1), "'blk.3.attn_q.weight' data offset",
            "18,446,744,073,709,551,615")


@pytest.mark.parametrize("shift", [1, 16, 32, -32])
def test_misaligned_or_moved_offset(fixtures, tmp_path, shift):
    data = fixtures["q8_0"].read_bytes()
    t = Layout.of(data).tensor("blk.3.attn_q.weight")
    refused(tmp_path, put(data, t.offset_at, "<Q", t.offset + shift), "'blk.3.attn_q.weight' data offset")


def test_overlapping_offsets(fixtures, tmp_path):
    data = fixtures["q8_0"].read_bytes()
    lay = Layout.of(data)
    t = lay.tensor("blk.3.attn_q.weight")
    before = lay.tensors[lay.tensors.index(t) - 1]
    refused(tmp_path, put(data, t.offset_at, "<Q", before.offset), "'blk.3.attn_q.weight' data offset")


@pytest.mark.parametrize("fixture,tensor,new", [("q8_0", "blk.2.ffn_up.weight", QT.Q4_K),
                                                ("q4_k", "blk.2.ffn_up.weight", QT.Q6_K),
                                                ("q4_k", "blk.2.ffn_up.weight", QT.Q5_K),
                                                ("q4_k", "output.weight", QT.Q4_K)])
def test_type_swapped_for_another_valid_type(fixtures, tmp_path, fixture, tensor, new):
    """A swapped type changes the tensor's byte length, so the next offset (or, for the last
    tensor, the file's end) no longer matches."""
    data = fixtures[fixture].read_bytes()
    t = Layout.of(data).tensor(tensor)
    refused(tmp_path, put(data, t.type_at, "<I", int(new)))


def test_trailing_bytes_after_the_last_tensor(fixtures, tmp_path):
    refused(tmp_path, fixtures["q8_0"].read_bytes() + b"\0" * 64, "bytes after the last tensor")


@pytest.mark.parametrize("edit,value,fragment", [("type", 99, "a known ggml type"),
                                                 ("n_dims", 5, "dimension count"),
                                                 ("n_dims", 0, "dimension count"),
                                                 ("ne", 2**63, "elements"), ("ne", 0, "zero dimension"),
                                                 ("ne", 33, "block size")])
def test_tensor_table_fields(fixtures, tmp_path, edit, value, fragment):
    data = fixtures["q8_0"].read_bytes()
    t = Layout.of(data).tensor("blk.1.attn_k.weight")
    at = {"type": t.type_at, "n_dims": t.n_dims_at, "ne": t.dims_at[0]}[edit]
    refused(tmp_path, put(data, at, "<Q" if edit == "ne" else "<I", value), fragment)


def test_duplicate_tensor_name(fixtures, tmp_path):
    data = fixtures["q8_0"].read_bytes()
    k = Layout.of(data).tensor("blk.0.attn_k.weight")  # renamed in place to blk.0.attn_q.weight
    mutant = put(data, k.start + 8 + len("blk.0.attn_"), "<B", ord("q"))
    refused(tmp_path, mutant, "duplicate tensor 'blk.0.attn_q.weight'")


# ---- what the numbers mean -----------------------------------------------------------------


@pytest.mark.parametrize("key,value,fragment", [
    ("rope.freq_base_swa", 1e-45, ">= 1"), ("rope.freq_base", 0.5, ">= 1"),
    ("rope.freq_base_swa", float("inf"), "finite"),
    ("attention.layer_norm_rms_epsilon", 0.0, "[1e-12, 1]"),
    ("attention.layer_norm_rms_epsilon", 1e-45, "[1e-12, 1]"),
    ("attention.layer_norm_rms_epsilon", 10.0, "[1e-12, 1]"),
    ("logit_scale", 0.0, "[0.0001, 10000]"), ("logit_scale", -1.0, "[0.0001, 10000]"),
    ("logit_scale", float("-inf"), "finite"),
    ("final_logit_softcapping", 1e-45, "(or 0)"), ("final_logit_softcapping", float("inf"), "finite"),
])
def test_float_keys_in_range(fixtures, tmp_path, key, value, fragment):
    data = fixtures["f32"].read_bytes()
    mutant = splice_kv(data, K + key, enc_scalar(VT.FLOAT32, value))
    refused(tmp_path, mutant, f"'{K}{key}'", fragment)


def test_softcap_zero_means_off(fixtures, tmp_path):
    data = splice_kv(fixtures["f32"].read_bytes(), K + "final_logit_softcapping", enc_scalar(VT.FLOAT32, 0.0))
    p = tmp_path / "nocap.gguf"
    p.write_bytes(data)
    assert load(p).geometry.final_logit_softcap is None


@pytest.mark.parametrize("context", [2**32 - 1, 2**31 - 1, 2**28])
def test_absurd_context_names_the_bytes(fixtures, tmp_path, context):
    data = fixtures["f32"].read_bytes()
    msg = refused(tmp_path, put(data, kv_value_at(data, K + "context_length"), "<I", context),
                  "context_length", f"{context:,}", "bytes")
    assert "would need" in msg


def test_context_2_24_is_left_to_the_memory_check(fixtures, tmp_path):
    """2^24 positions are computable at this geometry; whether they fit memory is asked at allocation."""
    data = fixtures["q8_0"].read_bytes()
    p = tmp_path / "ctx.gguf"
    p.write_bytes(put(data, kv_value_at(data, K + "context_length"), "<I", 2**24))
    g = load(p).geometry
    assert g.context_length == 2**24 and g.slot_kv_bytes(2**24) > 4e9


@pytest.mark.parametrize("tensor,value,fragment", [
    ("blk.1.ffn_norm.weight", 3e38, "|w| <= 10000"), ("output_norm.weight", -2e4, "|w| <= 10000"),
    ("blk.0.attn_k_norm.weight", 2e4, "|w| <= 10000"), ("blk.0.attn_q_norm.weight", float("nan"), "finite"),
])
def test_norm_weights(fixtures, tmp_path, tensor, value, fragment):
    data = set_tensor_values(fixtures["f32"].read_bytes(), tensor, 5, value)
    refused(tmp_path, data, f"'{tensor}' element 5", fragment)


def test_norm_weight_within_bounds_loads(fixtures, tmp_path):
    data = set_tensor_values(fixtures["f32"].read_bytes(), "blk.0.attn_k_norm.weight", 5, 9000.0)
    p = tmp_path / "ok.gguf"
    p.write_bytes(data)
    load(p)


def test_k_norm_bound_keeps_f16_keys_finite():
    """|rmsnorm(k)_i| <= sqrt(head_dim), so |w| <= 65,504 / sqrt(head_dim) keeps every f16 K finite."""
    assert norm_weight_limit("blk.3.attn_k_norm.weight", 128) == pytest.approx(65504 / 128 ** 0.5)
    assert norm_weight_limit("blk.3.attn_k_norm.weight", 32) == 1e4  # the general bound is lower there
    assert norm_weight_limit("blk.3.ffn_norm.weight", 128) == 1e4
    unit = np.zeros(128, np.float32)
    unit[0] = np.sqrt(128)  # the largest element a unit-RMS vector can have
    assert np.isfinite((unit * np.float32(norm_weight_limit("attn_k_norm.weight", 128))).astype(np.float16)).all()


@pytest.mark.parametrize("fixture,tensor,value", [
    ("f32", "blk.1.attn_v.weight", float("nan")), ("f32", "token_embd.weight", float("inf")),
    ("f32", "blk.0.ffn_up.weight", 3e38), ("f32", "output.weight", -1e5),
    ("f16", "blk.1.ffn_down.weight", float("inf")), ("bf16", "blk.0.attn_q.weight", float("nan")),
    ("bf16", "blk.0.attn_gate.weight", 1e20),
    ("q8_0", "blk.4.ffn_gate.weight", float("nan")), ("q8_0", "output.weight", float("inf")),
    ("q4_k", "blk.2.attn_q.weight", float("inf")), ("q4_k", "output.weight", float("nan")),
])
def test_non_finite_matrix_weights(fixtures, tmp_path, fixture, tensor, value):
    data = set_tensor_values(fixtures[fixture].read_bytes(), tensor, 7, value)
    msg = refused(tmp_path, data, f"'{tensor}' row")
    p = tmp_path / "skip.gguf"
    p.write_bytes(data)
    open_artifact(p, check_weights=False)  # the scan, and only the scan, can be skipped
    assert "block scale" in msg if fixture.startswith("q") else "element" in msg


@pytest.mark.parametrize("threads", [1, 4])
def test_the_first_bad_matrix_in_the_file_is_named(fixtures, tmp_path, monkeypatch, threads):
    """The scan runs on threads; with several bad matrices, the one named is the first in the
    contract's tensor order (the order of open_artifact's tensors), whatever order the threads
    finish in."""
    import muse_mlx.artifact as artifact

    monkeypatch.setattr(artifact, "SCAN_THREADS", threads)
    bad = ("blk.3.ffn_down.weight", "output.weight", "blk.1.attn_q.weight")
    first = next(n for n in open_artifact(fixtures["q4_k"]).tensors if n in bad)
    data = fixtures["q4_k"].read_bytes()
    for tensor in bad:
        data = set_tensor_values(data, tensor, 7, float("nan"))
    refused(tmp_path, data, f"'{first}' row")


def test_large_finite_f16_weight_loads(fixtures, tmp_path):
    data = set_tensor_values(fixtures["f16"].read_bytes(), "blk.0.ffn_up.weight", 7, 65504.0)
    p = tmp_path / "big.gguf"
    p.write_bytes(data)
    load(p)


# ---- the fuzz run ------------------------------------------------------------------------


def fuzz_outcome(path) -> str:
    """'refused' (the engine's own one-line error at load or at the first token, e.g. non-finite
    logits) or 'finite' (loaded, and a one-token prompt gave finite logits and a token)."""
    from muse_mlx.generate import generate_tokens
    from muse_mlx.model import Model
    from muse_mlx.ops import ReferenceOps
    from muse_mlx.sampling import Sampler, SamplerSettings

    try:
        a = open_artifact(path)
        tok = MuseTokenizer(a.vocabulary)
        ids = tok.encode("hello <|start|> world 123")
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        except MuseError as exc:
            assert "\n" not in str(exc)
        model = Model(a, ReferenceOps())
        cache = model.make_cache(min(8, a.geometry.context_length))
        out = list(generate_tokens(model, cache, ids[:1] or [0], Sampler(SamplerSettings()), 1))
        assert len(out) == 1 and 0 <= out[0] < a.geometry.n_vocab
        return "finite"
    except MuseError as exc:
        assert "\n" not in str(exc), str(exc)
        return "refused"


def test_fuzz(fixtures, tmp_path):
    per_fixture = int(os.environ.get("MUSE_FUZZ_MUTANTS", "100"))
    counts = collections.Counter()
    failures = []
    slowest = 0.0
    for seed, name in enumerate(("f32", "q8_0", "q4_k")):
        data = fixtures[name].read_bytes()
        for i, (desc, mutant) in enumerate(mutants(data, seed=1900 + seed, n=per_fixture)):
            p = tmp_path / f"{name}.gguf"
            p.write_bytes(mutant)
            t = time.perf_counter()
            try:
                counts[fuzz_outcome(p)] += 1
            except Exception as exc:  # anything but MuseError is a failure of the contract
                counts["other"] += 1
                failures.append(f"{name} #{i} ({desc}): {type(exc).__name__}: {str(exc)[:200]}")
            slowest = max(slowest, time.perf_counter() - t)
    print(f"fuzz: {sum(counts.values())} mutants: {dict(counts)}; slowest {slowest:.2f} s")
    assert not failures, "\n".join(failures[:20])
    assert counts["refused"] and counts["finite"]
    assert slowest < 10
