"""The Metal dialect's stand-ins for CUDA intrinsics, compiled as C++ on the CPU.

The Metal instantiation has never run on Apple hardware here (docs/kernels.md), so its
emulations of CUDA's byte permute and funnel shift, and the unaligned loads built on them, are
checked here against independent Python oracles (PTX's `prmt` default mode, the 64-bit shift,
byte slicing, ggml's get_scale_min_k4). dialect_metal.h and blocks.h are compiled with g++
behind a small shim for the Metal-only names; skipped where no C++ compiler exists.
"""

import random
import shutil
import struct
import subprocess

import pytest

from muse_mlx.kernels.source import read

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

SHIM = """
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#define device
#define thread
#define constant
#define threadgroup
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef _Float16 half;
template <class T, class U> T as_type(U u) { static_assert(sizeof(T) == sizeof(U), "size"); T t; std::memcpy(&t, &u, sizeof t); return t; }
namespace metal { using std::exp; using std::sqrt; using std::max; inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
                  inline half fma(half a, half b, half c) { return (half)std::fma(double(a), double(b), double(c)); } }
struct float2 { float x, y; float2(float a, float b) : x(a), y(b) {} };
struct float4 { float x, y, z, w; float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {} };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
inline float simd_sum(float v) { return v; }
inline float simd_max(float v) { return v; }
inline float simd_shuffle_xor(float v, unsigned short) { return v; }
inline float simd_shuffle(float v, unsigned short) { return v; }
inline uint32_t simd_shuffle(uint32_t v, unsigned short) { return v; }
"""

MAIN = """
int main() {
  char op[16];
  while (std::scanf("%15s", op) == 1) {
    if (!std::strcmp(op, "perm")) { uint32_t a, b, s; std::scanf("%u %u %u", &a, &b, &s); std::printf("%u\\n", BYTE_PERM(a, b, s)); }
    else if (!std::strcmp(op, "unit")) { uint32_t v, k; std::scanf("%u %u", &v, &k); std::printf("%u\\n", as_type<uint32_t>(BYTE_UNIT_FLOAT(v, k))); }
    else if (!std::strcmp(op, "magic")) { uint32_t v, k; std::scanf("%u %u", &v, &k); std::printf("%u\\n", as_type<uint32_t>(BYTE_MAGIC_FLOAT(v, k))); }
    else if (!std::strcmp(op, "funnel")) { uint32_t lo, hi, s; std::scanf("%u %u %u", &lo, &hi, &s); std::printf("%u\\n", FUNNEL_R(lo, hi, s)); }
    else if (!std::strcmp(op, "load")) {  // 64 bytes, then an even offset: load16_at and load8_at
      static uint32_t words[16]; unsigned off; uint8_t* bytes = (uint8_t*)words;
      for (int i = 0; i < 64; ++i) { unsigned b; std::scanf("%u", &b); bytes[i] = (uint8_t)b; }
      std::scanf("%u", &off);
      const uint4 q = load16_at((const uint32_t*)words, (uint64_t)off);
      const uint2 h = load8_at((const uint32_t*)words, (uint64_t)off);
      std::printf("%u %u %u %u %u %u\\n", q.x, q.y, q.z, q.w, h.x, h.y);
    }
    else if (!std::strcmp(op, "hfma")) { uint32_t a, b, c; std::scanf("%u %u %u", &a, &b, &c); std::printf("%u\\n", HFMA2_BITS(a, b, c)); }
    else if (!std::strcmp(op, "scale")) {  // k4_scale_min_sel from three words, group g
      uint32_t s0, s1, s2; int g; std::scanf("%u %u %u %d", &s0, &s1, &s2, &g);
      const float2 r = k4_scale_min_sel(g, s0, s1, s2); std::printf("%g %g\\n", r.x, r.y);
    }
  }
}
"""


