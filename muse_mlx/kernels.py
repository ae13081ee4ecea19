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
from functools import lru_cache
from importlib import resources

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

MAX_BATCH = 8            # matvec rows handled by one launch (decode, small prefill chunks, verification)
ROWS_PER_GROUP = 4       # simdgroups (output rows) per threadgroup in the matvecs
RING_CHUNK, PLANE_CHUNK = 64, 256   # attention rows per split for rings / planes

QUANT_VARIANTS = {QT.Q4_K: "q4_k", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k", QT.Q8_0: "q8_0", QT.NVFP4: "nvfp4"}
FLOAT_DTYPES = {QT.F32: mx.float32, QT.F16: mx.float16, QT.BF16: mx.bfloat16}


def device_copy_enabled() -> bool:
    """MUSE_MLX_DEVICE_COPY=1: copy the raw blocks into memory the GPU allocated (untested default).

    MLX's CUDA backend keeps an array made from host data (our memory-mapped GGUF) in
    CUDA managed memory, and arrays a GPU operation produces in device memory
    (mlx/backend/cuda/allocator.cpp). Whether that residency explains the 650 GB/s the
    matvecs reached on the H200 (docs/kernels.md) is the first thing to measure next;
    until then the copy is opt-in.
    """
    return os.environ.get("MUSE_MLX_DEVICE_COPY", "") not in ("", "0")


def to_device(a: mx.array) -> mx.array:
    """A GPU-made copy of `a` (see device_copy_enabled); evaluated at once."""
    out = a + mx.zeros((), dtype=a.dtype)
    mx.eval(out)
    return out


def backend() -> str | None:
    """'metal', 'cuda', or None (the MLX-ops reference path)."""
    if os.environ.get("MUSE_MLX_REFERENCE", "") not in ("", "0"):
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def _read(name: str) -> str:
    return resources.files("custom_kernels").joinpath(name).read_text(encoding="utf-8")


def sections(family: str) -> dict[str, str]:
    """The `// ==== name ====` sections of custom_kernels/<family>.inc."""
    text = _read(f"{family}.inc")
    parts = re.split(r"^// ==== (\w+) ====\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}


def render(family: str, parts: list[str], which: str) -> tuple[str, str]:
    """(header, source) of one kernel for backend `which` ('metal' or 'cuda')."""
    body = sections(family)
    header = _read(f"dialect_{which}.h") + "\n" + _read("blocks.h")
    source = _read(f"indices_{which}.h") + "\n" + "".join(body[p] for p in parts)
    return header, source


KERNELS = {
    # name: (family, sections, inputs, outputs)
    **{f"matvec_{v}": ("matvec", ["prologue", v, "epilogue"], ["w", "x", "xs"], ["y"])
       for v in QUANT_VARIANTS.values()},
    "matvec_float": ("matvec", ["prologue", "float", "epilogue"], ["w", "x"], ["y"]),
    **{f"matvec_wide_{v}": ("matvec_wide", ["prologue", v, "epilogue"], ["w", "x"], ["y"]) for v in ("q4_k", "q6_k", "q4_k_magic", "q6_k_magic")},
    **{f"matvec_stream_{v}": ("matvec_stream", ["prologue", v, "epilogue"], ["w", "x"], ["y"]) for v in ("q4_k", "q6_k")},
    "attention_partial": ("attention", ["partial"], ["q", "keys", "values", "params"], ["part_o", "part_ml"]),
    "attention_combine": ("attention", ["combine"], ["part_o", "part_ml", "params"], ["out"]),
}


@lru_cache(maxsize=None)
def kernel(name: str, which: str | None = None):
    which = which or backend()
    if which is None:
        raise RuntimeError("no GPU backend: the kernel path needs Metal or CUDA")
    family, parts, inputs, outputs = KERNELS[name]
    header, source = render(family, parts, which)
    make = mx.fast.metal_kernel if which == "metal" else mx.fast.cuda_kernel
    return make(name=f"muse_{name}", input_names=inputs, output_names=outputs, source=source, header=header)


# ---- matvec ----------------------------------------------------------------------------


WIDE_VARIANTS = {QT.Q4_K: ("q4_k", 8), QT.Q6_K: ("q6_k", 16)}   # units per 256 values
WIDE_ROWS = 16          # output rows per threadgroup in the one-token kernels


def _threads_for(units: int) -> int:
    """Threads per threadgroup (a multiple of 32, 128..256) leaving the fewest idle unit slots."""
    return min(range(256, 127, -32), key=lambda t: (-(-units // t)) * t - units)


def wide_enabled() -> bool:
    return os.environ.get("MUSE_MLX_MATVEC", "") != "simple"


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
    if B == 1 and qtype in WIDE_VARIANTS and wide_enabled():
        variant, per_block = WIDE_VARIANTS[qtype]
        tpg = _threads_for(K // 256 * per_block)
        groups = -(-N // WIDE_ROWS)
        return kernel(f"matvec_wide_{variant}")(
            inputs=[w, x.reshape(-1)], template=[("K", K), ("N", N), ("R", WIDE_ROWS), ("TPG", tpg)],
            grid=(groups * tpg, 1, 1), threadgroup=(tpg, 1, 1), output_shapes=[(1, N)],
            output_dtypes=[mx.float32], init_value=init_value, stream=mx.gpu)[0]
    groups = -(-N // ROWS_PER_GROUP)
    launch = dict(grid=(groups * ROWS_PER_GROUP * 32, 1, 1), threadgroup=(ROWS_PER_GROUP * 32, 1, 1),
                  output_shapes=[(B, N)], output_dtypes=[mx.float32], init_value=init_value, stream=mx.gpu)
    template = [("K", K), ("N", N), ("B", B), ("RPT", ROWS_PER_GROUP)]
    if qtype in QUANT_VARIANTS:
        xs = x.reshape(B, K // 16, 16).sum(axis=-1)
        return kernel(f"matvec_{QUANT_VARIANTS[qtype]}")(inputs=[w, x, xs], template=template, **launch)[0]
    weights = w.view(FLOAT_DTYPES[qtype]).reshape(N, K)
    return kernel("matvec_float")(inputs=[weights, x], template=template + [("WT", weights.dtype)], **launch)[0]


# ---- decode attention ----------------------------------------------------------------


def _warps_for(group: int) -> int:
    return next(nw for nw in (4, 3, 2, 1) if group % nw == 0)


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, n_valid: int, chunk: int,
                     init_value: float | None = None) -> mx.array:
    """One query token over rows 0..n_valid-1 of (n_kv, CAP, HD) f16 K/V. q (n_head, HD) -> (n_head, HD) f32."""
    n_head, hd = q.shape
    n_kv, cap, _ = keys.shape
    group = n_head // n_kv
    nw = _warps_for(group)
    nsplit = max(1, -(-n_valid // chunk))
    params = mx.array([n_valid, nsplit, 0, 0, 0, 0, 0, 0], dtype=mx.int32)
    template = [("HD", hd), ("G", group), ("HPW", group // nw), ("CAP", cap), ("CHUNK", chunk)]
    part_o, part_ml = kernel("attention_partial")(
        inputs=[q.astype(mx.float32), keys, values, params], template=template,
        grid=(nsplit * nw * 32, n_kv, 1), threadgroup=(nw * 32, 1, 1),
        output_shapes=[(n_head * nsplit * hd,), (n_head * nsplit * 2,)],
        output_dtypes=[mx.float32, mx.float32], stream=mx.gpu)
    out = kernel("attention_combine")(
        inputs=[part_o, part_ml, params], template=[("HD", hd)],
        grid=(n_head * 32, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(n_head, hd)], output_dtypes=[mx.float32], init_value=init_value, stream=mx.gpu)[0]
    return out


