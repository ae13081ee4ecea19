"""Run the Metal instantiation of a kernel body on the CPU, as C++ with one thread per GPU thread.

No Mac exists here, so the Metal text of custom_kernels/ (dialect_metal.h + blocks.h +
indices_metal.h + the body sections, exactly as kernels.render gives them to
mx.fast.metal_kernel) is compiled with g++ behind a shim and executed:

- every thread of a threadgroup is an OS thread; threadgroups run one after another on the
  same threads;
- `threadgroup_barrier` is a barrier over the threadgroup's threads, and the SIMD-group
  functions (`simd_sum`, `simd_max`, `simd_shuffle_xor`) exchange values through a barrier
  over the 32 lanes of the simdgroup (the sum is taken in lane order, not as a butterfly);
- C++ has no address spaces: `device`, `constant`, `thread` and `threadgroup` are empty
  words, so the dialect name that declares threadgroup memory is redefined after the
  dialect: `SHARED` becomes `static` (one array shared by the threads of the running
  threadgroup).

What this checks: the kernels' logic under the Metal dialect (indexing, loops, the Metal
stand-ins for CUDA intrinsics, synchronisation points a missing barrier would break, every
output element written), against independent float64 references in the tests. What it does
not: Metal's compiler (address-space errors, MSL-only rules), Apple GPU timing, or
simdgroup lockstep (a lane reading another lane's registers without a SIMD function would
not be caught).

`emulated_kernels()` is a kernels.Kernels for the Metal device whose kernel objects run this
emulator with the inputs, template constants, grid and output shapes the launches pass, so
the Metal launch plans (kernels/plan.py) are what runs.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from muse_mlx.config import KernelConfig
from muse_mlx.kernels import Device, Kernels
from muse_mlx.kernels.device import METAL_PLANNING_CORES
from muse_mlx.kernels.source import KERNELS, render

CXX = shutil.which("g++") or shutil.which("clang++")
_BUILD = Path(tempfile.gettempdir()) / "muse-metal-emulator"

C_TYPES = {mx.uint8: ("uint8_t", np.uint8), mx.int32: ("int32_t", np.int32), mx.float16: ("half", np.float16),
           mx.float32: ("float", np.float32)}

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
using emu_thread = std::thread;  // before `thread` becomes an empty word
#define device
#define constant
#define thread
#define threadgroup
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef _Float16 half;
template <class T, class U> T as_type(U u) { static_assert(sizeof(T) == sizeof(U), "size"); T t; std::memcpy(&t, &u, sizeof t); return t; }
namespace metal { using std::exp; using std::sqrt; using std::max; using std::min; inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
                  inline _Float16 fma(_Float16 a, _Float16 b, _Float16 c) { return (_Float16)std::fma(double(a), double(b), double(c)); } }
struct float2 { float x, y; float2(float a, float b) : x(a), y(b) {} };
struct float4 { float x, y, z, w; float4() = default; float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {} };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; uint4() = default; uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) : x(a), y(b), z(c), w(d) {} };
struct emu_uint3 { uint32_t x, y, z; };
thread_local emu_uint3 thread_position_in_threadgroup, threadgroup_position_in_grid, threadgroups_per_grid;
thread_local uint32_t thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
struct EmuWarp { std::barrier<> bar{32}; float slot[32]; uint32_t uslot[32]; };
thread_local EmuWarp* emu_warp;
thread_local std::barrier<>* emu_group;
inline float simd_sum(float v) {
  emu_warp->slot[thread_index_in_simdgroup] = v; emu_warp->bar.arrive_and_wait();
  float s = 0.0f; for (int i = 0; i < 32; ++i) s += emu_warp->slot[i];
  emu_warp->bar.arrive_and_wait(); return s;
}
inline float simd_max(float v) {
  emu_warp->slot[thread_index_in_simdgroup] = v; emu_warp->bar.arrive_and_wait();
  float s = emu_warp->slot[0]; for (int i = 1; i < 32; ++i) s = std::max(s, emu_warp->slot[i]);
  emu_warp->bar.arrive_and_wait(); return s;
}
inline float simd_shuffle_xor(float v, ushort m) {
  emu_warp->slot[thread_index_in_simdgroup] = v; emu_warp->bar.arrive_and_wait();
  const float r = emu_warp->slot[thread_index_in_simdgroup ^ m];
  emu_warp->bar.arrive_and_wait(); return r;
}
inline float simd_shuffle(float v, ushort l) {
  emu_warp->slot[thread_index_in_simdgroup] = v; emu_warp->bar.arrive_and_wait();
  const float r = emu_warp->slot[l & 31u];
  emu_warp->bar.arrive_and_wait(); return r;
}
inline uint32_t simd_shuffle(uint32_t v, ushort l) {
  emu_warp->uslot[thread_index_in_simdgroup] = v; emu_warp->bar.arrive_and_wait();
  const uint32_t r = emu_warp->uslot[l & 31u];
  emu_warp->bar.arrive_and_wait(); return r;
}
namespace mem_flags { constexpr int mem_threadgroup = 0; }
inline void threadgroup_barrier(int) { emu_group->arrive_and_wait(); }
"""

