"""The logit bias, the penalties and the filters against the pinned llama.cpp's own samplers.

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


FILTERS = {
    "top-n-sigma": SamplerSettings(temp=1, top_n_sigma=1.0),
    "top-n-sigma-wide": SamplerSettings(temp=1, top_n_sigma=2.5),
    "typical-half": SamplerSettings(temp=1, typical_p=0.5),
    "typical-tight": SamplerSettings(temp=1, typical_p=0.2),
    "typical-loose": SamplerSettings(temp=1, typical_p=0.95),
    "top-k": SamplerSettings(temp=1, top_k=10),
    "top-p": SamplerSettings(temp=1, top_p=0.8),
    "min-p": SamplerSettings(temp=1, min_p=0.05),
    "chain": SamplerSettings(temp=1, top_k=40, typical_p=0.7, top_p=0.9, min_p=0.02),
    "sigma-k-min": SamplerSettings(temp=1, top_n_sigma=1.5, top_k=20, min_p=0.1),
    # XTC at probability 1 (llama.cpp's draw in [0, 1) is then always under it)
    "xtc": SamplerSettings(temp=1, xtc_probability=1.0, xtc_threshold=0.05),
    "k-xtc": SamplerSettings(temp=1, top_k=30, min_p=0.01, xtc_probability=1.0, xtc_threshold=0.1),
}


def llama_filters(L, s: SamplerSettings) -> list:
    """llama.cpp's filters as common/sampling.cpp chains them (top-n-sigma, top-k, typical-p, top-p,
    min-p; min_keep 0), those that are on."""
    out = []
    if s.top_n_sigma > 0:
        out.append(L.llama_sampler_init_top_n_sigma(s.top_n_sigma))
    if s.top_k > 0:
        out.append(L.llama_sampler_init_top_k(s.top_k))
    if s.typical_p < 1:
        out.append(L.llama_sampler_init_typical(s.typical_p, 0))
    if s.top_p < 1:
        out.append(L.llama_sampler_init_top_p(s.top_p, 0))
    if s.min_p > 0:
        out.append(L.llama_sampler_init_min_p(s.min_p, 0))
    if s.xtc_probability > 0:
        out.append(L.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, 0, 1234))
    return out


@pytest.mark.parametrize("name", FILTERS)
def test_filters_keep_what_llama_cpp_s_keep(name):
    """Over 40 random logit rows (some tokens banned to -inf, as a bias or grammar leaves them, except
    before typical-p: test_typical_p_with_banned_tokens), the tokens top-n-sigma / top-k / typical-p /
    top-p / min-p leave are the ones llama.cpp's own samplers leave, chained in its order."""
    settings, L, V = FILTERS[name], llama(), 300
    rng = np.random.default_rng([11, len(name)])
    samplers, cut = llama_filters(L, settings), 0
    try:
        for row in range(40):
            logits = (rng.standard_normal(V) * rng.uniform(0.5, 4)).astype(np.float32)
            if settings.xtc_probability:   # a few likely tokens, so that XTC has some to drop
                logits[rng.integers(0, V, int(rng.integers(1, 5)))] += 6.0
            if settings.typical_p == 1 and settings.top_n_sigma <= 0:
                logits[rng.integers(0, V, 20)] = -np.inf
            data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
            arr = L.llama_token_data_array(data, V, -1, False)
            for smpl in samplers:
                L.llama_sampler_apply(smpl, ctypes.byref(arr))
            want = sorted(arr.data[i].id for i in range(arr.size) if arr.data[i].logit != -np.inf)   # XTC moves `data`
            got = np.flatnonzero(np.isfinite(np.array(Sampler(settings).filter(mx.array(logits))))).tolist()
            assert got == want, (row, sorted(set(got) ^ set(want))[:8], len(got), len(want))
            assert want
            cut += len(want) < int(np.isfinite(logits).sum())
        assert cut >= 10   # the filter left fewer tokens than it was given in at least a quarter of the rows
    finally:
        for smpl in samplers:
            L.llama_sampler_free(smpl)


DYNATEMP = {
    "alone": SamplerSettings(temp=0.9, dynatemp_range=0.6),
    "exponent": SamplerSettings(temp=1.2, dynatemp_range=0.5, dynatemp_exponent=2.0),
    "floor": SamplerSettings(temp=0.3, dynatemp_range=0.5, dynatemp_exponent=0.5),   # lo = 0
    "after-k-min-xtc": SamplerSettings(temp=1.0, dynatemp_range=0.8, top_k=25, min_p=0.02, xtc_probability=1.0,
                                       xtc_threshold=0.15),
    "after-sigma": SamplerSettings(temp=1.0, dynatemp_range=0.8, top_n_sigma=1.0),   # its cut stays in the list
    "one-left": SamplerSettings(temp=0.7, dynatemp_range=0.5, top_k=1),
}


