"""`python -m muse_mlx.tools.footprint`: what the KV cache costs, from the formula and from the allocator.

Reproduces chapter 22 (seed 000) from the geometry the engine loads: bytes per
layer class and per slot at any context, computed twice — from the formula
`(n_swa·min(C,W) + n_full·C) · row` and from `SlotCache`'s own accounting of
what it allocates — with a check that the two agree to the byte; the class
split at depth, the marginal cost per token, the depth ratio, the deep-handoff
decomposition, and Figure 22.1 as a PNG.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .anchors import BOOK_HANDOFF_DEPTH, PINNED_ARTIFACT_BYTES
from ..errors import MuseError
from .. import cli
from ..cli import Parser
from ..geometry import PINNED, Geometry
from ..kv import SlotCache

DEFAULT_CONTEXTS = (2_048, 8_192, 32_768, 131_072)
MAX_SLOTS = 1 << 20


@dataclass(frozen=True)
class FootprintRow:
    context: int
    swa_rows: int
    full_rows: int
    formula_swa_bytes: int
    formula_full_bytes: int
    formula_slot_bytes: int
    cache_swa_bytes: int
    cache_full_bytes: int
    cache_slot_bytes: int

    @property
    def agrees(self) -> bool:
        return (self.formula_swa_bytes, self.formula_full_bytes, self.formula_slot_bytes) == \
            (self.cache_swa_bytes, self.cache_full_bytes, self.cache_slot_bytes)


def footprint_row(g: Geometry, context: int) -> FootprintRow:
    swa_rows, full_rows = g.ring_rows(context), context
    row = g.kv_row_bytes
    cache = SlotCache(g, context)  # MLX allocates lazily: this accounts, it does not allocate
    kinds = cache.bytes_by_kind()
    return FootprintRow(
        context=context, swa_rows=swa_rows, full_rows=full_rows,
        formula_swa_bytes=g.n_swa * swa_rows * row, formula_full_bytes=g.n_full * full_rows * row,
        formula_slot_bytes=g.slot_kv_bytes(context),
        cache_swa_bytes=kinds["sliding"], cache_full_bytes=kinds["full"], cache_slot_bytes=cache.nbytes,
    )


def marginal_bytes_per_token(g: Geometry) -> tuple[int, int]:
    """KV bytes one more token costs below the window (every layer) and above it (full layers only)."""
    return g.n_layer * g.kv_row_bytes, g.n_full * g.kv_row_bytes


def class_split(g: Geometry, context: int) -> tuple[float, float]:
    """Fractions of a slot's KV bytes in the full (NoPE) layers and in the sliding layers."""
    r = footprint_row(g, context)
    return r.formula_full_bytes / r.formula_slot_bytes, r.formula_swa_bytes / r.formula_slot_bytes


def handoff_bytes(g: Geometry, depth: int) -> dict:
    """Bytes a deep handoff carries (seed 000 §22.7): the receiver holds back the boundary token,
    so the NoPE planes carry depth-1 rows and the rings min(depth-1, W) rows each."""
    rows = depth - 1
    per_full_row = g.n_full * g.kv_row_bytes
    swa_rows = min(rows, g.sliding_window)
    return {
        "depth": depth, "nope_rows": rows, "nope_bytes": rows * per_full_row,
        "swa_rows": swa_rows, "swa_bytes": g.n_swa * swa_rows * g.kv_row_bytes,
        "total_bytes": rows * per_full_row + g.n_swa * swa_rows * g.kv_row_bytes,
    }


def machine_memory_bytes() -> int | None:
    """What this machine can give the process (kv.memory_capacity_bytes: the GPU's working set, else RAM)."""
    from ..kv import memory_capacity_bytes

    return memory_capacity_bytes()


