"""Logits -> token: greedy, or temperature sampling after top-n-sigma / top-k / typical-p / top-p /
min-p / XTC filters, or Mirostat.

The order follows llama.cpp's default sampler chain (common/sampling.cpp): the logit bias,
then the penalties (repeat, frequency, presence over the last `repeat_last_n` tokens of the
prompt and the output, as llama-server accepts the prompt's tokens into its sampler), then DRY
(dry.py, on the host), then top-n-sigma, top-k, typical-p, top-p, min-p, XTC, then temperature,
then a draw: the filters see the model's distribution as biased and penalized, and the temperature
only reshapes what survives them. With Mirostat the chain is llama.cpp's for it: the bias, the
temperature, Mirostat (mirostat.py). Each sampler is llama-sampler.cpp's (tests/test_sampling.py,
tests/test_dry.py and tests/test_mirostat.py run them side by side). `temp == 0` is greedy (argmax
of the biased, penalized logits). The sampler accepts its own picks lazily, on the device, so a
decode loop can build the next step before reading a token (DRY and a grammar excepted: `paced`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .adaptive_p import AdaptiveP
from .dry import Dry
from .mirostat import Mirostat


# llama.cpp's sampler chain (common_params_sampling.samplers): its default order, the filters among
# them, and those of them that always keep the best token (moot when the temperature is 0)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
FILTERS = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc")
KEEP_THE_BEST = frozenset({"top_n_sigma", "top_k", "top_p", "min_p"})
# llama.cpp's names (common_sampler_types_from_names: any case, '-' or no '_' for '_', and its aliases)
# and characters (common_sampler_types_from_chars) of the samplers; its `infill` is not served here
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "e": "penalties", "a": "adaptive_p"}
SAMPLER_NAMES = {**{n: n for n in SAMPLER_CHARS.values()}, **{n.replace("_", "-"): n for n in SAMPLER_CHARS.values()},
                 **{n.replace("_", ""): n for n in SAMPLER_CHARS.values()},
                 "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


def samplers_of(value) -> tuple[str, ...]:
    """A sampler order as llama.cpp takes it: a list of names or a string of characters -> the
    canonical names. A name or character it does not know, or `infill`, is a ValueError (llama.cpp
    skips an unknown one with a warning)."""
    if isinstance(value, str):
        out = []
        for c in value:
            if c not in SAMPLER_CHARS:
                raise ValueError(f"sampler character {c!r} is not one of {''.join(SAMPLER_CHARS)}"
                                 + (" (infill is not served)" if c == "i" else ""))
            out.append(SAMPLER_CHARS[c])
        return tuple(out)
    out = []
    for name in value:
        key = name.lower() if isinstance(name, str) else None
        if key not in SAMPLER_NAMES:
            raise ValueError(f"sampler {str(name)[:40]!r} is not one of {', '.join(sorted(set(SAMPLER_NAMES.values())))}"
                             + (" (infill is not served)" if key == "infill" else ""))
        out.append(SAMPLER_NAMES[key])
    return tuple(out)


@dataclass(frozen=True)
class SamplerSettings:
    temp: float = 0.0
    top_k: int = 0      # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    typical_p: float = 1.0    # 1: off (llama.cpp's locally typical sampling)
    top_n_sigma: float = -1.0   # <= 0: off (llama.cpp's: logits within n standard deviations of the best)
    # llama.cpp's XTC: with this probability a pick drops every token of probability >= xtc_threshold but
    # the least likely of them (when two or more are); 0, or a threshold over 0.5: off
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # llama.cpp's dynamic temperature: temp -/+ dynatemp_range, by the candidates' entropy over its
    # largest (normalized, to the power dynatemp_exponent); 0: off
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    seed: int = 0
    # llama.cpp's penalties sampler (llama_sampler_penalties_apply): a token among the last
    # repeat_last_n has its logit divided by repeat_penalty (multiplied where <= 0), then count *
    # frequency_penalty + presence_penalty taken off.
    repeat_penalty: float = 1.0     # 1: off
    repeat_last_n: int = 64         # 0: off
    presence_penalty: float = 0.0   # 0: off
    frequency_penalty: float = 0.0  # 0: off
    logit_bias: tuple = ()          # ((token id, bias), ...), added to the logits first
    # llama.cpp's DRY (dry.py): a token extending a repeat of >= dry_allowed_length tokens among the
    # last dry_penalty_last_n loses dry_multiplier * dry_base^(length - dry_allowed_length); a repeat
    # does not reach back past a sequence breaker. 0 (multiplier or last_n), or a base under 1: off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple = ("\n", ":", "\"", "*")
    # llama.cpp's Mirostat (mirostat.py): 1 or 2 replaces the penalties, DRY and the filters with a pick
    # held at surprise mirostat_tau, learning at rate mirostat_eta; 0: off
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # the chain's order (llama.cpp's samplers: a sampler left out is not applied; `adaptive_p` named
    # anywhere makes the final draw adaptive-p's, adaptive_p.py)
    samplers: tuple = DEFAULT_SAMPLERS
    min_keep: int = 0   # llama.cpp's: typical-p, top-p and min-p keep at least this many tokens, XTC leaves as many
    adaptive_target: float = -1.0   # < 0: adaptive-p draws from the candidates as they are
    adaptive_decay: float = 0.9

    @property
    def penalized(self) -> bool:
        return self.mirostat == 0 and "penalties" in self.samplers and self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    @property
    def dry(self) -> bool:
        return (self.mirostat == 0 and "dry" in self.samplers and self.dry_multiplier != 0.0 and self.dry_base >= 1.0
                and self.dry_penalty_last_n != 0)

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
        if not 0 <= self.typical_p <= 1:
            p.append(f"--typical must be in [0, 1], got {self.typical_p}")
        if not math.isfinite(self.top_n_sigma):
            p.append(f"--top-n-sigma must be finite, got {self.top_n_sigma}")
        if not 0 <= self.xtc_probability <= 1:
            p.append(f"--xtc-probability must be in [0, 1], got {self.xtc_probability}")
        if not 0 <= self.xtc_threshold <= 1:
            p.append(f"--xtc-threshold must be in [0, 1], got {self.xtc_threshold}")
        if not (self.dynatemp_range >= 0 and math.isfinite(self.dynatemp_range)):
            p.append(f"--dynatemp-range must be a finite number >= 0, got {self.dynatemp_range}")
        if not (self.dynatemp_exponent >= 0 and math.isfinite(self.dynatemp_exponent)):
            p.append(f"--dynatemp-exp must be a finite number >= 0, got {self.dynatemp_exponent}")
        if not (self.repeat_penalty > 0 and math.isfinite(self.repeat_penalty)):
            p.append(f"--repeat-penalty must be a finite number > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            p.append(f"--repeat-last-n must be >= 0, got {self.repeat_last_n}")
        for name, v in (("presence", self.presence_penalty), ("frequency", self.frequency_penalty)):
            if not math.isfinite(v):
                p.append(f"--{name}-penalty must be finite, got {v}")
        if not math.isfinite(self.dry_multiplier):
            p.append(f"--dry-multiplier must be finite, got {self.dry_multiplier}")
        if not math.isfinite(self.dry_base):
            p.append(f"--dry-base must be finite, got {self.dry_base}")
        if self.dry_allowed_length < 0:
            p.append(f"--dry-allowed-length must be >= 0, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < 0:
            p.append(f"--dry-penalty-last-n must be >= 0, got {self.dry_penalty_last_n}")
        if self.mirostat not in (0, 1, 2):
            p.append(f"--mirostat must be 0, 1 or 2, got {self.mirostat}")
        for name, v in (("--mirostat-ent", self.mirostat_tau), ("--mirostat-lr", self.mirostat_eta)):
            if not math.isfinite(v):
                p.append(f"{name} must be finite, got {v}")
        if self.min_keep < 0:
            p.append(f"--min-keep must be >= 0, got {self.min_keep}")
        unknown = [n for n in self.samplers if n not in SAMPLER_CHARS.values()]
        if unknown:
            p.append(f"--samplers: {unknown[0]!r} is not one of {', '.join(sorted(SAMPLER_CHARS.values()))}")
        for name, v in (("--adaptive-target", self.adaptive_target), ("--adaptive-decay", self.adaptive_decay)):
            if not math.isfinite(v):
                p.append(f"{name} must be finite, got {v}")
        if not all(isinstance(b, str) and b for b in self.dry_sequence_breakers):
            p.append("--dry-sequence-breaker: each breaker must be a non-empty text")
        for token, bias in self.logit_bias:
            if token < 0 or math.isnan(bias) or bias == math.inf:
                p.append(f"--logit-bias: token {token} bias {bias}: a token id >= 0 and a bias < +inf (not NaN)")
        return p


def breakers_of_flags(flags: list[str] | None) -> tuple[str, ...]:
    """--dry-sequence-breaker's texts as llama.cpp takes them: the defaults when none is given, else
    the texts given ('none' clearing those before it)."""
    if flags is None:
        return SamplerSettings.dry_sequence_breakers
    out: list[str] = []
    for text in flags:
        out = [] if text == "none" else out + [text]
    return tuple(out)


def add_samplers_flags(p) -> None:
    """llama.cpp's --samplers (names separated by ';') and --sampling-seq (characters) on a parser."""
    order = p.add_mutually_exclusive_group()
    order.add_argument("--samplers", metavar="NAMES",
                       help="the sampler chain's order, names separated by ';' (llama.cpp's; default "
                            + ";".join(DEFAULT_SAMPLERS) + "); a sampler left out is not applied")
    order.add_argument("--sampling-seq", "--sampler-seq", metavar="CHARS",
                       help="the same order as characters (llama.cpp's; default "
                            + "".join(c for n in DEFAULT_SAMPLERS for c, m in SAMPLER_CHARS.items() if m == n) + ")")


