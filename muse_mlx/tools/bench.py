"""`python -m muse_mlx.tools.bench`: decode and prefill throughput on the kernel path, with a receipt.

Cells (each: warm-up, then --reps repetitions; mean and CV of tok/s):
- decode: batch 1, greedy, at each --depths value, two ways (decode_cell): synced (a host
  sync per token, as generate.py runs) and pipelined (the next step is built while the GPU
  computes this one, as mlx-lm generates); `tok_s` is the faster, named in `tok_s_is`.
  The KV cache is filled to the depth with random f16 rows (timing depends on the sizes,
  not the values); labelled so in the receipt.
- prefill: --prefill lengths on a cache filled to each --prefill-depths value (0: empty; else
  random f16 rows, as the decode cells), chunks of 512 (llama-bench -p N -d D).
- matvecs only: one token's projections (as launched: Q|K|gate and FFN gate|up stacked), our raw-block kernels against
  MLX's built-in affine 4-bit `quantized_matmul` (group 32) on the same weights.
Effective GB/s = bytes streamed per token (envelope.py: weights once, the embedding row,
KV read and written at the depth) x tok/s; also as a fraction of the read bandwidth
measured in the same process. `--combine` folds a llama-bench JSON from the same session
into the receipt with the ratios llama.cpp ÷ muse_mlx (above 1: we are slower).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from ..errors import MuseError
from .. import cli
from ..cli import Parser
from ..config import KernelConfig


def _stats(samples: list[float]) -> dict:
    mean = statistics.fmean(samples)
    cv = statistics.stdev(samples) / mean if len(samples) > 1 and mean else 0.0
    return {"mean": mean, "cv": cv, "samples": samples}


def eval_ms(fn, reps: int, warmup: int) -> list[float]:
    """Milliseconds to build and evaluate fn()'s arrays, `reps` times after `warmup` untimed runs."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t) * 1e3)
    return samples


def read_bandwidth_gbps(gigabytes: float = 8.0, reps: int = 5) -> dict:
    """Read bandwidth as MLX's sum over a large float32 array (bytes read / time)."""
    n = int(gigabytes * 1e9 / 4)
    a = mx.random.uniform(shape=(n,), dtype=mx.float32)
    mx.eval(a)
    mx.eval(mx.sum(a))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(mx.sum(a))
        samples.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    del a
    mx.clear_cache()
    return _stats(samples)


def decode_cell(model, depth: int, tokens: int, reps: int, warmup: int) -> dict:
    """Greedy decode from a cache filled to `depth` with random f16 rows (synthetic content), two
    ways: `synced` waits for each token before building the next step; `pipelined` is the
    engine's decode loop (generate.decode_tokens: step t+1 built from the lazy token of step t
    while the GPU computes step t)."""
    from ..generate import decode_tokens
    from ..sampling import Sampler, SamplerSettings

    cache = model.make_cache(depth + 2 * tokens + 2)
    greedy = Sampler(SamplerSettings())
    cache.fill_random(depth)

    def rewind() -> None:
        """Every layer back to `depth` positions, the storage kept: the rows a rep wrote are
        overwritten by the next (synthetic content: the timing depends on the sizes). Refilling
        instead would put a second set of storage arrays inside the peak-memory window."""
        for layer in cache.layers:
            layer.offset = depth

    def synced() -> float:
        rewind()
        token = 1
        t = time.perf_counter()
        for _ in range(tokens):
            token = int(mx.argmax(model.step(token, cache)).item())
        return tokens / (time.perf_counter() - t)

    def pipelined() -> float:
        rewind()
        t = time.perf_counter()
        n = sum(1 for _ in decode_tokens(model, cache, model.step(1, cache), greedy, tokens))
        return n / (time.perf_counter() - t)

    out = {"depth": depth, "tokens_per_rep": tokens, "kv_fill": "random f16 rows (synthetic)",
           "largest_kv_array_bytes": max(a.nbytes for a in cache.state())}
    for name, fn in (("synced", synced), ("pipelined", pipelined)):
        for _ in range(warmup):
            fn()
        mx.eval(cache.state())
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out[f"tok_s_{name}"] = _stats([fn() for _ in range(reps)])
        # A K/V row write whose storage is still held elsewhere (e.g. by a step the GPU has not
        # finished) copies the whole array: the peak then rises by at least one storage array.
        out[f"peak_over_active_bytes_{name}"] = mx.get_peak_memory() - base
    out["tok_s"] = max((out["tok_s_synced"], out["tok_s_pipelined"]), key=lambda c: c["mean"])
    out["tok_s_is"] = "pipelined" if out["tok_s"] is out["tok_s_pipelined"] else "synced"
    return out


