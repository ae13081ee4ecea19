"""The synthetic fixtures' vocabulary: byte-level BPE in the GPT-2 style.

Ids 0..255 are the 256 byte tokens (GPT-2's printable byte-to-unicode mapping),
then merges learned deterministically from a small embedded corpus, then the
special tokens, then reserved control tokens to fill any requested size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from ..tokenizer import byte_to_unicode

SPECIAL_TOKENS = ("<|bos|>", "<|eot|>", "<|eom|>", "<|start|>", "<|message|>")
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3


@dataclass(frozen=True)
class FixtureVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def _corpus_words() -> Counter:
    from tokenizers import pre_tokenizers

    text = resources.files("muse_mlx").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str(text)
    return Counter(word for word, _ in split)


@lru_cache(maxsize=8)
def learn_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    """Greedy byte-level BPE on the embedded corpus; ties go to the lexically smallest pair."""
    words = {tuple(w): c for w, c in _corpus_words().items()}
    merges = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = best[0]
        merges.append((a, b))
        merged = {}
        for symbols, count in words.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    return tuple(merges)


def build_vocab(n_vocab: int, max_merges: int = 1024) -> FixtureVocab:
    """A vocabulary of exactly `n_vocab` tokens (at least 256 bytes + the specials)."""
    floor = 256 + len(SPECIAL_TOKENS)
    if n_vocab < floor:
        raise ValueError(f"a fixture vocabulary needs at least {floor} tokens, got {n_vocab}")
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = list(learn_merges(min(max_merges, n_vocab - floor)))
    for a, b in merges:  # a merge can rebuild an existing string; it adds no second token
        if a + b not in tokens:
            tokens.append(a + b)
    types = [TOKEN_TYPE_NORMAL] * len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    n_reserved = n_vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(n_reserved)]
    types += [TOKEN_TYPE_CONTROL] * n_reserved
    return FixtureVocab(tokens, types, [f"{a} {b}" for a, b in merges])
