"""`python -m muse_mlx.tools.envelope`: the bandwidth envelope of one decoded token (seed 002, ch. 1).

From the tensor table the engine loads: the parameter count, bytes on disk and
bits per parameter, the bytes one decode step must stream (weights read once,
embedding rows gathered, plus the KV read at a given depth), FLOPs per token and
arithmetic intensity; and, given a measured tok/s (or a benchmark receipt), the
effective bandwidth it implies. Effective bandwidth is a derivation from a
throughput, not a measurement of the memory system, and is printed as such.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from .anchors import PINNED_ARTIFACT_BYTES
from ..errors import MuseError
from .. import cli
from ..cli import Parser
from ..geometry import PINNED, Geometry
from ..quant import row_bytes

TOKEN_EMBD = "token_embd.weight"


@dataclass(frozen=True)
class Envelope:
    n_params: int
    n_matmul_params: int
    file_bytes: int
    file_bytes_source: str
    tensor_bytes: int
    embedding_bytes: int
    embedding_row_bytes: int
    depth: int
    kv_read_bytes: int
    kv_write_bytes: int

    @property
    def bits_per_param(self) -> float:
        return self.file_bytes * 8 / self.n_params

    @property
    def weight_stream_bytes(self) -> int:
        """Every weight tensor read once, except the embedding: only the token's row is gathered."""
        return self.tensor_bytes - self.embedding_bytes + self.embedding_row_bytes

    @property
    def token_bytes(self) -> int:
        return self.weight_stream_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def matmul_flops(self) -> int:
        return 2 * self.n_matmul_params


def tensor_bytes(g: Geometry, types: dict[str, QT]) -> dict[str, int]:
    out = {}
    for name, shape in g.tensor_shapes().items():
        rows = 1
        for s in shape[1:]:
            rows *= s
        out[name] = rows * row_bytes(types[name], shape[0])
    return out


def attention_flops(g: Geometry, depth: int) -> int:
    """QK^T and PV for one query over the keys it sees at `depth` (2 FLOPs per multiply-add)."""
    keys = g.n_swa * min(depth + 1, g.sliding_window) + g.n_full * (depth + 1)
    return 2 * 2 * g.n_head * g.head_dim * keys


def envelope(g: Geometry, types: dict[str, QT], file_bytes: int, file_bytes_source: str, depth: int) -> Envelope:
    sizes = tensor_bytes(g, types)
    return Envelope(
        n_params=g.n_params, n_matmul_params=g.n_matmul_params,
        file_bytes=file_bytes, file_bytes_source=file_bytes_source,
        tensor_bytes=sum(sizes.values()), embedding_bytes=sizes[TOKEN_EMBD],
        embedding_row_bytes=row_bytes(types[TOKEN_EMBD], g.n_embd),
        depth=depth,
        kv_read_bytes=(g.n_swa * min(depth, g.sliding_window) + g.n_full * depth) * g.kv_row_bytes,
        kv_write_bytes=g.n_layer * g.kv_row_bytes,
    )


def effective_gbps(bytes_per_token: int, tok_s: float) -> float:
    return bytes_per_token * tok_s / 1e9


MAX_FILE_BYTES = 2**63 - 1  # what a file size (off_t) can be


