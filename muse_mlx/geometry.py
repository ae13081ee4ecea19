"""The Muse Glimmer geometry: one config object, the pinned values, derived sizes.

Everything the engine needs to know about a model's shape lives in `Geometry`,
which `artifact.py` builds from a GGUF file. `PINNED` is the full released model
(DESIGN.md §1); fixtures scale it down but keep its shape. Derived quantities
(tensor shapes, parameter counts, KV bytes) are computed here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ARCH = "muse-glimmer"

# Post-attention and post-FFN RMSNorm epsilon: a constant of the reference graph
# (`post_norm_eps` in llama.cpp's src/models/muse-glimmer.cpp), not a GGUF key.
POST_NORM_EPS = 1e-8

# K and V are stored as f16: two bytes per element (DESIGN.md §3).
KV_ELEMENT_BYTES = 2

# llama.cpp's default sliding pattern when the file carries none: layer % 4 == 3 is full.
DEFAULT_SWA_PERIOD = 4

# Prefill is processed in chunks of this many positions (seed 000 §22.4).
PREFILL_CHUNK = 512

# ---- ranges the architecture can compute with (issue 19) ---------------------------------
# A file whose numbers fall outside these is refused at load (artifact.py names the key).

# RoPE: frequency i is base^(-2i/rope_dim), i < rope_dim/2. A base >= 1 keeps every frequency
# <= 1 (angles at most the position); below 1 they grow instead, up to about 1/base:
# 1e-45 gives 1e45, past float32's 3.4e38, and the angles become inf, their sin/cos NaN.
ROPE_BASE_MIN = 1.0
# RMSNorm divides by sqrt(mean(x^2) + eps). Below ~1e-12 eps sinks towards float32's
# denormals (which GPUs flush to zero: an all-zero row becomes 0/0); above 1 it is no longer
# an epsilon. Released models use 1e-5 .. 1e-6.
RMS_EPS_RANGE = (1e-12, 1.0)
# Logits are multiplied by logit_scale (released models: 1/16 .. 16); a scale of 0 or below
# makes every token equally likely or inverts the distribution.
LOGIT_SCALE_RANGE = (1e-4, 1e4)
# final_logit_softcapping c: logits -> c * tanh(logits / c); 0 = off (released models: 30, 50).
SOFTCAP_RANGE = (1e-3, 1e6)
# Context: MLX array dimensions are 32-bit integers (a context of 2^32-1 raised OverflowError
# at KV allocation), and we keep one layer's K buffer, (context, n_head_kv * head_dim), under
# 2^31 elements so that no 32-bit element index into it can overflow; and no slot is longer
# than 2^24 positions (128x the pinned 131,072). Whether a context's KV fits the machine's
# memory is asked where it is allocated, not here.
MAX_CONTEXT = 1 << 24
MAX_BUFFER_ELEMENTS = (1 << 31) - 1
# Norm weights multiply a unit-RMS vector, whose elements are at most sqrt(n) in size (all
# of the energy in one element). Released models' norm weights are O(1) to O(100). We allow
# up to 1e4: then the largest products the graph forms from normed activations -- q.k over
# head_dim 128 is at most 128 * (11.3 * 1e4)^2 ~ 1.6e12, and the FFN's gate * up products of
# unit-scale matrices are of the same order -- stay far inside float32's 3.4e38, while a
# weight like 3e38 overflows on its first multiply. K is stored as f16 (max 65,504), so
# attn_k_norm is held to 65,504 / sqrt(head_dim) (5,790 at head_dim 128): then no K element
# can overflow f16 whatever the key vector.
NORM_WEIGHT_MAX = 1e4
F16_MAX = 65_504.0


def max_context(kv_dim: int) -> int:
    """The longest context whose per-layer K/V buffers stay under 2^31 elements (and <= MAX_CONTEXT)."""
    return min(MAX_CONTEXT, MAX_BUFFER_ELEMENTS // max(kv_dim, 1))


def norm_weight_limit(tensor: str, head_dim: int) -> float:
    """The largest |w| allowed in a norm weight (see NORM_WEIGHT_MAX)."""
    if tensor.endswith("attn_k_norm.weight"):
        return min(NORM_WEIGHT_MAX, F16_MAX / head_dim ** 0.5)
    return NORM_WEIGHT_MAX


NORM_TENSORS = (
    "attn_norm",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
    "ffn_norm",
    "post_ffw_norm",
)
MATRIX_TENSORS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_gate",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
LAYER_TENSORS = NORM_TENSORS + MATRIX_TENSORS


def swa_pattern_from_period(n_layer: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern(period)`: layer il is sliding iff il % period < period - 1.

    period 0 means every layer is sliding (llama.cpp's convention).
    """
    if period == 0:
        return (True,) * n_layer
    return tuple(il % period < period - 1 for il in range(n_layer))


