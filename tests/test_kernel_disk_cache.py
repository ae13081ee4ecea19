"""kernels/disk_cache.py on the CPU: libstdc++'s string hash against g++'s own, MLX's module names,
and the cache's bookkeeping with a stand-in compiler (the NVRTC compile and MLX reading the files
are checked on the GPU, tests/gpu/test_kernels.py)."""

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from muse_mlx.kernels import source
from muse_mlx.kernels.disk_cache import KernelCache, mlx_source, module_name, module_path, std_hash, template_suffix

CXX = shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no g++")
def test_std_hash_is_libstdcxx(tmp_path):
    """std::hash<std::string> from a program g++ builds, on strings of every length modulo 8 and
    a kernel's real text: the hash MLX's module names carry."""
    program = tmp_path / "h.cpp"
    program.write_text('#include <fstream>\n#include <iostream>\n#include <sstream>\n#include <string>\n'
                       'int main(int c, char** v) { for (int i = 1; i < c; ++i) { std::ifstream f(v[i], '
                       'std::ios::binary); std::stringstream s; s << f.rdbuf(); std::cout << std::hash<std::string>'
                       '{}(s.str()) << "\\n"; } }\n')
    subprocess.run([CXX, "-O1", "-o", tmp_path / "h", program], check=True)
    rng = np.random.default_rng(3)
    blobs = [rng.bytes(n) for n in (0, 1, 7, 8, 9, 15, 16, 23, 1000)]
    blobs.append(mlx_source("muse_residual_norm", *source.texts("residual_norm", "cuda"), [("x", mx.float32, 2)],
                            [("y", mx.float32)], [("N", 256)])[1].encode())
    files = []
    for i, blob in enumerate(blobs):
        files.append(tmp_path / f"s{i}")
        files[-1].write_bytes(blob)
    out = subprocess.run([tmp_path / "h", *files], check=True, capture_output=True, text=True).stdout.split()
    assert [int(v) for v in out] == [std_hash(b) for b in blobs]


def test_module_names_follow_mlx():
    """The kernel name carries MLX's template suffix (ints, booleans, dtype names); the source
    MLX's wrapper: inputs const, the template as constexpr / using, our body inside."""
    assert template_suffix([("K", 6656), ("B", 2), ("FLAG", True), ("WT", mx.float16)]) == "_6656_2_t_float16_t"
    kernel, text = mlx_source("muse_k", "// header\n", "y[0] = x[0];\n", [("x", mx.float32, 2)],
                              [("y", mx.float16)], [("N", 4), ("WT", mx.bfloat16)])
    assert kernel == "custom_kernel_muse_k_4_bfloat16_t"
    assert ("__global__ void custom_kernel_muse_k_4_bfloat16_t(\n    const float* x,\n    __half* y) {\n"
            "  constexpr int N = 4;\n  using WT = __nv_bfloat16;\n\ny[0] = x[0];\n\n}\n\n} // namespace mlx::core::cu\n") in text
    assert text.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n') and "// header\n" in text
    assert module_name(kernel, text) == f"{kernel}_{std_hash(text.encode()):x}"
    long = "m" * 600
    assert module_path(__import__("pathlib").Path("/c"), long).parts[-3:] == ("m" * 245, "m" * 245, "m" * 110 + ".ptx")


class FakeNvrtc:
    def __init__(self, fail=()):
        self.compiled, self.fail = [], set(fail)

    def compile(self, kernel, text):
        self.compiled.append(kernel)
        if kernel in self.fail:
            raise RuntimeError("NVRTC could not compile it")
        return b"CUBIN:" + kernel.encode(), "_Z" + kernel


def _note(cache, n):
    x = mx.zeros((1, n))
    cache.note("muse_residual_norm", *source.texts("residual_norm", "cuda"), ["x", "f", "w_post", "w_next"],
               [x, x, mx.zeros((n,)), mx.zeros((n,))], ["x_out", "h"], [mx.float32, mx.float32],
               [("N", n), ("TPG", n)])


def test_kernel_cache_writes_what_mlx_reads(tmp_path):
    """A new instantiation is compiled once, at `ready`, and written as MLX reads it (names file
    then binary, no temporary left); one already on disk, or already seen, is not compiled again;
    a compile that fails leaves nothing behind (MLX then compiles it itself)."""
    nvrtc = FakeNvrtc(fail={"custom_kernel_muse_residual_norm_64_64"})
    cache = KernelCache(tmp_path, nvrtc, workers=2)
    for n in (128, 128, 256, 64):
        _note(cache, n)
    assert nvrtc.compiled == []          # nothing before ready()
    cache.ready()
    assert sorted(nvrtc.compiled) == sorted(f"custom_kernel_muse_residual_norm_{n}_{n}" for n in (128, 256, 64))
    assert len(cache.written) == 2 and len(cache.failed) == 1
    for module in cache.written:
        path = module_path(tmp_path, module)
        kernel = module.rsplit("_", 1)[0]
        assert path.read_bytes() == b"CUBIN:" + kernel.encode()
        assert path.with_suffix(".txt").read_text() == f"mlx::core::cu::{kernel}\t_Z{kernel}\n"
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".ptx", ".ptx", ".txt", ".txt"]
    again = KernelCache(tmp_path, FakeNvrtc())
    for n in (128, 256):
        _note(again, n)
    again.ready()
    assert again.nvrtc.compiled == [] and again.written == []
