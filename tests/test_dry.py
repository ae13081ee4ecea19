"""DRY against the pinned llama.cpp's own sampler (llama_sampler_init_dry) and a brute-force oracle.

The oracle for the runs is the definition: for each window position, walk back while the tokens
ending there equal the tokens ending the window. llama.cpp's DRY runs through llama-cpp-python's
low-level API on the fixture's vocabulary (its breakers processed from that vocabulary, as
llama-server does), fed the same tokens and applied to the same logits as muse_mlx's Sampler, step
after step; the logits each leaves are compared bit for bit.
"""

import ctypes
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.artifact import open_artifact
from muse_mlx.dry import Dry, _runs
from muse_mlx.errors import MuseError
from muse_mlx.sampling import Sampler, SamplerSettings, breakers_of_flags
from muse_mlx.tokenizer import MuseTokenizer


def brute_runs(w) -> list[int]:
    n, out = len(w), []
    for e in range(n):
        m = 0
        while m <= e and w[e - m] == w[n - 1 - m]:
            m += 1
        out.append(m)
    return out


def test_runs_kept_as_tokens_arrive_equal_the_definition():
    """The runs made once (a prompt) and kept as each token is read, the window sliding: both equal
    the brute-force walk at every step."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        w = rng.integers(0, 3, size=int(rng.integers(0, 40)))
        assert _runs(w).tolist() == brute_runs(w)
        last_n = int(rng.integers(1, 20))
        d = Dry(1.0, 1.75, 2, last_n, {}, w[:5])
        for i, t in enumerate(w[5:], start=6):
            d.read(int(t))
            window = w[max(0, i - last_n):i]
            assert d.tokens.tolist() == window.tolist() and d.runs.tolist() == brute_runs(window)


@pytest.fixture(scope="module")
def vocab_oracle(f32_fixture):
    from muse_mlx.tools import llamacpp
    try:
        L = llamacpp.lib()
    except MuseError as exc:
        pytest.skip(str(exc))
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(f32_fixture).encode(), params)
    assert model
    yield L, L.llama_model_get_vocab(model)
    L.llama_model_free(model)


@pytest.fixture(scope="module")
def tokenizer(f32_fixture):
    return MuseTokenizer(open_artifact(f32_fixture).vocabulary)


class LlamaDry:
    def __init__(self, L, vocab, s: SamplerSettings, history):
        self.L = L
        texts = [b.encode("utf-8") for b in s.dry_sequence_breakers]
        arr = (ctypes.c_char_p * max(1, len(texts)))(*texts)
        self.smpl = L.llama_sampler_init_dry(vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                             s.dry_penalty_last_n, arr, len(texts))
        for t in history:
            self.accept(t)

    def accept(self, token: int) -> None:
        self.L.llama_sampler_accept(self.smpl, int(token))

    def apply(self, logits: np.ndarray) -> np.ndarray:
        L, V = self.L, len(logits)
        data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
        arr = L.llama_token_data_array(data, V, -1, False)
        L.llama_sampler_apply(self.smpl, ctypes.byref(arr))
        out = np.empty(V, dtype=np.float32)
        for i in range(V):
            out[data[i].id] = data[i].logit
        return out


def breaker_tokens(tokenizer, texts):
    """Tokens whose text holds one of `texts`, or ends with a text's first character."""
    out = set()
    for i, piece in enumerate(tokenizer._pieces):
        for t in texts:
            b = t.encode()
            if b in piece or piece.endswith(b[:1]):
                out.add(i)
    return sorted(out)


def cases(tokenizer):
    pieces = tokenizer._pieces
    # a two-character breaker whose first character ends some token and whose second is a token of its
    # own, so that two tokens make it: a restart sequence of a head and a tail
    two = next(p[-1:] + q for p in pieces for q in pieces
               if len(p) > 1 and len(q) == 1 and p[-1:].isalpha() and q.isalpha() and p[-1:] != q).decode()
    return {
        "defaults": SamplerSettings(dry_multiplier=0.8),
        "long-window": SamplerSettings(dry_multiplier=1.5, dry_base=1.3, dry_allowed_length=1, dry_penalty_last_n=300),
        "two-token-breaker": SamplerSettings(dry_multiplier=2.0, dry_allowed_length=2, dry_penalty_last_n=100,
                                             dry_sequence_breakers=(two,)),
        "no-breakers": SamplerSettings(dry_multiplier=0.5, dry_base=2.5, dry_allowed_length=3, dry_penalty_last_n=50,
                                       dry_sequence_breakers=()),
        "base-one": SamplerSettings(dry_multiplier=-0.25, dry_base=1.0, dry_allowed_length=0, dry_penalty_last_n=40),
        "clamped-exponent": SamplerSettings(dry_multiplier=1e-20, dry_base=1e4, dry_allowed_length=0,
                                            dry_penalty_last_n=200, dry_sequence_breakers=("~~~",)),
    }


