"""The GGUF contract: a valid file opens; every kind of bad file fails closed with one clear error."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ggufedit import rewrite
from muse_mlx.artifact import open_artifact
from muse_mlx.errors import ArtifactError
from muse_mlx.tools.fixtures import DEFAULT_GEOMETRY, kquant_mix, write_sparse
from muse_mlx.geometry import PINNED, PINNED_SHAPE_FIELDS


def expect_error(path, *fragments):
    with pytest.raises(ArtifactError) as info:
        open_artifact(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    return message


def test_fixture_opens_with_its_geometry(f32_fixture):
    a = open_artifact(f32_fixture)
    g = a.geometry
    for name in PINNED_SHAPE_FIELDS:
        assert getattr(g, name) == getattr(DEFAULT_GEOMETRY, name)
    assert g.rms_eps == pytest.approx(DEFAULT_GEOMETRY.rms_eps, rel=1e-7)
    assert g.logit_scale == DEFAULT_GEOMETRY.logit_scale
    assert g.final_logit_softcap == DEFAULT_GEOMETRY.final_logit_softcap
    assert g.n_full == 2 and g.n_swa == 6
    assert set(a.tensors) == set(DEFAULT_GEOMETRY.tensor_shapes())


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, I am not a model\n")
    expect_error(p, "not a GGUF file", "b'GGUF'")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "absent.gguf", "no such file")


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.3, 0.7, 0.999])
def test_truncated(f32_fixture, tmp_path, fraction):
    data = f32_fixture.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: max(4, int(len(data) * fraction))] if fraction else data[:2])
    msg = expect_error(p)
    assert "truncated" in msg or "not a GGUF" in msg


def test_foreign_architecture(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "llama.gguf", arch="llama")
    expect_error(p, "general.architecture", "'muse-glimmer'", "'llama'")


@pytest.mark.parametrize("key", ["muse-glimmer.block_count", "muse-glimmer.embedding_length",
                                 "muse-glimmer.attention.sliding_window", "muse-glimmer.logit_scale",
                                 "muse-glimmer.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens"])
def test_missing_key(f32_fixture, tmp_path, key):
    p = rewrite(f32_fixture, tmp_path / "missing.gguf", drop_keys=[key])
    expect_error(p, f"missing required key {key!r}")


def test_wrong_key_type(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "type.gguf", set_keys={"muse-glimmer.block_count": (8, VT.INT32)})
    expect_error(p, "'muse-glimmer.block_count'", "type UINT32", "type INT32")


def test_non_finite_float_key(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "nan.gguf",
                set_keys={"muse-glimmer.logit_scale": (float("nan"), VT.FLOAT32)})
    expect_error(p, "'muse-glimmer.logit_scale'", "finite")


def test_sliding_pattern_length(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "pattern.gguf",
                set_keys={"muse-glimmer.attention.sliding_window_pattern": ([True] * 5, VT.ARRAY, VT.BOOL)})
    expect_error(p, "sliding_window_pattern", "8 per-layer flags", "5")


def test_sliding_pattern_as_period(f32_fixture, tmp_path):
    """llama.cpp also accepts a UINT32 period; 2 makes every odd layer full."""
    p = rewrite(f32_fixture, tmp_path / "period.gguf",
                set_keys={"muse-glimmer.attention.sliding_window_pattern": (2, VT.UINT32)})
    assert open_artifact(p).geometry.swa_layers == (True, False) * 4


def test_wrong_shape(f32_fixture, tmp_path):
    bad = np.zeros((128, 256), dtype=np.float32)  # 128 rows instead of 256
    p = rewrite(f32_fixture, tmp_path / "shape.gguf", replace_tensors={"blk.2.attn_q.weight": (bad, None)})
    expect_error(p, "'blk.2.attn_q.weight' shape", "[256, 256]", "[256, 128]")


def test_unsupported_type(f32_fixture, tmp_path):
    # Q4_0: 18 bytes per 32 values
    p = rewrite(f32_fixture, tmp_path / "q40.gguf", replace_tensors={"blk.0.ffn_up.weight": (
        np.zeros((768, 256 // 32 * 18), dtype=np.uint8), QT.Q4_0)})
    expect_error(p, "'blk.0.ffn_up.weight' type", "Q4_K", "found Q4_0")


def test_quantized_norm_rejected(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "qnorm.gguf", replace_tensors={"blk.0.attn_norm.weight": (
        np.zeros(256 // 32 * 34, dtype=np.uint8), QT.Q8_0)})
    expect_error(p, "'blk.0.attn_norm.weight' type", "F32", "found Q8_0")


def test_unknown_tensor(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "extra.gguf",
                add_tensors={"blk.0.attn_qkv.weight": (np.zeros((384, 256), dtype=np.float32), None)})
    expect_error(p, "unknown tensor 'blk.0.attn_qkv.weight'")


def test_missing_tensor(f32_fixture, tmp_path):
    p = rewrite(f32_fixture, tmp_path / "nohead.gguf", drop_tensors=["output.weight"])
    expect_error(p, "missing tensor 'output.weight'", "[256, 512]")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_norm(f32_fixture, tmp_path, value):
    w = np.ones(256, dtype=np.float32)
    w[17] = value
    p = rewrite(f32_fixture, tmp_path / "nan-norm.gguf", replace_tensors={"blk.3.ffn_norm.weight": (w, None)})
    expect_error(p, "'blk.3.ffn_norm.weight' element 17", "finite")


def test_vocab_and_embedding_disagree(f32_fixture, tmp_path):
    tokens = open_artifact(f32_fixture).vocabulary.tokens[:500]
    p = rewrite(f32_fixture, tmp_path / "vocab.gguf",
                set_keys={"tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING),
                          "tokenizer.ggml.token_type": ([1] * 500, VT.ARRAY, VT.INT32)})
    expect_error(p, "'token_embd.weight' shape", "[256, 500]", "[256, 512]")


def test_pinned_geometry_header(tmp_path):
    """The full 52-layer Q4_K_M layout, tensor data left as a hole: the contract reads it without 16 GB."""
    p = write_sparse(tmp_path / "pinned-sparse.gguf", PINNED, kquant_mix(PINNED))
    st = p.stat()
    assert st.st_size > 16e9 and st.st_blocks * 512 < 100e6  # sparse on disk
    a = open_artifact(p)
    for name in PINNED_SHAPE_FIELDS:
        assert getattr(a.geometry, name) == getattr(PINNED, name), name
    assert (a.geometry.n_swa, a.geometry.n_full) == (39, 13)
    assert a.geometry.n_params == 27_854_794_240
    types = a.tensor_types()
    assert types["output.weight"] == "Q6_K" and types["blk.10.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.7.attn_v.weight"] == "Q4_K"
    assert sum(t.nbytes for t in a.tensors.values()) < st.st_size


@pytest.mark.parametrize("which", ["f32 fixture", "shipped tiny model", "pinned-geometry header"])
def test_keys_and_tensors_read_as_gguf_py_reads_them(f32_fixture, tmp_path, which):
    """open_artifact reads the metadata and places the tensors itself (gguf-py's reader is ~10 s on
    a 202,048-token vocabulary); gguf-py's GGUFReader is the oracle: every key's types and value,
    and every tensor's bytes, the same."""
    from gguf import GGUFReader

    from muse_mlx.default_model import default_model_path

    if which == "f32 fixture":
        path = f32_fixture
    elif which == "shipped tiny model":
        path = default_model_path()
    else:
        path = write_sparse(tmp_path / "pinned.gguf", PINNED, kquant_mix(PINNED))
    a = open_artifact(path, check_weights=False)
    r = GGUFReader(path)
    assert set(a.keys.scan.kv) == {k for k in r.fields if not k.startswith("GGUF.")}
    for key in a.keys.scan.kv:
        theirs, ours = r.fields[key], a.keys.field(key, required=True)
        assert ours.types == theirs.types, key
        assert ours.contents() == theirs.contents(), key
        if ours.types == [VT.ARRAY, VT.STRING]:
            assert ours.strings() == [bytes(theirs.parts[i]) for i in theirs.data], key
        if ours.types == [VT.STRING]:
            assert ours.raw == bytes(theirs.parts[-1]), key
    found = {t.name: t for t in r.tensors}
    assert set(found) == set(a.tensors)
    for name, t in a.tensors.items():
        g = found[name]
        assert (t.qtype, t.shape) == (g.tensor_type, tuple(int(x) for x in g.shape)), name
        assert t.data.ctypes.data - a.keys.file.ctypes.data == g.data_offset, name
        if which != "pinned-geometry header":   # a sparse file: its holes read as zeros either way
            assert np.array_equal(t.data.reshape(-1), np.asarray(g.data).view(np.uint8).reshape(-1)), name
