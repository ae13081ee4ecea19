"""Fold an `ncu --csv --page raw` listing (scripts/device/profile_decode.sh) by kernel name.

Per name: launches, total and mean time, DRAM read GB/s over the kernel's own time, warp
instructions per KB of DRAM read, occupancy and issue activity (time-weighted means), and
the share of the token's summed kernel time."""

from __future__ import annotations

import csv
import re
import sys
from collections import defaultdict


def rows(path):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    next(reader)  # units
    for r in reader:
        yield dict(zip(header, r))


def num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def short(name: str) -> str:
    """The kernel's name without namespace, argument list and MLX's prefix; MLX appends the
    template integers, so each shape of a kernel keeps a name of its own."""
    name = re.sub(r"\(.*", "", name).split("::")[-1]
    return name.replace("custom_kernel_muse_", "")[:60]


def main(argv: list[str]) -> int:
    """ncu_summary.py LISTING [--parts tag,tag2,... [--ends REGEX]]: with --parts the listing's
    launches are split into that many runs in order (profile_decode.py --variants: one token
    each), each folded on its own: equal runs, or with --ends a run ending at each launch whose
    kernel name matches REGEX (a token's last kernel, e.g. the LM head's "_202048_": variants
    whose tokens launch different numbers of kernels)."""
    path, tags, ends = argv[0] if argv else "", [], None
    if argv[1:2] == ["--parts"] and len(argv) in (3, 5):
        tags = argv[2].split(",")
        if len(argv) == 5:
            if argv[3] != "--ends":
                print(main.__doc__, file=sys.stderr)
                return 2
            ends = re.compile(argv[4])
    elif len(argv) != 1:
        print(main.__doc__, file=sys.stderr)
        return 2
    listing = list(rows(path))
    if not tags:
        fold(listing)
        return 0
    if ends is None:
        if not listing or len(listing) % len(tags):
            print(f"{path}: {len(listing)} launches do not split into {len(tags)} equal parts", file=sys.stderr)
            return 1
        n = len(listing) // len(tags)
        bounds = [(i * n, (i + 1) * n) for i in range(len(tags))]
    else:
        cuts = [i + 1 for i, r in enumerate(listing) if ends.search(r.get("Kernel Name", ""))]
        if len(cuts) != len(tags) or cuts[-1] != len(listing):
            print(f"{path}: {len(cuts)} launches match {ends.pattern!r} (the last at {cuts[-1:]}), "
                  f"not one ending each of {len(tags)} parts of {len(listing)} launches", file=sys.stderr)
            return 1
        bounds = list(zip([0] + cuts[:-1], cuts))
    for tag, (a, b) in zip(tags, bounds):
        print(f"== {tag}: launches {a + 1}-{b}")
        fold(listing[a:b])
    return 0


def fold(listing: list[dict]) -> None:
    agg = defaultdict(lambda: defaultdict(float))
    for r in listing:
        k = agg[short(r.get("Kernel Name", "?"))]
        t = num(r["gpu__time_duration.sum"])
        k["n"] += 1
        k["ns"] += t
        k["read"] += num(r.get("dram__bytes_read.sum", "0"))  # absent from a durations-only listing
        k["inst"] += num(r.get("smsp__inst_executed.sum", "0"))
        for m in ("sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
                  "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
                  "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
                  "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
                  "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
                  "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
                  "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio"):
            k[m] += num(r.get(m, "0")) * t
        k["regs"] = num(r.get("launch__registers_per_thread", "0"))
        k["block"] = num(r.get("launch__block_size", "0"))
        k["grid"] = max(k["grid"], num(r.get("launch__grid_size", "0")))
    total = sum(k["ns"] for k in agg.values())
    print(f"kernels: {sum(int(k['n']) for k in agg.values())}, summed time {total / 1e6:.3f} ms")
    print(f"{'kernel':60} {'n':>4} {'ms':>7} {'%':>5} {'us/each':>8} {'GB/s':>6} {'i/KB':>6} {'occ%':>5} "
          f"{'iss%':>5} {'lsb':>5} {'bar':>5} {'wait':>5} {'ssb':>5} {'mth':>5} {'lgt':>5} regs block grid")
    for name, k in sorted(agg.items(), key=lambda kv: -kv[1]["ns"]):
        t = k["ns"]
        w = (lambda m: k[m] / t if t else 0.0)
        print(f"{name:60} {int(k['n']):4d} {t / 1e6:7.3f} {100 * t / total:5.1f} {t / k['n'] / 1e3:8.2f} "
              f"{k['read'] / t if t else 0:6.0f} {1024 * k['inst'] / k['read'] if k['read'] else 0:6.1f} "
              f"{w('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} "
              f"{w('smsp__issue_active.avg.pct_of_peak_sustained_active'):5.1f} "
              f"{w('smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio'):5.2f} "
              f"{w('smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio'):5.2f} "
              f"{w('smsp__average_warps_issue_stalled_wait_per_issue_active.ratio'):5.2f} "
              f"{w('smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio'):5.2f} "
              f"{w('smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio'):5.2f} "
              f"{w('smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio'):5.2f} "
              f"{int(k['regs']):4d} {int(k['block']):5d} {int(k['grid']):5d}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