def prefill_cell(model, length: int, reps: int, warmup: int, depth: int = 0) -> dict:
    tokens = mx.array(np.random.default_rng(length).integers(0, model.geometry.n_vocab, length))
    cache = model.make_cache(depth + length + 1)

    def one_rep() -> float:
        cache.fill_random(depth)
        t = time.perf_counter()
        logits = model.prefill(tokens, cache)
        mx.eval(logits)
        return length / (time.perf_counter() - t)

    for _ in range(warmup):
        one_rep()
    out = {"length": length, "depth": depth, "tok_s": _stats([one_rep() for _ in range(reps)])}
    if depth:
        out["kv_fill"] = "random f16 rows (synthetic)"
    return out


def matvec_chain_cell(model, reps: int, warmup: int) -> dict:
    """One token's projections only: our kernels against MLX's affine 4-bit quantized_matmul."""
    from ..quant import dequantize

    projs = [m for m in model.matrices() if m.raw]
    xs = {p.n_in: mx.random.normal((1, p.n_in)) for p in projs}
    mx.eval(list(xs.values()))
    xs16 = {k: v.astype(mx.float16) for k, v in xs.items()}
    quantized = []
    for p in projs:  # MLX's usual configuration: float16 activations, scales and biases
        wq, scales, biases = mx.quantize(dequantize(p.data, p.qtype).astype(mx.float16), group_size=32, bits=4)
        mx.eval(wq, scales, biases)
        quantized.append((wq, scales, biases))
        mx.clear_cache()

    def ours():
        return [model.ops.project(p, xs[p.n_in]) for p in projs]

    def mlx_qmm():
        return [mx.quantized_matmul(xs16[p.n_in], wq, s, b, transpose=True, group_size=32, bits=4)
                for p, (wq, s, b) in zip(projs, quantized)]

    ours_ms, qmm_ms = eval_ms(ours, reps, warmup), eval_ms(mlx_qmm, reps, warmup)
    qmm_bytes = sum(wq.nbytes + s.nbytes + b.nbytes for wq, s, b in quantized)
    return {"projections": len(projs), "ours_ms": _stats(ours_ms), "mlx_qmm_ms": _stats(qmm_ms),
            "ours_weight_bytes": sum(p.data.nbytes for p in projs), "mlx_qmm_weight_bytes": qmm_bytes,
            "note": "MLX 4-bit affine, group 32, float16 activations/scales, from our dequantized weights "
                    "(Q6_K tensors re-quantized to 4 bits); ours: raw GGUF blocks, float32 activations"}


def launch_overhead_cell(model, launches: int, reps: int, warmup: int) -> dict:
    """`launches` matvecs of a tiny Q4_K matrix (32 x 256) in one graph: host and launch cost per call."""
    from gguf import GGMLQuantizationType as QT

    from ..ops.reference import Matrix
    from .fixtures import random_blocks

    w = Matrix(mx.array(random_blocks(32, 256, QT.Q4_K, np.random.default_rng(0))), QT.Q4_K, True, 256, 32)
    x = mx.random.normal((1, 256))
    mx.eval(w, x)

    def chain():
        return [model.ops.project(w, x) for _ in range(launches)]

    samples = [ms * 1e3 / launches for ms in eval_ms(chain, reps, warmup)]
    return {"launches": launches, "us_per_launch": _stats(samples)}


