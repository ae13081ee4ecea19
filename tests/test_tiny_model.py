"""The tiny model (docs/tiny-model.md): its corpus cleaner, that the training architecture is the
engine's, that the exported tokenizer is the trained one, and that the shipped default model is
a trained model (perplexity on its held-out pages, against the float64 oracle and llama.cpp)."""

from __future__ import annotations

import math
import subprocess
import sys
from importlib import resources

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
import numpy as np
import pytest

from muse_mlx.default_model import default_model_path, held_out_text_path
from muse_mlx.model import load
from muse_mlx.tokenizer import MuseTokenizer
from muse_mlx.tools import corpus
from muse_mlx.tools.tiny_data import train_tokenizer, vocabulary
from muse_mlx.tools.tiny_export import write_f16
from muse_mlx.tools.tiny_train import TINY_GEOMETRY, TinyMuse, load_weights, save_weights

from reference import ReferenceModel, log_softmax as log_softmax64

RST = """\
:mod:`bisect` --- Array bisection
=================================

.. module:: bisect
   :synopsis: Array bisection algorithms.

This module keeps a list in **sorted** order without
having to sort the list after *each* insertion, see :func:`insort_left`
and :ref:`the recipes <bisect-example>`.

.. function:: bisect_left(a, x)

   Locate the insertion point for ``x`` in *a*.

   .. versionchanged:: 3.10
      Added the *key* parameter.

An example::

    >>> bisect_left([1, 2], 2)
    1

>>> print("a doctest")
a doctest

* first item
* second item
"""


def test_page_prose_keeps_the_prose_and_drops_markup_and_code():
    text = corpus.page_prose(RST)
    assert text.split("\n\n") == [
        "This module keeps a list in sorted order without having to sort the list after each insertion, "
        "see insort_left and the recipes.",
        "Locate the insertion point for x in a.",
        "Added the key parameter.",
        "An example:",
        "* first item",
        "* second item",
    ]


SMALL = TINY_GEOMETRY.with_(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, rope_dim=16, n_ff=128,
                            sliding_window=8, context_length=64, logit_scale=0.7, final_logit_softcap=5.0)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A TinyMuse of a small geometry (random weights, norms away from 1), its shards, and its GGUF."""
    folder = tmp_path_factory.mktemp("tiny")
    text = resources.files("muse_mlx").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    tok = train_tokenizer([text], vocab_size=300)
    tok.save(str(folder / "tokenizer.json"))
    g = SMALL.with_(n_vocab=tok.get_vocab_size())
    mx.random.seed(3)
    model = TinyMuse(g)
    rng = np.random.default_rng(0)
    model.update(tree_unflatten([(k, mx.array((1 + 0.2 * rng.standard_normal(v.shape)).astype(np.float32))
                                  if v.ndim == 1 else v) for k, v in tree_flatten(model.parameters())]))
    save_weights(model, folder)
    gguf = write_f16(folder, folder / "tokenizer.json", folder / "tiny-f16.gguf")
    return tok, folder, gguf


def training_logits(folder, tokens, **geometry_changes) -> np.ndarray:
    """TinyMuse with the shards' weights (the float16 the GGUF holds), float32, no cache."""
    g, tensors = load_weights(sorted(folder.glob("weights-*.safetensors")))
    model = TinyMuse(g.with_(**geometry_changes) if geometry_changes else g)
    model.load_gguf_tensors(tensors)
    return np.array(model(mx.array(np.asarray(tokens, dtype=np.int32)[None]))[0])


def test_training_model_is_the_engines_forward(small_model):
    """The architecture trained is the one the engine (and llama.cpp) computes: same logits on the
    exported GGUF up to the f16 rounding of K/V in the engine's cache, across the window (40 > 8)."""
    tok, folder, gguf = small_model
    ids = tok.encode("The weights are a river. One token is one complete pass of that river past "
                     "the arithmetic units.").ids[:40]
    assert len(ids) == 40
    engine = load(gguf, backend="reference")
    ours = np.array(engine.prefill(ids, engine.make_cache(64), all_logits=True))
    theirs = training_logits(folder, ids)
    scale = np.abs(theirs).max()
    err = np.abs(ours - theirs).max() / scale
    assert err < 2e-3, err
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.95
    # the comparison can fail: the same weights with a window of 16 give other logits
    wrong = training_logits(folder, ids, sliding_window=16)
    assert np.abs(ours - wrong).max() / scale > 20 * err


def test_exported_vocabulary_tokenizes_as_trained(small_model):
    tok, folder, gguf = small_model
    engine_tok = MuseTokenizer(load(gguf, backend="reference").artifact.vocabulary)
    text = held_out_text_path().read_text(encoding="utf-8")[:20000]
    assert engine_tok.encode(text, add_bos=False) == tok.encode(text).ids
    tokens, types, merges = vocabulary(tok)
    assert len(tokens) == tok.get_vocab_size() and sum(t == 3 for t in types) == 5


# ---- the shipped default model -------------------------------------------------------------------

CTX, CHUNKS = 128, 3