@pytest.mark.parametrize("name", ["defaults", "long-window", "two-token-breaker", "no-breakers", "base-one",
                                  "clamped-exponent"])
def test_dry_matches_the_pinned_llama_cpp(vocab_oracle, tokenizer, name):
    """40 steps over random logits, after a prompt of 120 tokens drawn from 12 or so (so runs repeat),
    four of them tokens that hold or start a breaker, and a breaker's tokens after its first (for the clamp, five tokens over and over); each step's token drawn from the same 12 and accepted
    by both: the logits DRY leaves are llama.cpp's, bit for bit, and the penalty bit somewhere."""
    L, vocab = vocab_oracle
    s = cases(tokenizer)[name]
    rng = np.random.default_rng(sorted(cases(tokenizer)).index(name))
    V = tokenizer.n_vocab
    pool = np.concatenate([rng.choice(V, 8, replace=False),
                           rng.choice(breaker_tokens(tokenizer, s.dry_sequence_breakers or ("e",)), 4),
                           [t for b in s.dry_sequence_breakers for t in tokenizer.encode(b, add_bos=False)[1:]]])
    history = [int(t) for t in rng.choice(pool, 120)]
    if name == "clamped-exponent":   # one long repeat: runs far past the clamp (9 at this base)
        history = [int(t) for t in pool[:5]] * 24
    if name == "two-token-breaker":   # one long repeat holding the breaker's two tokens: they cut the runs
        head = next(t for t in pool[8:12] if tokenizer._pieces[t].endswith(s.dry_sequence_breakers[0][:1].encode()))
        history = [int(pool[0]), int(pool[1]), int(head), int(pool[-1]), int(pool[2])] * 24
    ours = Sampler(s, history, breakers=tokenizer.dry_breakers(s.dry_sequence_breakers))
    theirs = LlamaDry(L, vocab, s, history)
    changed = 0
    for step in range(40):
        logits = rng.normal(0, 3, V).astype(np.float32)
        got = np.array(ours.process(mx.array(logits)))
        want = theirs.apply(logits)
        assert got.tobytes() == want.tobytes(), (name, step, np.flatnonzero(got != want)[:10])
        changed += int((got != logits).any())
        t = int(rng.choice(pool))
        ours.read(t)
        theirs.accept(t)
    assert changed > 0


def test_breakers_of_flags_as_llama_cpp_takes_them():
    assert breakers_of_flags(None) == ("\n", ":", "\"", "*")
    assert breakers_of_flags(["a"]) == ("a",)
    assert breakers_of_flags(["a", "none", "b", "c"]) == ("b", "c")
    assert breakers_of_flags(["none"]) == ()


def test_generate_dry_flags(f32_fixture):
    """generate's DRY flags: a bad value is one line and exit 2; with DRY on, the greedy output of a
    prompt that repeats itself differs from the one without it (the server's test checks the text
    against the decode loop's with the same DRY)."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(f32_fixture),
                               "--prompt", "a b a b a b a b", "--max-tokens", "24", *args],
                              capture_output=True, text=True, timeout=300)
    for bad, fragment in [(("--dry-allowed-length", "-1"), "--dry-allowed-length must be >= 0"),
                          (("--dry-penalty-last-n", "-3"), "--dry-penalty-last-n must be >= 0"),
                          (("--dry-multiplier", "nan"), "--dry-multiplier must be finite"),
                          (("--dry-sequence-breaker", ""), "non-empty")]:
        r = run(*bad)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr
    plain = run()
    dry = run("--dry-multiplier", "40", "--dry-allowed-length", "1")
    assert plain.returncode == 0 and dry.returncode == 0, dry.stderr
    assert dry.stdout != plain.stdout


def test_a_penalty_past_float32_stops_at_its_largest():
    """multiplier x base^n past float32's range: llama.cpp's penalty is infinite (with a negative
    multiplier a logit then becomes +inf and the softmax NaN); here it is the largest float32, and the
    pick stays a token of the vocabulary."""
    big = np.finfo(np.float32).max
    for multiplier in (1e6, -1e6):
        d = Dry(multiplier, 1e6, 0, 64, {}, [1, 2, 3] * 10)
        ids, values = d.penalties()
        assert np.isfinite(values).all() and np.abs(values).max() == big
        s = Sampler(SamplerSettings(temp=1.0, dry_multiplier=multiplier, dry_base=1e6, dry_allowed_length=0),
                    [1, 2, 3] * 10)
        logits = mx.array(np.zeros(16, dtype=np.float32))
        assert 0 <= int(s.token(logits).item()) < 16
        assert not np.isnan(np.array(s.chain(logits))).any()