@dataclass(frozen=True)
class Geometry:
    """A muse-glimmer model's shape and numerics, as read from its GGUF."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    sliding_window: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    logit_scale: float
    final_logit_softcap: float | None = None
    rope_dim: int | None = None  # rotated dims on sliding layers; None = head_dim
    swa_layers: tuple[bool, ...] = field(default=())  # per layer: True = sliding

    def __post_init__(self) -> None:
        if not self.swa_layers:
            object.__setattr__(
                self, "swa_layers", swa_pattern_from_period(self.n_layer, DEFAULT_SWA_PERIOD)
            )
        if self.rope_dim is None:
            object.__setattr__(self, "rope_dim", self.head_dim)
        problems = self.inconsistencies()
        if problems:
            raise ValueError("inconsistent geometry: " + "; ".join(problems))

    def inconsistencies(self) -> list[str]:
        p = []
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab",
                     "sliding_window", "context_length"):
            if getattr(self, name) <= 0:
                p.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head_kv > 0 and self.n_head % self.n_head_kv:
            p.append(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if len(self.swa_layers) != self.n_layer:
            p.append(f"sliding pattern has {len(self.swa_layers)} entries for {self.n_layer} layers")
        if self.rope_dim is not None and (self.rope_dim <= 0 or self.rope_dim > self.head_dim
                                          or self.rope_dim % 2):
            p.append(f"rope_dim {self.rope_dim} must be even and in 1..head_dim={self.head_dim}")
        if not RMS_EPS_RANGE[0] <= self.rms_eps <= RMS_EPS_RANGE[1]:
            p.append(f"rms_eps must be in [{RMS_EPS_RANGE[0]:g}, {RMS_EPS_RANGE[1]:g}], got {self.rms_eps}")
        for name in ("rope_base", "rope_base_swa"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= ROPE_BASE_MIN):
                p.append(f"{name} must be finite and >= {ROPE_BASE_MIN:g}, got {value}")
        if not LOGIT_SCALE_RANGE[0] <= self.logit_scale <= LOGIT_SCALE_RANGE[1]:
            p.append(f"logit_scale must be in [{LOGIT_SCALE_RANGE[0]:g}, {LOGIT_SCALE_RANGE[1]:g}], "
                     f"got {self.logit_scale}")
        if self.final_logit_softcap is not None and \
                not SOFTCAP_RANGE[0] <= self.final_logit_softcap <= SOFTCAP_RANGE[1]:
            p.append(f"final_logit_softcap must be in [{SOFTCAP_RANGE[0]:g}, {SOFTCAP_RANGE[1]:g}] or absent, "
                     f"got {self.final_logit_softcap}")
        if self.context_length > 0 and self.n_head_kv > 0 and self.head_dim > 0 \
                and self.context_length > max_context(self.kv_dim):
            p.append(f"context_length {self.context_length:,} exceeds {max_context(self.kv_dim):,} "
                     f"(a slot's f16 K/V would need {self.slot_kv_bytes(self.context_length):,} bytes)")
        return p

    # ---- derived shape -------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head; query head h reads KV head h // gqa_group."""
        return self.n_head // self.n_head_kv

    @property
    def n_swa(self) -> int:
        return sum(self.swa_layers)

    @property
    def n_full(self) -> int:
        return self.n_layer - self.n_swa

    def is_swa(self, layer: int) -> bool:
        return self.swa_layers[layer]

    def with_(self, **changes) -> "Geometry":
        """A copy with some fields changed (and the sliding pattern re-derived if n_layer moves)."""
        if "n_layer" in changes and "swa_layers" not in changes:
            changes["swa_layers"] = swa_pattern_from_period(changes["n_layer"], DEFAULT_SWA_PERIOD)
        return replace(self, **changes)

    # ---- tensors -------------------------------------------------------------------
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the contract requires, in GGUF `ne` order (row length first)."""
        d, q, kv, ff, hd = self.n_embd, self.q_dim, self.kv_dim, self.n_ff, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (d, self.n_vocab),
            "output_norm.weight": (d,),
            "output.weight": (d, self.n_vocab),
        }
        per_layer = {
            "attn_norm": (d,),
            "attn_q": (d, q),
            "attn_k": (d, kv),
            "attn_v": (d, kv),
            "attn_gate": (d, q),
            "attn_q_norm": (hd,),
            "attn_k_norm": (hd,),
            "attn_output": (q, d),
            "post_attention_norm": (d,),
            "ffn_norm": (d,),
            "ffn_gate": (d, ff),
            "ffn_up": (d, ff),
            "ffn_down": (ff, d),
            "post_ffw_norm": (d,),
        }
        for il in range(self.n_layer):
            for name, shape in per_layer.items():
                shapes[f"blk.{il}.{name}.weight"] = shape
        return shapes

    @property
    def n_params(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @property
    def n_matmul_params(self) -> int:
        """Parameters that take part in a matrix-vector product per token (not the embedding gather)."""
        per_layer = 2 * self.n_embd * self.q_dim + 2 * self.n_embd * self.kv_dim \
            + self.q_dim * self.n_embd + 3 * self.n_embd * self.n_ff
        return self.n_layer * per_layer + self.n_embd * self.n_vocab

    # ---- KV cache ------------------------------------------------------------------
    @property
    def kv_row_bytes(self) -> int:
        """Bytes one token occupies in one layer: K + V, f16."""
        return 2 * self.kv_dim * KV_ELEMENT_BYTES

    def ring_rows(self, context: int) -> int:
        return min(context, self.sliding_window)

    def slot_kv_bytes(self, context: int) -> int:
        """(n_swa * min(C, W) + n_full * C) * kv_row_bytes (DESIGN.md §3)."""
        return (self.n_swa * self.ring_rows(context) + self.n_full * context) * self.kv_row_bytes


# The full released model (DESIGN.md §1). Shape fields are pinned; the numerics
# (eps, RoPE bases, logit scale, softcap) are always read from the file, and the
# values here only serve synthetic full-geometry files.
PINNED = Geometry(
    n_layer=52,
    n_embd=6_656,
    n_head=32,
    n_head_kv=2,
    head_dim=128,
    n_ff=19_968,
    n_vocab=202_048,
    sliding_window=2_048,
    context_length=131_072,
    rms_eps=1e-6,
    rope_base=1_000_000.0,
    rope_base_swa=10_000.0,
    logit_scale=1.0,
    final_logit_softcap=30.0,
)

PINNED_SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab",
                       "sliding_window", "context_length", "swa_layers")