@pytest.mark.parametrize("name", DYNATEMP)
def test_dynamic_temperature_is_llama_cpp_s(name):
    """llama.cpp's temp_ext (dynamic temperature) after its filters, over 30 random rows: the logits
    left (the candidates', scaled) equal ours within float32 rounding of the entropy, and the
    candidates are the same."""
    settings, L, V = DYNATEMP[name], llama(), 300
    rng = np.random.default_rng([13, len(name)])
    samplers = llama_filters(L, settings) + [L.llama_sampler_init_temp_ext(settings.temp, settings.dynatemp_range,
                                                                           settings.dynatemp_exponent)]
    try:
        for row in range(30):
            logits = (rng.standard_normal(V) * rng.uniform(0.3, 5)).astype(np.float32)
            logits[rng.integers(0, V, int(rng.integers(1, 4)))] += 5.0
            data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
            arr = L.llama_token_data_array(data, V, -1, False)
            for smpl in samplers:
                L.llama_sampler_apply(smpl, ctypes.byref(arr))
            want = {arr.data[i].id: arr.data[i].logit for i in range(arr.size) if arr.data[i].logit != -np.inf}
            ours = Sampler(settings)
            got = np.array(ours.temperature(*ours._filter(mx.array(logits))))
            assert sorted(np.flatnonzero(np.isfinite(got)).tolist()) == sorted(want), row
            ids = sorted(want)
            assert np.allclose(got[ids], [want[i] for i in ids], rtol=1e-5, atol=1e-5), (row, got[ids][:4])
    finally:
        for smpl in samplers:
            L.llama_sampler_free(smpl)


def test_xtc_applies_at_its_probability():
    """XTC's draw: at probability 0.3 the likely tokens are dropped for about 30 % of 400 draws, never
    at probability 0 or at a threshold over 0.5; through token() at probability 1 the pick is never
    one of the likely tokens but the least likely of them."""
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal(200) * 0.5).astype(np.float32)
    logits[:3] += 5.0   # three likely tokens (p >= 0.1 each)
    best, least = int(np.argmax(logits[:3])), int(np.argmin(logits[:3]))
    xtc = Sampler(SamplerSettings(temp=1.0, xtc_probability=0.3, xtc_threshold=0.1))
    dropped = [not np.isfinite(np.array(xtc.filter(mx.array(logits), mx.random.uniform(key=mx.random.key(s))))[best])
               for s in range(400)]
    assert 0.24 <= np.mean(dropped) <= 0.36, np.mean(dropped)
    for settings in ({"xtc_probability": 0.0}, {"xtc_probability": 1.0, "xtc_threshold": 0.6}):
        assert np.isfinite(np.array(Sampler(SamplerSettings(temp=1.0, **settings)).filter(mx.array(logits)))).all()
    picks = {int(Sampler(SamplerSettings(temp=1.0, seed=s, xtc_probability=1.0)).token(mx.array(logits)).item())
             for s in range(30)}
    assert picks & {0, 1, 2} == {least}


def test_typical_p_with_banned_tokens():
    """Typical-p over logits with -inf among them (a bias's ban, a grammar's mask, top-n-sigma's cut):
    llama.cpp's sampler takes 0 * log(0) into the entropy, which makes it NaN, and then keeps every
    token. Here the entropy is the support's and the kept tokens are a float64 reference's: ranked
    by |-log p - H|, taken until the mass passes typical_p."""
    rng = np.random.default_rng(5)
    V = 300
    for row in range(40):
        p = float(rng.uniform(0.1, 0.95))
        logits = (rng.standard_normal(V) * rng.uniform(0.5, 4)).astype(np.float32)
        logits[rng.integers(0, V, 40)] = -np.inf
        z = logits.astype(np.float64)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        support = probs > 0
        entropy = -np.sum(probs[support] * np.log(probs[support]))
        shifted = np.where(support, np.abs(-np.log(np.where(support, probs, 1)) - entropy), np.inf)
        order = np.argsort(shifted, kind="stable")
        n_keep = int(np.sum(np.cumsum(probs[order]) - probs[order] <= p))
        want = sorted(order[:n_keep].tolist())
        got = np.flatnonzero(np.isfinite(np.array(Sampler(SamplerSettings(temp=1, typical_p=p)).filter(
            mx.array(logits))))).tolist()
        assert got == want, (row, p, sorted(set(got) ^ set(want))[:8])
        assert 0 < len(want) < V - 40


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
    (SamplerSettings(typical_p=1.5), "--typical must be in [0, 1]"),
    (SamplerSettings(top_n_sigma=float("nan")), "--top-n-sigma must be finite"),
    (SamplerSettings(xtc_probability=1.5), "--xtc-probability must be in [0, 1]"),
    (SamplerSettings(xtc_threshold=-0.1), "--xtc-threshold must be in [0, 1]"),
    (SamplerSettings(dynatemp_range=-1.0), "--dynatemp-range must be a finite number >= 0"),
    (SamplerSettings(dynatemp_exponent=float("inf")), "--dynatemp-exp must be a finite number >= 0"),
])
def test_settings_refused(settings, says):
    assert any(says in p for p in settings.problems()), settings.problems()


