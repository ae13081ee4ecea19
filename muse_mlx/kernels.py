"""The GPU kernel path: backend choice and kernels built from custom_kernels/.

Each kernel body in `custom_kernels/*.inc` is written once against a small dialect
map. For a backend we compose

    header = dialect_<backend>.h + blocks.h          (types, helpers, block decoders)
    source = indices_<backend>.h + the body sections (thread indices as text, so MLX's
                                                      Metal wrapper sees the attribute names)

and hand them to `mx.fast.metal_kernel` (Apple GPUs) or `mx.fast.cuda_kernel` (NVIDIA).
The CUDA instantiation is the one executed and checked here (on an H200); the Metal
instantiation is the same body under the Metal map and has not been run on Apple
hardware in this project.

Backend choice: Metal if available, else CUDA, else none (the MLX-ops reference path).
`MUSE_MLX_REFERENCE=1` forces the reference path everywhere.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from typing import NamedTuple

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

MAX_BATCH = 8            # matvec rows handled by one launch (decode, small prefill chunks, verification)
ROWS_PER_GROUP = 4       # simdgroups (output rows) per threadgroup in the matvecs
RING_CHUNK, PLANE_CHUNK = 32, 128   # attention rows per split for rings / planes (MUSE_MLX_ATTN_CHUNK)
COMBINE_WARPS = 4                    # the fewest simdgroups merging one query head's splits (MUSE_MLX_COMBINE_WARPS)


def attention_prefetch_rows() -> int:
    """Rows of K/V the attention partial loads together (MUSE_MLX_ATTN_ROWS, default 8). On the
    H200 (Nsight Compute, one token at depth 32,768; docs/kernels.md "Fifth session") 8 rows
    took the partials of a 32,776-row plane from 125.5 to 102.5 us and of a 2,048-row ring
    from 33.2 to 26.6 us against 1 row at a time."""
    value = os.environ.get("MUSE_MLX_ATTN_ROWS", "") or "8"
    if not value.isdigit() or not 1 <= int(value) <= 32:
        raise ValueError(f"MUSE_MLX_ATTN_ROWS must be an integer 1..32, not {value!r}")
    return int(value)


ATTENTION_LOOPS = ("rows", "butterfly")


def attention_loop() -> str:
    """The attention partial's walk over its rows (MUSE_MLX_ATTN_LOOP): butterfly (default:
    attention.inc `partial_butterfly`, the dot products of 32 (row, head) pairs summed in one
    butterfly) or rows (`partial`, one simdgroup reduction per row and head). On the H200
    (Nsight Compute, one token at depth 32,768; docs/kernels.md "Sixth session") the butterfly
    took a 32,785-row plane's partial from 102.6 to 40.8 us and a 2,048-row ring's from 26.4
    to 10.8-15.4 us."""
    choice = os.environ.get("MUSE_MLX_ATTN_LOOP", "") or "butterfly"
    if choice not in ATTENTION_LOOPS:
        raise ValueError(f"MUSE_MLX_ATTN_LOOP must be one of {', '.join(ATTENTION_LOOPS)}, not {choice!r}")
    return choice


def attention_chunks() -> tuple[int, int]:
    """Rows per split of the attention partial for rings and for planes (MUSE_MLX_ATTN_CHUNK,
    "RING,PLANE", default RING_CHUNK,PLANE_CHUNK). Fewer rows a split: more threadgroups, each
    a shorter chain of dependent row updates, and more partial results for the combine."""
    value = os.environ.get("MUSE_MLX_ATTN_CHUNK", "")
    if not value:
        return RING_CHUNK, PLANE_CHUNK
    parts = value.split(",")
    if len(parts) != 2 or not all(p.isdigit() and 1 <= int(p) <= 65536 for p in parts):
        raise ValueError(f"MUSE_MLX_ATTN_CHUNK must be two integers 1..65536, 'RING,PLANE', not {value!r}")
    return int(parts[0]), int(parts[1])


def combine_warps_setting() -> int:
    """Simdgroups of the attention combine per query head (MUSE_MLX_COMBINE_WARPS): a number
    1..32, or 0 / "auto" (the default) for combine_warps(nsplit), one per 16 splits from
    COMBINE_WARPS up to 32. On the H200 (ncu, depth 32,768) a plane's combine of 257 splits
    took 8.5 us in 17 simdgroups against ~18 in 4 (docs/kernels.md "Sixth session")."""
    value = os.environ.get("MUSE_MLX_COMBINE_WARPS", "") or "auto"
    if value == "auto":
        return 0
    if not value.isdigit() or not 0 <= int(value) <= 32:
        raise ValueError(f"MUSE_MLX_COMBINE_WARPS must be 'auto' or an integer 0..32, not {value!r}")
    return int(value)


def combine_warps(nsplit: int, setting: int) -> int:
    """The combine's simdgroups for `nsplit` partial results: `setting`, or when 0 one per 16
    splits, at least 4 and at most 32 (each simdgroup then walks ~16 splits, its loads in flight
    four at a time, instead of nsplit / 4)."""
    return setting if setting else max(COMBINE_WARPS, min(32, -(-nsplit // 16)))


def fuse_norm() -> bool:
    """Whether the decode step makes each sub-layer's residual step (post-norm, residual add,
    next input norm) inside the matvec that consumes it (MUSE_MLX_FUSE_NORM=1; matvec_resnorm)
    instead of in a residual_norm launch of its own, where every consumer streams. Off by default:
    checked on the H200 (the fused kernels and the whole model), but slower there. It removes 104
    of a token's launches (-0.5 ms of GPU time), and each fused product pays for its prologue
    (every threadgroup reads four vectors and reduces twice) and for the register cap (2 rows
    loaded together, not 4): gate|up 61 -> 100 us, Q|K|gate 18.6 -> 56 us. A token's summed
    kernel time went from 10.6 to 14.6 ms at depth 32,768 (Nsight Compute; docs/kernels.md
    "Seventh session")."""
    value = os.environ.get("MUSE_MLX_FUSE_NORM", "") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"MUSE_MLX_FUSE_NORM must be 0 or 1, not {value!r}")
    return value == "1"


def compile_step() -> bool:
    """Whether the decode step's layers run as one compiled MLX function (MUSE_MLX_COMPILE, default
    1; Model._compiled_layers, decode_kv.TracedRows): traced once per attention split count
    (attention_splits) and replayed from MLX's C++ for every other token, so the Python that builds
    a token's ~500 graph nodes runs only at trace time. On the H200 (synthetic full-geometry
    Q4_K_M, same instance; docs/kernels.md "Seventh session") it took pipelined decode from
    72-84 to 101-103 tok/s at depth 0 and 94.6-95.3 at depth 32,768, against llama.cpp's 93.9 /
    88.9. MUSE_MLX_COMPILE=0 builds every token in Python (the eager step)."""
    value = os.environ.get("MUSE_MLX_COMPILE", "") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"MUSE_MLX_COMPILE must be 0 or 1, not {value!r}")
    return value == "1"


QUANT_VARIANTS = {QT.Q4_K: "q4_k", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k", QT.Q8_0: "q8_0", QT.NVFP4: "nvfp4"}
FLOAT_DTYPES = {QT.F32: mx.float32, QT.F16: mx.float16, QT.BF16: mx.bfloat16}


def backend() -> str | None:
    """'metal', 'cuda', or None (the MLX-ops reference path)."""
    if os.environ.get("MUSE_MLX_REFERENCE", "") not in ("", "0"):
        return None
    return _device_backend()


@lru_cache(maxsize=None)
def _device_backend() -> str | None:
    """The GPU MLX can use, asked once (the answer does not change within a process)."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


