"""Kernel text: the bodies in custom_kernels/*.inc, composed for Metal or CUDA, and the table of kernels.

Each body is written once against a small dialect map. For a backend we compose

    header = dialect_<backend>.h + blocks.h          (types, helpers, block decoders)
    source = indices_<backend>.h + the body sections (thread indices as text, so MLX's
                                                      Metal wrapper sees the attribute names)

and hand them to `mx.fast.metal_kernel` (Apple GPUs) or `mx.fast.cuda_kernel` (NVIDIA). The
CUDA instantiation is the one executed and checked here (on an H200); the Metal
instantiation is the same body under the Metal map and has not been run on Apple hardware
in this project (tests/metal_emulator.py executes its text on the CPU).
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

import mlx.core as mx

STREAM_FORMATS = ("q4_k", "q6_k")                           # formats with a streaming one-token kernel
BATCH_FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "nvfp4")   # matvec.inc's quantized formats

ATTENTION_SEQS = 4   # sequences one attention launch takes (attention.inc's partial_seqs: kv0..kv3)

KERNELS = {
    # name: (family, sections, inputs, outputs)
    # matvec.inc: up to MAX_BATCH rows of x, any supported block type
    **{f"matvec_{v}": ("matvec", ["prologue", v, "epilogue"], ["w", "x", "xs"], ["y"]) for v in BATCH_FORMATS},
    "matvec_float": ("matvec", ["prologue", "float", "epilogue"], ["w", "x"], ["y"]),
    # matvec_stream.inc: rows streamed from device memory, x for one token in registers or for
    # B tokens in threadgroup memory (_shared); the _silu form makes silu(gate) * up in its
    # prologue (the FFN down projection)
    **{f"matvec_stream{where}{act}_{v}": ("matvec_stream", ["prologue", xs, v, f"x_{keep}", f"{v}_sums",
                                                            "loop_direct", f"{v}_rows", "epilogue"], ["w", *inputs], ["y"])
       for act, xs, inputs in (("", "x_plain", ["x"]), ("_silu", "x_silu_mul", ["gate", "up"]))
       for where, keep in (("", "registers"), ("_shared", "shared"))
       for v in STREAM_FORMATS},
    # matvec_stream.inc's tensor-core form: 1..4 rows of x (a packed step over slots) by
    # mma.m16n8k16, x's fragments in threadgroup memory (the FFN down input is made before it:
    # launch.Kernels.matvec_silu)
    **{f"matvec_mma_{v}": ("matvec_stream", ["x_plain", f"mma_{v}", "mma_prologue", "mma_block_tiles", f"mma_{v}_block",
                                             "mma_close"], ["w", "x"], ["y"]) for v in ("q4_k", "q6_k")},
    # dequant.inc: raw blocks -> float16 values (the prefill's tensor-core products)
    **{f"dequant_{v}": ("dequant", ["prologue", v], ["w"], ["y"]) for v in BATCH_FORMATS},
    # attention.inc: split decode attention, then the combine (optionally times the output gate)
    "attention_partial": ("attention", ["partial_one", "partial_butterfly"], ["q", "kv", "params"],
                          ["part_o", "part_ml"]),
    "attention_combine": ("attention", ["combine_one", "combine", "store"], ["part_o", "part_ml", "params"], ["out"]),
    "attention_combine_gated": ("attention", ["combine_one", "combine", "store_gated"],
                                ["part_o", "part_ml", "params", "gate"], ["out"]),
    # the same over up to ATTENTION_SEQS sequences in one launch, each with its own K|V storage
    "attention_partial_seqs": ("attention", ["partial_seqs", "partial_butterfly"],
                               ["q_all", *(f"kv{i}" for i in range(ATTENTION_SEQS)), "params_all"],
                               ["part_o_all", "part_ml_all"]),
    "attention_combine_seqs": ("attention", ["combine_seqs", "combine", "store"],
                               ["part_o_all", "part_ml_all", "params_all"], ["out_all"]),
    "attention_combine_seqs_gated": ("attention", ["combine_seqs", "combine_seqs_gate", "combine", "store_gated"],
                                     ["part_o_all", "part_ml_all", "params_all", "gate_all"], ["out_all"]),
    # prefill_attention.inc: a chunk's queries over the held rows and its own, flash-style on the tensor cores
    "attention_prefill": ("prefill_attention", ["flash"], ["q", "keys", "values", "q_pos", "k_pos", "params"],
                          ["out"]),
    # decode_glue.inc: the steps between the products
    "qk_post": ("decode_glue", ["qk_post"], ["q", "k", "v", "q_norm", "k_norm", "rope"],
                ["q_out", "kv_out"]),
    "residual_norm": ("decode_glue", ["residual_norm"], ["x", "f", "w_post", "w_next"], ["x_out", "h"]),
}


def read(name: str) -> str:
    return resources.files("custom_kernels").joinpath(name).read_text(encoding="utf-8")


def sections(family: str) -> dict[str, str]:
    """The `// ==== name ====` sections of custom_kernels/<family>.inc."""
    text = read(f"{family}.inc")
    parts = re.split(r"^// ==== (\w+) ====\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}


def strip_comments(text: str) -> str:
    """The text without `//` comment lines and blank lines.

    MLX rebuilds and hashes a custom kernel's whole source on every call, so the comments,
    which are most of the text, cost host time per launch."""
    lines = (ln.rstrip() for ln in text.splitlines())
    return "".join(ln + "\n" for ln in lines if ln and not ln.lstrip().startswith("//"))


def header_items(header: str) -> list[tuple[str | None, str]]:
    """The header's top-level items as (the name each defines, its text): a `#define` line, or a
    function from its first line (or the `template <...>` line standing before it) to the brace
    that closes it. Any other line defines nothing."""
    items: list[tuple[str | None, str]] = []
    lines = header.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        macro = re.match(r"#define\s+(\w+)", line)
        if macro:
            j = i + 1
            while lines[j - 1].rstrip().endswith("\\") and j < len(lines):
                j += 1
            items.append((macro.group(1), "".join(lines[i:j])))
            i = j
            continue
        if re.fullmatch(r"template\s*<[^>]*>\s*", line) and i + 1 < len(lines):
            line = line.rstrip("\n") + " " + lines[i + 1]   # its function's first line, for the name
        head = re.sub(r"^template\s*<[^>]*>\s*", "", line)
        function = re.match(r"[\w\s]*?\b(\w+)\s*\(", head) if "(" in head and not line.startswith("#") else None
        if function is None:
            items.append((None, lines[i]))
            i += 1
            continue
        j, depth, seen = i, 0, False
        while j < len(lines):
            depth += lines[j].count("{") - lines[j].count("}")
            seen = seen or "{" in lines[j]
            j += 1
            if seen and depth == 0:
                break
        items.append((function.group(1), "".join(lines[i:j])))
        i = j
    return items


def prune(header: str, source: str) -> str:
    """The header without the items `source` does not use, directly or through the items it
    keeps. MLX hashes a custom kernel's whole text at every launch (ledger, 2026-12-02): a
    matvec needs one block format's decoders, not all five formats' and the attention's helpers."""
    items = header_items(header)
    names = set(re.findall(r"\w+", source))
    keep = [name is None for name, _ in items]
    grew = True
    while grew:
        grew = False
        for n, (name, text) in enumerate(items):
            if not keep[n] and name in names:
                keep[n] = grew = True
                names.update(re.findall(r"\w+", text))
    return "".join(text for (_, text), k in zip(items, keep) if k)


