"""`python -m muse_mlx.tools.parity`: our engine against the pinned llama.cpp, lane by lane.

Both engines get the same GGUF and the same token ids: the first `prefill` tokens
in one go (chunked), then one token per decode step, with full-vocabulary logits
kept at every position. Per lane we report max/mean |Δ log-prob|, KL(llama ‖ ours)
mean and max, teacher-forced top-1 agreement, greedy continuation agreement, and —
where both hold f16 K/V computed from the same weights — how many of layer 0's
K/V elements are bit-identical to llama.cpp's (the f16 KV contract, read from
llama.cpp's own state). The verdict is refereed by the float64 oracle on the same
dequantized weights (`referee`, ALLOWANCE); the rule and its reasons: docs/parity.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import MuseError
from ..sampling import log_softmax
from .. import cli
from ..cli import Parser

RECEIPT_DIR = Path("receipts/parity")


@dataclass(frozen=True)
class Lane:
    name: str
    weights: str           # "F32" (the base as is), a llama.cpp ftype ("Q4_K_M", ...), or "NVFP4" (ours)
    engine_kv: str         # "f32" | "f16"
    llama_kv: str          # "f32" | "f16"
    flash_attn: bool
    thresholds: dict = field(default_factory=dict)  # metric -> (">=" | "<=", value)
    why: str = ""


# The verdict (docs/parity.md): the float64 oracle (tools/oracle.py) on the lane file's own
# dequantized weights and the same tokens referees. Ours must be no farther from it than
# llama.cpp is, plus ALLOWANCE (max |Δ log-prob|, nats: float32 noise, and the f16 rounding of
# K/V where the lane keeps K/V in f16, whose rounding can flip where float64 and float32 sums
# differ); agree with its top-1 at least as often; and every top-1 disagreement with llama.cpp
# must be explained: our choice is the oracle's, or the oracle's log-probs of the two choices lie
# within ALLOWANCE (a near-tie). The thresholds below are contracts beyond that, not tolerances:
# the F32 lane is the same float32 graph on both sides (greedy text equal), and the F16-KV lane
# must store layer 0's K/V with llama.cpp's bits.
ALLOWANCE = {"f32": 1e-4, "f16": 3e-3}

LANES = {lane.name: lane for lane in [
    Lane("f32", "F32", "f32", "f32", False, {"greedy_match": (">=", 1.0)},
         "F32 weights, F32 KV, flash attention off: the same graph in float32 on both sides."),
    Lane("f16kv", "F32", "f16", "f16", True, {"kv_layer0_identical": (">=", 0.99)},
         "F32 weights, llama.cpp's default F16 KV (flash attention on): K/V rounded to f16 on both sides."),
    Lane("f16", "F16", "f16", "f16", True, {},
         "F16 weights: llama.cpp rounds activations to f16 in its matmuls; we do not."),
    Lane("bf16", "BF16", "f16", "f16", True, {},
         "BF16 weights: llama.cpp rounds activations to bf16 in its matmuls."),
    Lane("q8_0", "Q8_0", "f16", "f16", True, {},
         "Q8_0: llama.cpp quantizes activations to Q8_0 for the dot products."),
    Lane("q6_k", "Q6_K", "f16", "f16", True, {},
         "Q6_K: llama.cpp quantizes activations to Q8_K."),
    Lane("q5_k_m", "Q5_K_M", "f16", "f16", True, {},
         "Q5_K_M: Q5_K body, Q6_K output and more-bits layers; Q8_K activations in llama.cpp."),
    Lane("q4_k_m", "Q4_K_M", "f16", "f16", True, {},
         "Q4_K_M: Q4_K body, Q6_K output and more-bits layers; Q8_K activations in llama.cpp."),
    Lane("nvfp4", "NVFP4", "f16", "f16", True, {},
         "NVFP4 written by the project (llama.cpp's quantizer refuses the ftype); Q8_0 activations in llama.cpp."),
]}


# ---- lane files ----------------------------------------------------------------------


def write_nvfp4(src, dst) -> Path:
    """The project's NVFP4 file: every matrix of a F32/F16 GGUF in block_nvfp4, norms as they are."""
    from ..artifact import open_artifact
    from .fixtures import write_gguf
    from ..quant import dequantize_numpy, quantize_nvfp4

    a = open_artifact(src)
    g = a.geometry
    types = {name: (QT.NVFP4 if len(shape) == 2 else a.tensors[name].qtype) for name, shape in g.tensor_shapes().items()}

    def producer(name, shape, qtype):
        t = a.tensors[name]
        if qtype == QT.NVFP4:
            return quantize_nvfp4(dequantize_numpy(t))
        return np.ascontiguousarray(t.data)

    return write_gguf(dst, g, types, producer, f"{model_name(src)}, NVFP4 (written by muse_mlx)")