class Settings(NamedTuple):
    """The kernel path's knobs, as read from the environment (MUSE_MLX_*)."""
    backend: str | None   # backend()
    matvec: str           # matvec_loop()
    stream_groups: str    # MUSE_MLX_STREAM_GROUPS, "" = the plan's own
    attn_rows: int        # attention_prefetch_rows()
    attn_loop: str        # attention_loop()
    attn_chunks: tuple    # attention_chunks(): (ring, plane) rows per split
    combine_warps: int    # combine_warps_setting(): 0 = scaled with the splits
    fuse_norm: bool       # fuse_norm(): the residual step inside the consuming matvec
    compile_step: bool    # compile_step(): the decode step's layers as one compiled function


_frozen: Settings | None = None


def settings() -> Settings:
    """The knobs now: read from the environment on each call, except inside `frozen_settings()`.

    A decode token launches ~700 kernels; reading the environment for each cost ~20 % of the
    host's Python time (a CPU profile of the step, docs/kernels.md "Fifth session")."""
    if _frozen is not None:
        return _frozen
    return Settings(backend(), matvec_loop(), os.environ.get("MUSE_MLX_STREAM_GROUPS", ""),
                    attention_prefetch_rows(), attention_loop(), attention_chunks(), combine_warps_setting(),
                    fuse_norm(), compile_step())


