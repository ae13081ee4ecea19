"""llama.cpp's DRY ("don't repeat yourself") penalty, on the host.

A token that would extend a repeat gets its logit lowered by multiplier * base^(n - allowed_length),
n the length of the longest run of the last tokens that appeared before with that token after it,
when n >= allowed_length (llama-sampler.cpp's llama_sampler_dry, after koboldcpp). A repeat does not
reach back past a sequence breaker: a text (by default a newline, ":", '"' and "*") whose tokens end
the history cuts the runs there, and a token whose own text holds a breaker is never penalized.
Only the last `dry_penalty_last_n` tokens (the prompt's and the output's, as llama-server accepts
both) are looked at.

llama.cpp finds the runs by the Z-algorithm over the window on every pick. Here each window
position keeps the length of the run that ends there and matches the history's end, updated by one
vectorized comparison as each token is read: the same lengths (tests/test_dry.py runs the two side
by side), and O(window) numpy work a token.
"""

from __future__ import annotations

import numpy as np

MAX_BREAKER_BYTES = 40   # llama.cpp truncates a breaker to 40 bytes ...
MAX_TAIL_TOKENS = 20     # ... and the tokens of what follows its head in a token to 20
FLOAT_MAX_LOG = np.float32(88.7228391)   # ~log(FLT_MAX): the exponent's clamp, as llama.cpp computes it
FLOAT32_MAX = float(np.finfo(np.float32).max)


def sequence_breakers(pieces: list[bytes], encode, breakers) -> dict[int, tuple[tuple[int, ...], ...]]:
    """llama.cpp's processed breakers (get_overlapping_token_sequences): for each token whose text
    (`pieces[id]`, control tokens as their text) holds a breaker, an empty tail (the token breaks
    alone); for each token whose text ends with the start of a breaker, the tokens of the breaker's
    rest (`encode`: text -> ids, no special tokens parsed), truncated to MAX_TAIL_TOKENS.
    -> {head token: (tail, ...)}."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for text in breakers:
        s = text.encode("utf-8")[:MAX_BREAKER_BYTES]
        if not s:
            continue
        head = s[:1]
        for token, word in enumerate(pieces):
            if head not in word:   # (most tokens: one scan)
                continue
            tails = out.setdefault(token, [])
            if s in word:
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(head)
            while pos >= 0:
                i = 1
                while i < len(s) and pos + i < len(word) and word[pos + i] == s[i]:
                    i += 1
                if pos + i == len(word):   # the word ends inside the breaker
                    tail = tuple(encode(s[i:].decode("utf-8", "replace"))[:MAX_TAIL_TOKENS])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(head, pos + 1)
    return {t: tuple(tails) for t, tails in out.items() if tails}


def _runs(w: np.ndarray) -> np.ndarray:
    """For each position e of w, the length of the longest run ending at e that also ends w (the
    Z-function of w reversed; w's own end: len(w)). O(len(w)), once a request (the prompt)."""
    r = w[::-1].tolist()
    n = len(r)
    z = [0] * n
    if n:
        z[0] = n
    lt = rt = 0   # the rightmost window [lt, rt) found to match a prefix of r
    for k in range(1, n):
        m = min(rt - k, z[k - lt]) if k < rt else 0
        while k + m < n and r[m] == r[k + m]:
            m += 1
        z[k] = m
        if k + m > rt:
            lt, rt = k, k + m
    return np.array(z[::-1], dtype=np.int64)


class Dry:
    """One sequence's DRY state: the window's tokens, and for each position the length of the run
    ending there that matches the run ending at the last token."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int,
                 breakers: dict[int, tuple[tuple[int, ...], ...]], history=()):
        self.multiplier, self.base = np.float32(multiplier), np.float32(base)
        self.allowed, self.last_n = allowed_length, last_n
        self.breakers = breakers
        self.singles = np.array(sorted(t for t, tails in breakers.items() if () in tails), dtype=np.int64)
        self.heads = np.array(sorted(breakers), dtype=np.int64)
        self.max_exponent = int(FLOAT_MAX_LOG / np.log(self.base)) if self.base > np.float32(1.000001) else 0
        history = np.asarray(history, dtype=np.int64)
        self.tokens = history[max(0, len(history) - last_n):] if last_n else history[:0]
        self.runs = _runs(self.tokens)

    def read(self, token: int) -> None:
        """The next token of the history."""
        ext = np.append(self.tokens, token)
        runs = np.zeros(len(ext), dtype=np.int64)
        same = ext == token
        runs[0] = same[0]
        runs[1:] = np.where(same[1:], self.runs + 1, 0)
        if len(ext) > self.last_n:   # the oldest leaves the window; no run reaches back past its start
            ext, runs = ext[1:], np.minimum(runs[1:], np.arange(1, len(ext)))
        self.tokens, self.runs = ext, runs

    def _rep_limit(self) -> int:
        """How far back a repeat may reach: to the last breaker that ends the history, else the window."""
        w = self.tokens
        n = len(w)
        for at in np.flatnonzero(np.isin(w, self.heads))[::-1]:
            i = n - 1 - int(at)   # the head's distance from the end
            longest = -1
            for tail in self.breakers[int(w[at])]:
                if longest < len(tail) <= i and all(tail[k] == w[at + 1 + k] for k in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return n

    def penalties(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids, what to take off their logits, float32), or None where nothing is penalized."""
        n = len(self.tokens)
        if n <= self.allowed:
            return None
        limit = self._rep_limit()
        if limit < self.allowed:
            return None
        runs = np.minimum(self.runs[:-1], limit)   # each earlier position's run; the token after it would extend it
        keep = runs >= self.allowed
        if not keep.any():
            return None
        following, runs = self.tokens[1:][keep], runs[keep]
        order = np.lexsort((-runs, following))   # by token, the longest run first
        following, runs = following[order], runs[order]
        first = np.ones(len(following), dtype=bool)
        first[1:] = following[1:] != following[:-1]
        ids, longest = following[first], runs[first]
        if self.singles.size:
            breaks = np.isin(ids, self.singles)
            ids, longest = ids[~breaks], longest[~breaks]
        if not ids.size:
            return None
        exponent = longest - self.allowed
        if self.max_exponent > 0:
            exponent = np.minimum(exponent, self.max_exponent)
        # float * std::pow(float, int) is double arithmetic in C++, rounded to float once
        values = (np.float64(self.multiplier) * np.power(np.float64(self.base), exponent.astype(np.float64)))
        # past float32's range llama.cpp's penalty is an infinity (a negative multiplier then makes a
        # logit +inf and its softmax NaN); here it stops at the largest float32
        return ids, np.clip(values, -FLOAT32_MAX, FLOAT32_MAX).astype(np.float32)