def model_name(path) -> str:
    """general.name of a GGUF ('' when absent)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.name")
    return str(field.contents()) if field is not None else ""


def is_synthetic(path) -> bool:
    """The fixtures' files (random or synthetic weights) name themselves so (tools/fixtures.py)."""
    name = model_name(path).lower()
    return "synthetic" in name or "random" in name


def lane_file(lane: Lane, base: Path, workdir: Path) -> Path:
    """The GGUF a lane runs on, made from the F32 base (and cached by the base's name)."""
    if lane.weights == "F32":
        return base
    out = Path(workdir) / f"{base.stem}.{lane.weights.lower()}.gguf"
    if out.exists() and out.stat().st_mtime >= base.stat().st_mtime:
        return out
    if lane.weights == "NVFP4":
        return write_nvfp4(base, out)
    from .llamacpp import quantize

    return quantize(base, out, lane.weights)


def infer_lanes(path) -> list[str]:
    """Which lanes a given file belongs to, from its matrix types."""
    from ..artifact import open_artifact

    types = {t.qtype for name, t in open_artifact(path).tensors.items() if len(t.shape) == 2}
    if types == {QT.F32}:
        return ["f32", "f16kv"]
    simple = {QT.F16: "f16", QT.BF16: "bf16", QT.Q8_0: "q8_0", QT.NVFP4: "nvfp4"}
    if len(types) == 1 and next(iter(types)) in simple:
        return [simple[next(iter(types))]]
    if QT.Q4_K in types:
        return ["q4_k_m"]
    if QT.Q5_K in types:
        return ["q5_k_m"]
    if QT.Q6_K in types:
        return ["q6_k"]
    raise MuseError(f"{path}: no parity lane for matrix types {sorted(t.name for t in types)}")


# ---- the two engines -------------------------------------------------------------------

_KV = {"f32": mx.float32, "f16": mx.float16}


def engine_teacher_forced(model, tokens, prefill: int, kv: str):
    """Our logits at every position (prefill in chunks, then single-token steps), and the cache."""
    cache = model.make_cache(len(tokens), dtype=_KV[kv])
    rows = [np.array(model.prefill(mx.array(tokens[:prefill]), cache, all_logits=True))]
    for t in tokens[prefill:]:
        rows.append(np.array(model.step(int(t), cache))[None])
    mx.eval(cache.state())
    return np.concatenate(rows), cache


def engine_greedy(model, prompt, n: int, kv: str) -> list[int]:
    from ..generate import generate_tokens
    from ..sampling import Sampler, SamplerSettings

    cache = model.make_cache(len(prompt) + n, dtype=_KV[kv])
    return list(generate_tokens(model, cache, list(prompt), Sampler(SamplerSettings()), n))


# ---- metrics ---------------------------------------------------------------------------


