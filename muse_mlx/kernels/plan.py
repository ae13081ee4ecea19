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
# With B > 1 rows of x (x_shared): rows per step R by B, and rows of weights decoded per pass over
# x RF (KernelConfig.stream_batch_rf overrides it): RF = 2 took one step's products at B = 2 / 3 / 4
# from 14.5 / 22.1 / 32.4 ms to 12.1 / 18.0 / 26.1 (H200, 2026-12-01, 2d74d6b, ledger).
STREAM_BATCH_R = {QT.Q4_K: {2: 8, 3: 8, 4: 8}, QT.Q6_K: {2: 8, 3: 8, 4: 4}}
STREAM_BATCH_RF = 2
# Registers a thread of the x_shared kernels takes, by (type, B, RF): ptxas, sm_90a, NVRTC 13.0 with
# MLX 0.32.1's headers (scripts/nvrtc_check.py), the most over K = 4,096 / 6,656 / 19,968, plain and
# silu forms. MLX launches without launch bounds, so a threadgroup must fit the multiprocessor's
# GROUP_REGISTERS (fits_registers): an RF whose registers would not is lowered (at 255 some spill).
STREAM_BATCH_REGISTERS = {
    (QT.Q4_K, 2, 1): 126, (QT.Q4_K, 2, 2): 128, (QT.Q4_K, 2, 4): 168,
    (QT.Q4_K, 3, 1): 138, (QT.Q4_K, 3, 2): 170, (QT.Q4_K, 3, 4): 254,
    (QT.Q4_K, 4, 1): 176, (QT.Q4_K, 4, 2): 254, (QT.Q4_K, 4, 4): 255,
    (QT.Q6_K, 2, 1): 140, (QT.Q6_K, 2, 2): 168, (QT.Q6_K, 2, 4): 255,
    (QT.Q6_K, 3, 1): 180, (QT.Q6_K, 3, 2): 255, (QT.Q6_K, 3, 4): 255,
    (QT.Q6_K, 4, 1): 194, (QT.Q6_K, 4, 2): 255, (QT.Q6_K, 4, 4): 255,
}
GROUP_REGISTERS = 65536
# The register file is four sub-partitions of GROUP_REGISTERS / 4, a block's warps spread over them.
REGISTER_PARTS = 4