@pytest.fixture(scope="module")
def metal_helpers(tmp_path_factory):
    d = tmp_path_factory.mktemp("metal-dialect")
    src = d / "helpers.cpp"
    src.write_text(SHIM + read("dialect_metal.h") + read("blocks.h") + MAIN)
    exe = d / "helpers"
    r = subprocess.run([CXX, "-std=c++17", "-O1", "-Wno-unknown-pragmas", str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def ask(lines: list[str]) -> list[str]:
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
        return out.stdout.split("\n")[:-1]
    return ask


def prmt(a: int, b: int, s: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (nibble i of s) & 7 of b:a."""
    v = (b << 32) | a
    return sum(((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_byte_perm_is_ptx_prmt(metal_helpers):
    rng = random.Random(1)
    cases = [(rng.getrandbits(32), rng.getrandbits(32), rng.getrandbits(16)) for _ in range(300)]
    got = metal_helpers([f"perm {a} {b} {s}" for a, b, s in cases])
    assert [int(x) for x in got] == [prmt(a, b, s) for a, b, s in cases]


def test_byte_floats_match_the_cuda_selectors(metal_helpers):
    """The CUDA dialect builds these with __byte_perm(v, 0x3F, 0x4055 | k << 8) and
    __byte_perm(v, 0x4B, 0x4550 | k): byte k under 0x3F at bits 16-23, under 0x4B at bits 0-7."""
    rng = random.Random(2)
    cases = [(rng.getrandbits(32), k) for _ in range(100) for k in range(4)]
    unit = metal_helpers([f"unit {v} {k}" for v, k in cases])
    magic = metal_helpers([f"magic {v} {k}" for v, k in cases])
    assert [int(x) for x in unit] == [prmt(v, 0x3F, 0x4055 | (k << 8)) for v, k in cases]
    assert [int(x) for x in magic] == [prmt(v, 0x4B, 0x4550 | k) for v, k in cases]
    # and what they mean: 0.5 + byte / 128 (for bytes below 0x80) and 2^23 + byte
    for (v, k), u, m in zip(cases, unit, magic):
        byte = (v >> (8 * k)) & 0xFF
        assert struct.unpack("<f", struct.pack("<I", int(m)))[0] == 2 ** 23 + byte
        if byte < 0x80:
            assert struct.unpack("<f", struct.pack("<I", int(u)))[0] == 0.5 + byte / 256


def test_funnel_shift_and_unaligned_loads(metal_helpers):
    rng = random.Random(3)
    cases = [(rng.getrandbits(32), rng.getrandbits(32), s) for s in (0, 8, 16, 24) for _ in range(20)]
    got = metal_helpers([f"funnel {lo} {hi} {s}" for lo, hi, s in cases])
    assert [int(x) for x in got] == [((hi << 32 | lo) >> s) & 0xFFFFFFFF for lo, hi, s in cases]
    buf = bytes(rng.getrandbits(8) for _ in range(64))
    offsets = list(range(0, 42, 2))  # even offsets, as Q6_K's 2-byte-aligned blocks give
    got = metal_helpers([f"load {' '.join(map(str, buf))} {off}" for off in offsets])
    for off, line in zip(offsets, got):
        want = struct.unpack("<4I", buf[off:off + 16]) + struct.unpack("<2I", buf[off:off + 8])
        assert tuple(int(x) for x in line.split()) == want, off


def get_scale_min_k4(g: int, q: bytes) -> tuple[int, int]:
    """ggml-quants.c, get_scale_min_k4."""
    if g < 4:
        return q[g] & 63, q[g + 4] & 63
    return (q[g + 4] & 0xF) | ((q[g - 4] >> 6) << 4), (q[g + 4] >> 4) | ((q[g] >> 6) << 4)


def test_q4_k_scale_unpacking(metal_helpers):
    rng = random.Random(4)
    blocks = [bytes(rng.getrandbits(8) for _ in range(12)) for _ in range(40)]
    lines = [f"scale {' '.join(str(w) for w in struct.unpack('<3I', q))} {g}" for q in blocks for g in range(8)]
    got = metal_helpers(lines)
    want = [get_scale_min_k4(g, q) for q in blocks for g in range(8)]
    assert [tuple(int(float(v)) for v in x.split()) for x in got] == want


def test_q4_k_products_in_f16_are_exact(metal_helpers):
    """The tensor-core form's Q4_K A values: the nibble q under 0x6400 (the f16 1024 + q) times sc,
    plus -1024 sc, in one f16x2 FMA, is q * sc exactly for every nibble and 6-bit scale (the
    CUDA dialect's fma.rn.f16x2 rounds once, as this stand-in does); and sc itself from
    1024 + sc the same way. numpy's float16 is the oracle."""
    import numpy as np
    bits = lambda v: int(np.float16(v).view(np.uint16))
    lines, want = [], []
    for sc in range(64):
        for q in range(0, 16, 2):
            a = (0x6400 | q) | ((0x6400 | (q + 1)) << 16)
            b = bits(sc) * 0x10001
            c = bits(-1024.0 * sc) * 0x10001
            lines.append(f"hfma {a} {b} {c}")
            want.append(bits(q * sc) | (bits((q + 1) * sc) << 16))
        lines.append(f"hfma {0x64006400 | sc * 0x10001} {0x3C003C00} {0xE400E400}")
        want.append(bits(sc) * 0x10001)
    assert [int(x) for x in metal_helpers(lines)] == want
