"""The tiny model's tokenizer and token streams (docs/tiny-model.md).

A byte-level BPE of `VOCAB_SIZE` tokens is learned with `tokenizers` from the training split of
the corpus (tools/corpus.py), with exactly the pipeline the engine and llama.cpp's "gpt-2"
pre-tokenizer run (muse_mlx/tokenizer.py): split by GPT-2's regex, bytes to GPT-2's printable
characters, merges by rank. The special tokens are the fixtures' (tools/fixture_vocab.py), so
the fixtures' chat template serves this model too. Each page becomes `<|bos|> text <|eot|>`
and the pages are concatenated into one stream of uint16 ids per split.

    python -m muse_mlx.tools.tiny_data CORPUS_DIR OUTDIR   # -> tokenizer.json, train.npy, heldout.npy
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ..tokenizer import PRE_TOKENIZERS
from .corpus import documents
from .fixture_vocab import SPECIAL_TOKENS

VOCAB_SIZE = 4096
MIN_FREQUENCY = 2


def pre_tokenizer():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS["gpt-2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def vocabulary(tok: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """-> (tokens by id, GGUF token types, merges as 'a b') for tokenizer.ggml.*."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    if any(t is None for t in tokens):
        raise ValueError("the tokenizer's ids are not dense")
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """<|bos|> page <|eot|> for each page, concatenated -> uint16 ids."""
    bos, eot = tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1])
    out = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        out += [bos, *enc.ids, eot]
    return np.asarray(out, dtype=np.uint16)


def build(corpus_dir, out) -> dict:
    corpus_dir, out = Path(corpus_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = documents((corpus_dir / "train.txt").read_text(encoding="utf-8"))
    held = documents((corpus_dir / "heldout.txt").read_text(encoding="utf-8"))
    tok = train_tokenizer(train)
    tok.save(str(out / "tokenizer.json"))
    counts = {}
    for split, docs in (("train", train), ("heldout", held)):
        ids = stream(tok, docs)
        np.save(out / f"{split}.npy", ids)
        counts[split] = int(ids.size)
    return counts


def _command(argv=None) -> int:
    from ..cli import Parser
    from ..errors import MuseError

    ap = Parser(prog="python -m muse_mlx.tools.tiny_data", description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="tools/corpus.py's output folder")
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    for name in ("train.txt", "heldout.txt"):
        if not (args.corpus / name).is_file():
            raise MuseError(f"{args.corpus / name} is missing: make it with python -m muse_mlx.tools.corpus")
    counts = build(args.corpus, args.out)
    print(f"{counts['train']:,} training tokens, {counts['heldout']:,} held out; {args.out / 'tokenizer.json'}")
    return 0


if __name__ == "__main__":
    from .. import cli

    raise SystemExit(cli.run(_command))