def plot(g: Geometry, path: Path, max_context: int | None = None) -> Path:
    """Figure 22.1: KV bytes per slot against context, per layer class, as a PNG at `path`
    (written atomically; its folder must exist)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_context = max_context or g.context_length
    n = 400
    contexts = sorted({max(1, round(max_context * i / n)) for i in range(n + 1)} | {g.sliding_window})
    contexts = [c for c in contexts if c <= max_context]
    rows = [footprint_row(g, c) for c in contexts]
    gb = 1e9
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    ax.plot(contexts, [r.formula_full_bytes / gb for r in rows], label=f"full (NoPE) layers: {g.n_full}×C×row")
    ax.plot(contexts, [r.formula_swa_bytes / gb for r in rows],
            label=f"sliding layers: {g.n_swa}×min(C,{g.sliding_window:,})×row")
    ax.plot(contexts, [r.formula_slot_bytes / gb for r in rows], "k--", linewidth=1, label="slot total")
    ax.axvline(g.sliding_window, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("context C (positions)")
    ax.set_ylabel("KV bytes per slot (GB, 10^9)")
    ax.set_title(f"KV cache by layer class (row = {g.kv_row_bytes:,} B per layer per token)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    from .receipts import write_atomic

    try:
        return write_atomic(path, lambda f: fig.savefig(f, format="png"), "--plot")
    finally:
        plt.close(fig)


def _parse_contexts(text: str) -> list[int]:
    """--contexts: comma-separated integers >= 1 (each checked against the model's limit later)."""
    values = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            v = int(x)
        except ValueError:
            shown = x if len(x) <= 40 else x[:40] + "..."
            raise MuseError(f"--contexts must be a comma-separated list of integers, got {shown!r}") from None
        if v < 1:
            raise MuseError(f"--contexts must be positive integers, got {v}")
        values.append(v)
    if not values:
        raise MuseError(f"--contexts must name at least one context, got {text!r}")
    return values


def report(g: Geometry, contexts: list[int], slots: int, weights_bytes: int, weights_label: str,
           out=None) -> dict:
    out = out or sys.stdout
    w = lambda s="": print(s, file=out)  # noqa: E731
    rows = [footprint_row(g, c) for c in contexts]
    w(f"geometry: {g.n_layer} layers ({g.n_swa} sliding, {g.n_full} full), window {g.sliding_window:,}, "
      f"{g.n_head_kv} KV heads × {g.head_dim} dims, f16 K+V: {g.kv_row_bytes:,} B per layer per token")
    w()
    w(f"{'context':>9} | {'sliding B':>13} {'full B':>15} {'slot B':>15} | {'slot GB':>8} "
      f"{f'×{slots} GB':>9} | cache accounting")
    for r in rows:
        check = "agrees to the byte" if r.agrees else \
            f"DISAGREES: {r.cache_swa_bytes:,} / {r.cache_full_bytes:,} / {r.cache_slot_bytes:,}"
        w(f"{r.context:>9,} | {r.formula_swa_bytes:>13,} {r.formula_full_bytes:>15,} {r.formula_slot_bytes:>15,} | "
          f"{r.formula_slot_bytes / 1e9:>8.3f} {slots * r.formula_slot_bytes / 1e9:>9.3f} | {check}")
    below, above = marginal_bytes_per_token(g)
    deep, shallow = g.context_length, min(g.sliding_window, g.context_length)
    ratio = g.slot_kv_bytes(deep) / g.slot_kv_bytes(shallow)
    full_frac, swa_frac = class_split(g, deep)
    w()
    w(f"marginal KV per token: {below:,} B below the window, {above:,} B above it "
      f"({above / below:.0%} of the cost)")
    w(f"kv({deep:,}) / kv({shallow:,}) = {g.slot_kv_bytes(deep):,} / {g.slot_kv_bytes(shallow):,} = {ratio:.2f}× "
      f"(naive {deep / shallow:.0f}×)")
    w(f"at C = {deep:,}: {full_frac:.1%} of a slot's KV is in the {g.n_full} full layers, "
      f"{swa_frac:.1%} in the {g.n_swa} sliding layers")
    depth = min(BOOK_HANDOFF_DEPTH, g.context_length)
    h = handoff_bytes(g, depth)
    w(f"deep handoff at {depth:,} tokens: {h['nope_rows']:,} NoPE rows × {g.n_full * g.kv_row_bytes:,} B "
      f"= {h['nope_bytes']:,} B + {h['swa_rows']:,} ring rows × {g.n_swa} layers × {g.kv_row_bytes:,} B "
      f"= {h['swa_bytes']:,} B; total {h['total_bytes']:,} B")
    top = g.slot_kv_bytes(max(contexts))
    need = slots * top + weights_bytes
    have = machine_memory_bytes()
    verdict = "unknown" if have is None else ("fits" if need <= have else "does not fit")
    w(f"{slots} slots at {max(contexts):,} + weights ({weights_label}, {weights_bytes:,} B) = {need / 1e9:.3f} GB; "
      f"this machine: {have / 1e9:.1f} GB -> {verdict}" if have else f"{need / 1e9:.3f} GB needed")
    return {
        "rows": [dict(asdict(r), agrees=r.agrees) for r in rows],
        "marginal_bytes_below_window": below, "marginal_bytes_above_window": above,
        "depth_ratio": ratio, "full_fraction_at_max": full_frac, "swa_fraction_at_max": swa_frac,
        "handoff": h, "slots": slots, "need_bytes": need, "machine_bytes": have, "fits": verdict,
    }


def allocate(g: Geometry, context: int, slots: int, need: int, have: int | None, out=None) -> dict:
    """Allocate `slots` caches for real and measure MLX's active memory — unless they would not fit."""
    import mlx.core as mx

    out = out or sys.stdout
    if have is not None and need > have:
        print(f"not allocating: {slots} slots at {context:,} need {need / 1e9:.3f} GB, "
              f"more than this machine's {have / 1e9:.1f} GB", file=out)
        return {"allocated": False, "reason": "would not fit"}
    mx.clear_cache()
    before = mx.get_active_memory()
    caches = [SlotCache(g, context) for _ in range(slots)]
    mx.eval([c.state() for c in caches])
    grown = mx.get_active_memory() - before
    accounted = sum(c.nbytes for c in caches)
    print(f"allocated {slots} slots at {context:,}: MLX active memory grew {grown:,} B; "
          f"the caches account for {accounted:,} B", file=out)
    return {"allocated": True, "active_memory_growth": grown, "accounted_bytes": accounted}


def _command(argv=None) -> int:
    p = Parser(prog="python -m muse_mlx.tools.footprint", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a muse-glimmer GGUF (default: the pinned geometry)")
    p.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS),
                   help="comma-separated context lengths (default %(default)s)")
    p.add_argument("--slots", type=int, default=4, help=f"concurrent slots, 1 to {MAX_SLOTS:,} (default %(default)s)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write Figure 22.1 (KV bytes vs context per class) to this file; the name must end in "
                        ".png (nothing is appended) and its folder must exist")
    p.add_argument("--allocate", action="store_true",
                   help="also allocate the slots at the largest context, if they fit this machine")
    p.add_argument("--receipt", help="write a receipt JSON here (its folder must exist)")
    args = p.parse_args(argv)
    contexts = _parse_contexts(args.contexts)
    if not 1 <= args.slots <= MAX_SLOTS:
        shown = args.slots if len(str(args.slots)) <= 24 else f"a {len(str(abs(args.slots)))}-digit number"
        raise MuseError(f"--slots must be between 1 and {MAX_SLOTS:,}, got {shown}")
    from .receipts import check_output

    if args.plot is not None:
        check_output(args.plot, "--plot", suffix=".png")
    if args.receipt is not None:
        check_output(args.receipt, "--receipt")
    if args.model:
        from ..artifact import open_artifact

        a = open_artifact(args.model)
        g, weights_bytes, label = a.geometry, a.file_bytes, Path(args.model).name
    else:
        g, weights_bytes, label = PINNED, PINNED_ARTIFACT_BYTES, "pinned kquant artifact, seed 002"
    too_long = [c for c in contexts if c > g.context_length]
    if too_long:
        raise MuseError(f"context {too_long[0]:,} exceeds the model's limit of {g.context_length:,} positions")
    metrics = report(g, contexts, args.slots, weights_bytes, label)
    if args.allocate:
        metrics["allocation"] = allocate(g, max(contexts), args.slots, metrics["need_bytes"],
                                         metrics["machine_bytes"])
    if args.plot is not None:
        print(f"plot: {plot(g, Path(args.plot))}")
    if args.receipt is not None:
        from .receipts import make_receipt, write_receipt

        r = make_receipt("footprint", inputs={"model": args.model, "contexts": contexts, "slots": args.slots,
                                              "geometry": asdict(g)},
                         metrics=metrics, verdict="agrees" if all(x["agrees"] for x in metrics["rows"])
                         else "disagrees")
        print(f"receipt: {write_receipt(args.receipt, r)}")
    return 0 if all(x["agrees"] for x in metrics["rows"]) else 1


def main(argv=None) -> int:
    return cli.run(_command, argv)


if __name__ == "__main__":
    sys.exit(main())
