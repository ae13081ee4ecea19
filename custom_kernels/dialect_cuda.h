// CUDA side of the dialect map: goes into the kernel's `header` (helpers and types).
// Every kernel body in this folder is written once against these names.
#define GLOBAL_CONST(T) const T
#define LOCAL(T) T
#define BITS_TO_FLOAT(u) __uint_as_float(uint32_t(u))
#define HALF_BITS_TO_FLOAT(u) __half2float(__ushort_as_half(uint16_t(u)))
#define EXPF(x) expf(x)
#define SQRTF(x) sqrtf(x)
#define FMAXF(a, b) fmaxf(a, b)
#define NEG_INF (-__uint_as_float(0x7f800000u))
#define MAKE_FLOAT2(a, b) make_float2(a, b)
#define MAKE_FLOAT4(a, b, c, d) make_float4(a, b, c, d)
#define UNROLL_4 _Pragma("unroll 4")
#define UNROLL_1 _Pragma("unroll 1")
#define UNROLL_FULL _Pragma("unroll")
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Byte k (0..3) of v as the float 2^23 + byte, built with one byte permute (no int->float
// conversion, which runs at 1/8 of the FMA rate); subtract 8388608.0f for the byte's value.
#define BYTE_MAGIC_FLOAT(v, k) __uint_as_float(__byte_perm((v), 0x4Bu, 0x4550u | uint32_t(k)))
// Byte k of v as bits 16-23 under 0x3F: with the byte 0x80 | n << 3 that is the float 1 + n/16.
#define BYTE_UNIT_FLOAT(v, k) __uint_as_float(__byte_perm((v), 0x3Fu, 0x4055u | (uint32_t(k) << 8)))
// Bytes of the 8-byte value b:a picked by the low three bits of each selector nibble (byte i of
// the result from nibble i of s; 0-3 are a's bytes, 4-7 b's).
#define BYTE_PERM(a, b, s) __byte_perm((a), (b), (s))
// The 32 bits starting `s` bits (0 or 16) into the 64-bit value hi:lo.
#define FUNNEL_R(lo, hi, s) __funnelshift_r((lo), (hi), (s))
#define RSQRTF(x) rsqrtf(x)
#define FLOAT_TO_HALF(x) __float2half_rn(x)
// Two floats rounded to f16, as one 32-bit word (a first, in the low half); a device pointer.
#define HALF2_BITS(a, b) (uint32_t(__half_as_ushort(__float2half_rn(a))) | (uint32_t(__half_as_ushort(__float2half_rn(b))) << 16))
#define GLOBAL(T) T
#define MAKE_UINT4(a, b, c, d) make_uint4(a, b, c, d)
__device__ __forceinline__ float shuffle_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float shuffle_idx(float v, int l) { return __shfl_sync(0xffffffffu, v, l); }
// Threadgroup memory sized at launch (MLX's `shared_memory`, which MLX lets past 48 KB):
// X_MEMORY(name, n) declares `name`, n floats; TG(T) qualifies a pointer into it.
#define X_MEMORY(name, n) extern __shared__ float4 name##_v4[]; float* name = (float*)name##_v4
#define TG(T) T
// LOAD_TG_F4(p): 16 bytes of threadgroup memory as one volatile load, performed where the source
// places it: a plain load of x_shared's rows, invariant across the row loop, is hoisted out of it
// by the compiler, which then holds every row's x in registers (231 registers at 2 rows, spills
// at 4).
__device__ __forceinline__ float4 load_tg_f4(const float* p) {
  float4 v;
  asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(uint32_t(__cvta_generic_to_shared(p))));
  return v;
}
#define LOAD_TG_F4(p) load_tg_f4(p)
__device__ __forceinline__ uint4 load_tg_u4(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(uint32_t(__cvta_generic_to_shared(p))));
  return v;
}
#define LOAD_TG_U4(p) load_tg_u4(p)
#define FLOAT_TO_BITS(x) __float_as_uint(x)
// a * b + c on two f16 values packed in 32-bit words (low half first), rounded once.
__device__ __forceinline__ uint32_t hfma2_bits(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
#define HFMA2_BITS(a, b, c) hfma2_bits((a), (b), (c))
// (a & m) | c as one logic instruction (LOP3 takes one immediate: m; c stays in a register, made
// once, where the compiler's own and-then-or spends two instructions with both as immediates).
__device__ __forceinline__ uint32_t mask_or(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(m), "r"(c));
  return r;
}
#define MASK_OR(a, m, c) mask_or((a), (m), (c))
// d[0..3] += A B on the tensor cores: mma.m16n8k16, f16 inputs, float32 accumulation (sm_80 on).
// Fragments as PTX lays them out, lane = 4 g + t: A (16 x 16, row-major) a0 = rows g, columns
// 2t, 2t+1; a1 = row g + 8, the same columns; a2, a3 = the same rows, columns + 8; B (16 x 8)
// b0 = rows 2t, 2t+1 of column g, b1 = rows + 8; d0, d1 = row g, columns 2t, 2t+1; d2, d3 = row g + 8.
// `lane` is for the Metal stand-in.
__device__ __forceinline__ void mma_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#define MMA_16816(d, a0, a1, a2, a3, b0, b1, lane) mma_16816((d), (a0), (a1), (a2), (a3), (b0), (b1))