def finite_positive(text: str) -> float:
    """argparse type: a finite number > 0 (not inf, not nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def tok_s_from_receipt(path) -> float:
    """metrics.decode_tok_s (a number, or {"mean": number}) of a bench receipt; one MuseError naming
    the file and what was wrong when it is not there or not a finite positive number."""
    from .receipts import json_kind, read_json

    where = f"--bench-receipt {path}"
    data = read_json(path, "--bench-receipt")
    if not isinstance(data, dict):
        raise MuseError(f"{where}: expected a JSON object (a bench receipt), found {json_kind(data)}")
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        raise MuseError(f"{where}: no metrics object (metrics is {json_kind(metrics)})" if "metrics" in data
                        else f"{where}: no metrics.decode_tok_s (no metrics object)")
    if "decode_tok_s" not in metrics:
        raise MuseError(f"{where}: no metrics.decode_tok_s")
    name, value = "metrics.decode_tok_s", metrics["decode_tok_s"]
    if isinstance(value, dict):
        if "mean" not in value:
            raise MuseError(f"{where}: metrics.decode_tok_s is an object without a mean")
        name, value = "metrics.decode_tok_s.mean", value["mean"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MuseError(f"{where}: {name} is {json_kind(value)}, not a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise MuseError(f"{where}: {name} = {value!r}, not a finite number > 0")
    return number


def check_derivable(e: Envelope, tok_s: float | None, ceiling: float | None) -> None:
    """Refuse inputs whose derived numbers would overflow to inf or 0 (e.g. --tok-s 1e300)."""
    values = {"bits per parameter": e.bits_per_param, "FLOP/B over the file": e.matmul_flops / e.file_bytes}
    if tok_s is not None:
        values.update({"token time": 1e3 / tok_s, "effective GB/s": effective_gbps(e.token_bytes, tok_s),
                       "effective GB/s (file)": effective_gbps(e.file_bytes, tok_s)})
        if ceiling is not None:
            values.update({"fraction of the ceiling": effective_gbps(e.token_bytes, tok_s) / ceiling,
                           "tok/s the ceiling allows": ceiling * 1e9 / e.token_bytes})
    bad = [k for k, v in values.items() if not (math.isfinite(v) and v > 0)]
    if bad:
        given = [f"{e.file_bytes:,} file bytes"] + ([f"{tok_s:g} tok/s"] if tok_s is not None else []) + \
            ([f"a {ceiling:g} GB/s ceiling"] if ceiling is not None else [])
        raise MuseError(f"out of range: with {', '.join(given)} the {bad[0]} would be {values[bad[0]]:g}")


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.envelope", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a muse-glimmer GGUF (default: the pinned geometry in the Q4_K_M layout, "
                                   "with the pinned artifact's size from seed 002)")
    p.add_argument("--tok-s", type=finite_positive, help="a measured decode throughput, tokens/s (finite, > 0)")
    p.add_argument("--bench-receipt", help="a benchmark receipt to read decode tok/s from (metrics.decode_tok_s)")
    p.add_argument("--depth", type=int, default=0, help="context depth for the KV read (default 0)")
    p.add_argument("--ceiling-gbps", type=finite_positive,
                   help="a measured read bandwidth to compare against, GB/s (finite, > 0; needs a tok/s)")
    p.add_argument("--file-bytes", type=int, help="override the bytes on disk (e.g. the book's artifact; >= 1)")
    p.add_argument("--receipt", help="write this run's receipt JSON here (its folder must exist)")
    args = p.parse_args(argv)
    if args.tok_s is not None and args.bench_receipt is not None:
        raise MuseError("give --tok-s or --bench-receipt, not both")
    if args.ceiling_gbps is not None and args.tok_s is None and args.bench_receipt is None:
        raise MuseError("--ceiling-gbps needs a throughput to compare: give --tok-s or --bench-receipt")
    if args.depth < 0:
        raise MuseError(f"--depth must be >= 0, got {args.depth}")
    if args.file_bytes is not None and not 1 <= args.file_bytes <= MAX_FILE_BYTES:
        shown = args.file_bytes if len(str(args.file_bytes)) <= 24 else f"a {len(str(abs(args.file_bytes)))}-digit number"
        raise MuseError(f"--file-bytes must be between 1 and {MAX_FILE_BYTES:,}, got {shown}")
    if args.receipt is not None:
        from .receipts import check_output

        check_output(args.receipt, "--receipt")
    tok_s = args.tok_s if args.bench_receipt is None else tok_s_from_receipt(args.bench_receipt)
    if args.model:
        from ..artifact import open_artifact

        a = open_artifact(args.model)
        g = a.geometry
        types = {name: t.qtype for name, t in a.tensors.items()}
        file_bytes, source = a.file_bytes, f"{Path(args.model).name} on disk"
    else:
        from .fixtures import kquant_mix

        g, types = PINNED, kquant_mix(PINNED)
        file_bytes, source = PINNED_ARTIFACT_BYTES, "the pinned kquant artifact (seed 002 §1.3, quoted)"
    if args.file_bytes is not None:
        file_bytes, source = args.file_bytes, "given with --file-bytes"
    if args.depth > g.context_length:
        raise MuseError(f"--depth {args.depth:,} exceeds the model's {g.context_length:,} positions")
    e = envelope(g, types, file_bytes, source, args.depth)
    check_derivable(e, tok_s, args.ceiling_gbps)
    metrics = print_report(g, e, tok_s, args.ceiling_gbps)
    if args.receipt is not None:
        from .receipts import make_receipt, write_receipt

        r = make_receipt("envelope", inputs={"model": args.model, "tok_s": tok_s, "depth": args.depth,
                                             "file_bytes": file_bytes, "file_bytes_source": source},
                         metrics=metrics, notes="effective GB/s is derived from a throughput, not measured")
        print(f"receipt: {write_receipt(args.receipt, r)}")
    return 0


def print_report(g: Geometry, e: Envelope, tok_s: float | None, ceiling: float | None, out=None) -> dict:
    out = out or sys.stdout
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"parameters (from the tensor table): {e.n_params:,}  (matmul: {e.n_matmul_params:,})")
    w(f"bytes on disk: {e.file_bytes:,} B = {e.file_bytes / 1e9:.3f} GB = {e.file_bytes / 2**30:.2f} GiB "
      f"[{e.file_bytes_source}]; {e.bits_per_param:.2f} bits per parameter")
    w(f"tensor data: {e.tensor_bytes:,} B; embedding table {e.embedding_bytes:,} B, of which one row "
      f"({e.embedding_row_bytes:,} B) is gathered per token")
    w(f"streamed per token at depth {e.depth:,}: weights {e.weight_stream_bytes:,} B + KV read "
      f"{e.kv_read_bytes:,} B + KV write {e.kv_write_bytes:,} B = {e.token_bytes:,} B ({e.token_bytes / 1e9:.3f} GB)")
    att = attention_flops(g, e.depth)
    w(f"FLOPs per token: matmuls 2 × {e.n_matmul_params:,} = {e.matmul_flops / 1e9:.1f} GFLOP; "
      f"attention at depth {e.depth:,}: {att / 1e9:.4f} GFLOP")
    w(f"arithmetic intensity: {e.matmul_flops / e.token_bytes:.2f} FLOP/B over the streamed bytes, "
      f"{e.matmul_flops / e.file_bytes:.2f} FLOP/B over the file (the book's ratio)")
    metrics = dict(asdict(e), bits_per_param=e.bits_per_param, weight_stream_bytes=e.weight_stream_bytes,
                   token_bytes=e.token_bytes, matmul_flops=e.matmul_flops, attention_flops=att,
                   intensity_streamed=e.matmul_flops / e.token_bytes, intensity_file=e.matmul_flops / e.file_bytes)
    if tok_s is not None:
        eff_file = effective_gbps(e.file_bytes, tok_s)
        eff_stream = effective_gbps(e.token_bytes, tok_s)
        w(f"derived at {tok_s:g} tok/s (a derivation from throughput, not a measured bandwidth):")
        w(f"  token time {1e3 / tok_s:.2f} ms; effective {eff_file:.2f} GB/s counting the file per token "
          f"(the book's convention), {eff_stream:.2f} GB/s counting the streamed bytes")
        metrics.update(tok_s=tok_s, token_ms=1e3 / tok_s, effective_gbps_file=eff_file,
                       effective_gbps_streamed=eff_stream)
        if ceiling is not None:
            w(f"  {eff_stream / ceiling:.1%} of the {ceiling:,.0f} GB/s ceiling given "
              f"(streamed bytes); the ceiling allows {ceiling * 1e9 / e.token_bytes:.1f} tok/s")
            metrics.update(ceiling_gbps=ceiling, fraction_of_ceiling=eff_stream / ceiling)
    return metrics


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