def run_bench(args) -> dict:
    from ..artifact import open_artifact
    from .envelope import envelope
    from ..model import Model
    from ..ops import select_ops

    artifact = open_artifact(args.model)
    t = time.perf_counter()
    model = Model(artifact, select_ops("gpu", args.kernel_config))
    load_s = time.perf_counter() - t
    g = model.geometry
    types = {n: t.qtype for n, t in artifact.tensors.items()}
    bw = read_bandwidth_gbps()
    out = {"model": str(args.model), "kernel_config": dataclasses.asdict(args.kernel_config),
           "device": dataclasses.asdict(model.ops.kernels.device), "weight_bytes_loaded": model.weight_bytes, "load_seconds": load_s,
           "read_bandwidth_gbps": bw, "decode": [], "prefill": []}
    for depth in args.depths:
        cell = decode_cell(model, depth, args.decode_tokens, args.reps, args.warmup)
        e = envelope(g, types, artifact.file_bytes, "file", depth)
        tok_s = cell["tok_s"]["mean"]
        cell.update(bytes_per_token=e.token_bytes, ms_per_token=1e3 / tok_s,
                    effective_gbps=e.token_bytes * tok_s / 1e9,
                    fraction_of_read_bw=e.token_bytes * tok_s / 1e9 / bw["mean"])
        out["decode"].append(cell)
        print(f"decode depth {depth:>6}: {tok_s:8.2f} tok/s {cell['tok_s_is']} (CV {cell['tok_s']['cv']:.2%}; "
              f"synced {cell['tok_s_synced']['mean']:.2f}), "
              f"{cell['ms_per_token']:.3f} ms, {cell['effective_gbps']:.0f} GB/s = "
              f"{cell['fraction_of_read_bw']:.1%} of {bw['mean']:.0f} GB/s read", flush=True)
    for depth in args.prefill_depths:
        for length in args.prefill:
            cell = prefill_cell(model, length, args.reps, args.warmup, depth)
            out["prefill"].append(cell)
            print(f"prefill {length:>5} at depth {depth:>6}: {cell['tok_s']['mean']:8.1f} tok/s "
                  f"(CV {cell['tok_s']['cv']:.2%})", flush=True)
    if args.matvecs:
        n = len(model.matrices())
        out["launch_overhead"] = launch_overhead_cell(model, n, args.reps, args.warmup)
        print(f"{n} tiny matvec launches: {out['launch_overhead']['us_per_launch']['mean']:.1f} us each", flush=True)
        cell = matvec_chain_cell(model, args.reps, args.warmup)
        out["matvecs_only"] = cell
        print(f"matvecs only: ours {cell['ours_ms']['mean']:.3f} ms, MLX quantized_matmul "
              f"{cell['mlx_qmm_ms']['mean']:.3f} ms per token", flush=True)
    if out["decode"]:
        out["decode_tok_s"] = out["decode"][0]["tok_s"]
    return out


