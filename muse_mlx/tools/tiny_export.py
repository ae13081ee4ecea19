"""The trained tiny model's weights -> GGUF files (docs/tiny-model.md).

F16 (matrices float16, norms float32) is written by gguf-py from the training run's shards
(tools/tiny_train.py) and the tokenizer (tools/tiny_data.py); Q8_0 and Q4_K_M come from it
through the pinned llama.cpp's own quantizer (tools/llamacpp.quantize, the parity extra).

    python -m muse_mlx.tools.tiny_export WEIGHTS_DIR TOKENIZER_JSON OUTDIR [--quantize Q8_0,Q4_K_M]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer

from .. import cli
from ..cli import Parser
from ..errors import MuseError
from .fixture_vocab import FixtureVocab
from .fixtures import encode, uniform_types, write_gguf
from .tiny_data import vocabulary
from .tiny_train import load_weights

NAME = "muse-glimmer tiny (trained on the Python 3.11 documentation)"


def write_f16(weights_dir, tokenizer_json, path, weight_type: QT = QT.F16) -> Path:
    """The F16 GGUF (or, with weight_type F32, the same float16 values widened: the base parity's
    --derive-lanes takes)."""
    g, tensors = load_weights(sorted(Path(weights_dir).glob("weights-*.safetensors")))
    tokens, types, merges = vocabulary(Tokenizer.from_file(str(tokenizer_json)))
    if len(tokens) != g.n_vocab:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, the weights {g.n_vocab}")
    shapes = g.tensor_shapes()
    missing = set(shapes) ^ set(tensors)
    if missing:
        raise ValueError(f"the weights and the geometry disagree on {sorted(missing)}")

    def producer(name, shape, qtype):
        values = tensors[name]
        expect = tuple(reversed(shape)) if len(shape) == 2 else shape
        if values.shape != expect:
            raise ValueError(f"{name}: {values.shape}, expected {expect}")
        return encode(values, qtype)

    return write_gguf(path, g, uniform_types(g, weight_type), producer, NAME, FixtureVocab(tokens, types, merges))


def _command(argv=None) -> int:
    ap = Parser(prog="python -m muse_mlx.tools.tiny_export", description=__doc__.splitlines()[0])
    ap.add_argument("weights", type=Path)
    ap.add_argument("tokenizer", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--quantize", default="Q8_0,Q4_K_M")
    ap.add_argument("--f32", action="store_true", help="also write the F32 file (parity's --derive-lanes base)")
    args = ap.parse_args(argv)
    if not sorted(args.weights.glob("weights-*.safetensors")):
        raise MuseError(f"{args.weights}: no weights-*.safetensors (tools/tiny_train.py writes them)")
    if not args.tokenizer.is_file():
        raise MuseError(f"{args.tokenizer}: no such tokenizer file")
    f16 = write_f16(args.weights, args.tokenizer, args.out / "muse-glimmer-tiny-f16.gguf")
    print(f16, f16.stat().st_size)
    if args.f32:
        f32 = write_f16(args.weights, args.tokenizer, args.out / "muse-glimmer-tiny-f32.gguf", QT.F32)
        print(f32, f32.stat().st_size)
    if args.quantize:
        from .llamacpp import quantize

        for ftype in args.quantize.split(","):
            dst = quantize(f16, args.out / f"muse-glimmer-tiny-{ftype.lower()}.gguf", ftype)
            print(dst, dst.stat().st_size)
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
