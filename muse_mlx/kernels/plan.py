"""Launch planning: grids, threadgroups and template constants of each kernel, from the shapes,
the device and the KernelConfig. Pure functions, memoised per shape (the decode step asks the
same questions for every token)."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

from ..config import KernelConfig
from .device import Device

MAX_BATCH = 8            # rows of x one matvec.inc launch takes (decode over slots, verify steps, short chunks)
ROWS_PER_GROUP = 4       # simdgroups (output rows) per threadgroup in matvec.inc
COMBINE_WARPS = 4        # the fewest simdgroups merging one query head's splits
STREAM_MAX_THREADS = 512   # 65,536 registers / 512 threads = 128 each; the kernels use 123-128 (ptxas, sm_90a)
STREAM_RED_BYTES = 4096    # the streaming kernels' static threadgroup memory at most (red[2][B*R][NW])

# The streaming one-token matvec (matvec_stream.inc): format name, rows per step R, rows loaded together RF.
STREAM_VARIANTS = {QT.Q4_K: ("q4_k", 8, 4), QT.Q6_K: ("q6_k", 8, 2)}
# With B > 1 rows of x each 64-value unit of K is split over P threads (stream_pieces), and each
# (type, B) steps R rows at a time, RF loaded together: the largest R and RF whose registers stay
# at 128 a thread or fewer (ptxas, sm_90a, CUDA 13.0, at K = 4,096 / 6,656 / 19,968), so that 512
# threads of one or more threadgroups fit a multiprocessor. (Q6_K at B = 4 takes 167 at R = 4.)
STREAM_BATCH_PLAN = {(QT.Q4_K, 2): (8, 2), (QT.Q4_K, 3): (8, 2), (QT.Q4_K, 4): (4, 2),
                     (QT.Q6_K, 2): (8, 2), (QT.Q6_K, 3): (8, 2), (QT.Q6_K, 4): (2, 2)}
STREAM_BATCH_MAX = 4     # rows of x one streaming launch takes (more are split over launches)
ROW_BYTES_PER_256 = {QT.Q4_K: 144, QT.Q6_K: 210}
QUANT_VARIANTS = {QT.Q4_K: "q4_k", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k", QT.Q8_0: "q8_0", QT.NVFP4: "nvfp4"}
FLOAT_DTYPES = {QT.F32: mx.float32, QT.F16: mx.float16, QT.BF16: mx.bfloat16}


def supports(qtype: QT) -> bool:
    """Whether the matvec kernels take this block type (others stay dequantized)."""
    return qtype in QUANT_VARIANTS or qtype in FLOAT_DTYPES


def stream_threads(K: int) -> int | None:
    """Threads of a one-row streaming matvec: one 64-value unit of K each, rounded up to whole
    simdgroups.

    None past STREAM_MAX_THREADS (K > 32,768): MLX launches without launch bounds, so a larger
    group could ask for more registers than a multiprocessor has; such rows take matvec.inc."""
    t = -(-(K // 64) // 32) * 32
    return t if t <= STREAM_MAX_THREADS else None


def streams(qtype: QT, K: int) -> bool:
    """Whether a product with a (N, K) matrix of this type takes the streaming kernel."""
    return qtype in STREAM_VARIANTS and stream_threads(K) is not None


def stream_pieces(B: int) -> int:
    """Threads that share one 64-value unit of K with B rows of x: each keeps 64 / P values of
    every row in registers (B x 64 / P <= 64)."""
    return 1 if B == 1 else 2 if B == 2 else 4


class StreamPlan(NamedTuple):
    """How one streaming matvec launch walks its rows."""
    rows: int          # R: rows per step (one threadgroup barrier each)
    rows_loaded: int   # RF: rows whose pieces are loaded together
    groups: int        # threadgroups along the rows (grid x)
    pieces: int        # P: threads a 64-value unit of K
    parts: int         # KS: threadgroups along K (grid y); their sums are added after the launch
    units: int         # UPG: units of K a threadgroup covers
    threads: int       # TPG


def stream_groups(threads: int, device: Device, config: KernelConfig) -> int:
    """Threadgroups of a one-row streaming matvec: the config's, else on CUDA as many as fit on
    each multiprocessor at once by registers (~128 a thread: 512 threads), so that enough warps
    have loads in flight; on Metal the planning value (unmeasured)."""
    if config.stream_groups:
        return config.stream_groups
    if device.backend != "cuda":
        return device.cores
    return device.cores * max(1, STREAM_MAX_THREADS // threads)


def stream_batch_rows(config: KernelConfig) -> int:
    """Rows of x one streaming launch takes with B > 1 (x in registers, 64 / P values a row a
    thread): config.stream_batch, at most STREAM_BATCH_MAX; 0 when it is below 2 (products of
    several rows then take matvec.inc)."""
    rows = min(config.stream_batch, STREAM_BATCH_MAX)
    return rows if rows >= 2 else 0


@lru_cache(maxsize=None)
def stream_plan(qtype: QT, K: int, N: int, device: Device, config: KernelConfig, B: int = 1) -> StreamPlan:
    """The launch of a streaming matvec over N rows of length K for B rows of x (streams(qtype, K)
    must hold; 1 <= B <= STREAM_BATCH_MAX).

    One row of x: a thread a unit, the threadgroup over all of K. B > 1: P threads a unit, and
    where P x K / 64 threads would pass STREAM_MAX_THREADS, K in KS parts, one threadgroup each
    (the FFN down product's K = 19,968: 2 parts at P = 2, 3 at P = 4). A matrix with fewer row
    groups than multiprocessors (V: 256 rows, 32 groups of 8) would leave most of the GPU idle,
    each group working through its rows one after another: fewer rows per group instead, down
    to 2 (docs/kernels.md)."""
    units = K // 64
    P = stream_pieces(B)
    if B == 1:
        _, R, RF = STREAM_VARIANTS[qtype]
    else:
        R, RF = STREAM_BATCH_PLAN[qtype, B]
    parts = -(-units * P // STREAM_MAX_THREADS)
    upg = -(-units // parts)
    threads = -(-upg * P // 32) * 32
    while R > 2 and -(-N // R) < device.cores:
        R //= 2
        RF = min(RF, R)
    if B == 1:
        groups = stream_groups(threads, device, config)
    else:
        groups = config.stream_groups or max(1, stream_groups(threads, device, config) // parts)
    return StreamPlan(R, RF, min(-(-N // R), groups), P, parts, upg, threads)


@lru_cache(maxsize=None)
def stream_launch(qtype: QT, K: int, N: int, act: str, up_offset: int, device: Device,
                  config: KernelConfig, B: int = 1, row_stride: int = 0) -> tuple[str, dict]:
    """(kernel name, launch keywords) of a streaming matvec over B rows of x; act '' or '_silu';
    row_stride: floats between x's rows (0: K). Its output is (B, N), or (KS, B, N) with K in
    KS parts (the caller adds them)."""
    variant = STREAM_VARIANTS[qtype][0]
    p = stream_plan(qtype, K, N, device, config, B)
    template = [("K", K), ("N", N), ("B", B), ("XS", row_stride or K), ("TPG", p.threads), ("R", p.rows),
                ("RF", p.rows_loaded), ("RB", K // 256 * ROW_BYTES_PER_256[qtype]), ("P", p.pieces),
                ("UPG", p.units), ("KS", p.parts)]
    template += [("UP_OFF", up_offset)] if act else []
    return f"matvec_stream{act}_{variant}", dict(
        template=template, grid=(p.groups * p.threads, p.parts, 1), threadgroup=(p.threads, 1, 1),
        output_shapes=[(p.parts, B, N) if p.parts > 1 else (B, N)], output_dtypes=[mx.float32], stream=mx.gpu)


@lru_cache(maxsize=None)
def batch_launch(qtype: QT, K: int, N: int, B: int) -> tuple[str, dict]:
    """(kernel name, launch keywords) of matvec.inc over B rows of x."""
    groups = -(-N // ROWS_PER_GROUP)
    template = [("K", K), ("N", N), ("B", B), ("RPT", ROWS_PER_GROUP)]
    if qtype in FLOAT_DTYPES:
        template.append(("WT", FLOAT_DTYPES[qtype]))
    name = f"matvec_{QUANT_VARIANTS[qtype]}" if qtype in QUANT_VARIANTS else "matvec_float"
    return name, dict(grid=(groups * ROWS_PER_GROUP * 32, 1, 1), threadgroup=(ROWS_PER_GROUP * 32, 1, 1),
                      output_shapes=[(B, N)], output_dtypes=[mx.float32], template=template, stream=mx.gpu)


# The dequantization's units a row (dequant.inc: one thread each) by values a unit.
DEQUANT_UNIT = {QT.Q4_K: 32, QT.Q5_K: 32, QT.Q6_K: 16, QT.Q8_0: 32, QT.NVFP4: 16}
DEQUANT_THREADS = 256


@lru_cache(maxsize=None)
def dequant_launch(qtype: QT, K: int, N: int) -> tuple[str, dict]:
    """(kernel name, launch keywords) of dequant.inc: (N, row_bytes) raw rows -> (N, K) float16."""
    upr = K // DEQUANT_UNIT[qtype]
    groups = -(-(N * upr) // DEQUANT_THREADS)
    template = [("K", K), ("N", N), ("UPR", upr), ("TPG", DEQUANT_THREADS)]
    return f"dequant_{QUANT_VARIANTS[qtype]}", dict(
        grid=(groups * DEQUANT_THREADS, 1, 1), threadgroup=(DEQUANT_THREADS, 1, 1), output_shapes=[(N, K)],
        output_dtypes=[mx.float16], template=template, stream=mx.gpu)


# ---- decode attention ----------------------------------------------------------------


def combine_warps(nsplit: int, config: KernelConfig) -> int:
    """The combine's simdgroups for `nsplit` partial results: the config's, or when 0 one per 16
    splits, at least 4 and at most 32 (each simdgroup then walks ~16 splits, its loads in flight
    four at a time, instead of nsplit / 4)."""
    return config.combine_warps or max(COMBINE_WARPS, min(32, -(-nsplit // 16)))


def attention_params(n_valid: int, chunk: int, splits: int | None = None) -> mx.array:
    """The runtime scalars of the decode attention: rows visible and splits (int32[8]).
    `splits` defaults to the fewest that cover n_valid; more leave the extra splits empty,
    which the combine weighs at zero."""
    splits = max(1, -(-n_valid // chunk)) if splits is None else splits
    if splits * chunk < n_valid:
        raise ValueError(f"{splits} splits of {chunk} rows do not cover {n_valid} rows")
    return mx.array([n_valid, splits, 0, 0, 0, 0, 0, 0], dtype=mx.int32)


def attention_splits(n_valid: int, chunk: int, capacity: int) -> int:
    """A split count for n_valid rows that stays the same over many tokens, for a compiled step
    (whose grids are fixed at trace time): the fewest splits, rounded up to a multiple of a
    quarter of their highest power of two (at most 25 % of them empty; about four counts per
    doubling of the depth), and at most the splits of the whole storage."""
    need = max(1, -(-n_valid // chunk))
    step = 1 << max(0, need.bit_length() - 3)
    return min(-(-need // step) * step, max(need, -(-capacity // chunk)))


def _warps_for(group: int) -> int:
    return next(nw for nw in (4, 3, 2, 1) if group % nw == 0)


@lru_cache(maxsize=None)
def attention_launch(q_shape: tuple, kv_shape: tuple, chunk: int, nsplit: int, gated: bool, gate_offset: int,
                     out_shape: tuple | None, config: KernelConfig) -> tuple[dict, dict]:
    """The launch keywords of the decode attention's partial and combine kernels."""
    n_head, hd = q_shape
    n_kv, cap, _ = kv_shape
    group = n_head // n_kv
    nw = _warps_for(group)
    cw = combine_warps(nsplit, config)
    partial = dict(
        template=[("HD", hd), ("G", group), ("HPW", group // nw), ("CAP", cap), ("CHUNK", chunk)],
        grid=(nsplit * nw * 32, n_kv, 1), threadgroup=(nw * 32, 1, 1),
        output_shapes=[(n_head * nsplit * hd,), (n_head * nsplit * 2,)],
        output_dtypes=[mx.float32, mx.float32], stream=mx.gpu)
    combine = dict(
        template=[("HD", hd), ("CW", cw)] + ([("GATE_OFF", gate_offset)] if gated else []),
        grid=(n_head * cw * 32, 1, 1), threadgroup=(cw * 32, 1, 1),
        output_shapes=[out_shape or (n_head, hd)], output_dtypes=[mx.float32], stream=mx.gpu)
    return partial, combine
