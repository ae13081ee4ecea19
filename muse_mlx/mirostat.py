"""llama.cpp's Mirostat (v1 and v2): sampling held at a target surprise, on the device.

Each pick keeps the candidates a running bound `mu` allows, samples among them, and moves `mu` by
eta times the picked token's surprise (-log2 p, p among the kept) less the target tau; mu starts at
2 tau (llama-sampler.cpp's llama_sampler_mirostat / _v2, after Basu et al. 2021). v2 keeps the
tokens of surprise <= mu (at least the most likely); v1 keeps the k most likely, k worked out from
mu and the Zipf exponent s estimated over the m = 100 most likely tokens. As in llama.cpp's chain,
Mirostat takes the biased logits scaled by the temperature and replaces the penalties, DRY and the
filters. `mu` is a device scalar: a pick is lazy like any other (nothing waits on the host).
"""

from __future__ import annotations

import math

import mlx.core as mx

M = 100   # v1's tokens for the Zipf estimate (llama.cpp's common sampler passes 100)


class Mirostat:
    def __init__(self, version: int, tau: float, eta: float):
        if version not in (1, 2):
            raise ValueError(f"mirostat must be 1 or 2, got {version}")
        self.version, self.tau, self.eta = version, tau, eta
        self.mu = mx.array(2.0 * tau, dtype=mx.float32)

    def candidates(self, logits: mx.array) -> mx.array:
        """The kept tokens' logits (the others minus infinity), from logits (V,) already scaled by the
        temperature."""
        neg_inf = mx.array(-math.inf, dtype=mx.float32)
        p = mx.softmax(logits, precise=True)
        if self.version == 2:
            keep = -mx.log2(p) <= self.mu   # a prefix of the tokens by probability
            best = mx.arange(logits.shape[-1]) == mx.argmax(logits)
            return mx.where(keep | (best & ~mx.any(keep)), logits, neg_inf)
        top = mx.sort(p)[::-1][:M]
        n = min(M - 1, logits.shape[-1] - 1)
        i = mx.arange(n, dtype=mx.float32)
        t = mx.log((i + 2) / (i + 1))
        b = mx.log(top[:n] / top[1:n + 1])
        s_hat = mx.sum(t * b) / mx.sum(t * t)
        eps = s_hat - 1
        k = mx.power(eps * mx.power(2.0, self.mu) / (1 - mx.power(float(logits.shape[-1]), -eps)), 1 / s_hat)
        # C's int(k): truncation; NaN, infinity or past int32 give INT_MIN there, so max(int(k), 1) is 1
        k = mx.where((k >= 1) & (k < 2.0 ** 31), mx.floor(k), 1).astype(mx.int32)
        kth = mx.sort(logits)[::-1][mx.minimum(k, logits.shape[-1]) - 1]
        return mx.where(logits >= kth, logits, neg_inf)

    def accept(self, kept: mx.array, token: mx.array) -> None:
        """mu moved by the picked token's surprise among the kept (lazily)."""
        p = mx.softmax(kept, precise=True)[token]
        self.mu = self.mu - self.eta * (-mx.log2(p) - self.tau)