def llama_sampler(L, name: str, s: SamplerSettings, V: int):
    """One sampler of llama.cpp's chain as common/sampling.cpp makes it (min_keep 0)."""
    return {"penalties": lambda: L.llama_sampler_init_penalties(V, s.repeat_last_n, s.repeat_penalty,
                                                                s.frequency_penalty, s.presence_penalty),
            "top_n_sigma": lambda: L.llama_sampler_init_top_n_sigma(s.top_n_sigma),
            "top_k": lambda: L.llama_sampler_init_top_k(s.top_k),
            "typ_p": lambda: L.llama_sampler_init_typical(s.typical_p, s.min_keep),
            "top_p": lambda: L.llama_sampler_init_top_p(s.top_p, s.min_keep),
            "min_p": lambda: L.llama_sampler_init_min_p(s.min_p, s.min_keep),
            "xtc": lambda: L.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, s.min_keep, 1234),
            "temperature": lambda: L.llama_sampler_init_temp_ext(s.temp, s.dynatemp_range, s.dynatemp_exponent),
            "adaptive_p": lambda: L.llama_sampler_init_adaptive_p(s.adaptive_target, s.adaptive_decay, 99)}[name]()


def apply_chain(L, samplers, logits: np.ndarray):
    V = len(logits)
    data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
    arr = L.llama_token_data_array(data, V, -1, False)
    for smpl in samplers:
        L.llama_sampler_apply(smpl, ctypes.byref(arr))
    kept = {arr.data[i].id: arr.data[i].logit for i in range(arr.size) if arr.data[i].logit != -np.inf}
    return kept, arr.data[arr.selected].id if arr.selected >= 0 else None


ORDERS = {
    # llama.cpp's own order, at temperature 0: typical-p and XTC may drop the best token, so greedy is the
    # best of what they leave (not the argmax of the logits); with a dynamic range, temperature 0 samples
    "greedy-typical": SamplerSettings(temp=0, typical_p=0.3, top_k=40),
    "greedy-xtc": SamplerSettings(temp=0, xtc_probability=1.0, xtc_threshold=0.05, min_p=0.01),
    "zero-dynatemp": SamplerSettings(temp=0, dynatemp_range=0.7, top_p=0.9),
    # other orders, as a client's `samplers` gives them
    "temperature-first": SamplerSettings(temp=1.8, top_p=0.7, min_p=0.05, top_k=50,
                                         samplers=("temperature", "top_p", "min_p", "top_k")),
    "penalties-last": SamplerSettings(temp=0.8, top_k=30, repeat_penalty=1.4, presence_penalty=0.5,
                                      samplers=("top_k", "temperature", "penalties")),
    "no-temperature": SamplerSettings(temp=0.0, top_k=20, typical_p=0.8, samplers=("typ_p", "top_k")),
    # llama.cpp's min_keep: each filter keeps (or XTC leaves) at least this many
    "min-keep-p": SamplerSettings(temp=1.0, top_p=0.3, min_p=0.5, min_keep=12),
    "min-keep-typical": SamplerSettings(temp=1.0, typical_p=0.1, min_keep=7, samplers=("typ_p", "temperature")),
    "min-keep-xtc": SamplerSettings(temp=1.0, top_k=6, xtc_probability=1.0, xtc_threshold=0.02, min_keep=5,
                                    dynatemp_range=0.3),
    "min-keep-past-k": SamplerSettings(temp=0.9, top_k=4, top_p=0.5, min_keep=9),
    "sigma-after-xtc": SamplerSettings(temp=1.1, top_n_sigma=1.0, xtc_probability=1.0, xtc_threshold=0.02,
                                       dynatemp_range=0.5, samplers=("xtc", "top_n_sigma", "temperature")),
}