def compact(text: str) -> str:
    """Each line without its indentation (C, CUDA and Metal do not read it)."""
    return "".join(ln.lstrip() for ln in text.splitlines(keepends=True))


def render(family: str, parts: list[str], which: str) -> tuple[str, str]:
    """(header, source) of one kernel for backend `which` ('metal' or 'cuda'): comments stripped,
    the header pruned to what the kernel uses, indentation dropped."""
    body = sections(family)
    header = strip_comments(read(f"dialect_{which}.h") + "\n" + read("blocks.h"))
    source = strip_comments(read(f"indices_{which}.h") + "\n" + "".join(body[p] for p in parts))
    return compact(prune(header, source)), compact(source)


@lru_cache(maxsize=None)
def texts(name: str, which: str) -> tuple[str, str]:
    """(header, source) of kernel `name` for backend `which`."""
    family, parts, _, _ = KERNELS[name]
    return render(family, parts, which)


@lru_cache(maxsize=None)
def build(name: str, which: str, shared_memory: int = 0):
    """The MLX kernel object `name` for backend `which`; `shared_memory`: dynamic threadgroup
    memory in bytes (CUDA; a Metal body declares its threadgroup memory with a size)."""
    _, _, inputs, outputs = KERNELS[name]
    header, source = texts(name, which)
    if which == "metal":
        return mx.fast.metal_kernel(name=f"muse_{name}", input_names=inputs, output_names=outputs, source=source,
                                    header=header)
    return mx.fast.cuda_kernel(name=f"muse_{name}", input_names=inputs, output_names=outputs, source=source,
                               header=header, shared_memory=shared_memory)