@pytest.fixture(scope="module")
def shipped():
    model = load(default_model_path(), backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    tokens = tok.encode(held_out_text_path().read_text(encoding="utf-8"))
    return model, tok, tokens


def chunk_nll(logprobs: np.ndarray, ids: list[int]) -> list[float]:
    """llama-perplexity's rule: score the second half of a chunk."""
    first = CTX // 2
    return [-float(logprobs[first + j, t]) for j, t in enumerate(ids[first + 1:])]


def chunk_ids(tokens, tok, k):
    ids = list(tokens[k * CTX:(k + 1) * CTX])
    ids[0] = tok.bos_id
    return ids


def test_the_default_model_is_the_trained_tiny_model(shipped):
    model, tok, tokens = shipped
    g = model.geometry
    assert (g.n_layer, g.n_embd, g.n_vocab, g.context_length) == (8, 512, 4096, 512)
    assert g.n_swa == 6 and g.n_full == 2 and g.sliding_window < g.context_length
    assert g.n_head // g.n_head_kv == 4 and g.logit_scale != 1 and g.final_logit_softcap
    assert model.artifact.path.stat().st_size < 25 * 2**20


def test_the_default_model_predicts_its_held_out_text(shipped):
    """Perplexity on pages it never saw, 3 chunks of 128: the receipt's 512-token figure is ~37-40;
    a random model scores ~n_vocab (4,096). And the float64 oracle agrees with the engine."""
    model, tok, tokens = shipped
    from muse_mlx.sampling import log_softmax

    nll, oracle_nll = [], []
    oracle = ReferenceModel(str(default_model_path()))
    for k in range(CHUNKS):
        ids = chunk_ids(tokens, tok, k)
        nll += chunk_nll(log_softmax(np.array(model.prefill(ids, model.make_cache(CTX), all_logits=True))), ids)
        if k == 0:
            oracle_nll += chunk_nll(log_softmax64(oracle.logits(ids)), ids)
    ppl = math.exp(np.mean(nll))
    assert ppl < 80, ppl
    assert abs(np.mean(nll[:len(oracle_nll)]) - np.mean(oracle_nll)) < 1e-4


@pytest.mark.parity
def test_the_default_model_agrees_with_llama_cpp(shipped):
    """The pinned llama.cpp on the same tokens (CPU, Q8_0 x Q8_0-quantized activations): the mean NLL
    of one chunk within 2e-3 nats (docs/tiny-model.md has the per-lane figures)."""
    from muse_mlx.sampling import log_softmax
    from muse_mlx.tools.llamacpp import LlamaCpp

    model, tok, tokens = shipped
    ids = chunk_ids(tokens, tok, 0)
    ours = chunk_nll(log_softmax(np.array(model.prefill(ids, model.make_cache(CTX), all_logits=True))), ids)
    with LlamaCpp(default_model_path(), n_ctx=CTX) as llama:
        assert llama.tokenize(held_out_text_path().read_text(encoding="utf-8")[:4000], add_special=False) == \
            tok.encode(held_out_text_path().read_text(encoding="utf-8")[:4000], add_bos=False)
        theirs = chunk_nll(log_softmax(llama.teacher_forced(ids, len(ids))), ids)
    assert abs(np.mean(ours) - np.mean(theirs)) < 2e-3


@pytest.mark.parity
def test_the_default_model_passes_parity_refereed_by_the_oracle(shipped):
    """The parity harness on real weights: the shipped Q8_0 lane on held-out text, 60 tokens
    prefilled and 40 decoded, the float64 oracle refereeing (tools/parity.py)."""
    from muse_mlx.tools import parity

    model, tok, tokens = shipped
    ids = np.array(tokens[:100])
    result = parity.run_lane(parity.LANES["q8_0"], default_model_path(), ids, 60, 0, model=model)
    assert result.passed, parity.table([result])
    assert result.metrics["referee"]["vs_oracle"]["max_abs_dlogprob"] < 1e-2


@pytest.mark.parity
def test_llama_cpp_writes_the_same_greedy_text_from_the_default_model():
    from muse_mlx.generate import DEFAULT_PROMPT
    from muse_mlx.tools.llamacpp import LlamaCpp

    n = 40
    r = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--max-tokens", str(n)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with LlamaCpp(default_model_path(), n_ctx=128) as llama:
        ids = llama.greedy(llama.tokenize(DEFAULT_PROMPT), n)
        stop = next((i for i, t in enumerate(ids) if llama.is_eog(t)), n)
        text = llama.detokenize(ids[:stop]).decode("utf-8", errors="replace")
    assert r.stdout == text + "\n"


def test_generate_with_no_model_prints_english():
    """The README's first command: the shipped model, greedy, prints words (the random fixture it
    replaced printed byte soup: fails this)."""
    out = subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--max-tokens", "40"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    common = {"the", "a", "of", "is", "to", "and", "in", "list", "for", "an"}
    assert len(words) >= 15 and sum(w.lower().strip(".,:") in common for w in words) >= 5, out.stdout
    assert all(c.isascii() for c in out.stdout), out.stdout


@pytest.mark.parametrize("tool,args,fragment", [
    ("corpus", ["/nonexistent", "OUT"], "unpack python3.11-doc"),
    ("tiny_data", ["/nonexistent", "OUT"], "train.txt is missing"),
    ("tiny_train", ["/nonexistent", "OUT"], "train.npy is missing"),
    ("tiny_train", ["/nonexistent", "OUT", "--steps", "0"], "must be >= 1"),
    ("tiny_export", ["/nonexistent", "tok.json", "OUT"], "no weights-*.safetensors"),
])
def test_the_tiny_model_tools_refuse_bad_input_in_one_line(tool, args, fragment, tmp_path):
    r = subprocess.run([sys.executable, "-m", f"muse_mlx.tools.{tool}", *[a.replace("OUT", str(tmp_path / "o"))
                                                                        for a in args]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and fragment in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()