def samplers_flags(args) -> tuple[str, ...] | None:
    """The order add_samplers_flags' flags give, or None; MuseError names a sampler it does not know."""
    from .errors import MuseError

    try:
        if getattr(args, "samplers", None) is not None:
            return samplers_of([n for n in args.samplers.split(";") if n])
        if getattr(args, "sampling_seq", None) is not None:
            return samplers_of(args.sampling_seq)
    except ValueError as exc:
        raise MuseError(f"--samplers: {exc}") from None
    return None


class Sampler:
    def __init__(self, settings: SamplerSettings, history=(), suppress=(), constraint=None, breakers=None):
        """history: the prompt's token ids, which the penalties look back over as over the output;
        suppress: the model's tokens never to pick (its GGUF's suppress list: llama.cpp's common
        sampler adds them to the logit bias as minus infinity); constraint: a grammar the output
        follows (grammar.Constraint): each pick is made among the tokens it allows; breakers: DRY's
        sequence breakers as tokens (MuseTokenizer.dry_breakers; None: none). With a grammar or DRY
        the sampler is `paced`: a loop must `read` each token before it builds the next pick (the
        mask and the DRY penalty follow the tokens so far)."""
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.settings = settings
        self._dry = (Dry(settings.dry_multiplier, settings.dry_base, settings.dry_allowed_length,
                         settings.dry_penalty_last_n, breakers or {}, history) if settings.dry else None)
        self._mirostat = (Mirostat(settings.mirostat, settings.mirostat_tau, settings.mirostat_eta)
                          if settings.mirostat else None)
        self._adaptive = (AdaptiveP(settings.adaptive_target, settings.adaptive_decay)
                          if "adaptive_p" in settings.samplers and not settings.mirostat else None)
        self._key = mx.random.key(settings.seed % 2**64)   # any integer: taken modulo 2^64
        self._n = len(history) if settings.penalized else 0   # tokens accepted: the prompt's, then every pick
        self._window = np.asarray(history[-settings.repeat_last_n:] if self._n else [], dtype=np.int64)
        self._suppress = tuple(suppress)
        self.constraint = constraint
        self._bias = self._counts = self._ring = None   # made at the first logits (their size is the vocabulary's)
        # the logits the last pick drew from (llama-server's post-sampling probabilities); None: a greedy
        # pick, where only the picked token was left
        self.drawn: mx.array | None = None
        self._started = False

    def _start(self, n_vocab: int) -> None:
        """The bias as one (V,) array; the penalties' window: each token's count over the last
        repeat_last_n tokens (V,) float32, and those tokens in a ring."""
        s = self.settings
        if s.logit_bias or self._suppress:
            bias = np.zeros(n_vocab, dtype=np.float32)
            for token, b in s.logit_bias + tuple((t, -np.inf) for t in self._suppress):
                if token >= n_vocab:
                    raise ValueError(f"--logit-bias: token {token} is not in the vocabulary of {n_vocab}")
                bias[token] += np.float32(b)
            self._bias = mx.array(bias)
        if s.penalized:
            last = self._window   # the prompt's last repeat_last_n tokens: positions n - len(last) .. n - 1
            if last.size and not (0 <= last.min() and last.max() < n_vocab):
                raise ValueError(f"a prompt token is not in the vocabulary of {n_vocab}")
            self._counts = mx.array(np.bincount(last, minlength=n_vocab).astype(np.float32))
            ring = np.zeros(s.repeat_last_n, dtype=np.int32)
            ring[np.arange(self._n - last.size, self._n) % s.repeat_last_n] = last
            self._ring = mx.array(ring)
        self._window = None
        self._started = True

    @property
    def paced(self) -> bool:
        """Whether a pick needs the token before it read on the host (a grammar, DRY)."""
        return self.constraint is not None or self._dry is not None

    def process(self, logits: mx.array) -> mx.array:
        """The logit bias, then the penalties, then DRY (llama.cpp's order and arithmetic), lazily.
        (V,) float32."""
        return self._dry_step(self._penalties(self._biased(logits)))

    def _biased(self, logits: mx.array) -> mx.array:
        if not self._started:
            self._start(logits.shape[-1])
        return logits if self._bias is None else logits + self._bias

    def _penalties(self, logits: mx.array) -> mx.array:
        if self._counts is None:
            return logits
        s = self.settings
        seen = self._counts > 0
        if s.repeat_penalty != 1.0:
            logits = mx.where(seen, mx.where(logits <= 0, logits * s.repeat_penalty, logits / s.repeat_penalty), logits)
        if s.frequency_penalty != 0.0 or s.presence_penalty != 0.0:
            logits = logits - mx.where(seen, self._counts * s.frequency_penalty + s.presence_penalty, 0.0)
        return logits

    def _dry_step(self, logits: mx.array) -> mx.array:
        dry = self._dry.penalties() if self._dry is not None else None
        if dry is None:
            return logits
        ids, values = dry
        return logits.at[mx.array(ids)].add(mx.array(-values))

    def _accept(self, token: mx.array) -> None:
        """The picked token (a lazy 0-d array) into the penalties' window."""
        if self._counts is None:
            return
        n = self.settings.repeat_last_n
        token = token.reshape(1).astype(mx.int32)
        i = self._n % n
        if self._n >= n:   # the oldest leaves the window
            self._counts = self._counts.at[self._ring[i:i + 1]].add(-1.0)
        self._counts = self._counts.at[token].add(1.0)
        self._ring[i:i + 1] = token
        self._n += 1

    @property
    def xtc(self) -> bool:
        s = self.settings
        return s.xtc_probability > 0 and s.xtc_threshold <= 0.5 and "xtc" in s.samplers

    def filter(self, logits: mx.array, xtc_draw: mx.array | None = None) -> mx.array:
        """Mask (to -inf) the tokens the top-n-sigma / top-k / typical-p / top-p / min-p / XTC filters
        drop, in llama.cpp's order and by its rules (llama-sampler.cpp). logits: (V,) float32;
        xtc_draw: XTC's uniform draw in [0, 1) (it applies where the draw <= xtc_probability; None:
        it applies)."""
        return self._filter(logits, xtc_draw)[0]

    def _filter(self, logits: mx.array, xtc_draw: mx.array | None = None) -> tuple[mx.array, mx.array | int]:
        """filter's logits, and how many candidates llama.cpp's list would then hold (_step)."""
        size = logits.shape[-1]
        for name in FILTERS:
            logits, size = self._step(name, logits, size, xtc_draw)
        return logits, size

    def _step(self, name: str, logits: mx.array, size, xtc_draw: mx.array | None = None) -> tuple[mx.array, object]:
        """One filter of llama.cpp's chain -> (logits, the candidates llama.cpp's list then holds: top-k,
        typical-p, top-p, min-p and XTC take tokens out of it, a bias's ban or top-n-sigma leave them
        in at minus infinity; the size dynamic temperature's largest entropy is of, counted only
        where it is read)."""
        s = self.settings
        neg_inf = mx.array(-float("inf"), dtype=mx.float32)
        count = s.dynatemp_range > 0 or s.min_keep > 0   # (min_keep: top-p and XTC read the list's size)
        if name == "top_n_sigma" and s.top_n_sigma > 0:   # within n standard deviations (of the finite ones) of the best
            valid = logits > neg_inf
            n_valid = mx.sum(valid)
            mean = mx.sum(mx.where(valid, logits, 0.0)) / n_valid
            std = mx.sqrt(mx.sum(mx.where(valid, mx.square(logits - mean), 0.0)) / n_valid)
            logits = mx.where(logits < logits.max() - s.top_n_sigma * std, neg_inf, logits)
        elif name == "top_k" and 0 < s.top_k < logits.shape[-1]:
            kth = mx.sort(logits)[-s.top_k]
            logits = mx.where(logits >= kth, logits, neg_inf)
            size = mx.minimum(size, s.top_k) if count else size
        elif name == "typ_p" and s.typical_p < 1.0:   # the tokens whose surprise is nearest the entropy, up to mass typical_p
            probs = mx.softmax(logits, precise=True)
            logp = mx.log(probs)
            entropy = -mx.sum(mx.where(probs > 0, probs * logp, 0.0))
            shifted = mx.where(probs > 0, mx.abs(-logp - entropy), mx.inf)
            order = mx.argsort(shifted)
            ranked = probs[order]
            n_keep = mx.maximum(mx.sum(mx.cumsum(ranked) - ranked <= s.typical_p), max(1, s.min_keep))   # through the one passing it
            logits = mx.where(shifted <= shifted[order[n_keep - 1]], logits, neg_inf)
            size = n_keep if count else size
        elif name == "top_p" and s.top_p < 1.0:
            ordered = mx.sort(logits)[::-1]
            probs = mx.softmax(ordered, precise=True)
            before = mx.cumsum(probs) - probs          # mass strictly above each token
            n_keep = mx.sum(before < s.top_p)          # >= 1: the first token is always kept
            if s.min_keep > 1:
                n_keep = mx.minimum(mx.maximum(n_keep, s.min_keep), size)
            threshold = ordered[n_keep - 1]
            logits = mx.where(logits >= threshold, logits, neg_inf)
            size = mx.minimum(n_keep, size) if count else size
        elif name == "min_p" and s.min_p > 0.0:   # p >= min_p * p_max, as llama.cpp tests it: in logits
            kept = logits >= logits.max() + float(np.log(np.float32(s.min_p)))
            if s.min_keep > 1:   # fewer kept: the best min_keep instead
                kth = mx.sort(logits)[-min(s.min_keep, logits.shape[-1])]
                kept = mx.where(mx.sum(kept) >= s.min_keep, kept, logits >= kth)
            logits, size = mx.where(kept, logits, neg_inf), mx.sum(kept) if count else size
        elif name == "xtc" and self.xtc:   # the likely tokens but the least likely of them out, when two or more are
            probs = mx.softmax(logits, precise=True)
            likely = probs >= s.xtc_threshold
            least = mx.min(mx.where(likely, probs, mx.inf))
            cut = likely & (probs > least) & (mx.sum(likely) >= 2)
            if s.min_keep > 0:   # only where as many candidates stay (llama.cpp: size - pos_last >= min_keep)
                cut = cut & (size - (mx.sum(likely) - 1) >= s.min_keep)
            if xtc_draw is not None:
                cut = cut & (xtc_draw <= s.xtc_probability)
            logits, size = mx.where(cut, neg_inf, logits), size - mx.sum(cut) if count else size
        return logits, size

    def temperature(self, logits: mx.array, size) -> mx.array:
        """The filtered logits scaled by the temperature: llama.cpp's temp_ext. With a dynamic range the
        temperature is lo + (hi - lo) (H / log size)^exponent, lo = max(0, temp - range), hi = temp +
        range, H the candidates' entropy and size how many they are (llama.cpp's list: _filter); none
        when one candidate is left; at 0 only the best token stays."""
        s = self.settings
        best = mx.arange(logits.shape[-1]) == mx.argmax(logits)
        if s.dynatemp_range <= 0:
            return logits / s.temp if s.temp > 0 else mx.where(best, logits, -mx.inf)
        lo, hi = max(0.0, s.temp - s.dynatemp_range), s.temp + s.dynatemp_range
        probs = mx.softmax(logits, precise=True)
        entropy = -mx.sum(mx.where(probs > 0, probs * mx.log(mx.where(probs > 0, probs, 1.0)), 0.0))
        size = mx.array(size, dtype=mx.float32)
        temp = lo + (hi - lo) * mx.power(entropy / mx.log(size), s.dynatemp_exponent)
        scaled = mx.where(temp > 0, logits / temp, mx.where(best, logits, -mx.inf))
        return mx.where(size <= 1, logits, scaled)

    def token(self, logits: mx.array) -> mx.array:
        """The sampled token as a lazy 0-d array: nothing waits for the logits, so the next
        step can be built on it before it is computed (generate.generate_tokens)."""
        s = self.settings
        logits = self._biased(logits.reshape(-1).astype(mx.float32))
        if self._mirostat is not None:   # llama.cpp's chain for it: the bias, the temperature, Mirostat
            logits = self._masked(logits)
            if s.temp > 0:   # (llama.cpp's plain temperature here: no dynamic range)
                kept = self._mirostat.candidates(logits / s.temp)
            else:
                kept = mx.where(mx.arange(logits.shape[-1]) == mx.argmax(logits), logits, -mx.inf)
            self._key, sub = mx.random.split(self._key)
            token = mx.random.categorical(kept, key=sub)
            self._mirostat.accept(kept, token)
            self.drawn = kept
            self._accept(token)
            return token
        greedy = "temperature" in s.samplers and s.temp == 0 and s.dynatemp_range <= 0 and self._adaptive is None
        order = s.samplers
        if greedy:   # only the best token is left at the temperature: filters that always keep it are moot
            order = order[:order.index("temperature")]   # after the last one that may not (they shape its input)
            drops = {"typ_p"} if s.typical_p < 1.0 else set()   # the filters on that may drop the best token
            drops |= {"xtc"} if self.xtc else set()
            last = max((i for i, n in enumerate(order) if n in drops), default=-1)
            order = order[:last + 1] + tuple(n for n in order[last + 1:] if n not in KEEP_THE_BEST)
        draw = None
        if self.xtc and "xtc" in order:   # XTC's draw, from a split of its own
            self._key, xtc_key = mx.random.split(self._key)
            draw = mx.random.uniform(key=xtc_key)
        logits = self._chain(logits, order, draw)
        if greedy:
            token, self.drawn = mx.argmax(logits), None
        else:
            self._key, sub = mx.random.split(self._key)
            if self._adaptive is not None:
                reshaped, p = self._adaptive.reshaped(logits)
                token = mx.random.categorical(reshaped, key=sub)
                self._adaptive.accept(p, token)
                self.drawn = reshaped
            else:
                token = mx.random.categorical(logits, key=sub)
                self.drawn = logits
        self._accept(token)
        return token

    def chain(self, logits: mx.array, xtc_draw: mx.array | None = None) -> mx.array:
        """The logits (V,) through the bias and the settings' sampler order (the grammar's mask before
        the first filter): what the final draw samples from."""
        return self._chain(self._biased(logits), self.settings.samplers, xtc_draw)

    def _chain(self, logits: mx.array, order: tuple, xtc_draw: mx.array | None) -> mx.array:
        masked, size = False, logits.shape[-1]
        for name in order:
            if name == "penalties":
                logits = self._penalties(logits)
            elif name == "dry":
                logits = self._dry_step(logits)
            else:
                if not masked:
                    logits, masked = self._masked(logits), True
                if name == "temperature":
                    logits = self.temperature(logits, size)
                elif name != "adaptive_p":   # (the final draw's)
                    logits, size = self._step(name, logits, size, xtc_draw)
        return logits if masked else self._masked(logits)

    def _masked(self, logits: mx.array) -> mx.array:
        """The grammar's mask, if any (None from a lazy grammar not yet triggered: no mask)."""
        if self.constraint is None:
            return logits
        allowed = self.constraint.allowed(logits.shape[-1])
        return logits if allowed is None else mx.where(allowed, logits, -mx.inf)

    def __call__(self, logits: mx.array) -> int:
        token = int(self.token(logits).item())
        self.read(token)
        return token

    def read(self, token: int) -> None:
        """The token picked, as read on the host: the grammar and DRY, if any, take it."""
        if self._dry is not None:
            self._dry.read(token)
        if self.constraint is not None:
            self.constraint.read(token)


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