def logit_metrics(ours: np.ndarray, ref: np.ndarray) -> dict:
    lo, lr = log_softmax(ours), log_softmax(ref)
    d = np.abs(lo - lr)
    kl = (np.exp(lr) * (lr - lo)).sum(axis=-1)
    return {"max_abs_dlogprob": float(d.max()), "mean_abs_dlogprob": float(d.mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((ours.argmax(-1) == ref.argmax(-1)).mean())}


def by_depth(ours: np.ndarray, ref: np.ndarray, window: int) -> list[dict]:
    """The same metrics per band of `window` positions: below the window, then each window past it."""
    bands = []
    for a in range(0, len(ours), window):
        b = min(len(ours), a + window)
        bands.append({"positions": [a, b - 1], **logit_metrics(ours[a:b], ref[a:b])})
    return bands


def kv_identity(cache, llama_state: dict, geometry) -> list[float]:
    """Per layer: the fraction of K and V elements that are bit-identical to llama.cpp's f16 cells."""
    full = [il for il in range(geometry.n_layer) if not geometry.is_swa(il)]
    swa = [il for il in range(geometry.n_layer) if geometry.is_swa(il)]
    fractions = [None] * geometry.n_layer
    for kind, ids in (("full", full), ("sliding", swa)):
        for il, cells in zip(ids, llama_state[kind]):
            (k, v), positions = cache.layers[il].view()
            row_of = {int(p): i for i, p in enumerate(positions)}
            missing = [int(p) for p in cells["positions"] if int(p) not in row_of]
            if missing:
                raise MuseError(f"layer {il}: llama.cpp holds positions {missing[:3]}... that our cache does not")
            rows = [row_of[int(p)] for p in cells["positions"]]
            ours_k = np.array(k.astype(mx.float32))[:, rows, :].transpose(1, 0, 2).reshape(len(rows), -1)
            ours_v = np.array(v.astype(mx.float32))[:, rows, :].transpose(1, 0, 2).reshape(len(rows), -1)
            same = (ours_k == cells["k"].astype(np.float32)).sum() + (ours_v == cells["v"].astype(np.float32)).sum()
            fractions[il] = float(same / (ours_k.size + ours_v.size))
    return fractions


def referee(ours: np.ndarray, ref: np.ndarray, oracle: np.ndarray, allowance: float) -> tuple[dict, dict]:
    """Ours and llama.cpp's logits each against the float64 oracle's on the same tokens ->
    (metrics, checks): the verdict's rule (see ALLOWANCE)."""
    to_oracle, llama_to_oracle = logit_metrics(ours, oracle), logit_metrics(ref, oracle)
    lx = log_softmax(oracle)
    mine, theirs, best = ours.argmax(-1), ref.argmax(-1), oracle.argmax(-1)
    rows = np.arange(len(ours))
    near_tie = lx[rows, best] - lx[rows, mine] <= allowance
    unexplained = (mine != theirs) & (mine != best) & ~near_tie
    metrics = {"vs_oracle": to_oracle, "llama_vs_oracle": llama_to_oracle, "allowance": allowance,
               "top1_disagreements_with_llama": int((mine != theirs).sum()),
               "unexplained_disagreements": int(unexplained.sum()),
               "unexplained_positions": [int(i) for i in np.flatnonzero(unexplained)[:20]]}
    checks = {
        "closer_to_oracle": {"value": to_oracle["max_abs_dlogprob"], "op": "<=",
                             "bound": llama_to_oracle["max_abs_dlogprob"] + allowance,
                             "pass": to_oracle["max_abs_dlogprob"] <= llama_to_oracle["max_abs_dlogprob"] + allowance},
        "top1_vs_oracle": {"value": to_oracle["top1"], "op": ">=", "bound": llama_to_oracle["top1"],
                           "pass": to_oracle["top1"] >= llama_to_oracle["top1"]},
        "disagreements_explained": {"value": int(unexplained.sum()), "op": "<=", "bound": 0,
                                    "pass": not unexplained.any()},
    }
    return metrics, checks


def judge(metrics: dict, thresholds: dict) -> dict:
    checks = {}
    for name, (op, bound) in thresholds.items():
        value = metrics.get(name)
        ok = value is not None and (value >= bound if op == ">=" else value <= bound)
        checks[name] = {"value": value, "op": op, "bound": bound, "pass": bool(ok)}
    return checks


# ---- one lane --------------------------------------------------------------------------


@dataclass
class LaneResult:
    lane: Lane
    path: Path
    metrics: dict
    bands: list
    checks: dict
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c["pass"] for c in self.checks.values())


