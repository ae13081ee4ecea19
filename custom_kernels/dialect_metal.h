// Metal side of the dialect map: goes into the kernel's `header` (helpers and types).
// Every kernel body in this folder is written once against these names.
#define GLOBAL_CONST(T) const device T
#define LOCAL(T) thread T
#define BITS_TO_FLOAT(u) as_type<float>(uint32_t(u))
#define HALF_BITS_TO_FLOAT(u) float(as_type<half>(uint16_t(u)))
#define EXPF(x) metal::exp(x)
#define SQRTF(x) metal::sqrt(x)
#define FMAXF(a, b) metal::max(a, b)
#define NEG_INF (-INFINITY)
#define MAKE_FLOAT2(a, b) float2(a, b)
#define MAKE_FLOAT4(a, b, c, d) float4(a, b, c, d)
#define UNROLL_4 _Pragma("clang loop unroll_count(4)")
#define UNROLL_1 _Pragma("clang loop unroll(disable)")
#define UNROLL_FULL _Pragma("clang loop unroll(full)")
inline float warp_sum(float v) { return simd_sum(v); }
inline float warp_max(float v) { return simd_max(v); }
// Byte k (0..3) of v as the float 2^23 + byte (see dialect_cuda.h); subtract 8388608.0f.
#define BYTE_MAGIC_FLOAT(v, k) as_type<float>(0x4B000000u | (((v) >> (8u * uint32_t(k))) & 0xFFu))
// Byte k of v as bits 16-23 under 0x3F (see dialect_cuda.h).
#define BYTE_UNIT_FLOAT(v, k) as_type<float>(0x3F000000u | ((((v) >> (8u * uint32_t(k))) & 0xFFu) << 16))
// Bytes of the 8-byte value b:a picked by selector nibbles (see dialect_cuda.h; only the
// selector forms the kernels use, without the sign-replicate mode).
inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  const ulong v = (ulong(b) << 32) | ulong(a);
  uint32_t r = 0u;
  for (uint32_t i = 0u; i < 4u; ++i) r |= uint32_t((v >> (8u * ((s >> (4u * i)) & 7u))) & 0xFFu) << (8u * i);
  return r;
}
#define BYTE_PERM(a, b, s) byte_perm((a), (b), (s))
// The 32 bits starting `s` bits (0 or 16) into the 64-bit value hi:lo.
#define FUNNEL_R(lo, hi, s) uint32_t(((ulong(hi) << 32) | ulong(lo)) >> (s))
#define RSQRTF(x) metal::rsqrt(x)
#define FLOAT_TO_HALF(x) half(x)
#define HALF2_BITS(a, b) (uint32_t(as_type<ushort>(half(a))) | (uint32_t(as_type<ushort>(half(b))) << 16))
#define GLOBAL(T) device T
#define MAKE_UINT4(a, b, c, d) uint4(a, b, c, d)
inline float shuffle_xor(float v, int m) { return simd_shuffle_xor(v, ushort(m)); }
inline float shuffle_idx(float v, int l) { return simd_shuffle(v, ushort(l)); }
// Threadgroup memory declared with its size (at most 32 KB on Apple GPUs: kernels/plan.py
// plans within it); TG(T) qualifies a pointer into it.
#define X_MEMORY(name, n) threadgroup float4 name##_v4[(n) / 4]; threadgroup float* name = (threadgroup float*)name##_v4
#define TG(T) threadgroup T
#define LOAD_TG_F4(p) (*((threadgroup float4*)(p)))
#define LOAD_TG_U4(p) (*((threadgroup uint4*)(p)))
#define FLOAT_TO_BITS(x) as_type<uint32_t>(float(x))
inline half half_lo(uint32_t v) { return as_type<half>(ushort(v & 0xFFFFu)); }
inline half half_hi(uint32_t v) { return as_type<half>(ushort(v >> 16)); }
// a * b + c on two packed f16 values (see dialect_cuda.h).
inline uint32_t hfma2_bits(uint32_t a, uint32_t b, uint32_t c) {
  const half lo = metal::fma(half_lo(a), half_lo(b), half_lo(c)), hi = metal::fma(half_hi(a), half_hi(b), half_hi(c));
  return uint32_t(as_type<ushort>(lo)) | (uint32_t(as_type<ushort>(hi)) << 16);
}
#define HFMA2_BITS(a, b, c) hfma2_bits((a), (b), (c))
#define MASK_OR(a, m, c) (((a) & (m)) | (c))
// A stand-in for CUDA's mma.m16n8k16 (dialect_cuda.h has the fragment layout), by SIMD-group
// shuffles and float32 arithmetic: correct, not fast. No Metal plan chooses the kernels that use
// it (kernels/plan.py); it lets their Metal text run in the emulator.
inline float half2_dot(uint32_t a, uint32_t b) {
  return float(half_lo(a)) * float(half_lo(b)) + float(half_hi(a)) * float(half_hi(b));
}
inline void mma_16816(thread float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1,
                      uint32_t lane) {
  const uint32_t g = lane >> 2, t = lane & 3u;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  for (uint32_t j = 0u; j < 4u; ++j) {
    const ushort ra = ushort(4u * g + j), rc = ushort(8u * t + j), rd = ushort(8u * t + 4u + j);
    const uint32_t x0 = simd_shuffle(a0, ra), x1 = simd_shuffle(a1, ra), x2 = simd_shuffle(a2, ra),
                   x3 = simd_shuffle(a3, ra);
    const uint32_t y0 = simd_shuffle(b0, rc), y1 = simd_shuffle(b1, rc), z0 = simd_shuffle(b0, rd),
                   z1 = simd_shuffle(b1, rd);
    s0 += half2_dot(x0, y0) + half2_dot(x2, y1);
    s1 += half2_dot(x0, z0) + half2_dot(x2, z1);
    s2 += half2_dot(x1, y0) + half2_dot(x3, y1);
    s3 += half2_dot(x1, z0) + half2_dot(x3, z1);
  }
  d[0] += s0;
  d[1] += s1;
  d[2] += s2;
  d[3] += s3;
}
#define MMA_16816(d, a0, a1, a2, a3, b0, b1, lane) mma_16816((d), (a0), (a1), (a2), (a3), (b0), (b1), (lane))