MAIN = r"""
static std::vector<char> read_file(const char* path) {
  FILE* f = std::fopen(path, "rb"); std::vector<char> b;
  if (!f) { std::perror(path); std::exit(2); }
  std::fseek(f, 0, SEEK_END); b.resize(std::ftell(f)); std::fseek(f, 0, SEEK_SET);
  if (!b.empty() && std::fread(b.data(), 1, b.size(), f) != b.size()) std::exit(2);
  std::fclose(f); return b;
}
int main(int argc, char** argv) {
  // argv: dir gx gy tx   (groups in x and y, threads per group)
  const char* dir = argv[1];
  const uint32_t gx = std::atoi(argv[2]), gy = std::atoi(argv[3]), tx = std::atoi(argv[4]);
  std::vector<std::vector<char>> bufs;
  for (int i = 0; i < N_BUFFERS; ++i) { char p[4096]; std::snprintf(p, sizeof p, "%s/b%d", dir, i); bufs.push_back(read_file(p)); }
  // One OS thread per thread of a threadgroup, made once; the threadgroups run one after
  // another (a barrier before and after each), so `static` threadgroup arrays are never shared
  // by two threadgroups at once.
  std::barrier<> group(tx);
  std::vector<EmuWarp> warps((tx + 31) / 32);
  std::vector<emu_thread> threads;
  for (uint32_t t = 0; t < tx; ++t) threads.emplace_back([&, t] {
    thread_position_in_threadgroup = {t, 0, 0};
    threadgroups_per_grid = {gx, gy, 1};
    thread_index_in_simdgroup = t % 32; simdgroup_index_in_threadgroup = t / 32;
    emu_warp = &warps[t / 32]; emu_group = &group;
    for (uint32_t y = 0; y < gy; ++y) for (uint32_t x = 0; x < gx; ++x) {
      threadgroup_position_in_grid = {x, y, 0};
      group.arrive_and_wait();
      KERNEL_CALL;
      group.arrive_and_wait();
    }
  });
  for (auto& th : threads) th.join();
  for (int i = N_INPUTS; i < N_BUFFERS; ++i) {
    char p[4096]; std::snprintf(p, sizeof p, "%s/b%d", dir, i);
    FILE* f = std::fopen(p, "wb"); std::fwrite(bufs[i].data(), 1, bufs[i].size(), f); std::fclose(f);
  }
}
"""

REDEFINE = """
#undef SHARED
#define SHARED static
#undef X_MEMORY
#define X_MEMORY(name, n) static float4 name##_v4[(n) / 4]; float* name = (float*)name##_v4
"""


def _template_line(name, value) -> str:
    if isinstance(value, (bool, int)):
        return f"  constexpr int {name} = {int(value)};\n"
    return f"  using {name} = {C_TYPES[value][0]};\n"


def _program(name: str, inputs: list[mx.array], out_dtypes: list, template: list) -> str:
    family, parts, in_names, out_names = KERNELS[name]
    header, source = render(family, parts, "metal")
    args = [f"const {C_TYPES[a.dtype][0]}* {n}" for n, a in zip(in_names, inputs)]
    args += [f"{C_TYPES[d][0]}* {n}" for n, d in zip(out_names, out_dtypes)]
    body = "".join(_template_line(k, v) for k, v in template)
    text = SHIM + header + f"\nstatic void kernel_body({', '.join(args)}) {{\n{body}"
    text += _indices_then_body(source) + "\n}\n"
    n_in, n_buf = len(inputs), len(inputs) + len(out_dtypes)
    call_args = [f"({C_TYPES[a.dtype][0]}*)bufs[{i}].data()" for i, a in enumerate(inputs)]
    call_args += [f"({C_TYPES[d][0]}*)bufs[{n_in + j}].data()" for j, d in enumerate(out_dtypes)]
    main = MAIN.replace("N_BUFFERS", str(n_buf)).replace("N_INPUTS", str(n_in))
    return text + main.replace("KERNEL_CALL", f"kernel_body({', '.join(call_args)})")


def _indices_then_body(source: str) -> str:
    """The rendered source with the emulator's threadgroup-memory redefinitions placed after
    the index macros (indices_metal.h defines SHARED) and before the body."""
    marker = "#define NUM_GROUPS_X"
    i = source.index(marker)
    j = source.index("\n", i) + 1
    return source[:j] + REDEFINE + source[j:]


def _binary(program: str) -> Path:
    _BUILD.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(program.encode()).hexdigest()[:20]
    exe = _BUILD / f"k{key}"
    if not exe.exists():
        src = _BUILD / f"k{key}.cpp"
        src.write_text(program)
        r = subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(exe) + ".tmp"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"g++ failed for the Metal text of a kernel:\n{r.stderr[:4000]}")
        Path(str(exe) + ".tmp").rename(exe)
    return exe


class EmulatedKernel:
    """Stands in for an mx.fast.metal_kernel object: same call signature, runs the emulator."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
                 stream=None, **_):
        inputs = [mx.array(a) if not isinstance(a, mx.array) else a for a in inputs]
        arrays = [np.ascontiguousarray(np.asarray(a)) for a in inputs]
        fill = np.nan if init_value is None else init_value  # unwritten elements show as NaN
        outs = [np.full(shape, fill, dtype=C_TYPES[d][1]) for shape, d in zip(output_shapes, output_dtypes)]
        exe = _binary(_program(self.name, inputs, list(output_dtypes), list(template)))
        gx, gy = -(-grid[0] // threadgroup[0]), -(-grid[1] // max(1, threadgroup[1]))
        with tempfile.TemporaryDirectory() as d:
            for i, a in enumerate(arrays + outs):
                a.tofile(f"{d}/b{i}")
            subprocess.run([str(exe), d, str(gx), str(gy), str(threadgroup[0])], check=True, timeout=600)
            results = [np.fromfile(f"{d}/b{len(arrays) + j}", dtype=o.dtype).reshape(o.shape)
                       for j, o in enumerate(outs)]
        return [mx.array(r) for r in results]


def emulated_kernels(config: KernelConfig = KernelConfig()) -> Kernels:
    """Kernels for the Metal device whose launches run the emulator."""
    return Kernels(Device("metal", METAL_PLANNING_CORES), config, build=lambda name, which, shared: EmulatedKernel(name))