def combine(ours_path, llama_path) -> dict:
    """Ratios llama.cpp ÷ muse_mlx (tok/s) from llama-bench's JSON (-o json) and our bench receipt."""
    from .receipts import json_kind, read_json

    ours = read_json(ours_path, "--combine")
    llama = read_json(llama_path, "--combine")
    if not isinstance(ours, dict):
        raise MuseError(f"--combine {ours_path}: expected a bench receipt (a JSON object), found {json_kind(ours)}")
    if not isinstance(ours.get("metrics"), dict):
        raise MuseError(f"--combine {ours_path}: not a bench receipt (metrics is {json_kind(ours.get('metrics'))}, "
                        f"not an object)")
    if not isinstance(llama, list):
        raise MuseError(f"--combine {llama_path}: expected llama-bench's -o json output (an array), "
                        f"found {json_kind(llama)}")
    m = ours["metrics"]
    ratios = []
    for i, rec in enumerate(llama):
        try:
            n_prompt, n_gen, depth = rec.get("n_prompt", 0), rec.get("n_gen", 0), rec.get("n_depth", 0)
            entry = {"llama": {"n_prompt": n_prompt, "n_gen": n_gen, "depth": depth, "avg_ts": rec["avg_ts"],
                               "stddev_ts": rec["stddev_ts"], "samples_ts": rec.get("samples_ts")}}
            if n_gen and not n_prompt:
                mine = next((c for c in m.get("decode", []) if c["depth"] == depth), None)
                if mine:
                    entry.update(cell=f"decode depth {depth}", ours_tok_s=mine["tok_s"]["mean"],
                                 ratio_llama_over_ours=rec["avg_ts"] / mine["tok_s"]["mean"])
            elif n_prompt and not n_gen:
                mine = next((c for c in m.get("prefill", []) if c["length"] == n_prompt
                             and c.get("depth", 0) == depth), None)
                if mine:
                    entry.update(cell=f"prefill {n_prompt} depth {depth}", ours_tok_s=mine["tok_s"]["mean"],
                                 ratio_llama_over_ours=rec["avg_ts"] / mine["tok_s"]["mean"])
        except (KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
            raise MuseError(f"--combine {ours_path} {llama_path}: record {i} of llama-bench's output does not "
                            f"fit the receipt ({type(exc).__name__}: {exc})") from None
        ratios.append(entry)
    return {"ours": ours, "llama_bench": llama, "ratios": ratios}


def check_flags(args) -> None:
    """Every number the bench takes, checked before anything is loaded (no GPU needed). Parses
    --depths and --prefill into lists and --kernel-config into a KernelConfig in place."""
    if args.reps < 1:
        raise MuseError(f"--reps must be >= 1, got {args.reps}")
    if args.warmup < 0:
        raise MuseError(f"--warmup must be >= 0, got {args.warmup}")
    if args.decode_tokens < 1:
        raise MuseError(f"--decode-tokens must be >= 1, got {args.decode_tokens}")
    args.depths, args.prefill = cli.ints(args.depths, "--depths"), cli.ints(args.prefill, "--prefill")
    args.prefill_depths = cli.ints(args.prefill_depths, "--prefill-depths")
    for flag, values in (("--depths", args.depths), ("--prefill-depths", args.prefill_depths)):
        bad = [d for d in values if d < 0]
        if bad:
            raise MuseError(f"{flag} must be >= 0, got {bad[0]}")
    bad = [n for n in args.prefill if n < 1]
    if bad:
        raise MuseError(f"--prefill lengths must be >= 1, got {bad[0]}")
    args.kernel_config = KernelConfig.parse(args.kernel_config)
    if args.receipt is not None:
        from .receipts import check_output

        check_output(args.receipt, "--receipt")


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a muse-glimmer GGUF (the numbers are as synthetic as the file)")
    p.add_argument("--depths", default="0,32768", help="decode depths, each >= 0 (default %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=64,
                   help="tokens per decode repetition, >= 1 (default %(default)s)")
    p.add_argument("--prefill", default="512,2048", help="prefill lengths, each >= 1 (default %(default)s)")
    p.add_argument("--prefill-depths", default="0",
                   help="cache depths the prefill lengths start at, each >= 0 (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell, >= 1 (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first, >= 0 (default %(default)s)")
    p.add_argument("--no-matvecs", dest="matvecs", action="store_false", help="skip the matvec-only comparison")
    p.add_argument("--receipt", help="write the receipt here (its folder must exist)")
    p.add_argument("--combine", nargs=2, metavar=("OURS_JSON", "LLAMA_BENCH_JSON"),
                   help="fold a llama-bench -o json result into our receipt, with ratios")
    p.add_argument("--kernel-config", default="", help="kernel tuning values, name=value,... (config.KernelConfig; "
                                                        "default: its defaults)")
    p.add_argument("--synthetic", action="store_true", help="label the numbers synthetic (random-block fixture)")
    args = p.parse_args(argv)
    check_flags(args)
    from .receipts import make_receipt, write_receipt

    if args.combine:
        data = combine(*args.combine)
        for r in data["ratios"]:
            if "ratio_llama_over_ours" in r:
                print(f"{r['cell']}: llama.cpp {r['llama']['avg_ts']:.2f} tok/s, ours {r['ours_tok_s']:.2f} tok/s, "
                      f"ratio llama/ours {r['ratio_llama_over_ours']:.3f}")
        receipt = make_receipt("bench/compare", inputs={"ours": args.combine[0], "llama_bench": args.combine[1]},
                               metrics=data, synthetic=data["ours"].get("synthetic"))
    else:
        if not args.model:
            raise MuseError("--model is required")
        metrics = run_bench(args)
        receipt = make_receipt("bench/decode-prefill", inputs=vars(args) | {
            "model": str(args.model), "kernel_config": dataclasses.asdict(args.kernel_config)},
                               metrics=metrics, synthetic=args.synthetic)
    if args.receipt is not None:
        print(f"receipt: {write_receipt(args.receipt, receipt)}")
    return 0


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
