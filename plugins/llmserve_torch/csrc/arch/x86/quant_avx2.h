// The rows path's AVX2 helpers (quant_rows.h includes them where the build has AVX2): one weight row at a time
// through vpmaddwd. Reads group_term (quant_rows.h, which includes this after it).
#pragma once

#include <immintrin.h>

#include "quant_format.h"

namespace quant {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane i: the sum of v[i]'s eight lanes
inline __m256i hsum8(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

inline __m256 load8_half(const uint16_t* p) {  // 8 float16 as float
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = load_half(p[i]);
  return _mm256_load_ps(f);
#endif
}

// Groups g..g+7's scales (kind 0) or offsets (1) of a part (with Sup g is a super-block's first group)
template <typename F>
HOT_INLINE __m256 row_scales8(const Block<F>& b, int g, int part, int kind) {
  const uint8_t* p = kind ? b.offsets(g, part) : b.scales(g, part);
  if (!F::kSup) return load8_half(reinterpret_cast<const uint16_t*>(p));
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  return _mm256_mul_ps(v, _mm256_set1_ps(load_half(*b.factors(g, kind))));
}

// One group's values as bytes: lo inputs 0..15, hi 16..31
template <typename F>
HOT_INLINE void unpack_row(const uint8_t* v, __m128i& lo, __m128i& hi) {
  if (F::kBits == 8) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16));
    return;
  }
  const __m128i m4 = _mm_set1_epi8(0x0F), p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  lo = _mm_and_si128(p, m4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
  // input 4c + j's bit is bit c of plane byte j: byte i of the spread plane is byte i % 4, tested against bit i / 4
  const __m128i spread = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m128i sel = _mm_setr_epi8(1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8), sel_hi = _mm_slli_epi16(sel, 4);
  for (int pl = 0; pl < F::kBits - 4; ++pl) {
    int32_t bits;
    std::memcpy(&bits, v + 16 + 4 * pl, 4);
    const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(bits), spread), bit = _mm_set1_epi8(static_cast<char>(16 << pl));
    lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel), sel), bit));
    hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel_hi), sel_hi), bit));
  }
}

// One group's products with the int16 activations xg: eight int32 partial sums over inputs 0..15 (lo) and 16..31 (hi)
template <typename F>
HOT_INLINE void group_dots(const uint8_t* v, const int16_t* xg, __m256i& lo_sums, __m256i& hi_sums) {
  __m128i lo, hi;
  unpack_row<F>(v, lo, hi);
  lo_sums = _mm256_madd_epi16(_mm256_cvtepu8_epi16(lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg)));
  hi_sums = _mm256_madd_epi16(_mm256_cvtepu8_epi16(hi), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16)));
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// What an output's groups add, eight at a time: their int32 sums meet their eight scales in one vector (not one
// broadcast each); the groups left over (576 inputs are 18 groups) one at a time, their sums still in SIMD. g: the
// groups done (all of them)
template <typename F>
HOT_INLINE float avx2_groups_term(const Block<F>& b, const int16_t* x, const float* d, const int32_t* qs0,
                                  const int32_t* qs, const float* xs0, const float* xs, int ng, int& g) {
  float sum = 0.f;
  constexpr int P = F::kParts;
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) {
    __m256i v[P][8];  // per part, per group: eight int32 partial sums of q * xq (exact: at most 32 * 255 * 32767)
    for (int j = 0; j < 8; ++j) {
      __m256i dl, dh;
      group_dots<F>(b.values(g + j), x + (g + j) * kG, dl, dh);
      if (P == 2)
        v[0][j] = dl, v[P - 1][j] = dh;
      else
        v[0][j] = _mm256_add_epi32(dl, dh);
    }
    const __m256i q_all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g));
    const __m256i q_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs0 + g));
    const __m256 x_all = _mm256_loadu_ps(xs + g), x_lo = _mm256_loadu_ps(xs0 + g), dg = _mm256_loadu_ps(d + g);
    for (int p = 0; p < P; ++p) {
      const __m256i qp = P == 1 ? q_all : (p ? _mm256_sub_epi32(q_all, q_lo) : q_lo);
      const __m256i s = _mm256_sub_epi32(hsum8(v[p]), _mm256_mullo_epi32(qp, _mm256_set1_epi32(F::kCentre)));
      const __m256 scale = row_scales8(b, g, p, 0);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, dg), acc);
      if (F::kOff) {
        const __m256 zero = _mm256_fmadd_ps(_mm256_set1_ps(F::kCentre), scale, row_scales8(b, g, p, 1));
        acc = _mm256_fmadd_ps(zero, P == 1 ? x_all : (p ? _mm256_sub_ps(x_all, x_lo) : x_lo), acc);
      }
    }
  }
  sum = hsum(acc);
  for (; g < ng; ++g) {  // the groups left over
    __m256i dl, dh;
    group_dots<F>(b.values(g), x + g * kG, dl, dh);
    const int s[2] = {hsum_i32(dl), hsum_i32(dh)};
    sum += group_term(b, g, s, d, qs0, qs, xs0, xs);
  }
  return sum;
}

}  // namespace quant
