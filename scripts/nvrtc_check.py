"""Compile every CUDA instantiation of custom_kernels/ with NVRTC, no GPU needed (a developer check).

It wraps each body the way MLX 0.32's cuda_kernel does (mlx/backend/cuda/custom_kernel.cpp:
the MLX device utils include, our header, then `__global__ void` with `const T*` inputs,
`T*` outputs and the template constants as constexpr) and compiles it for sm_90a with MLX's
NVRTC flags, printing registers-free diagnostics. Needs:
  MUSE_NVRTC_LIB   path to libnvrtc.so.13 (pip download nvidia-cuda-nvrtc==13.0.*, unzip the wheel;
                   LD_LIBRARY_PATH must hold its folder too, for libnvrtc-builtins.so.13.0)
  MUSE_NVRTC_CUBIN_DIR  also write each CUBIN (for nvdisasm) and its PTX there
  MUSE_NVRTC_VERBOSE=1  also print ptxas's registers / spills per kernel, and fail a tensor-core or
                   x_shared build that takes more registers than the planner counts it at
                   (register_check; nvcc's counts are always checked so)
  MUSE_NVRTC_ONLY  a regular expression: only the cases whose kernel name it finds
  MUSE_NVRTC_MLX_INCLUDE  a folder holding mlx/backend/cuda/device/{utils.cuh,complex.cuh,config.h}
  CUDA include folders (default /usr/local/cuda/include and /usr/local/cuda/include/cccl)
Or, without NVRTC, with CUDA's compiler driver (its ptxas; registers and spills always printed):
  MUSE_NVCC        path to nvcc (13.0); the header's functions are marked __device__, which
                   NVRTC's --device-as-default-execution-space does for MLX. Its counts are not
                   MLX's: the x_shared silu kernels at B = 2, RF = 2 take 96 (Q4_K) and 150 (Q6_K)
                   registers under nvcc, 128 and 168 under NVRTC (2026-12-02); plan limits come
                   from NVRTC
Usage: python scripts/nvrtc_check.py (with the package installed: pip install -e .)
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile

from muse_mlx.kernels.source import KERNELS, render

CUDA_T = {"uint8": "uint8_t", "uint64": "uint64_t", "int32": "int32_t", "float16": "__half", "bfloat16": "__nv_bfloat16",
          "float32": "float"}

# (kernel, input dtypes, output dtypes, template) to instantiate; every kernel of KERNELS needs
# at least one (main() counts a kernel without one as a failure).
CASES = [
    *[(f"matvec_{v}", ["uint8", "float32", "float32"], ["float32"],
       [("K", 6656), ("N", 4096), ("B", b), ("RPT", 4)]) for v in ("q4_k", "q5_k", "q6_k", "q8_0", "nvfp4")
      for b in (1, 8)],
    *[("matvec_float", [wt, "float32"], ["float32"], [("K", 256), ("N", 512), ("B", 2), ("RPT", 4), ("WT", wt)])
      for wt in ("float32", "float16", "bfloat16")],
    *[(f"matvec_stream{where}_{v}", ["uint8", "float32"], ["float32"],
       [("K", k), ("N", 4096), ("B", b), ("XS", k), ("TPG", -(-k // 64 // 32) * 32), ("R", 8), ("RF", rf),
        ("RB", k // 256 * rb)])
      for v, rb in (("q4_k", 144), ("q6_k", 210)) for k in (256, 4096, 6656, 19968) for rf in (1, 2, 4)
      for where, b in (("", 1), ("_shared", 2), ("_shared", 4))],
    *[(f"matvec_stream{where}_silu_{v}", ["uint8", "float32", "float32"], ["float32"],
       [("K", 19968), ("N", 6656), ("B", b), ("XS", 39936), ("TPG", 320), ("R", 8), ("RF", 2), ("RB", 78 * rb),
        ("UP_OFF", 19968)])
      for v, rb in (("q4_k", 144), ("q6_k", 210)) for where, b in (("", 1), ("_shared", 2))],
    *[(f"matvec_mma_{v}", ["uint8", "float32"], ["float32"],
       [("K", k), ("N", 4096), ("B", b), ("XS", k), ("NW", nw), ("KW", kw), ("KP", kp), ("RB", k // 256 * rb)])
      for v, rb in (("q4_k", 144), ("q6_k", 210))
      for k, nw, kw, kp in ((4096, 16, 16, 1), (4096, 20, 5, 1), (6656, 26, 26, 1), (6656, 25, 5, 1), (6656, 20, 4, 1),
                            (6656, 19, 1, 1), (19968, 13, 13, 2))
      for b in (2, 4)],
    # q, the layer's K|V storage (2, NKV, CAP, HD), params
    *[("attention_partial", ["float32", "float16", "int32"], ["float32", "float32"],
       [("HD", hd), ("G", g), ("HPW", hpw), ("NKV", nkv), ("CAP", cap), ("CHUNK", chunk)])
      for hd, g, hpw, nkv, cap, chunk in ((128, 16, 4, 2, 131072, 128), (128, 16, 4, 2, 2048, 32), (48, 6, 2, 1, 64, 64))],
    ("attention_combine", ["float32", "float32", "int32"], ["float32"], [("HD", 128), ("CW", 4)]),
    ("attention_combine", ["float32", "float32", "int32"], ["float32"], [("HD", 48), ("CW", 4)]),
    ("attention_combine_gated", ["float32", "float32", "int32", "float32"], ["float32"],
     [("HD", 128), ("CW", 4), ("GATE_OFF", 4352)]),
    # the same over 4 sequences in one launch (q, each sequence's K|V storage, params)
    *[("attention_partial_seqs", ["float32"] + ["float16"] * 4 + ["int32"], ["float32", "float32"],
       [("HD", hd), ("G", g), ("HPW", hpw), ("CAP", cap), ("CHUNK", chunk), ("NKV", nkv)])
      for hd, g, hpw, cap, chunk, nkv in ((128, 16, 4, 131072, 128, 2), (48, 6, 2, 64, 64, 1))],
    ("attention_combine_seqs", ["float32", "float32", "int32"], ["float32"], [("HD", 128), ("CW", 4), ("NH", 32)]),
    ("attention_combine_seqs_gated", ["float32", "float32", "int32", "float32"], ["float32"],
     [("HD", 128), ("CW", 4), ("NH", 32), ("GATE_OFF", 4352), ("GATE_ROW", 17408)]),
    # the flash prefill attention (q, keys, values, q_pos, k_pos, params)
    *[("attention_prefill", ["float32", "float16", "float16", "int32", "int32", "int32"], ["float32"],
       [("HD", hd), ("G", g), ("NKV", nkv), ("NW", 4), ("KB", kb)])
      for hd, g, nkv, kb in ((128, 16, 2, 64), (48, 6, 2, 64), (256, 8, 4, 32))],
    # q, k, v from one stacked Q|K|gate|V row per token (row stride 68 heads)
    # (q, k, v, q_norm, k_norm, rope) -> q normed and rotated, K|V
    *[("qk_post", ["float32"] * 6, ["float32", "float16"],
       [("HD", hd), ("NH", 32), ("NKV", 2), ("ROPE_HALF", rh), ("TPG", -(-hd // 32) * 32), ("Q_OFF", 0),
        ("K_OFF", 32 * hd), ("V_OFF", 66 * hd), ("QS", 68 * hd), ("KS", 68 * hd), ("VS", 68 * hd), ("ROWS", 1),
        ("EPS", 0x358637BD)])
      for hd, rh in ((128, 64), (128, 0), (48, 16))],
    *[("residual_norm", ["float32"] * 5, ["float32", "float32"],
       [("N", 6656), ("TPG", 1024), ("EPS_POST", 0x322BCC77), ("EPS_NEXT", 0x358637BD), ("FP", fp), ("R", r)])
      for fp, r in ((1, 0), (8, 4))],
    *[(f"dequant_{v}", ["uint8"], ["float16"], [("K", 6656), ("N", 19968), ("UPR", 6656 // u), ("TPG", 256)])
      for v, u in (("q4_k", 32), ("q5_k", 32), ("q6_k", 16), ("q8_0", 32), ("nvfp4", 16))],
]

def wrap(name: str, header: str, source: str, inputs, in_types, outputs, out_types, template) -> str:
    s = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    s += header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void {name}(\n"
    s += "".join(f"    const {CUDA_T[t]}* {n},\n" for n, t in zip(inputs, in_types))
    s += ",\n".join(f"    {CUDA_T[t]}* {n}" for n, t in zip(outputs, out_types)) + ") {\n"
    for k, v in template:
        s += f"  using {k} = {CUDA_T[v]};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
    return s + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"


def nvcc(path: str, text: str, includes: list[str]) -> tuple[int, str]:
    """(return code, ptxas's report) of one wrapped kernel compiled by nvcc for sm_90a."""
    text = re.sub(r"\binline ", "__device__ inline ", text)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.cu")
        with open(src, "w") as fh:
            fh.write(text)
        r = subprocess.run([path, "-arch=sm_90a", "-cubin", "-Xptxas", "-v", *[f"-I{p}" for p in includes], "-o",
                            os.path.join(d, "k.cubin"), src], capture_output=True, text=True)
    report = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores", r.stderr))
    return r.returncode, report if r.returncode == 0 else r.stderr


def register_check(kname: str, template, report: str) -> tuple[list[str], list[str]]:
    """(problems, notes) from ptxas's register count in `report`. A problem: a build past the
    planning value the planner counts it at (plan.MMA_REGISTERS for the tensor-core form,
    plan.STREAM_BATCH_REGISTERS for the x_shared kernels), so that a planned threadgroup might not
    fit the register file: it would not launch, and inside an MLX CUDA graph it fails silently. A
    note: this case's own threadgroup does not fit (plan.fits_registers; CASES holds compile
    cases the planner does not make)."""
    from gguf import GGMLQuantizationType as QT

    from muse_mlx.kernels import plan

    used = re.findall(r"Used (\d+) registers", report)
    t = dict(template)
    threads = 32 * t["NW"] if "NW" in t else t.get("TPG")
    if not used or not threads:
        return [], []
    regs, problems = int(used[-1]), []
    notes = [] if plan.fits_registers(regs, threads) else [f"({regs} registers on {threads} threads: not launchable)"]
    if kname.startswith("matvec_mma_"):
        qtype = QT[kname.removeprefix("matvec_mma_").upper()]
        planned = plan.MMA_REGISTERS[qtype]
    elif kname.startswith("matvec_stream_shared_"):
        qtype = QT[kname.split("_")[-2].upper() + "_K"]
        if t["R"] != plan.STREAM_BATCH_R[qtype].get(t["B"]):   # the table counts the planned R only
            return [], notes
        planned = plan.STREAM_BATCH_REGISTERS.get((qtype, t["B"], t["RF"]), 255)
    else:
        return [], notes
    if regs > planned:
        problems.append(f"{regs} registers, past the planning value {planned}")
    return problems, notes


def main() -> int:
    lib = None if os.environ.get("MUSE_NVCC") else ctypes.CDLL(os.environ["MUSE_NVRTC_LIB"])
    includes = [os.environ["MUSE_NVRTC_MLX_INCLUDE"], "/usr/local/cuda/include/cccl", "/usr/local/cuda/include"]
    failures = 0
    uncovered = sorted(set(KERNELS) - {case[0] for case in CASES}) if not os.environ.get("MUSE_NVRTC_ONLY") else []
    for kname in uncovered:
        print(f"{kname:20s} no case in CASES: FAILED")
    failures += len(uncovered)
    from muse_mlx.kernels.upload import copy_source

    upload = ("upload", ["uint64"], ["uint8"], [])   # kernels/upload.py's copy (CUDA only, not in KERNELS)
    only = re.compile(os.environ.get("MUSE_NVRTC_ONLY", ""))
    for kname, in_types, out_types, template in CASES + [upload]:
        if not only.search(kname):
            continue
        if kname == "upload":
            header, source, inputs, outputs = "", copy_source(), ["meta"], ["out"]
        else:
            family, parts, inputs, outputs = KERNELS[kname]
            header, source = render(family, parts, "cuda")
        fn = f"custom_kernel_muse_{kname}"
        text = wrap(fn, header, source, inputs, in_types, outputs, out_types, template)
        if lib is None:
            rc, report = nvcc(os.environ["MUSE_NVCC"], text, includes)
            problems, notes = register_check(kname, template, report) if rc == 0 else ([], [])
            print(f"{kname:20s} {dict(template)}: {'ok' if rc == 0 and not problems else 'FAILED'} {report[:2000]}",
                  *problems, *notes)
            failures += rc != 0 or bool(problems)
            continue
        prog = ctypes.c_void_p()
        lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{fn}.cu".encode(), 0, None, None)
        opts = [b"--device-as-default-execution-space", b"--gpu-architecture=sm_90a"] + \
               [f"--include-path={p}".encode() for p in includes] + \
               ([b"--ptxas-options=-v"] if os.environ.get("MUSE_NVRTC_VERBOSE") else [])
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if rc == 0 and os.environ.get("MUSE_NVRTC_CUBIN_DIR"):  # for nvdisasm / cuobjdump
            size = ctypes.c_size_t()
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, cubin)
            tag = "_".join(f"{k}{v}" for k, v in template)
            with open(os.path.join(os.environ["MUSE_NVRTC_CUBIN_DIR"], f"{kname}_{tag}.cubin"), "wb") as fh:
                fh.write(cubin.raw)
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, ptx)
            with open(os.path.join(os.environ["MUSE_NVRTC_CUBIN_DIR"], f"{kname}_{tag}.ptx"), "wb") as fh:
                fh.write(ptx.value)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        text_log = log.value.decode().strip()
        problems, notes = register_check(kname, template, text_log) if rc == 0 else ([], [])
        status = "ok" if rc == 0 and not problems else "FAILED"
        print(f"{kname:20s} {dict(template)}: {status}", *problems, *notes)
        if text_log:
            print("   " + "\n   ".join(text_log.splitlines()[:20]))
        failures += rc != 0 or bool(problems)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
