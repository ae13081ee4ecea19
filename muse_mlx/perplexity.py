"""`python -m muse_mlx.perplexity`: perplexity and mean NLL over a text file, as llama-perplexity scores it.

    python -m muse_mlx.perplexity --model X.gguf -f text.txt [-c 512] [--chunks N] [--receipt out.json]
    python -m muse_mlx.perplexity --model B.gguf -f text.txt --kl-divergence A.gguf   # B against the base A

The text is tokenized once (with the model's BOS, if it adds one) and cut into chunks of
`--ctx-size` tokens; each chunk is a fresh sequence whose first token is BOS when the model
adds one; the second half of each chunk is scored (each token predicted from the tokens before
it in its chunk), the first half being context. With `--stride S` the chunks start every S
tokens and only their last S tokens are scored. PPL = exp(mean NLL); the error is the standard
error of the mean NLL carried through the exponential. `--kl-divergence BASE` also runs the base
model on the same chunks and reports KL(base || model), its maximum, the top-1 agreement and
both perplexities. Every run writes its numbers to stdout and, with --receipt, a receipt.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from . import cli
from .cli import Parser
from .errors import MuseError


def chunks(n_tokens: int, ctx: int, stride: int | None) -> list[tuple[int, int, int]]:
    """(start, end, first scored position within the chunk) of every chunk."""
    if stride is None:
        return [(s, s + ctx, ctx // 2) for s in range(0, n_tokens - ctx + 1, ctx)]
    return [(s, s + ctx, ctx - stride) for s in range(0, n_tokens - ctx + 1, stride)]


def chunk_logprobs(model, tokens: list[int], bos: int | None, progress=None) -> np.ndarray:
    """log-softmax of the model's logits at every position of one chunk (its first token BOS if given)."""
    from .sampling import log_softmax

    ids = list(tokens)
    if bos is not None:
        ids[0] = bos
    cache = model.make_cache(len(ids))
    return log_softmax(np.array(model.prefill(ids, cache, all_logits=True)))


def evaluate(model, tokens: list[int], ctx: int, stride: int | None, max_chunks: int | None, bos: int | None,
             base=None, progress=None, keep: bool = False) -> dict:
    """NLL of every scored token (and, with a base model, KL(base || model) at each)."""
    spans = chunks(len(tokens), ctx, stride)[:max_chunks]
    if not spans:
        raise MuseError(f"the text is {len(tokens):,} tokens, fewer than one chunk of {ctx:,}")
    nll, kl, agree, base_nll, running = [], [], [], [], []
    for i, (s, e, first) in enumerate(spans):
        lp = chunk_logprobs(model, tokens[s:e], bos)
        targets = np.array(tokens[s + first + 1:e])
        rows = lp[first:e - s - 1]
        nll += list(-rows[np.arange(len(targets)), targets])
        if base is not None:
            blp = chunk_logprobs(base, tokens[s:e], bos)[first:e - s - 1]
            kl += list((np.exp(blp) * (blp - rows)).sum(axis=-1))
            agree += list(blp.argmax(-1) == rows.argmax(-1))
            base_nll += list(-blp[np.arange(len(targets)), targets])
        running.append(math.exp(float(np.mean(nll))))
        if progress is not None:
            progress(i + 1, len(spans))
    out = {"chunks": len(spans), "scored": len(nll), **summary(np.array(nll)), "running_ppl": running}
    if base is not None:
        kl_a = np.array(kl)
        out["kl_divergence"] = {"mean": float(kl_a.mean()), "max": float(kl_a.max()),
                                "se": float(kl_a.std(ddof=1) / math.sqrt(len(kl_a))) if len(kl_a) > 1 else 0.0,
                                "top1_agreement": float(np.mean(agree)), "base": summary(np.array(base_nll))}
    if keep:
        out["nll"] = [float(v) for v in nll]
    return out


def summary(nll: np.ndarray) -> dict:
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return {"mean_nll": mean, "nll_se": se, "ppl": math.exp(mean), "ppl_se": math.exp(mean) * se}


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.perplexity", description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", required=True, help="a muse-glimmer GGUF")
    p.add_argument("--text", "-f", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx-size", "-c", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--stride", type=int, help="chunks every STRIDE tokens, scoring their last STRIDE (llama's "
                                              "--ppl-stride); default: non-overlapping, the second half scored")
    p.add_argument("--chunks", type=int, help="score at most this many chunks")
    p.add_argument("--kl-divergence", metavar="BASE", help="also run BASE (another lane of the same model) and "
                                                         "report KL(BASE || model)")
    p.add_argument("--reference", action="store_true", help="the MLX-ops reference backend even on a GPU")
    p.add_argument("--receipt", help="write a receipt JSON here")
    args = p.parse_args(argv)
    if args.ctx_size < 2:
        raise MuseError(f"--ctx-size must be >= 2, got {args.ctx_size}")
    if args.stride is not None and not 1 <= args.stride < args.ctx_size:
        raise MuseError(f"--stride must be 1..{args.ctx_size - 1}, got {args.stride}")
    if args.chunks is not None and args.chunks < 1:
        raise MuseError(f"--chunks must be >= 1, got {args.chunks}")
    from .tools.receipts import check_output, make_receipt, write_receipt

    if args.receipt:
        check_output(args.receipt, "--receipt", suffix=".json")
    try:
        text = Path(args.text).read_bytes().decode("utf-8")
    except OSError as exc:
        raise MuseError(f"--text {args.text}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise MuseError(f"--text {args.text}: not UTF-8 (byte {exc.start})") from None
    from .generate import progress_bar
    from .model import load
    from .tokenizer import MuseTokenizer

    backend = "reference" if args.reference else "auto"
    model = load(args.model, backend=backend)
    if args.ctx_size > model.geometry.context_length:
        raise MuseError(f"--ctx-size {args.ctx_size} exceeds the model's {model.geometry.context_length} positions")
    tok = MuseTokenizer(model.artifact.vocabulary)
    tokens = tok.encode(text)
    base = load(args.kl_divergence, backend=backend) if args.kl_divergence else None
    if base is not None and base.geometry.n_vocab != model.geometry.n_vocab:
        raise MuseError(f"--kl-divergence {args.kl_divergence}: another vocabulary ({base.geometry.n_vocab} tokens)")
    bos = tok.bos_id if tokens and tok.bos_id is not None and tokens[0] == tok.bos_id else None
    r = evaluate(model, tokens, args.ctx_size, args.stride, args.chunks, bos, base, progress_bar("chunks", "chunk"))
    print(" ".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(r["running_ppl"])))
    print(f"Final estimate: PPL = {r['ppl']:.4f} +/- {r['ppl_se']:.5f}  (mean NLL {r['mean_nll']:.6f} over "
          f"{r['scored']:,} tokens in {r['chunks']} chunks of {args.ctx_size})")
    if base is not None:
        k = r["kl_divergence"]
        print(f"KL({Path(args.kl_divergence).name} || {Path(args.model).name}): mean {k['mean']:.6f} +/- {k['se']:.6f}, "
              f"max {k['max']:.6f}; top-1 agreement {k['top1_agreement']:.4f}; base PPL {k['base']['ppl']:.4f}")
    if args.receipt:
        rec = make_receipt("perplexity", inputs={"model": args.model, "text": args.text, "ctx_size": args.ctx_size,
                                                 "stride": args.stride, "chunks": args.chunks,
                                                 "kl_divergence": args.kl_divergence, "tokens": len(tokens)},
                           metrics=r)
        print(f"receipt: {write_receipt(args.receipt, rec)}")
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
