"""Logits -> token: greedy, or temperature sampling after top-k / top-p / min-p filters.

The order follows llama.cpp's default sampler chain (top-k, top-p, min-p, then
temperature, then a draw): the filters see the model's own distribution, and the
temperature only reshapes what survives them. `temp == 0` is greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplerSettings:
    temp: float = 0.0
    top_k: int = 0      # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0

    def problems(self) -> list[str]:
        p = []
        if not self.temp >= 0:
            p.append(f"--temp must be >= 0, got {self.temp}")
        if self.top_k < 0:
            p.append(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            p.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            p.append(f"--min-p must be in [0, 1], got {self.min_p}")
        return p


class Sampler:
    def __init__(self, settings: SamplerSettings):
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.settings = settings
        self._key = mx.random.key(settings.seed % 2**64)   # any integer: taken modulo 2^64

    def filter(self, logits: mx.array) -> mx.array:
        """Mask (to -inf) the tokens the top-k / top-p / min-p filters drop. logits: (V,) float32."""
        s = self.settings
        neg_inf = mx.array(-float("inf"), dtype=mx.float32)
        if 0 < s.top_k < logits.shape[-1]:
            kth = mx.sort(logits)[-s.top_k]
            logits = mx.where(logits >= kth, logits, neg_inf)
        if s.top_p < 1.0:
            ordered = mx.sort(logits)[::-1]
            probs = mx.softmax(ordered, precise=True)
            before = mx.cumsum(probs) - probs          # mass strictly above each token
            n_keep = mx.sum(before < s.top_p)          # >= 1: the first token is always kept
            threshold = ordered[n_keep - 1]
            logits = mx.where(logits >= threshold, logits, neg_inf)
        if s.min_p > 0.0:
            probs = mx.softmax(logits, precise=True)
            logits = mx.where(probs >= s.min_p * probs.max(), logits, neg_inf)
        return logits

    def token(self, logits: mx.array) -> mx.array:
        """The sampled token as a lazy 0-d array: nothing waits for the logits, so the next
        step can be built on it before it is computed (generate.generate_tokens)."""
        logits = logits.reshape(-1).astype(mx.float32)
        if self.settings.temp == 0:
            return mx.argmax(logits)
        logits = self.filter(logits) / self.settings.temp
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logits, key=sub)

    def __call__(self, logits: mx.array) -> int:
        return int(self.token(logits).item())


def all_finite(logits: mx.array) -> mx.array:
    """Whether every logit is finite, as a lazy bool scalar: sum(x * 0) == 0, since NaN * 0 and
    ±inf * 0 are NaN and a NaN sum equals nothing (IEEE arithmetic alone; no reliance on how a
    reduction treats NaN). Five graph nodes where mx.all(mx.isfinite(x)) makes ten; the decode
    loops build it once a token, and MLX's host time is per node (docs/ledger.md, 2026-12-02)."""
    return mx.sum(logits * 0.0) == 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis, in float64 (the one home for it outside the test oracle)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