def run_lane(lane: Lane, path: Path, tokens: np.ndarray, prefill: int, greedy_tokens: int,
             model=None) -> LaneResult:
    """Compare our engine (optionally a given, e.g. fault-injected, model) with llama.cpp on one file,
    the float64 oracle refereeing."""
    from .llamacpp import LlamaCpp
    from .oracle import ReferenceModel
    from ..model import load

    start = time.perf_counter()
    model = model or load(path)
    g = model.geometry
    ours, cache = engine_teacher_forced(model, tokens, prefill, lane.engine_kv)
    with LlamaCpp(path, n_ctx=len(tokens) + greedy_tokens, kv_f32=lane.llama_kv == "f32",
                  flash_attn=lane.flash_attn) as llama:
        ref = llama.teacher_forced(tokens, prefill)
        kv = None
        if lane.llama_kv == "f16":
            kv = kv_identity(cache, llama.kv_state(g.n_full, g.n_swa), g)
        llama_greedy = llama.greedy(tokens[:prefill], greedy_tokens) if greedy_tokens else []
    ours_greedy = engine_greedy(model, tokens[:prefill], greedy_tokens, lane.engine_kv) if greedy_tokens else []
    metrics = logit_metrics(ours, ref)
    if greedy_tokens:
        same = next((i for i, (a, b) in enumerate(zip(ours_greedy, llama_greedy)) if a != b), greedy_tokens)
        metrics.update(greedy_prefix=same, greedy_match=same / greedy_tokens,
                       greedy_ours=ours_greedy, greedy_llama=llama_greedy)
    if kv is not None:
        metrics.update(kv_layer0_identical=kv[0], kv_identical_by_layer=kv)
    oracle = ReferenceModel(str(path), kv_f16=lane.engine_kv == "f16").logits(tokens)
    refereed, checks = referee(ours, ref, oracle, ALLOWANCE[lane.engine_kv])
    metrics["referee"] = refereed
    return LaneResult(lane, Path(path), metrics, by_depth(ours, ref, g.sliding_window),
                      {**checks, **judge(metrics, lane.thresholds)}, time.perf_counter() - start)


def lane_receipt(result: LaneResult, tokens_info: dict, base: Path | None) -> dict:
    from .receipts import file_sha256, make_receipt

    verdict = "pass" if result.passed else "fail"
    return make_receipt(
        f"parity/{result.lane.name}", synthetic=is_synthetic(result.path),
        inputs={"lane": asdict(result.lane), "model": str(result.path), "model_sha256": file_sha256(result.path),
                "base": str(base) if base else None, "base_sha256": file_sha256(base) if base else None,
                "tokens": tokens_info},
        metrics={**result.metrics, "by_depth": result.bands, "seconds": result.seconds},
        verdict={"verdict": verdict, "checks": result.checks},
    )


def table(results: list[LaneResult]) -> str:
    head = f"{'':8} {'vs llama.cpp':-^36} {'vs float64 oracle':-^36}\n" \
           f"{'lane':8} {'max|Δlp|':>9} {'KL mean':>9} {'top1':>6} {'greedy':>6} {'ours':>9} {'llama':>9} " \
           f"{'top1':>6} {'llama':>6} {'kv L0':>6}  verdict"
    lines = [head]
    for r in results:
        m, x = r.metrics, r.metrics["referee"]
        kv = f"{m['kv_layer0_identical']:.3f}" if "kv_layer0_identical" in m else "-"
        greedy = f"{m['greedy_prefix']}/{len(m['greedy_ours'])}" if "greedy_prefix" in m else "-"
        failed = [k for k, c in r.checks.items() if not c["pass"]]
        lines.append(f"{r.lane.name:8} {m['max_abs_dlogprob']:9.2e} {m['kl_mean']:9.2e} {m['top1']:6.3f} {greedy:>6} "
                     f"{x['vs_oracle']['max_abs_dlogprob']:9.2e} {x['llama_vs_oracle']['max_abs_dlogprob']:9.2e} "
                     f"{x['vs_oracle']['top1']:6.3f} {x['llama_vs_oracle']['top1']:6.3f} {kv:>6}  "
                     + ("pass" if r.passed else "FAIL: " + ", ".join(failed)))
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------