@pytest.mark.parametrize("name", ORDERS)
def test_the_chain_in_any_order_is_llama_cpp_s(name):
    """Over 30 random rows after a prompt of 40 tokens drawn from 30: the logits the chain leaves for
    the draw (the kept tokens, their values within float32 rounding of the dynamic temperature's
    entropy) are those of llama.cpp's samplers chained in the same order; where the temperature is 0
    and the order ends with it, our pick is the one token llama.cpp leaves."""
    s, L, V = ORDERS[name], llama(), 300
    rng = np.random.default_rng([17, len(name)])
    prompt = rng.integers(0, 30, 40).tolist()
    samplers = [llama_sampler(L, n, s, V) for n in s.samplers if n != "dry" and (s.penalized or n != "penalties")]
    for t in prompt:
        for smpl in samplers:
            L.llama_sampler_accept(smpl, int(t))
    ours = Sampler(s, prompt)
    try:
        for row in range(30):
            logits = (rng.standard_normal(V) * rng.uniform(0.5, 4)).astype(np.float32)
            logits[rng.integers(0, 30, 4)] += 5.0
            want, _ = apply_chain(L, samplers, logits)
            got = np.array(ours.chain(mx.array(logits)))
            assert sorted(np.flatnonzero(np.isfinite(got)).tolist()) == sorted(want), (row, len(want))
            ids = sorted(want)
            assert np.allclose(got[ids], [want[i] for i in ids], rtol=1e-5, atol=1e-6), row
            pick = int(ours.token(mx.array(logits)).item())
            if s.temp == 0 and s.dynatemp_range == 0 and "temperature" in s.samplers:
                assert [pick] == ids, (row, pick, ids)
            for smpl in samplers:
                L.llama_sampler_accept(smpl, pick)
    finally:
        for smpl in samplers:
            L.llama_sampler_free(smpl)


@pytest.mark.parametrize("target, decay", [(0.3, 0.9), (0.05, 0.5), (0.7, 0.99), (-1.0, 0.9)])
def test_adaptive_p_is_llama_cpp_s(target, decay):
    """adaptive-p after the temperature, 40 steps: its reshaped logits equal llama.cpp's (within the
    softmax's float32 rounding), then llama.cpp's pick is accepted by both, moving each running mean."""
    from muse_mlx.adaptive_p import AdaptiveP

    L, V = llama(), 300
    s = SamplerSettings(temp=0.9, adaptive_target=target, adaptive_decay=decay, samplers=("temperature", "adaptive_p"))
    samplers = [llama_sampler(L, n, s, V) for n in s.samplers]
    ours = AdaptiveP(target, decay)
    rng = np.random.default_rng([19, int(target * 100) + 100])
    try:
        for row in range(40):
            logits = (rng.standard_normal(V) * rng.uniform(1, 4)).astype(np.float32)
            logits[rng.integers(0, V, 20)] = -np.inf
            want, pick = apply_chain(L, samplers, logits)
            reshaped, p = ours.reshaped(mx.array(logits) / np.float32(0.9))
            got = np.array(reshaped)
            ids = sorted(want)
            assert sorted(np.flatnonzero(np.isfinite(got)).tolist()) == ids
            assert np.allclose(got[ids], [want[i] for i in ids], rtol=1e-5, atol=1e-4), row
            for smpl in samplers:
                L.llama_sampler_accept(smpl, pick)
            ours.accept(p, mx.array(pick))
    finally:
        for smpl in samplers:
            L.llama_sampler_free(smpl)


def test_sampler_orders_as_llama_cpp_names_them():
    from muse_mlx.sampling import DEFAULT_SAMPLERS, samplers_of

    assert samplers_of("edskypmxt") == DEFAULT_SAMPLERS
    assert samplers_of(["Top-K", "nucleus", "temp", "minp", "typ", "adaptive_p"]) == (
        "top_k", "top_p", "temperature", "min_p", "typ_p", "adaptive_p")
    for bad, says in [(["top_k", "bogus"], "'bogus' is not one of"), ("kz", "'z' is not one of"),
                      (["infill"], "infill is not served"), ("ki", "infill is not served"), ([3], "'3' is not")]:
        with pytest.raises(ValueError, match=says):
            samplers_of(bad)
