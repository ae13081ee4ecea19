"""The logit bias and the penalties against the pinned llama.cpp's own samplers.

llama.cpp's chain (common/sampling.cpp) starts with llama_sampler_init_logit_bias and then
llama_sampler_init_penalties, which accepts every token of the prompt and of the output
(llama-server's init_sampler). Here both run through llama-cpp-python's low-level API on the
same logits and the same tokens as muse_mlx's Sampler, step after step, and the logits they
leave are compared: bit for bit where the penalties' products are exact in float32 (llama.cpp
may fuse count * frequency + presence into one FMA), else within an ulp.
"""

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.errors import MuseError
from muse_mlx.sampling import Sampler, SamplerSettings


def llama():
    from muse_mlx.tools import llamacpp
    try:
        return llamacpp.lib()
    except MuseError as exc:
        pytest.skip(str(exc))


class LlamaChain:
    """llama.cpp's logit-bias then penalties samplers, as llama-server chains them."""

    def __init__(self, L, n_vocab: int, s: SamplerSettings, history):
        self.L, self.V = L, n_vocab
        self.samplers = []
        if s.logit_bias:
            biases = (L.llama_logit_bias * len(s.logit_bias))(*[L.llama_logit_bias(t, b) for t, b in s.logit_bias])
            self.samplers.append(L.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), biases))
        self.samplers.append(L.llama_sampler_init_penalties(n_vocab, s.repeat_last_n, s.repeat_penalty,
                                                            s.frequency_penalty, s.presence_penalty))
        for t in history:
            self.accept(t)

    def accept(self, token: int) -> None:
        for smpl in self.samplers:
            self.L.llama_sampler_accept(smpl, int(token))

    def apply(self, logits: np.ndarray) -> np.ndarray:
        L = self.L
        data = (L.llama_token_data * self.V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
        arr = L.llama_token_data_array(data, self.V, -1, False)
        for smpl in self.samplers:
            L.llama_sampler_apply(smpl, ctypes.byref(arr))
        out = np.empty(self.V, dtype=np.float32)
        for i in range(self.V):
            out[data[i].id] = data[i].logit
        return out

    def free(self) -> None:
        for smpl in self.samplers:
            self.L.llama_sampler_free(smpl)


CASES = {
    # exact products (counts times a dyadic penalty): bit for bit
    "repeat-window": (SamplerSettings(repeat_penalty=1.3, repeat_last_n=16, frequency_penalty=0.5,
                                      presence_penalty=0.25), True),
    "negative-wide": (SamplerSettings(repeat_penalty=0.8, repeat_last_n=200, frequency_penalty=-1.5,
                                     presence_penalty=0.75), True),
    "bias-and-ban": (SamplerSettings(repeat_penalty=1.1, repeat_last_n=8, presence_penalty=1.0,
                                     logit_bias=((3, -float("inf")), (7, 2.5), (40, -0.75), (250, 100.0))), True),
    "bias-alone": (SamplerSettings(logit_bias=((0, 1.0), (299, -100.0))), True),
    # products not exact in float32: within an ulp
    "inexact": (SamplerSettings(repeat_penalty=1.17, repeat_last_n=64, frequency_penalty=0.3,
                                presence_penalty=-0.2), False),
}


@pytest.mark.parametrize("name", CASES)
def test_bias_and_penalties_match_the_pinned_llama_cpp(name):
    """20 greedy steps over random logits with a prompt of 50 tokens drawn from 30 (so tokens
    repeat and the windows fill and slide): at every step the biased, penalized logits against
    llama.cpp's, and the pick (argmax) accepted into both."""
    settings, exact = CASES[name]
    L = llama()
    V = 300
    rng = np.random.default_rng([7, len(name)])
    prompt = rng.integers(0, 30, 50).tolist()
    ours, theirs = Sampler(settings, prompt), LlamaChain(L, V, settings, prompt)
    try:
        for step in range(20):
            logits = (rng.standard_normal(V) * 3).astype(np.float32)
            logits[rng.integers(0, 30, 5)] += 4.0   # recent tokens near the top, so picks repeat
            got = np.array(ours.process(mx.array(logits)))
            want = theirs.apply(logits)
            if exact:
                assert np.array_equal(got, want), (step, np.flatnonzero(got != want)[:5])
            else:
                assert np.allclose(got, want, rtol=2 ** -22, atol=0), step
            pick = int(ours.token(mx.array(logits)).item())
            assert pick == int(np.argmax(want)), step
            theirs.accept(pick)
    finally:
        theirs.free()


def test_settings_that_change_nothing_leave_the_logits_alone():
    """Neutral penalties (or a window of 0) and no bias: the logits are returned as they came."""
    logits = mx.array(np.random.default_rng(3).standard_normal(50).astype(np.float32))
    for s in (SamplerSettings(), SamplerSettings(repeat_penalty=1.5, repeat_last_n=0)):
        assert Sampler(s, [1, 2, 3]).process(logits) is logits


@pytest.mark.parametrize("settings, says", [
    (SamplerSettings(repeat_penalty=0.0), "--repeat-penalty must be a finite number > 0"),
    (SamplerSettings(repeat_penalty=float("inf")), "--repeat-penalty"),
    (SamplerSettings(repeat_last_n=-1), "--repeat-last-n must be >= 0"),
    (SamplerSettings(frequency_penalty=float("nan")), "--frequency-penalty must be finite"),
    (SamplerSettings(logit_bias=((5, float("inf")),)), "--logit-bias"),
])
def test_settings_refused(settings, says):
    assert any(says in p for p in settings.problems()), settings.problems()
