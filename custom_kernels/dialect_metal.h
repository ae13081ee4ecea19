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
