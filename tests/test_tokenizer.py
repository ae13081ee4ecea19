"""The GGUF vocabulary as a tokenizer, and the chat template against the pinned muse-glimmer.jinja."""

import os
import tarfile
from functools import lru_cache
from dataclasses import replace
from pathlib import Path

import pytest

from muse_mlx.artifact import open_artifact
from muse_mlx.errors import TokenizerError
from muse_mlx.tokenizer import MuseTokenizer, render_chat_template

TEXTS = [
    "The weights are a river.",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\n\n\tTabbed 123 456789 it's we'll",
    "unicode: naïve café — 東京 🚀 Ωmega",
    "",
]

PINNED_SDIST = "llama_cpp_python-0.3.36.tar.gz"
PINNED_TEMPLATE = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/muse-glimmer.jinja"


@pytest.fixture(scope="module")
def tok(f32_fixture):
    return MuseTokenizer(open_artifact(f32_fixture).vocabulary)


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.n_vocab for i in ids)


def test_bos_and_merges(tok):
    ids = tok.encode(" the river")
    assert ids[0] == tok.bos_id
    assert tok.vocab.tokens[ids[1]] == "Ġthe"  # a learned merge, applied
    assert len(ids) < 1 + len(" the river")


def test_special_tokens_are_parsed(tok):
    ids = tok.encode("<|start|>user<|message|>hi<|eot|>", add_bos=False)
    names = [tok.vocab.tokens[i] for i in ids]
    assert names[0] == "<|start|>" and "<|message|>" in names and names[-1] == "<|eot|>"
    # Control tokens render as nothing, like llama.cpp, except the ones llama.cpp always renders.
    assert tok.decode(ids) == "<|start|>user<|message|>hi"
    assert {tok.vocab.eot_id, tok.vocab.eom_id} <= tok.stop_ids


def test_streaming_holds_back_partial_utf8(tok):
    text = "ok 東京 🚀!"
    ids = tok.encode(text, add_bos=False)
    s = tok.streamer()
    pieces = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_unknown_pre_tokenizer_is_refused(tok):
    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery'"):
        MuseTokenizer(replace(tok.vocab, pre="mystery"))


