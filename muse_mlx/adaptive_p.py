"""llama.cpp's adaptive-p: a final draw that favours tokens near a target probability, on the device.

Each pick reshapes the candidates' probabilities p into logits 5 - 10 d^2 / (1 + d), d = |p - t| / 0.3,
around an adapted target t = clamp(2 target - the running mean of picked tokens' p, 0, 1), and draws
from them; the running mean is an exponential moving average (weight `decay`) of the picked tokens'
probabilities before the reshaping (llama-sampler.cpp's llama_sampler_adaptive_p, ggml-org/llama.cpp
#17927). A negative target draws from the candidates as they are. Minus-infinity logits stay out.
It runs only where a sampler order names it (`samplers`), as in llama.cpp's chain.
"""

from __future__ import annotations

import mlx.core as mx

WIDTH, PEAK, SHARPNESS = 0.3, 5.0, 10.0


class AdaptiveP:
    def __init__(self, target: float, decay: float):
        self.target = target
        self.decay = min(max(decay, 0.0), 0.99)
        self.weighted_sum = mx.array(target / (1.0 - self.decay), dtype=mx.float32)
        self.total_weight = mx.array(1.0 / (1.0 - self.decay), dtype=mx.float32)

    def reshaped(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(the logits to draw from, the candidates' probabilities before the reshaping)."""
        p = mx.softmax(logits, precise=True)
        if self.target < 0:
            return logits, p
        target = min(max(self.target, 0.0), 1.0)
        adapted = mx.clip(mx.where(self.total_weight == 0, target, 2.0 * target - self.weighted_sum / self.total_weight),
                          0.0, 1.0)
        d = mx.abs((p - adapted) * (1.0 / WIDTH))
        return mx.where(logits == -mx.inf, logits, PEAK - SHARPNESS * d * d / (1.0 + d)), p

    def accept(self, p: mx.array, token: mx.array) -> None:
        """The moving average takes the picked token's probability before the reshaping (lazily)."""
        if self.target < 0:
            return
        self.weighted_sum = p[token] + self.decay * self.weighted_sum
        self.total_weight = 1.0 + self.decay * self.total_weight