def fits_registers(regs: int, threads: int) -> bool:
    """Whether a threadgroup of `threads` threads taking `regs` registers each can launch (MLX
    launches without launch bounds): registers go to a warp in units of 256 (8 a thread) and the
    block's warps, rounded up to a multiple of REGISTER_PARTS, must fit GROUP_REGISTERS
    (cuda_occupancy.h, cudaOccMaxBlocksPerSMRegsLimit). 21 warps of 83 registers do not (24 x 32 x 88
    = 67,584): that Q4_K launch failed with "too many resources requested for launch" and, inside
    one of MLX's CUDA graphs, gave wrong sums and no error (H200, 2026-12-06, ledger)."""
    warps = -(-threads // 32)
    return 32 * -(-regs // 8) * 8 * -(-warps // REGISTER_PARTS) * REGISTER_PARTS <= GROUP_REGISTERS


def groups_by_registers(regs: int, threads: int) -> int:
    """Threadgroups of `threads` threads a multiprocessor holds at once by registers (the same rule)."""
    warps = -(-threads // 32)
    return GROUP_REGISTERS // REGISTER_PARTS // (32 * -(-regs // 8) * 8) * REGISTER_PARTS // warps
ROW_BYTES_PER_256 = {QT.Q4_K: 144, QT.Q6_K: 210}
QUANT_VARIANTS = {QT.Q4_K: "q4_k", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k", QT.Q8_0: "q8_0", QT.NVFP4: "nvfp4"}
FLOAT_DTYPES = {QT.F32: mx.float32, QT.F16: mx.float16, QT.BF16: mx.bfloat16}


def supports(qtype: QT) -> bool:
    """Whether the matvec kernels take this block type (others stay dequantized)."""
    return qtype in QUANT_VARIANTS or qtype in FLOAT_DTYPES


def stream_threads(K: int) -> int | None:
    """Threads of a streaming matvec: one 64-value unit of K each, rounded up to whole simdgroups.

    None past STREAM_MAX_THREADS (K > 32,768): MLX launches without launch bounds, so a larger
    group could ask for more registers than a multiprocessor has; such rows take matvec.inc."""
    t = -(-(K // 64) // 32) * 32
    return t if t <= STREAM_MAX_THREADS else None


def streams(qtype: QT, K: int) -> bool:
    """Whether a one-token product with a (N, K) matrix of this type takes the streaming kernel."""
    return qtype in STREAM_VARIANTS and stream_threads(K) is not None


class StreamPlan(NamedTuple):
    """How one streaming matvec launch walks its rows."""
    rows: int          # R: rows per step (one threadgroup barrier each)
    rows_loaded: int   # RF: rows whose pieces are loaded together
    groups: int        # threadgroups in the grid


def stream_groups(threads: int, device: Device, config: KernelConfig) -> int:
    """Threadgroups of a streaming matvec: the config's, else on CUDA as many as fit on each
    multiprocessor at once by registers (~128 a thread: 512 threads), so that enough warps have
    loads in flight; on Metal the planning value (unmeasured)."""
    if config.stream_groups:
        return config.stream_groups
    if device.backend != "cuda":
        return device.cores
    return device.cores * max(1, STREAM_MAX_THREADS // threads)


def stream_batch_rows(K: int, device: Device, config: KernelConfig) -> int:
    """Rows of x one batched streaming launch takes (x_shared: B x 64 floats a thread of
    threadgroup memory): at most config.stream_batch, as many as the device's threadgroup memory holds;
    0 when fewer than 2 fit (products of several rows then take matvec.inc)."""
    threads = stream_threads(K)
    if threads is None:
        return 0
    rows = min(config.stream_batch, (device.group_memory - STREAM_RED_BYTES) // (4 * 64 * threads))
    return rows if rows >= 2 else 0


@lru_cache(maxsize=None)
def stream_plan(qtype: QT, K: int, N: int, device: Device, config: KernelConfig, B: int = 1) -> StreamPlan:
    """The launch of a streaming matvec over N rows of length K for B rows of x (streams(qtype, K)
    must hold; B > 1: at most stream_batch_rows).

    A matrix with fewer row groups than multiprocessors (V: 256 rows, 32 groups of 8) would
    leave most of the GPU idle, each group working through its rows one after another: fewer
    rows per group instead, down to 2 (docs/kernels.md). With B rows of x each thread keeps B
    sets of sums: STREAM_BATCH_R rows a step, STREAM_BATCH_RF (or the config's) decoded per pass
    over x while their registers fit a threadgroup, and as many threadgroups share a
    multiprocessor as its threadgroup memory holds."""
    _, R, RF = STREAM_VARIANTS[qtype]
    threads = stream_threads(K)
    if B > 1:
        R = STREAM_BATCH_R[qtype][B]
        RF = min(R, config.stream_batch_rf or STREAM_BATCH_RF)
        while RF > 1 and not fits_registers(STREAM_BATCH_REGISTERS[qtype, B, RF], threads):
            RF //= 2
    while R > 2 and -(-N // R) < device.cores:
        R //= 2
        RF = min(RF, R)
    if B == 1:
        groups = stream_groups(threads, device, config)
    elif config.stream_groups:
        groups = config.stream_groups
    else:
        by_memory = device.group_memory // (4 * 64 * B * threads + STREAM_RED_BYTES)
        groups = device.cores * max(1, min(by_memory, STREAM_MAX_THREADS // threads))
    return StreamPlan(R, RF, min(-(-N // R), groups))


@lru_cache(maxsize=None)
def stream_launch(qtype: QT, K: int, N: int, act: str, up_offset: int, device: Device,
                  config: KernelConfig, B: int = 1, row_stride: int = 0) -> tuple[str, int, dict]:
    """(kernel name, its threadgroup memory in bytes, launch keywords) of a streaming matvec over
    B rows of x; act '' or '_silu'; row_stride: floats between x's rows (0: K)."""
    variant = STREAM_VARIANTS[qtype][0]
    tpg = stream_threads(K)
    plan = stream_plan(qtype, K, N, device, config, B)
    template = [("K", K), ("N", N), ("B", B), ("XS", row_stride or K), ("TPG", tpg), ("R", plan.rows),
                ("RF", plan.rows_loaded), ("RB", K // 256 * ROW_BYTES_PER_256[qtype])]
    template += [("UP_OFF", up_offset)] if act else []
    where, memory = ("", 0) if B == 1 else ("_shared", 4 * 64 * B * tpg)
    return f"matvec_stream{where}{act}_{variant}", memory, dict(
        template=template, grid=(plan.groups * tpg, 1, 1), threadgroup=(tpg, 1, 1), output_shapes=[(B, N)],
        output_dtypes=[mx.float32], stream=mx.gpu)


# The tensor-core form (matvec_stream.inc, mma_*): x's fragments, 1,056 bytes a 64-value unit of K
# (1,024 of fragments, 32 of group sums), in dynamic threadgroup memory; red[2][NW][128] and
# tmax[NW][4] static, per warp.
MMA_UNIT_BYTES = {QT.Q4_K: 1088, QT.Q6_K: 1056}   # Q4_K: and 32 of its mins' fragments (128 a block)
MMA_WARP_BYTES = 2 * 128 * 4 + 16
MMA_MAX_ROWS = 4          # B's eight columns: hi and lo of 4 rows of x
# Warps a threadgroup at most: 26 against 13 took gate|up from 0.159 to 0.116 ms at B = 4, the
# LM head's rows and FFN down (Q6_K) by 16-19 % (H200, 4509bef, ledger): more loads in flight.
MMA_MAX_WARPS = 32
# Registers a thread by type as allocated (whole units of 8), at least the most any build took:
# Q4_K's block loop 77-86 and Q6_K's 60-72 under NVRTC 13.0.88 (MLX's compiler) and nvcc 13.0 over
# the pinned model's plans at two to four rows, split and whole-tile plans alike (2026-12-05/06).
# With fits_registers they allow Q4_K 20 warps a threadgroup and Q6_K 28.
MMA_REGISTERS = {QT.Q4_K: 88, QT.Q6_K: 72}
# Warps a threadgroup the planner gives a type at most (KernelConfig.mma_warps = 0): Q6_K's plans
# were measured with at most 25 (the register rule before 2026-12-06 allowed no more); 26-28 are
# not timed.
MMA_PLANNED_WARPS = {QT.Q4_K: MMA_MAX_WARPS, QT.Q6_K: 25}
SM_THREADS = 2048
# Parts of K (grid y) at most; each adds B x N partial sums for one more node to add. With
# KernelConfig.mma_parts = 6 this bound keeps K = 6,656 (26 blocks: 1, 2, 13 or 26 parts) whole:
# the packed step was measured so (ledger, 2026-12-03, c202a3c); 13 parts there are not measured.
MMA_MAX_PARTS = 8


class MmaPlan(NamedTuple):
    warps: int       # NW: warps a threadgroup
    parts: int       # KP: parts of K (grid y), each with its own fragments; > 1 adds their products
    groups: int      # threadgroups in x (per part), each taking NW / KW tiles of 16 rows a round
    memory: int      # dynamic threadgroup memory, bytes
    tile_warps: int  # KW: warps splitting a tile's units of K (KW = 1: a warp sums a tile alone)


def _mma_warps(units: int, limit: int) -> int:
    """The warps (at most `limit`) that split `units` with the fewest idle, the most on a tie."""
    return min(range(1, min(units, limit) + 1), key=lambda nw: (-(-units // nw) * nw - units, -nw))


# The units of K a warp takes at a time: a whole block (mma_block_tiles).
MMA_GRANULE = 4

# A round's barrier and partial sums (KW > 1), in units of one warp's work on one 64-value unit of
# a tile (a planning value, not measured).
MMA_ROUND_UNITS = 2


# The most warps a tile that the planner gives a form on its own (KernelConfig.mma_tile_warps = 0):
# Q4_K's block form has passed the GPU checks with up to five warps a tile (8,448 x 6,656 and
# 256 x 6,656 at B = 2-4; 7b7d60d H200, 98cd826 H100, 6d5fc71 H200). The 21-warp whole-tile plan that
# summed wrong (256 x 6,656, 98cd826 H100 and 6d5fc71 H200) could not launch: 21 warps of 83
# registers exceed the register file (fits_registers), which the planner now keeps to; whole-tile
# and wider splits of Q4_K that fit are not checked on a GPU yet.
MMA_CHECKED_TILE_WARPS = {QT.Q4_K: 5}


def mma_split(tiles: int, units: int, groups: int, limit: int, tile_warps: int = 0,
              most_kw: int = 0) -> tuple[int, int]:
    """(NW, KW) of the tensor-core form: at most `limit` warps a threadgroup, KW (tile_warps
    when given, else at most most_kw where that is set) of them on each tile. Chosen to make the
    busiest warp's work the least, counted in units of K: rounds x (units a warp of a tile +
    MMA_ROUND_UNITS where KW > 1), where a round gives each of `groups` threadgroups NW / KW
    tiles, and a warp's units come MMA_GRANULE at a time; on a tie, the most threadgroups busy,
    then the most warps (more loads in flight)."""
    granule = MMA_GRANULE

    def cost(nw: int, kw: int) -> tuple:
        tpg = nw // kw
        rounds = -(-tiles // (groups * tpg))
        return (rounds * (granule * -(-units // (granule * kw)) + (MMA_ROUND_UNITS if kw > 1 else 0)),
                -min(groups, -(-tiles // tpg)), -nw)
    kws = [tile_warps] if tile_warps else range(1, min(limit, units // granule, most_kw or limit) + 1)
    return min(((nw, kw) for kw in kws for nw in range(kw, limit + 1, kw)), key=lambda p: cost(*p))


@lru_cache(maxsize=None)
def mma_plan(qtype: QT, K: int, N: int, B: int, device: Device, config: KernelConfig) -> MmaPlan | None:
    """The tensor-core form's launch for B rows of x over an (N, K) matrix, or None where it does
    not apply (another type, more than MMA_MAX_ROWS rows, K not whole 256-value blocks, or
    fragments that no part count up to MMA_MAX_PARTS fits into threadgroup memory). K is split into
    parts of whole blocks: the fewest from config.mma_parts up whose fragments fit, else the fewest
    below it; KW warps share a tile (the config's, else mma_split's); the threadgroups fill the multiprocessors as far as their memory,
    threads and registers allow."""
    if qtype not in STREAM_VARIANTS or not 1 <= B <= MMA_MAX_ROWS or K % 256 or K <= 0:
        return None
    units, granule, regs = K // 64, MMA_GRANULE, MMA_REGISTERS[qtype]
    limit = max(nw for nw in range(1, (config.mma_warps or MMA_PLANNED_WARPS[qtype]) + 1)
                if fits_registers(regs, 32 * nw))
    tiles = -(-N // 16)
    first = max(1, config.mma_parts)
    for parts in [*range(first, MMA_MAX_PARTS + 1), *range(1, first)]:   # from config.mma_parts up, else the fewest
        if units % parts or (units // parts) % 4:
            continue
        upp = units // parts
        memory = MMA_UNIT_BYTES[qtype] * upp + 32
        room = min(limit, (device.group_memory - memory) // MMA_WARP_BYTES)   # the warps' buffers
        if config.mma_tile_warps >= min(limit, upp // granule):   # the whole threadgroup on one tile
            warps = kw = _mma_warps(upp // granule, limit)
        elif room >= max(1, config.mma_tile_warps):
            warps, kw = mma_split(tiles, upp, config.stream_groups or max(1, device.cores // parts), room,
                                  config.mma_tile_warps, MMA_CHECKED_TILE_WARPS.get(qtype, 0))
        else:
            continue
        static = MMA_WARP_BYTES * warps
        if memory + static <= device.group_memory:
            break
    else:
        return None
    if config.stream_groups:
        groups = config.stream_groups
    else:
        threads = 32 * warps
        per_core = max(1, min(device.group_memory // (memory + static), SM_THREADS // threads,
                              groups_by_registers(regs, threads)))
        groups = max(1, device.cores * per_core // parts)
    return MmaPlan(warps, parts, min(-(-tiles // (warps // kw)), groups), memory, kw)


@lru_cache(maxsize=None)
def mma_launch(qtype: QT, K: int, N: int, device: Device, config: KernelConfig, B: int,
               row_stride: int = 0) -> tuple[str, int, dict]:
    """(kernel name, its threadgroup memory in bytes, launch keywords) of the tensor-core form over
    B rows of x (mma_plan must give a plan); the output is (B, N), or (parts, B, N) to be summed."""
    p = mma_plan(qtype, K, N, B, device, config)
    template = [("K", K), ("N", N), ("B", B), ("XS", row_stride or K), ("NW", p.warps), ("KW", p.tile_warps),
                ("KP", p.parts), ("RB", K // 256 * ROW_BYTES_PER_256[qtype])]
    shape = (B, N) if p.parts == 1 else (p.parts, B, N)
    return f"matvec_mma_{STREAM_VARIANTS[qtype][0]}", p.memory, dict(
        template=template, grid=(p.groups * 32 * p.warps, p.parts, 1), threadgroup=(32 * p.warps, 1, 1),
        output_shapes=[shape], output_dtypes=[mx.float32], stream=mx.gpu)


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


# The combine's simdgroups under KernelConfig.batch_invariant (when combine_warps is 0): a planning
# value, not measured (a 131,072-row plane in 128-row splits gives each 64 splits to walk).
INVARIANT_COMBINE_WARPS = 16


def combine_warps(nsplit: int, config: KernelConfig) -> int:
    """The combine's simdgroups for `nsplit` partial results: the config's, or when 0 one per 16
    splits, at least 4 and at most 32 (each simdgroup then walks ~16 splits, its loads in flight
    four at a time, instead of nsplit / 4). With batch_invariant a fixed count (the config's, or
    INVARIANT_COMBINE_WARPS): simdgroup w sums splits w, w + CW, ... and the CW sums are added in
    order, so a sequence's non-empty splits are summed in one order whatever split count its
    batch gives the launch (its empty ones add exact zeros)."""
    if config.batch_invariant:
        return config.combine_warps or INVARIANT_COMBINE_WARPS
    return config.combine_warps or max(COMBINE_WARPS, min(32, -(-nsplit // 16)))


def attention_params(n_valid: int, chunk: int, splits: int | None = None) -> mx.array:
    """The runtime scalars of the decode attention: rows visible and splits (int32[8]).
    `splits` defaults to the fewest that cover n_valid; more leave the extra splits empty,
    which the combine weighs at zero."""
    splits = max(1, -(-n_valid // chunk)) if splits is None else splits
    if splits * chunk < n_valid:
        raise ValueError(f"{splits} splits of {chunk} rows do not cover {n_valid} rows")
    return mx.array([n_valid, splits, 0, 0, 0, 0, 0, 0], dtype=mx.int32)


def plane_chunk(n_valid: int, config: KernelConfig) -> int:
    """Rows per split of a plane's decode attention over n_valid rows: config.plane_chunk, halved
    (not below config.ring_chunk) while n_valid would take fewer than config.plane_splits_min
    splits (0: never). Few values (one a doubling of the depth up to plane_chunk), so few traces.
    With batch_invariant always plane_chunk: a batch's rows per split follow its deepest sequence,
    and a sequence split otherwise than alone would be summed in another order."""
    chunk = config.plane_chunk
    if config.batch_invariant:
        return chunk
    while config.plane_splits_min and chunk // 2 >= config.ring_chunk \
            and -(-n_valid // chunk) < config.plane_splits_min:
        chunk //= 2
    return chunk


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
                     out_shape: tuple | None, config: KernelConfig, seqs: int = 0, gate_row: int = 0) -> tuple[dict, dict]:
    """kv_shape: one of K and V's (n_kv, CAP, HD). The launch keywords of the decode attention's partial and combine kernels: one sequence,
    or (seqs > 0: the _seqs kernels) `seqs` sequences in one launch each, sequence s's gate at
    gate_offset + s * gate_row and its output row s of out_shape."""
    n_head, hd = q_shape
    n_kv, cap, _ = kv_shape
    group = n_head // n_kv
    nw = _warps_for(group)
    cw = combine_warps(nsplit, config)
    b = max(1, seqs)
    partial = dict(
        template=[("HD", hd), ("G", group), ("HPW", group // nw), ("NKV", n_kv), ("CAP", cap), ("CHUNK", chunk)],
        grid=(nsplit * nw * 32, n_kv * b, 1), threadgroup=(nw * 32, 1, 1),
        output_shapes=[(b * n_head * nsplit * hd,), (b * n_head * nsplit * 2,)],
        output_dtypes=[mx.float32, mx.float32], stream=mx.gpu)
    combine = dict(
        template=[("HD", hd), ("CW", cw)] + ([("NH", n_head)] if seqs else [])
        + ([("GATE_OFF", gate_offset)] if gated else []) + ([("GATE_ROW", gate_row)] if gated and seqs else []),
        grid=(n_head * cw * 32, b, 1), threadgroup=(cw * 32, 1, 1),
        output_shapes=[out_shape or ((seqs, n_head * hd) if seqs else (n_head, hd))], output_dtypes=[mx.float32],
        stream=mx.gpu)
    return partial, combine


# The flash prefill attention (prefill_attention.inc): warps a threadgroup (one m16 tile of
# (query, head) rows each) and the keys a tile may take, largest first within the memory.
PREFILL_ATTENTION_WARPS = 4
PREFILL_ATTENTION_KEYS = (64, 32, 16)


def prefill_attention_memory(head_dim: int, keys: int) -> int:
    """Bytes of threadgroup memory: a tile of K rows and of V columns (each padded by 4 words),
    the tile's key positions and two flags."""
    return 4 * (keys * (head_dim // 2 + 4) + head_dim * (keys // 2 + 4) + keys + 4)


@lru_cache(maxsize=None)
def prefill_attention_launch(L: int, n_head: int, n_kv: int, head_dim: int, device: Device) -> tuple[int, dict] | None:
    """(threadgroup memory in bytes, launch keywords) of attention_prefill for L queries, or None
    where it does not apply (a head dim not a multiple of 16, heads not a multiple of the KV
    heads, no key tile within the device's threadgroup memory)."""
    if head_dim % 16 or n_head % n_kv or L < 1:
        return None
    limit = min(device.group_memory, 48 * 1024)
    kb = next((k for k in PREFILL_ATTENTION_KEYS if prefill_attention_memory(head_dim, k) <= limit), None)
    if kb is None:
        return None
    G, nw = n_head // n_kv, PREFILL_ATTENTION_WARPS
    tiles = -(-(L * G) // 16)
    groups = -(-tiles // nw)
    template = [("HD", head_dim), ("G", G), ("NKV", n_kv), ("NW", nw), ("KB", kb)]
    return prefill_attention_memory(head_dim, kb), dict(
        template=template, grid=(groups * 32 * nw, n_kv, 1), threadgroup=(32 * nw, 1, 1),
        output_shapes=[(L, n_head * head_dim)], output_dtypes=[mx.float32], stream=mx.gpu)