@lru_cache(maxsize=1)
def _pinned_template() -> str | None:
    for root in [os.environ.get("MUSE_PINNED_SDIST_DIR"), Path(__file__).parents[1] / ".pinned"]:
        if root and (Path(root) / PINNED_SDIST).exists():
            with tarfile.open(Path(root) / PINNED_SDIST) as tar:
                return tar.extractfile(PINNED_TEMPLATE).read().decode()
    return None


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Reasoning effort: low. Be kind."}, {"role": "user", "content": "Q1"},
     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
    [{"role": "user", "content": "multi\nline\n\ncontent"}, {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("extra", [{}, {"current_date": "2026-11-29", "reasoning_strength": "medium"}])
def test_fixture_template_renders_like_the_pinned_template(tok, messages, extra):
    pinned = _pinned_template()
    if pinned is None:
        pytest.skip(f"{PINNED_SDIST} not found in .pinned/ (the README's test set-up downloads it)")
    kwargs = dict(bos_token="<|bos|>", eos_token="<|eot|>", add_generation_prompt=True,
                  strftime_now=lambda fmt: "2026-11-29", **extra)
    assert render_chat_template(tok.vocab.chat_template, messages, **kwargs) == \
        render_chat_template(pinned, messages, **kwargs)


def test_chat_prompt_tokenizes_specials(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == tok.bos_id
    assert text.endswith("<|start|>assistant")


def _added_vocabulary_encode(tok: MuseTokenizer, text: str) -> list[int]:
    """The oracle: tokenizers' own added vocabulary (every special token added to a copy of the
    same BPE tokenizer, matched by its aho-corasick, leftmost-longest), the way MuseTokenizer
    encoded before SpecialSplitter."""
    from tokenizers import AddedToken, Tokenizer

    oracle = Tokenizer.from_str(tok._tok.to_str())
    oracle.add_special_tokens([AddedToken(tok.vocab.tokens[i], special=True, normalized=False)
                               for i in sorted(tok.special_ids)])
    return oracle.encode(text, add_special_tokens=False).ids


def test_special_tokens_split_as_tokenizers_added_vocabulary_does(tok):
    """SpecialSplitter against tokenizers' added vocabulary on a vocabulary whose special tokens
    overlap, nest and share prefixes (user-defined and control, one a single character), in
    texts that put them adjacent, inside words, cut short, overlapping, at both ends."""
    from muse_mlx.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED

    extra = ["<|eo", "t|>", "qzab", "zbcd", "qzabc", "☃", "<|start|><|message|>", "ot|>x"]
    vocab = tok.vocab
    types = list(vocab.token_types or [1] * len(vocab.tokens))
    tokens = list(vocab.tokens) + extra
    types += [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED] * (len(extra) // 2)
    wide = MuseTokenizer(replace(vocab, tokens=tokens, token_types=types))
    texts = ["<|eot|>", "<|eo", "<|eot|", "x<|eot|>y", "<|eot|><|eom|><|eot|>", "qzabcd", "qqzabcd", "qzabzbcd",
             "☃☃a☃", "<|start|><|message|>hi", "<|start|><|message|", "<|eot|>x", "<|eot|>>x<|",
             "The weights <|eom|>are☃a river.<|eot|>", "", "<", "<<|||>>", "naïve <|eot|>東京 🚀 qzabc"]
    for text in texts:
        assert wide.encode(text, add_bos=False) == _added_vocabulary_encode(wide, text), text
    rng = __import__("random").Random(5)
    pieces = extra + ["<|eot|>", "<|eom|>", "<|start|>", " the", "q", "z", "a", "b", "c", "d", "<", "|", ">", "t", "é"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        assert wide.encode(text, add_bos=False) == _added_vocabulary_encode(wide, text), text


def test_a_vocabulary_whose_special_tokens_would_make_the_split_slow_goes_back_to_tokenizers(tok):
    """Special tokens of more lengths from one first character than SpecialSplitter.MAX_LENGTHS, or
    one longer than MAX_CHARS (a hostile file: each place of a text would cost a lookup a length):
    tokenizers' own added vocabulary matches them, and the ids are its ids."""
    from muse_mlx.tokenizer import TOKEN_TYPE_CONTROL, SpecialSplitter

    vocab = tok.vocab
    base_types = list(vocab.token_types or [1] * len(vocab.tokens))
    for extra in (["<" + "q" * n + ">" for n in range(SpecialSplitter.MAX_LENGTHS + 1)],
                  ["<" + "z" * SpecialSplitter.MAX_CHARS + ">"]):
        odd = MuseTokenizer(replace(vocab, tokens=list(vocab.tokens) + extra,
                                    token_types=base_types + [TOKEN_TYPE_CONTROL] * len(extra)))
        assert odd._specials is None
        for text in ["<qqq>x<eot", extra[-1] + "<|eot|>" + extra[0], "<" * 50 + extra[-1]]:
            assert odd.encode(text, add_bos=False) == _added_vocabulary_encode(odd, text), text
            assert odd.vocab.tokens.index(extra[-1]) in odd.encode(extra[-1], add_bos=False)
    assert MuseTokenizer(vocab)._specials is not None


def test_special_tokens_do_not_hold_the_gil_while_the_tokenizer_is_built():
    """MuseTokenizer over the bench file's vocabulary (202,048 tokens, 201,485 of them control):
    a thread building it lets the main thread run (the longest wait here 0.13 s, tokenizers' BPE
    build; add_special_tokens held the GIL for its whole 0.59-0.63 s build), and the specials
    still encode to their ids."""
    import threading
    import time

    from muse_mlx.artifact import Vocabulary
    from muse_mlx.tools.fixture_vocab import build_vocab

    v = build_vocab(202048)
    vocab = Vocabulary(model="gpt2", pre="gpt-2", tokens=v.tokens, token_types=v.token_types, merges=v.merges,
                       bos_id=v.id_of("<|bos|>"), eos_id=v.id_of("<|eot|>"), eot_id=v.id_of("<|eot|>"),
                       eom_id=v.id_of("<|eom|>"), add_bos=True, chat_template=None)
    built, gaps = [], []
    worker = threading.Thread(target=lambda: built.append(MuseTokenizer(vocab)))
    last = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert max(gaps) < 0.35, max(gaps)
    ids = built[0].encode(f"<|reserved_7|>x{v.tokens[-1]}", add_bos=False)
    assert ids[0] == v.id_of("<|reserved_7|>") and ids[-1] == len(v.tokens) - 1
