// GGUF block decoding shared by the kernels (ggml-common.h layouts). Header text, after the dialect map.
#define LOAD_U4(p) (*((GLOBAL_CONST(uint4)*)(p)))
#define LOAD_U32(p) (*((GLOBAL_CONST(uint32_t)*)(p)))
#define LOAD_U2(p) (*((GLOBAL_CONST(uint2)*)(p)))
#define LOAD_U16(p) (*((GLOBAL_CONST(uint16_t)*)(p)))
#define LOAD_F4(p) (*((GLOBAL_CONST(float4)*)(p)))
#define STORE_U4(p, v) (*((GLOBAL(uint4)*)(p)) = (v))

// A little-endian f16 stored at p (any alignment).
template <typename P> inline float f16_at(P p) {
  return HALF_BITS_TO_FLOAT(uint32_t(p[0]) | (uint32_t(p[1]) << 8));
}

// Q4_K / Q5_K: the 6-bit scale (x) and min (y) of 32-value group g from the 12 packed bytes at s.
template <typename P> inline float2 k4_scale_min(int g, P s) {
  if (g < 4) return MAKE_FLOAT2(float(s[g] & 63), float(s[g + 4] & 63));
  return MAKE_FLOAT2(float((s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4)),
                     float((s[g + 4] >> 4) | ((s[g] >> 6) << 4)));
}

// NVFP4 scale byte -> float, as ggml_ue4m3_to_fp32 (top bit ignored, 0x00 and 0x7F -> 0),
// including its factor 0.5 (the E2M1 codes below are doubled).
inline float ue4m3_half(uint32_t x) {
  if (x == 0u || x == 0x7Fu) return 0.0f;
  const uint32_t e = (x >> 3) & 15u, m = x & 7u;
  if (e == 0u) return float(m) * 0.0009765625f;            // m * 2^-9 * 0.5
  return BITS_TO_FLOAT(((e + 119u) << 23) | (m << 20));    // (1 + m/8) * 2^(e-7) * 0.5
}

// An E2M1 code, doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives (ggml's kvalues_mxfp4).
inline float e2m1x2(uint32_t c) {
  const uint32_t m = c & 7u;
  const float v = m < 4u ? float(m) : float((2u + (m & 1u)) << ((m >> 1) - 1u));
  return (c & 8u) ? -v : v;
}

// Q4_K / Q5_K scale and min of group g from the 12 scale bytes held as three little-endian
// words (bytes 0-3, 4-7, 8-11): the same unpacking as k4_scale_min, from registers.
inline float2 k4_scale_min_words(int g, uint32_t s0, uint32_t s1, uint32_t s2) {
  if (g < 4) return MAKE_FLOAT2(float((s0 >> (8 * g)) & 63u), float((s1 >> (8 * g)) & 63u));
  const int k = 8 * (g - 4);
  return MAKE_FLOAT2(float(((s2 >> k) & 15u) | (((s0 >> k) >> 6 & 3u) << 4)),
                     float(((s2 >> k) >> 4 & 15u) | (((s1 >> k) >> 6 & 3u) << 4)));
}

// 16 bytes at byte offset `off` (a multiple of 2) from `words`, a 4-byte-aligned pointer to
// 32-bit words in any address space (device or threadgroup memory), as four little-endian
// words: five aligned word loads and funnel shifts (Q6_K's 210-byte blocks are only 2-byte
// aligned).
template <typename WP, typename O> inline uint4 load16_at(WP words, O off) {
  WP wp = words + (off >> 2);
  const uint32_t s = uint32_t(off & 3u) * 8u;
  const uint32_t a = wp[0], b = wp[1], c = wp[2], d = wp[3], e = s ? wp[4] : 0u;
  uint4 r;
  r.x = FUNNEL_R(a, b, s);
  r.y = FUNNEL_R(b, c, s);
  r.z = FUNNEL_R(c, d, s);
  r.w = FUNNEL_R(d, e, s);
  return r;
}

// 8 bytes at byte offset `off` (a multiple of 2) from `words` (as load16_at), as two words.
template <typename WP, typename O> inline uint2 load8_at(WP words, O off) {
  WP wp = words + (off >> 2);
  const uint32_t s = uint32_t(off & 3u) * 8u;
  const uint32_t a = wp[0], b = wp[1], c = s ? wp[2] : 0u;
  uint2 r;
  r.x = FUNNEL_R(a, b, s);
  r.y = FUNNEL_R(b, c, s);
  return r;
}

// k4_scale_min_words as integers (sc, m).
inline uint2 k4_scale_min_bits(int g, uint32_t s0, uint32_t s1, uint32_t s2) {
  uint2 r;
  if (g < 4) {
    r.x = (s0 >> (8 * g)) & 63u;
    r.y = (s1 >> (8 * g)) & 63u;
  } else {
    const int k = 8 * (g - 4);
    r.x = ((s2 >> k) & 15u) | (((s0 >> k) >> 6 & 3u) << 4);
    r.y = ((s2 >> k) >> 4 & 15u) | (((s1 >> k) >> 6 & 3u) << 4);
  }
  return r;
}

// k4_scale_min_bits without branches (a select), for lanes of one simdgroup that hold
// different groups g.
inline uint2 k4_scale_min_bits_sel(int g, uint32_t s0, uint32_t s1, uint32_t s2) {
  const uint32_t k = 8u * uint32_t(g & 3);
  const uint32_t a = s0 >> k, b = s1 >> k, c = s2 >> k;
  const bool low = g < 4;
  uint2 r;
  r.x = low ? (a & 63u) : ((c & 15u) | ((a >> 6 & 3u) << 4));
  r.y = low ? (b & 63u) : ((c >> 4 & 15u) | ((b >> 6 & 3u) << 4));
  return r;
}

// k4_scale_min_words without branches (a select), for lanes of one simdgroup that hold
// different groups g.
inline float2 k4_scale_min_sel(int g, uint32_t s0, uint32_t s1, uint32_t s2) {
  const uint32_t k = 8u * uint32_t(g & 3);
  const uint32_t a = s0 >> k, b = s1 >> k, c = s2 >> k;
  const bool low = g < 4;
  return MAKE_FLOAT2(float(low ? (a & 63u) : ((c & 15u) | ((a >> 6 & 3u) << 4))),
                     float(low ? (b & 63u) : ((c >> 4 & 15u) | ((b >> 6 & 3u) << 4))));
}

// Component e (0-3, a compile-time constant after unrolling) of a float4.
#define F4_AT(v, e) ((e) == 0 ? (v).x : (e) == 1 ? (v).y : (e) == 2 ? (v).z : (v).w)

// silu(g[j]) * u[j] for j = i..i+3 (i a multiple of 4; g + i and u + i 16-byte aligned).
template <typename P> inline float4 silu_mul4_at(P g, P u, int i) {
  const float4 a = LOAD_F4(g + i), b = LOAD_F4(u + i);
  return MAKE_FLOAT4(a.x / (1.0f + EXPF(-a.x)) * b.x, a.y / (1.0f + EXPF(-a.y)) * b.y,
                     a.z / (1.0f + EXPF(-a.z)) * b.z, a.w / (1.0f + EXPF(-a.w)) * b.w);
}