def token_ids(args, model_path, n_vocab: int) -> tuple[np.ndarray, dict]:
    if args.prompt_file:
        from ..artifact import open_artifact
        from ..tokenizer import MuseTokenizer

        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise MuseError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise MuseError(f"--prompt-file {args.prompt_file}: not UTF-8 text (offset {exc.start})") from None
        ids = np.array(MuseTokenizer(open_artifact(model_path).vocabulary).encode(text), dtype=np.int64)
        if len(ids) < args.prefill + 1:
            raise MuseError(f"{args.prompt_file}: {len(ids)} tokens, fewer than --prefill {args.prefill} + 1")
        n = args.prefill + args.decode_steps
        return ids[:n], {"source": "prompt-file", "path": args.prompt_file, "n": int(min(n, len(ids)))}
    rng = np.random.default_rng(args.seed)
    n = args.prefill + args.decode_steps
    return rng.integers(0, n_vocab, n), {"source": "random", "seed": args.seed, "n": n}


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.parity", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a muse-glimmer GGUF (with --derive-lanes: the F32 base)")
    p.add_argument("--lanes", help="comma-separated lanes (default: the file's own; with --derive-lanes: all)")
    p.add_argument("--derive-lanes", action="store_true",
                   help="make each lane's file from the F32 --model (llama.cpp's quantizer; our NVFP4 writer)")
    p.add_argument("--workdir", default=None, help="where derived lane files go (default: the cache dir)")
    p.add_argument("--seed", type=int, default=0, help="seed for random token ids, >= 0 (default %(default)s)")
    p.add_argument("--prompt-file", help="take the token ids from this text file instead")
    p.add_argument("--prefill", type=int, default=100, help="tokens fed at once before decoding (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=200, help="single-token steps after the prefill (default %(default)s)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens generated by both from the prefill (default %(default)s)")
    p.add_argument("--receipt-dir", default=str(RECEIPT_DIR),
                   help="where lane receipts go, a new file per lane and run: <date>-<revision>-<lane>.json "
                        "(an existing, writable folder; default %(default)s)")
    args = p.parse_args(argv)
    if args.prefill < 1 or args.decode_steps < 0 or args.greedy < 0:
        raise MuseError("--prefill must be >= 1, --decode-steps and --greedy >= 0")
    if args.seed < 0:
        raise MuseError(f"--seed must be >= 0, got {args.seed}")
    from .receipts import check_output_folder

    check_output_folder(args.receipt_dir, "--receipt-dir")
    if args.workdir is not None and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        raise MuseError(f"--workdir {args.workdir}: is not a folder")
    from ..artifact import open_artifact
    from .fixtures import cache_dir

    base = Path(args.model)
    g = open_artifact(base).geometry
    if args.prefill + args.decode_steps + args.greedy > g.context_length:
        raise MuseError(f"{args.prefill + args.decode_steps + args.greedy} positions exceed the model's "
                        f"{g.context_length}")
    names = args.lanes.split(",") if args.lanes else (list(LANES) if args.derive_lanes else infer_lanes(base))
    unknown = [n for n in names if n not in LANES]
    if unknown:
        raise MuseError(f"unknown lane {unknown[0]!r}; lanes: {', '.join(LANES)}")
    if args.derive_lanes and infer_lanes(base) != ["f32", "f16kv"]:
        raise MuseError(f"{base}: --derive-lanes needs an all-F32 base model")
    workdir = Path(args.workdir) if args.workdir else cache_dir() / "parity"
    tokens, tokens_info = token_ids(args, base, g.n_vocab)
    results, written = [], []
    for name in names:
        lane = LANES[name]
        path = lane_file(lane, base, workdir) if args.derive_lanes else base
        result = run_lane(lane, path, tokens, args.prefill, args.greedy)
        results.append(result)
        from .receipts import write_new_receipt

        written.append(write_new_receipt(args.receipt_dir, name,
                                         lane_receipt(result, tokens_info, base if args.derive_lanes else None),
                                         "--receipt-dir"))
    print(table(results))
    label = " (synthetic fixture numbers)" if any(is_synthetic(r.path) for r in results) else ""
    print(f"receipts{label}:", ", ".join(str(w) for w in written))
    return 0 if all(r.passed for r in results) else 1


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
