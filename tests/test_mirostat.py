"""Mirostat against the pinned llama.cpp's own samplers (llama_sampler_init_mirostat / _v2).

llama.cpp draws with its own generator, so the draws cannot be compared; what Mirostat decides can:
at each step both are given the same logits after the temperature, and the candidates llama.cpp
keeps (its array's size after the sampler: v2's tokens of surprise <= mu, v1's top k) must be the
ones muse_mlx's Mirostat keeps; then the token llama.cpp picked is accepted by both, which moves
each mu. A wrong mu, a wrong surprise or a wrong k shows as a different set within a few steps.
"""

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.errors import MuseError
from muse_mlx.mirostat import Mirostat
from muse_mlx.sampling import Sampler, SamplerSettings


def llama():
    from muse_mlx.tools import llamacpp
    try:
        return llamacpp.lib()
    except MuseError as exc:
        pytest.skip(str(exc))


class LlamaMirostat:
    def __init__(self, L, version, n_vocab, temp, tau, eta):
        self.L = L
        self.temp = L.llama_sampler_init_temp(temp)
        self.miro = (L.llama_sampler_init_mirostat(n_vocab, 7, tau, eta, 100) if version == 1
                     else L.llama_sampler_init_mirostat_v2(7, tau, eta))

    def apply(self, logits: np.ndarray) -> tuple[set[int], int]:
        """-> (the kept token ids, the picked one)."""
        L, V = self.L, len(logits)
        data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
        arr = L.llama_token_data_array(data, V, -1, False)
        L.llama_sampler_apply(self.temp, ctypes.byref(arr))
        L.llama_sampler_apply(self.miro, ctypes.byref(arr))
        kept = {data[i].id for i in range(arr.size)}
        return kept, data[arr.selected].id

    def free(self):
        self.L.llama_sampler_free(self.temp)
        self.L.llama_sampler_free(self.miro)


CASES = {
    "v2": (2, 1.0, 5.0, 0.1), "v2-hot-low-target": (2, 1.7, 2.0, 0.3), "v2-sharp": (2, 0.5, 8.0, 0.5),
    "v1": (1, 1.0, 5.0, 0.1), "v1-hot-low-target": (1, 1.7, 2.0, 0.3), "v1-sharp": (1, 0.5, 8.0, 0.5),
}


@pytest.mark.parametrize("name", CASES)
def test_mirostat_keeps_what_the_pinned_llama_cpp_keeps(name):
    """60 steps over random logits of a 512-token vocabulary (a Zipf-like spread, so that k and the
    surprise bound move): the same kept set at every step, mu following the same picks."""
    L = llama()
    version, temp, tau, eta = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name))
    V = 512
    theirs = LlamaMirostat(L, version, V, temp, tau, eta)
    ours = Mirostat(version, tau, eta)
    sizes = []
    try:
        for step in range(60):
            logits = (rng.normal(0, 1, V) * rng.uniform(1, 4) - 2 * np.log1p(rng.permutation(V))).astype(np.float32)
            kept, token = theirs.apply(logits)
            mine = ours.candidates(mx.array(logits) / temp)
            got = set(np.flatnonzero(np.isfinite(np.array(mine))).tolist())
            assert got == kept, (name, step, len(got), len(kept), float(ours.mu))
            assert token in got
            ours.accept(mine, mx.array(token))
            sizes.append(len(kept))
    finally:
        theirs.free()
    assert len(set(sizes)) > 3, sizes   # the bound moved


def test_the_sampler_with_mirostat():
    """Through the Sampler: a pick is always among Mirostat's kept tokens, the penalties and filters are
    left out as llama.cpp's chain leaves them, temperature 0 is greedy, and a seed reproduces the picks."""
    rng = np.random.default_rng(3)
    rows = [mx.array((rng.normal(0, 2, 300) - np.log1p(np.arange(300))).astype(np.float32)) for _ in range(30)]
    s = SamplerSettings(temp=1.0, seed=5, mirostat=2, mirostat_tau=3.0, top_k=1, repeat_penalty=5.0)
    a, b, check = Sampler(s, [1, 2, 3]), Sampler(s, [1, 2, 3]), Mirostat(2, 3.0, 0.1)
    picks = []
    for row in rows:
        t = int(a.token(row).item())
        assert t == int(b.token(row).item())
        kept = check.candidates(row)
        assert np.isfinite(np.array(kept)[t])
        check.accept(kept, mx.array(t))
        picks.append(t)
    assert len(set(picks)) > 1   # top_k = 1 left out
    greedy = Sampler(SamplerSettings(temp=0.0, mirostat=1))
    assert [int(greedy.token(r).item()) for r in rows] == [int(mx.argmax(r).item()) for r in rows]
    for bad in (SamplerSettings(mirostat=3), SamplerSettings(mirostat=2, mirostat_eta=float("nan"))):
        with pytest.raises(ValueError):
            Sampler(bad)


def test_generate_mirostat_flags(f32_fixture):
    """--mirostat 1 / 2 sample (reproducibly by the seed); a version past 2 or a non-finite rate is one
    line and exit 2."""
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "muse_mlx.generate", "--model", str(f32_fixture),
                               "--prompt", "the ring", "--max-tokens", "12", "--temp", "1.2", "--seed", "4", *args],
                              capture_output=True, text=True, timeout=300)
    for bad, fragment in [(("--mirostat", "3"), "--mirostat"), (("--mirostat", "2", "--mirostat-lr", "inf"),
                                                                 "--mirostat-lr must be finite")]:
        r = run(*bad)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr
    one, two, again = run("--mirostat", "1"), run("--mirostat", "2", "--mirostat-ent", "2"), run("--mirostat", "1")
    assert one.returncode == two.returncode == 0, (one.stderr, two.stderr)
    assert one.stdout == again.stdout and one.stdout != run().stdout
