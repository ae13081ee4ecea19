"""Instructions in a tensor-core kernel's innermost loop, from its SASS (a developer check, no GPU).

Wraps a kernel of custom_kernels/ as MLX's cuda_kernel does (scripts/nvrtc_check.py's `wrap`),
compiles it with nvcc for sm_90a, disassembles it with nvdisasm and counts the instructions of
the smallest loop (a backward branch) that holds every mma of the kernel: what one step of the
loop costs to issue. Also prints ptxas's registers.
Needs MUSE_NVCC (nvcc 13.0), MUSE_NVDISASM (nvdisasm: CUDA's, or the `nvidia-cuda-nvdisasm` wheel's
nvidia/cu13/bin/nvdisasm) and MUSE_NVRTC_MLX_INCLUDE (as nvrtc_check.py).
Usage: python scripts/sass_loop.py KERNEL K N B NW KW KP   (e.g. matvec_mma_q4_k 6656 39936 4 19 1 1)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))
from nvrtc_check import wrap  # noqa: E402

from muse_mlx.kernels.source import KERNELS, render  # noqa: E402

ROW_BYTES_PER_256 = {"q4_k": 144, "q6_k": 210}


def loop(sass: str) -> list[str]:
    """The instructions of the smallest backward-branch loop holding every HMMA of the listing."""
    code, label_at, pending = [], {}, []
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            for name in pending:
                label_at[name] = len(code)
            pending = []
            code.append(m.group(2))
    mmas = [i for i, text in enumerate(code) if "HMMA" in text]
    best: list[str] = []
    for i, text in enumerate(code):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        start = label_at.get(m.group(1), i) if m else i
        if m and start <= mmas[0] and i >= mmas[-1] and (not best or i - start + 1 < len(best)):
            best = code[start:i + 1]
    return best


def main() -> int:
    name, K, N, B, NW, KW, KP = sys.argv[1], *map(int, sys.argv[2:8])
    family, parts, inputs, outputs = KERNELS[name]
    header, source = render(family, parts, "cuda")
    rb = ROW_BYTES_PER_256[re.search(r"q\d_k", name).group(0)]
    template = [("K", K), ("N", N), ("B", B), ("XS", K), ("NW", NW), ("KW", KW), ("KP", KP), ("RB", K // 256 * rb)]
    text = re.sub(r"\binline ", "__device__ inline ", wrap("k", header, source, inputs, ["uint8", "float32"],
                                                           outputs, ["float32"], template))
    includes = [os.environ["MUSE_NVRTC_MLX_INCLUDE"], "/usr/local/cuda/include/cccl", "/usr/local/cuda/include"]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cu"), "w") as fh:
            fh.write(text)
        r = subprocess.run([os.environ["MUSE_NVCC"], "-arch=sm_90a", "-cubin", "-Xptxas", "-v",
                            *[f"-I{p}" for p in includes], "-o", os.path.join(d, "k.cubin"), os.path.join(d, "k.cu")],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr)
            return 1
        sass = subprocess.run([os.environ["MUSE_NVDISASM"], "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    body = loop(sass)
    ops = Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in body)
    registers = re.search(r"Used (\d+) registers", r.stderr).group(1)
    print(f"{name} {dict(template)}: {registers} registers; loop {len(body)} instructions, "
          f"{ops.get('HMMA.16816.F32', 0)} mma; {dict(ops.most_common(8))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