@contextmanager
def frozen_settings():
    """Read the knobs once for the launches made inside (Model.decode_one: one token)."""
    global _frozen
    outer = _frozen
    _frozen = settings()
    try:
        yield _frozen
    finally:
        _frozen = outer


def _read(name: str) -> str:
    return resources.files("custom_kernels").joinpath(name).read_text(encoding="utf-8")


def sections(family: str) -> dict[str, str]:
    """The `// ==== name ====` sections of custom_kernels/<family>.inc."""
    text = _read(f"{family}.inc")
    parts = re.split(r"^// ==== (\w+) ====\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}


def strip_comments(text: str) -> str:
    """The text without `//` comment lines and blank lines.

    MLX rebuilds and hashes a custom kernel's whole source on every call, so the comments,
    which are most of the text, cost host time per launch."""
    lines = (ln.rstrip() for ln in text.splitlines())
    return "".join(ln + "\n" for ln in lines if ln and not ln.lstrip().startswith("//"))


def render(family: str, parts: list[str], which: str) -> tuple[str, str]:
    """(header, source) of one kernel for backend `which` ('metal' or 'cuda'), comments stripped."""
    body = sections(family)
    header = strip_comments(_read(f"dialect_{which}.h") + "\n" + _read("blocks.h"))
    if which == "cuda" and "x_resnorm" in parts:
        # MLX declares the kernel itself (`__global__ void name(...)`, after this header) and
        # passes no register limit, so ptxas gave the residual-step prologue 130-152 registers a
        # thread (a multiprocessor then holds 3 of the plan's 4 threadgroups). The qualifier
        # caps it at 65,536 / 512 = 128 (stream_threads never exceeds 512).
        header += f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({STREAM_MAX_THREADS})\n"
    source = strip_comments(_read(f"indices_{which}.h") + "\n" + "".join(body[p] for p in parts))
    return header, source


KERNELS = {
    # name: (family, sections, inputs, outputs)
    **{f"matvec_{v}": ("matvec", ["prologue", v, "epilogue"], ["w", "x", "xs"], ["y"])
       for v in QUANT_VARIANTS.values()},
    "matvec_float": ("matvec", ["prologue", "float", "epilogue"], ["w", "x"], ["y"]),
    # streaming one-token matvecs: matvec_<loop>[_silu]_<format>: x in registers and the rows
    # loaded straight from device memory ("stream") or staged in threadgroup memory first
    # ("staged"); or x in threadgroup memory and the rows straight from device memory ("sharedx")
    **{f"matvec_{loop}{act}_{v}": ("matvec_stream", ["prologue", xs, v, f"x_{keep}", f"{v}_sums", f"loop_{head}",
                                                    f"{v}_rows", "epilogue"], ["w", *inputs], ["y"])
       for loop, keep, head in (("stream", "registers", "direct"), ("staged", "registers", "staged"),
                                ("sharedx", "shared", "direct"))
       for act, xs, inputs in (("", "x_plain", ["x"]), ("_silu", "x_silu_mul", ["gate", "up"]))
       for v in ("q4_k", "q6_k")},
    # the same with the residual step made in the prologue (x_resnorm): y and the new residual
    **{f"matvec_stream_resnorm_{v}": ("matvec_stream", ["prologue", v, "x_resnorm", f"{v}_sums", "loop_direct",
                                                         f"{v}_rows", "epilogue"],
                                      ["w", "xres", "f", "w_post", "w_next", "eps"], ["y", "x_out"])
       for v in ("q4_k", "q6_k")},
    "attention_partial": ("attention", ["partial"], ["q", "keys", "values", "params"], ["part_o", "part_ml"]),
    "attention_partial_butterfly": ("attention", ["partial_butterfly"], ["q", "keys", "values", "params"],
                                    ["part_o", "part_ml"]),
    "attention_combine": ("attention", ["combine", "store"], ["part_o", "part_ml", "params"], ["out"]),
    "attention_combine_gated": ("attention", ["combine", "store_gated"], ["part_o", "part_ml", "params", "gate"],
                                ["out"]),
    "qk_post": ("decode_glue", ["qk_post"], ["q", "k", "v", "q_norm", "k_norm", "rope", "eps"],
                ["q_out", "k_out", "v_out"]),
    "residual_norm": ("decode_glue", ["residual_norm"], ["x", "f", "w_post", "w_next", "eps"], ["x_out", "h"]),
}


@lru_cache(maxsize=None)
def kernel(name: str, which: str | None = None, shared_memory: int = 0):
    """The kernel `name` for backend `which`; `shared_memory`: dynamic threadgroup memory in bytes
    (CUDA; a Metal body declares its threadgroup memory with a size)."""
    which = which or backend()
    if which is None:
        raise RuntimeError("no GPU backend: the kernel path needs Metal or CUDA")
    family, parts, inputs, outputs = KERNELS[name]
    header, source = render(family, parts, which)
    if which == "metal":
        return mx.fast.metal_kernel(name=f"muse_{name}", input_names=inputs, output_names=outputs, source=source,
                                    header=header)
    return mx.fast.cuda_kernel(name=f"muse_{name}", input_names=inputs, output_names=outputs, source=source,
                               header=header, shared_memory=shared_memory)


# ---- matvec ----------------------------------------------------------------------------


STREAM_VARIANTS = {QT.Q4_K: ("q4_k", 8, 4), QT.Q6_K: ("q6_k", 8, 2)}   # name, rows per step R, rows loaded RF
QT_ROW_BYTES_PER_256 = {QT.Q4_K: 144, QT.Q6_K: 210}


STREAM_MAX_THREADS = 512   # 65,536 registers / 512 threads = 128 each; the kernels use 123-128 (ptxas, sm_90a)
CUDA_MULTIPROCESSORS = 132  # an H100 / H200 SXM; MLX does not report the count


def stream_threads(K: int) -> int | None:
    """Threads of a streaming matvec: one 64-value unit of K each, rounded up to whole simdgroups.

    None past STREAM_MAX_THREADS (K > 32,768): MLX launches without launch bounds, so a larger
    group could ask for more registers than a multiprocessor has; such rows take matvec.inc."""
    t = -(-(K // 64) // 32) * 32
    return t if t <= STREAM_MAX_THREADS else None


def stream_groups(threads: int, which: str | None = None, groups_env: str | None = None) -> int:
    """Threadgroups of a streaming matvec (MUSE_MLX_STREAM_GROUPS overrides).

    On CUDA as many as fit on each multiprocessor at once by registers (~128 a thread: 512
    threads), so that enough warps have loads in flight; Apple GPUs: 64 (unmeasured here)."""
    if which is None or groups_env is None:   # not given: the settings now
        s = settings()
        which = s.backend if which is None else which
        groups_env = s.stream_groups if groups_env is None else groups_env
    if groups_env:
        return max(1, int(groups_env))
    if which != "cuda":
        return 64
    return CUDA_MULTIPROCESSORS * max(1, STREAM_MAX_THREADS // threads)


def stream_cores(which: str | None) -> int:
    """Row groups a streaming matvec should have at least, so that every multiprocessor gets one
    (CUDA: the H200's 132; Metal: the 64 threadgroups its grid uses, unmeasured)."""
    return CUDA_MULTIPROCESSORS if which == "cuda" else 64


STAGED_MAX_ROWS = {QT.Q4_K: 4, QT.Q6_K: 2}  # R of the staged loop: ptxas keeps these within 128 registers (sm_90a)
SHAREDX_REGISTERS = 64              # the x-in-threadgroup-memory matvecs at R = RF = 2 (ptxas, sm_90a: 58 / 64)
STAGED_SHARED_PER_SM = 220 * 1024   # of a Hopper SM's 228 KB of shared memory (static arrays, 1 KB a block for the driver)
METAL_STAGE_BYTES = 28 * 1024        # Metal: at most 32 KB of threadgroup memory, declared with the body


class StreamPlan(NamedTuple):
    """How one streaming matvec launch walks its rows (matvec_stream.inc)."""
    loop: str          # "stream", "staged" or "sharedx" (matvec_loop); the kernel is matvec_<loop>_...
    rows: int          # R: rows per step (one threadgroup barrier each)
    rows_loaded: int   # RF: rows whose pieces are loaded together
    stages: int        # NS: row groups staged at once (staged)
    groups: int        # threadgroups in the grid
    shared_bytes: int  # dynamic threadgroup memory (CUDA: staged rows or shared x)


MATVEC_LOOPS = ("stream", "staged", "sharedx", "simple")


def matvec_loop() -> str:
    """The one-token matvec: MUSE_MLX_MATVEC = stream (default: x in registers, rows straight
    from device memory), staged (rows staged in threadgroup memory; on the H200 no faster per
    kernel and slower end to end, docs/kernels.md "Fourth session"), sharedx (x in threadgroup
    memory, so more warps fit; on the H200 faster on some shapes and slower on others, no
    faster a token: "Fifth session"), or simple (matvec.inc)."""
    choice = os.environ.get("MUSE_MLX_MATVEC", "") or "stream"
    if choice not in MATVEC_LOOPS:
        raise ValueError(f"MUSE_MLX_MATVEC must be one of {', '.join(MATVEC_LOOPS)}, not {choice!r}")
    return choice


def stream_plan(qtype: QT, K: int, N: int) -> StreamPlan:
    """The launch of a streaming matvec over N rows of length K (streams(qtype, K) must hold),
    worked out once per shape and setting (the decode step asks ~260 times a token)."""
    s = settings()
    return _stream_plan(qtype, K, N, s.matvec, s.backend, s.stream_groups)


@lru_cache(maxsize=None)
def _stream_plan(qtype: QT, K: int, N: int, loop: str, which: str | None, groups_env: str) -> StreamPlan:
    """stream_plan for one loop, backend and MUSE_MLX_STREAM_GROUPS value (the cache key)."""
    if loop == "sharedx" and (which == "cuda" or K * 4 <= METAL_STAGE_BYTES):
        return _plan_sharedx(K, N, which, groups_env)
    if loop == "staged":
        return _plan_staged(qtype, K, N, which, groups_env)
    _, R, RF = STREAM_VARIANTS[qtype]   # stream (and sharedx where x does not fit Metal's 32 KB)
    # A matrix with fewer row groups than multiprocessors (V: 256 rows, 32 groups of 8) would
    # leave most of the GPU idle, each group working through its rows one after another:
    # fewer rows per group instead, down to 2 (docs/kernels.md, "Fifth session").
    while R > 2 and -(-N // R) < stream_cores(which):
        R //= 2
        RF = min(RF, R)
    return StreamPlan("stream", R, RF, 1, min(-(-N // R), stream_groups(stream_threads(K), which, groups_env)), 0)


def _plan_sharedx(K: int, N: int, which: str | None, groups_env: str) -> StreamPlan:
    """x in threadgroup memory (K * 4 bytes), R = RF = 2. On CUDA as many threadgroups per
    multiprocessor as its registers (SHAREDX_REGISTERS a thread), threads and shared memory
    hold, but at most one per 16 rows, since each first reads all of x (an unmeasured choice)."""
    tpg = stream_threads(K)
    if groups_env:
        groups = stream_groups(tpg, which, groups_env)
    elif which == "cuda":
        per_sm = max(1, min(65536 // (SHAREDX_REGISTERS * tpg), 2048 // tpg, 32, (227 * 1024) // (K * 4 + 1280)))
        groups = min(CUDA_MULTIPROCESSORS * per_sm, max(CUDA_MULTIPROCESSORS, N // 16))
    else:
        groups = 64
    return StreamPlan("sharedx", 2, 2, 1, min(-(-N // 2), groups), K * 4 if which == "cuda" else 0)


def _plan_staged(qtype: QT, K: int, N: int, which: str | None, groups_env: str) -> StreamPlan:
    """Rows staged in threadgroup memory: R rows a stage (at most STAGED_MAX_ROWS), NS stages,
    as many threadgroups per multiprocessor as registers allow (stream_groups), the stages
    sharing its shared memory. Metal: one stage of at most METAL_STAGE_BYTES (its copies are
    synchronous; unmeasured here)."""
    tpg = stream_threads(K)
    row_bytes = K // 256 * QT_ROW_BYTES_PER_256[qtype]
    if which == "metal":
        stages, budget = 1, METAL_STAGE_BYTES
    else:
        per_sm = max(1, STREAM_MAX_THREADS // tpg)
        stages, budget = (4 if per_sm == 1 else 3), STAGED_SHARED_PER_SM // per_sm
    R = max(1, min(STAGED_MAX_ROWS[qtype], (budget // stages - 32) // row_bytes))
    RF = min(2, R)
    R -= R % RF
    while stages > 1 and stages * (R * row_bytes + 32) > budget:
        stages -= 1
    stage_bytes = (R * row_bytes + 31) // 16 * 16
    return StreamPlan("staged", R, RF, stages, min(-(-N // R), stream_groups(tpg, which, groups_env)),
                      stages * stage_bytes if which == "cuda" else 0)


def _stream_name(loop: str, variant: str, act: str = "") -> str:
    return f"matvec_{loop}{act}_{variant}"


def stream_enabled() -> bool:
    return settings().matvec != "simple"


def supports(qtype: QT) -> bool:
    return qtype in QUANT_VARIANTS or qtype in FLOAT_DTYPES


def matvec(w: mx.array, qtype: QT, x: mx.array, init_value: float | None = None) -> mx.array:
    """x (B, K) float32, B <= MAX_BATCH; w the raw GGUF rows (N, row_bytes) uint8. Returns (B, N) float32.

    `init_value` pre-fills the output (tests poison it with NaN to catch unwritten elements)."""
    B, K = x.shape
    if not 1 <= B <= MAX_BATCH:
        raise ValueError(f"matvec takes 1..{MAX_BATCH} rows, got {B}")
    x = x.astype(mx.float32)
    N = w.shape[0]
    if B == 1 and streams(qtype, K):
        return _stream_launch(w, qtype, K, "", [x], [], init_value)
    groups = -(-N // ROWS_PER_GROUP)
    launch = dict(grid=(groups * ROWS_PER_GROUP * 32, 1, 1), threadgroup=(ROWS_PER_GROUP * 32, 1, 1),
                  output_shapes=[(B, N)], output_dtypes=[mx.float32], init_value=init_value, stream=mx.gpu)
    template = [("K", K), ("N", N), ("B", B), ("RPT", ROWS_PER_GROUP)]
    if qtype in QUANT_VARIANTS:
        xs = x.reshape(B, K // 16, 16).sum(axis=-1)
        return kernel(f"matvec_{QUANT_VARIANTS[qtype]}")(inputs=[w, x, xs], template=template, **launch)[0]
    weights = w.view(FLOAT_DTYPES[qtype]).reshape(N, K)
    return kernel("matvec_float")(inputs=[weights, x], template=template + [("WT", weights.dtype)], **launch)[0]


def streams(qtype: QT, K: int) -> bool:
    """Whether a one-token product with this matrix takes the streaming kernel."""
    return qtype in STREAM_VARIANTS and stream_enabled() and stream_threads(K) is not None


def matvec_silu(w: mx.array, qtype: QT, gate: mx.array, up: mx.array, up_offset: int = 0,
                init_value: float | None = None) -> mx.array:
    """W @ (silu(gate) * up) for one token, the activation made inside the streaming kernel
    (streams(qtype, K) must hold). gate: K float32 values from its start; up: K from `up_offset`
    (pass one stacked gate|up output as both, up_offset = K). Returns (1, N) float32."""
    K = w.shape[1] // QT_ROW_BYTES_PER_256[qtype] * 256
    return _stream_launch(w, qtype, K, "_silu", [gate, up], [("UP_OFF", up_offset)], init_value)


def matvec_resnorm(w: mx.array, qtype: QT, x: mx.array, f: mx.array, w_post: mx.array, w_next: mx.array,
                   eps: mx.array, init_value: float | None = None) -> tuple[mx.array, mx.array]:
    """W @ h for one token, where h is made inside the streaming kernel from a sub-layer's output:
    r = x + rmsnorm(f, eps[0]) * w_post, h = rmsnorm(r, eps[1]) * w_next (what residual_norm
    computes, one launch and one graph node fewer). x, f, w_post, w_next: K float32 values;
    streams(qtype, K) must hold. Returns ((1, N) float32 product, (1, K) float32 r)."""
    K = w.shape[1] // QT_ROW_BYTES_PER_256[qtype] * 256
    s = settings()
    name, shared_bytes, launch = _stream_launch_args(qtype, K, w.shape[0], "_resnorm", (), s)
    y, r = kernel(name, s.backend, shared_bytes)(inputs=[w, x, f, w_post, w_next, eps], init_value=init_value,
                                                 **launch)
    return y, r


def _stream_launch(w: mx.array, qtype: QT, K: int, act: str, x_inputs: list, extra: list,
                   init_value: float | None) -> mx.array:
    """One launch of a streaming matvec (matvec_stream.inc) over the raw rows w: (1, N) float32."""
    s = settings()
    name, shared_bytes, launch = _stream_launch_args(qtype, K, w.shape[0], act, tuple(extra), s)
    return kernel(name, s.backend, shared_bytes)(inputs=[w, *x_inputs], init_value=init_value, **launch)[0]


@lru_cache(maxsize=None)
def _stream_launch_args(qtype: QT, K: int, N: int, act: str, extra: tuple, s: Settings) -> tuple[str, int, dict]:
    """(kernel name, shared bytes, launch keywords) of a streaming matvec, worked out once per
    shape and setting. The kernel object itself is looked up on each launch (tests swap
    `kernel` for an emulator)."""
    variant = STREAM_VARIANTS[qtype][0]
    tpg = stream_threads(K)
    resnorm = act == "_resnorm"   # x made in the prologue: the direct loop only, a second output
    plan = _stream_plan(qtype, K, N, "stream" if resnorm else s.matvec, s.backend, s.stream_groups)
    if resnorm:   # 2 rows loaded together: within 128 registers without spills (ptxas, sm_90a; Q4_K at 4 spills)
        plan = plan._replace(rows_loaded=min(plan.rows_loaded, 2))
    template = [("K", K), ("N", N), ("TPG", tpg), ("R", plan.rows), ("RF", plan.rows_loaded),
                ("RB", K // 256 * QT_ROW_BYTES_PER_256[qtype]), ("NS", plan.stages), *extra]
    shapes = [(1, N), (1, K)] if resnorm else [(1, N)]
    return _stream_name(plan.loop, variant, act), plan.shared_bytes, dict(
        template=template, grid=(plan.groups * tpg, 1, 1), threadgroup=(tpg, 1, 1), output_shapes=shapes,
        output_dtypes=[mx.float32] * len(shapes), stream=mx.gpu)


# ---- decode attention ----------------------------------------------------------------


def _warps_for(group: int) -> int:
    return next(nw for nw in (4, 3, 2, 1) if group % nw == 0)


def attention_params(n_valid: int, chunk: int, splits: int | None = None) -> mx.array:
    """The runtime scalars of decode_attention: rows visible and splits (int32[8], see docs/kernels.md).
    `splits` defaults to the fewest that cover n_valid; more (attention_splits) leave the extra
    splits empty, which the combine weighs at zero."""
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


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, n_valid: int | None, chunk: int,
                     init_value: float | None = None, gate: mx.array | None = None, gate_offset: int = 0,
                     params: mx.array | None = None, out_shape: tuple | None = None,
                     splits: int | None = None) -> mx.array:
    """One query token over rows 0..n_valid-1 of (n_kv, CAP, HD) f16 K/V. q (n_head, HD) -> (n_head, HD) f32.

    With `gate` (n_head * HD values from `gate_offset`), the output is multiplied by sigmoid(gate)
    (the attention output gate, model.output_gate) in the same launch. `params` may be passed in
    precomputed (attention_params(n_valid, chunk)): every layer of a kind shares it within a token.
    With `splits` the grid has that many splits and the rows visible are read only from `params`
    (attention_params(n_valid, chunk, splits), built outside; n_valid may then be None): a compiled
    step's trace serves every depth those splits cover. `out_shape` reshapes the result in the
    launch itself (default (n_head, HD))."""
    s = settings()
    if splits is None:
        nsplit = max(1, -(-n_valid // chunk))
        params = attention_params(n_valid, chunk) if params is None else params
    elif params is None:
        raise ValueError("decode_attention with `splits` needs its `params` (attention_params(n_valid, chunk, splits))")
    else:
        nsplit = splits
    partial, combine = _attention_launch_args(q.shape, keys.shape, chunk, nsplit, gate is not None, gate_offset,
                                              out_shape, s.attn_rows, combine_warps(nsplit, s.combine_warps))
    partial_name = "attention_partial" if s.attn_loop == "rows" else "attention_partial_butterfly"
    part_o, part_ml = kernel(partial_name, s.backend)(inputs=[q, keys, values, params], **partial)
    name, inputs = ("attention_combine", [part_o, part_ml, params]) if gate is None else \
        ("attention_combine_gated", [part_o, part_ml, params, gate])
    return kernel(name, s.backend)(inputs=inputs, init_value=init_value, **combine)[0]


@lru_cache(maxsize=None)
def _attention_launch_args(q_shape: tuple, kv_shape: tuple, chunk: int, nsplit: int, gated: bool, gate_offset: int,
                           out_shape: tuple | None, rows: int, cw: int = COMBINE_WARPS) -> tuple[dict, dict]:
    """The launch keywords of decode_attention's two kernels, worked out once per shape."""
    n_head, hd = q_shape
    n_kv, cap, _ = kv_shape
    group = n_head // n_kv
    nw = _warps_for(group)
    partial = dict(
        template=[("HD", hd), ("G", group), ("HPW", group // nw), ("CAP", cap), ("CHUNK", chunk), ("PF", rows)],
        grid=(nsplit * nw * 32, n_kv, 1), threadgroup=(nw * 32, 1, 1),
        output_shapes=[(n_head * nsplit * hd,), (n_head * nsplit * 2,)],
        output_dtypes=[mx.float32, mx.float32], stream=mx.gpu)
    combine = dict(
        template=[("HD", hd), ("CW", cw)] + ([("GATE_OFF", gate_offset)] if gated else []),
        grid=(n_head * cw * 32, 1, 1), threadgroup=(cw * 32, 1, 1),
        output_shapes=[out_shape or (n_head, hd)], output_dtypes=[mx.float32], stream=mx.gpu)
    return partial, combine


# ---- the steps between the products of one decode token (custom_kernels/decode_glue.inc) ----


def qk_post(q: mx.array, k: mx.array, v: mx.array, q_norm: mx.array, k_norm: mx.array, rope: mx.array,
            rope_half: int, eps: mx.array, n_head: int, n_kv: int, head_dim: int, q_offset: int = 0,
            k_offset: int = 0, init_value: float | None = None,
            v_offset: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    """One token's q, k, v (f32) -> q normed and rotated (n_head, hd) f32, k and v (n_kv, 1, hd) f16.

    q, k and v are read from `q_offset`, `k_offset` and `v_offset` of their arrays (pass one
    stacked Q|K|gate or Q|K|gate|V output as each). `rope` is cos then sin of the rope_half angles (model.rope_cos_sin), unused
    when rope_half is 0 (NoPE); `eps` a 1-element f32 array (the RMSNorm epsilon)."""
    tpg = -(-head_dim // 32) * 32
    q_out, k_out, v_out = kernel("qk_post", settings().backend)(
        inputs=[q, k, v, q_norm, k_norm, rope, eps],
        template=[("HD", head_dim), ("NH", n_head), ("NKV", n_kv), ("ROPE_HALF", rope_half), ("TPG", tpg),
                  ("Q_OFF", q_offset), ("K_OFF", k_offset), ("V_OFF", v_offset)],
        grid=((n_head + 2 * n_kv) * tpg, 1, 1), threadgroup=(tpg, 1, 1),
        output_shapes=[(n_head, head_dim), (n_kv, 1, head_dim), (n_kv, 1, head_dim)],
        output_dtypes=[mx.float32, mx.float16, mx.float16], init_value=init_value, stream=mx.gpu)
    return q_out, k_out, v_out


def residual_norm(x: mx.array, f: mx.array, w_post: mx.array, w_next: mx.array, eps: mx.array,
                  init_value: float | None = None) -> tuple[mx.array, mx.array]:
    """(x + rmsnorm(f, eps[0]) * w_post, then that rmsnorm'd with eps[1] times w_next); x, f (1, N) f32."""
    n = x.shape[-1]
    tpg = min(1024, -(-n // 32) * 32)
    x_out, h = kernel("residual_norm", settings().backend)(
        inputs=[x, f, w_post, w_next, eps], template=[("N", n), ("TPG", tpg)],
        grid=(tpg, 1, 1), threadgroup=(tpg, 1, 1), output_shapes=[(1, n), (1, n)],
        output_dtypes=[mx.float32, mx.float32], init_value=init_value, stream=mx.gpu)
    return x_out, h
